"""The best weights: written once when validation improves (weights only, in their training dtype), referenced by
every later checkpoint, read back by each rank for its own part.

    path = best_weights_path(filesystem, folder, step, rank)   # a name no checkpoint already refers to
    save_best(engine, rank, filesystem, path)                  # gathered one parameter at a time, written by rank 0
    load_best(engine, rank, filesystem, path)                  # each rank reads its own partition (ZeRO-3)
    gather_on_rank0(named, rank)                               # the whole tensors on rank 0 (exports use it too)

Every function is called by every rank (the gathers and the checks are collective). torch, DeepSpeed and pyarrow
are imported where they are used.
"""
from __future__ import annotations

from hpsearch.errors import UserError
from hpsearch.train.checkpoints import from_rank0


def _trained(engine):
    """(name, parameter) of what training changes: the parameters with requires_grad (each once, tied ones too)."""
    return [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]


def gather_on_rank0(named, rank: int) -> dict:
    """{name: whole tensor, on the CPU} on rank 0 ({name: None} elsewhere) from (name, tensor) pairs. ZeRO-3
    parameters are gathered one at a time, so no rank but 0 holds more than one whole parameter beyond its shard; a
    tensor under several names (tied weights) is gathered once. Every rank calls this (the gathers are collective).

    Nothing is copied but a device tensor to the host: a tensor on the CPU is the model's own (at stage 0 on CPU
    workers, copying every weight once more took 0.1-0.5 s of a t5-small export here), and a ZeRO-3 parameter's
    gathered values stay in the storage its gather filled (on release DeepSpeed points the parameter at an empty
    tensor; the values are checked after release in tests/workers/zero3_step.py). So use the state before training
    goes on, as `save_best` and the exports do."""
    import deepspeed

    state, seen = {}, {}
    for name, tensor in named:
        if id(tensor) not in seen:
            with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):  # not a ZeRO-3 parameter: no-op
                seen[id(tensor)] = tensor.detach().cpu() if rank == 0 else None
        state[name] = seen[id(tensor)]
    return state


def best_weights_path(filesystem, folder: str, step: int, rank: int) -> str:
    """Where `save_best` puts the best weights of `step`: `<folder>/step_<step>.safetensors`, or
    `step_<step>.<k>.safetensors` when that name is taken (a run resumed into the folder of one that went further,
    whose checkpoints refer to their own file): no version a checkpoint refers to is ever overwritten. Rank 0 looks;
    every rank gets its answer (each rank's checkpoint names it). Every rank calls this."""
    from pyarrow import fs

    path = None
    if rank == 0:
        path, k = f"{folder}/step_{step}.safetensors", 1
        while filesystem.get_file_info(path).type != fs.FileType.NotFound:
            path, k = f"{folder}/step_{step}.{k}.safetensors", k + 1
    return from_rank0(path)


def partition_range(p) -> tuple[int, int]:
    """(start, count) of this rank's real elements of ZeRO-3 parameter `p` in its flattened whole: its partition
    `p.ds_tensor` is padded to the same size on every rank, and DeepSpeed never writes the padding."""
    import torch

    part = p.ds_tensor
    start = part.ds_numel * torch.distributed.get_rank(group=p.ds_process_group)
    return start, max(0, min(part.ds_numel, p.ds_numel - start))


def save_best(engine, rank: int, filesystem, path: str) -> None:
    """Rank 0 writes the weights training changes as safetensors at `path` of a pyarrow `filesystem`, in their
    training dtype (16-bit when training is, under torch's autocast too): weights only, no optimizer state. Under
    ZeRO-3 the parameters are gathered one at a time, so no rank holds more than one full parameter beyond its
    shard. Every rank calls this."""
    import torch
    from safetensors.torch import save

    state = gather_on_rank0(_trained(engine), rank)
    if rank == 0 and getattr(engine, "torch_autocast_enabled", lambda: False)():  # fp32 weights, 16-bit training:
        dtype = engine.torch_autocast_dtype()  # kept 16-bit, as DeepSpeed's bf16 modules are
        state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in state.items()}
    if rank == 0:
        filesystem.create_dir(path.rsplit("/", 1)[0])
        with filesystem.open_output_stream(path) as out:
            out.write(save(state))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # written before any checkpoint refers to it


def load_best(engine, rank: int, filesystem, path: str) -> int:
    """Put the weights `save_best` wrote back into the engine's model; returns the tensor bytes this rank read. Under
    ZeRO-3 each rank reads its own partition of each parameter straight from the file (a byte range each,
    `tensorfile.py`; in a bucket a ranged read) after DeepSpeed released every gathered copy: no rank reads, receives
    or gathers the whole model, and nothing is broadcast. Otherwise every rank holds whole parameters and reads them
    whole. A file that is gone, unreadable or from another model is a one-line UserError on every rank; a read that
    failed is an OSError on every rank (a retry may succeed). Every rank calls this."""
    import torch

    from hpsearch.train.tensorfile import TensorFile

    trained = _trained(engine)
    problem, passing, weights = "", "", None
    try:
        weights = TensorFile(filesystem, path)
        missing = sorted({name for name, _ in trained} - weights.names)
        wrong = [name for name, p in trained if name in weights.names and
                 weights.shape(name) != list(getattr(p, "ds_shape", p.shape))]
        problem = (f"lacks {', '.join(missing[:3])}" if missing else
                   f"holds {wrong[0]} in another shape" if wrong else "")
    except FileNotFoundError:
        problem = "is gone"
    except ValueError:  # not a safetensors file
        problem = "is unreadable"
    except OSError as e:  # a read that failed (a bucket's, a network file system's): a retry may succeed
        passing = f"{type(e).__name__}: {e}"
    flags = torch.tensor([float(bool(problem)), float(bool(passing))])  # every rank learns what any rank met
    if torch.distributed.is_initialized():
        if torch.distributed.get_backend() == "nccl":  # NCCL reduces GPU tensors only
            flags = flags.cuda()
        torch.distributed.all_reduce(flags)
    if flags.any():
        if weights is not None:
            weights.close()
        if flags[0].item():
            raise UserError(f"the best weights {path} {problem or 'are unusable on another rank'}: the checkpoint "
                            "refers to weights that are not there (or belong to another model)")
        raise OSError(f"reading the best weights {path} failed ({passing or 'on another rank'})")
    if any(hasattr(p, "ds_tensor") for _, p in trained):
        # DeepSpeed's own release of every gathered copy (persistent ones too): the next forward gathers the
        # partitions loaded here, not a whole value left from the last evaluation
        engine.empty_partition_cache()
    with weights, torch.no_grad():
        for name, p in trained:
            if hasattr(p, "ds_tensor"):  # ZeRO-3: this rank's flat slice of the parameter, padded to the same size
                part = p.ds_tensor       # on every rank
                start, count = partition_range(p)
                if count:
                    part.data[:count].copy_(weights.read(name, start, count))
                if getattr(p, "ds_secondary_tensor", None) is not None:  # ZeRO++ hpZ gathers from its node-local
                    p.ds_secondary_tensor = None  # copy when there is one: drop it (DeepSpeed's own invalidation)
            else:
                p.data.copy_(weights.read(name).view(p.shape))
    return weights.bytes_read
