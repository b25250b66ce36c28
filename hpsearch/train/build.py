"""The model on every rank: built whole, or under ZeRO-3 partitioned as it is built (`deepspeed.zero.Init`).

An objective hands its model over as two functions (`objective.py`): `make()` builds it for real (the backbone's
weights, each method's initial values, data-dependent initialisation such as `init_task_params`) and `skeleton()`
builds the same structure from configs alone. `ModelBuilder` counts the parameters on the meta device (the ZeRO
stage is decided before anything is built), then:

- stage 3 with `train.zero_init` (by default on GPU workers; see `use_zero_init`): rank 0 calls `make()`; every
  rank builds `skeleton()` under `deepspeed.zero.Init`, so each parameter is partitioned as soon as its module
  exists; then each parameter in turn is gathered, overwritten with rank 0's value and partitioned again
  (`GatheredParameters(modifier_rank=0)`), and rank 0 frees its whole copy of it. Only rank 0 ever holds the whole
  model; every other rank holds its shards and one whole parameter at a time. The weights are exactly those of a
  whole build (tested), and buffers are sent from rank 0 too;
- otherwise every rank calls `make()` (the same seed: the same weights everywhere) and `deepspeed.initialize`
  partitions the model if the stage is 3.
"""
from __future__ import annotations

import torch


def unique_parameters(model) -> list:
    return list({id(p): p for p in model.parameters()}.values())


def shape_of(skeleton) -> tuple[int, int | None]:
    """(parameter count, hidden size d_model) from the model's structure built on the meta device (no memory, no
    weights read)."""
    with torch.device("meta"):
        model = skeleton()
    return sum(p.numel() for p in unique_parameters(model)), getattr(model.config, "d_model", None)


def fill_from_rank0(model, source, rank: int) -> None:
    """Give every rank's ZeRO-3 partitioned `model` the values of rank 0's whole `source` (same structure; None on
    other ranks), one parameter at a time; `source` is emptied as it goes (each parameter is freed once sent), so
    rank 0 holds at most the whole model plus its shards. Every rank calls this (the gathers and broadcasts are
    collective)."""
    import deepspeed

    params = dict(source.named_parameters()) if rank == 0 else {}
    for name, param in model.named_parameters():  # tied weights appear once, under the same first name
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):  # rank 0's value is scattered on exit
            if rank == 0:
                param.data.copy_(params[name].data)
                params[name].data = torch.empty(0, dtype=param.dtype)  # sent: the whole copy shrinks as it goes
    buffers = dict(source.named_buffers()) if rank == 0 else {}
    nccl = torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl"
    for name, buffer in model.named_buffers():  # whole on every rank (ZeRO-3 partitions parameters only)
        value = (buffers[name] if rank == 0 else buffer.data).to("cuda" if nccl else buffer.device,
                                                                 dtype=buffer.dtype, copy=True)  # zero.Init: bf16
        if torch.distributed.is_initialized():
            torch.distributed.broadcast(value, 0)  # NCCL sends device tensors only
        buffer.data.copy_(value)


def use_zero_init(setting, use_gpu: bool) -> bool:
    """`train.zero_init`: true, false, or auto = on GPU workers. There ZeRO-3's partitions live in device memory, so
    under zero.Init a node's host memory holds one whole model (rank 0's) instead of one per rank, and no GPU ever
    holds a whole model. On CPU workers the partitions and DeepSpeed's own partitioned buffers (four shard-sized
    ones) live in the same host memory, which reuses what the whole build freed: measured here (2 ranks, t5-large;
    4 ranks, t5-base), building whole took less memory per node than zero.Init (`python -m hpsearch.bench --only
    memory`), so auto leaves it off there."""
    return use_gpu if setting == "auto" else bool(setting)


WAIT_FOR_RANK0_S = 3 * 3600  # rank 0 may download and load a whole t5-11b before the others can go on


def _wait_for_rank0() -> None:
    """The other ranks wait while rank 0 builds (or downloads and loads) the whole model, on a gloo group of its
    own with a long timeout: in the process group's first collective they would wait under its timeout (NCCL's
    watchdog, Ray Train's `timeout_s`), which loading a large checkpoint on one rank can exceed."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return
    from datetime import timedelta

    group = torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=WAIT_FOR_RANK0_S))
    torch.distributed.barrier(group=group)
    torch.distributed.destroy_process_group(group)


class ModelBuilder:
    """`builder(make, skeleton)` -> this rank's model; `builder.stage` is the ZeRO stage it decided and
    `builder.hidden` the model's d_model (the loop configures DeepSpeed with both). `decide(n_params)` -> stage,
    `ds_config(stage, hidden)` -> the DeepSpeed config `zero.Init` reads; `zero_init`: build under it at stage 3
    (else every rank builds the whole model and `deepspeed.initialize` partitions it)."""

    def __init__(self, decide, ds_config, rank: int, zero_init: bool = True):
        self.decide, self.ds_config, self.rank, self.zero_init = decide, ds_config, rank, zero_init
        self.stage: int | None = None
        self.hidden: int | None = None
        self.partitioned = False  # built under zero.Init

    def __call__(self, make, skeleton):
        n_params, self.hidden = shape_of(skeleton)
        self.stage = self.decide(n_params)
        if self.stage != 3 or not self.zero_init:
            return make()
        import deepspeed

        source = make() if self.rank == 0 else None
        _wait_for_rank0()
        with deepspeed.zero.Init(config_dict_or_path=self.ds_config(self.stage, self.hidden)):
            model = skeleton()
        fill_from_rank0(model, source, self.rank)
        del source
        self.partitioned = True
        return model


def build_whole(make, skeleton):
    """The default for an objective used outside the loop: the model built whole."""
    return make()


def release(engine) -> None:
    """Undo what a finished run's DeepSpeed engine leaves in its process, for a process that trains trial after trial
    (a reused Tune actor, kept ranks): it then holds one run's model at a time. Two module-level references keep a
    ZeRO-3 model alive for the process's life, and through the hooks DeepSpeed put on it, its engine with the
    optimizer's state (on GPU, device memory), one more each trial:
    - the engine puts its model on DeepSpeed's forward-module stack (`FWD_MODULE_STACK`) when it sets up and never
      takes it off (and a forward that raised leaves its submodules there too);
    - the parameter coordinator memoises which parameters each submodule releases with `functools.lru_cache` on a
      method, a cache shared by the class that holds every coordinator and submodule it was asked about.
    `destroy()` (DeepSpeed's own clean-up) removes the hooks and the engine's buffers; the model's modules are taken
    off the stack and the cache emptied here (a memo: a live engine recomputes what it needs), also when `destroy()`
    fails. The loop restores torch's linear function, which ZeRO-3 also replaces process-wide."""
    try:
        engine.destroy()
    finally:
        from deepspeed.runtime.zero import parameter_offload
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

        ours = {id(m) for m in engine.module.modules()}
        parameter_offload.FWD_MODULE_STACK[:] = [m for m in parameter_offload.FWD_MODULE_STACK if id(m) not in ours]
        memo = vars(PartitionedParameterCoordinator).get("_PartitionedParameterCoordinator__params_to_release")
        wrapped = [cell.cell_contents for cell in getattr(memo, "__closure__", None) or ()]  # DeepSpeed's NVTX wrapper
        for cache in (memo, *wrapped):
            if hasattr(cache, "cache_clear"):
                cache.cache_clear()
