"""Checkpoint files: loaded weights-only (no code runs from a checkpoint), per-rank copies, the report they carry.

DeepSpeed writes its checkpoints with `torch.save` (pickle) and loads them with `torch.load(weights_only=False)`:
a crafted `*_model_states.pt` would run code in every worker on resume. Every load here goes through torch's
weights-only unpickler (`TORCH_FORCE_WEIGHTS_ONLY_LOAD`, honoured by every `torch.load` call, DeepSpeed's too),
which rebuilds tensors, containers and numbers, plus the two DeepSpeed types a ZeRO checkpoint really holds
(an enum and the loss scaler, both plain data); anything else is refused. The metrics a checkpoint was reported
with travel beside it as JSON (`report.json`), so a run restored at its last step can report its result again.
torch is imported where it is used: a trial's Tune actor that drives kept ranks reads reports and manifests here
without it.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import tempfile
import zipfile
from contextlib import contextmanager, suppress
from pathlib import Path

from hpsearch.data._util import temporary_beside
from hpsearch.errors import UserError
from hpsearch.remotefs import download_dir

REPORT = "report.json"


class DiskFull(UserError):
    """A write found no space left: one line naming where; not worth retrying until space is freed."""


def _deepspeed_types() -> list:
    from hpsearch.train.ops import import_deepspeed

    import_deepspeed()  # the first import of DeepSpeed in a process that resumes: without MLflow (ops.py)
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address  # ZeRO-1/2's (and bf16's) optimizer state: 2 ints
    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


@contextmanager
def weights_only_loads():
    """Within: every `torch.load` (DeepSpeed's included) unpickles weights-only, with DeepSpeed's data types."""
    import torch

    before = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(_deepspeed_types()):
            yield
    finally:
        if before is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = before


# what torch and DeepSpeed say when a checkpoint's tensors do not fit the model built (another config)
MISMATCH = ("Error(s) in loading state_dict", "size mismatch", "Missing key", "Unexpected key")


def load(engine, directory: str | Path, tag: str, **kwargs) -> dict | None:
    """`engine.load_checkpoint` weights-only; a refused, corrupt or mismatching checkpoint is a one-line UserError
    (a retry would meet it again). Anything else (an I/O error, memory, a peer rank gone mid-collective) is raised
    as it is: a trial's retry may succeed, so it must not be taken for the checkpoint's fault."""
    try:
        with weights_only_loads():
            path, client = engine.load_checkpoint(str(directory), tag=tag, **kwargs)
    except pickle.UnpicklingError as e:
        found = sorted(set(re.findall(r"GLOBAL ([\w.]+)", str(e)))) or ["an object that is not a tensor"]
        raise UserError(f"checkpoint {directory}: refused, it holds {', '.join(found)}, not only weights; "
                        "checkpoints are loaded weights-only") from None
    except Exception as e:
        corrupt = _corrupt_file(Path(directory) / tag)
        if corrupt:
            raise UserError(f"checkpoint {directory}: {corrupt} is corrupt or incomplete") from None
        if not (isinstance(e, KeyError) or any(m in str(e) for m in MISMATCH)):
            raise
        from hpsearch.model.export import older_layout
        detail = str(e).splitlines()[0][:200] if str(e) else ""
        missing, unexpected = state_dict_mismatch(str(e))
        older = older_layout(unexpected, missing, re.findall(r"size mismatch for ([\w.]+)", str(e)))
        raise UserError(f"checkpoint {directory} does not match this run's config ({type(e).__name__}: "
                        f"{detail})" + (f"; {older}" if older else "")) from None
    if path is None:
        raise UserError(f"checkpoint {directory}: no '{tag}' checkpoint in it (incomplete)")
    return client


# what a resume must keep as the checkpoint's run had it: the model, the data, the ranks and the optimisation (the
# step count, evaluation, logging, resources per rank and paths may change). The optimizer's and schedule's state
# come from the checkpoint (a new train.lr was silently ignored), and the sampler's and the ranks' random states
# assume the same data and ranks.
RESUME_KEEPS = ("model.", "data.tasks", "data.seed", "data.data_seed", "data.temperature", "data.batching",
                "data.task_prefix", "data.max_source_length", "data.max_target_length", "data.synthetic_train_rows",
                "data.synthetic_small_train_rows", "data.synthetic_eval_rows", "data.max_train_rows",
                "data.vocab_size", "train.num_workers", "train.micro_batch_size", "train.grad_accum",
                "train.optimizer", "train.lr", "train.embedding_lr_scale", "train.warmup_steps",
                "train.weight_decay", "train.grad_clip", "train.seed", "corpus.",  # corpus: pretraining's
                "corpus_layout.")  # how its corpus is cut (written since layout 2: a checkpoint without it is 1)
RESUME_MAY_CHANGE = ("model.backbone", "corpus.path")  # paths that may differ between machines
CONFIG = "config.json"


def write_config(directory: str | Path, run: dict) -> None:
    """The run config (`RunConfig.to_dict()`) a checkpoint was written by: a resume is checked against it."""
    (Path(directory) / CONFIG).write_text(json.dumps(run) + "\n")


def resume_differences(directory: str | Path, run: dict) -> dict[str, tuple]:
    """{field: (the checkpoint's value, this run's)} of the fields (`RESUME_KEEPS`) in which the run config `run`
    (with a `corpus` section for pretraining) differs from the one that wrote the checkpoint; none for a checkpoint
    written before checkpoints kept their config."""
    try:
        saved = json.loads((Path(directory) / CONFIG).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    flat = lambda config: {f"{s}.{k}": v for s, values in config.items() if isinstance(values, dict)
                           for k, v in values.items()}
    old, new = flat(saved), flat(run)
    if "corpus.max_length" in old and "corpus_layout.version" in new:  # a pretraining checkpoint from before it
        old.setdefault("corpus_layout.version", 1)
    return {k: (old[k], new[k]) for k in sorted(old)
            if k.startswith(RESUME_KEEPS) and k not in RESUME_MAY_CHANGE and k in new and old[k] != new[k]}


def state_dict_mismatch(text: str) -> tuple[list[str], list[str]]:
    """(missing, unexpected) parameter names of torch's `load_state_dict` error text ('Missing key(s) in
    state_dict: "a", "b". Unexpected key(s) in state_dict: "c".')."""
    missing = re.findall(r'"([\w.]+)"', text.partition("Missing key(s)")[2].partition("Unexpected key(s)")[0])
    return missing, re.findall(r'"([\w.]+)"', text.partition("Unexpected key(s)")[2])


def check_resume_dir(directory: str | Path, run: dict | None = None, local: bool = False) -> None:
    """`--resume-from`: a checkpoint folder whose files are safe to load, or a one-line UserError, before anything
    starts (nothing is unpickled). A checkpoint holds state/ (the training state), or is a finished run's last one,
    which holds its result only (`is_result_only`): that one can be reported again, not trained on past its step.
    `run`: this run's config (`RunConfig.to_dict()`): its max_steps must not be below the checkpoint's step, and
    the fields a resume keeps (`RESUME_KEEPS`) must be the checkpoint's."""
    report = read_report(directory) if Path(directory).is_dir() else None
    max_steps = run["train"]["max_steps"] if run else None
    if is_result_only(directory, report):
        if max_steps is not None and report["step"] < max_steps:
            raise UserError(f"--resume-from: {directory} is the last checkpoint of a finished run (step "
                            f"{report['step']}): it holds the run's result, not its training state, so it cannot "
                            f"train on to train.max_steps={max_steps}; resume from an earlier checkpoint")
        return
    if not (Path(directory) / "state").is_dir():
        raise UserError(f"--resume-from: {directory} is not a checkpoint (expected a directory holding "
                        "state/, e.g. <train.output_dir>/checkpoints/step_N)")
    past_end(directory, report, max_steps)
    differ = resume_differences(directory, run) if run else {}
    if local and "train.num_workers" in differ:  # `local`: the run is --local, one rank whatever the config says
        raise UserError(f"--resume-from: {directory} was written by {differ['train.num_workers'][0]} ranks and "
                        "--local runs one (another global batch and data order): resume it without --local")
    if differ:
        said = [f"{k}={old!r} (this run: {new!r})" for k, (old, new) in differ.items()]
        raise UserError(f"--resume-from: {directory} was trained with {', '.join(said[:3])}"
                        f"{f' and {len(said) - 3} more' if len(said) > 3 else ''}; a resume continues that run "
                        "as it was (its optimizer, schedule, data order and random streams): set these as it had "
                        "them, or start a new run without --resume-from")
    check_files(directory)


def past_end(directory: str | Path, report: dict | None, max_steps: int | None) -> None:
    """A checkpoint with training state at or beyond train.max_steps: one line. There is nothing left to train, and
    it is an intermediate evaluation, not a finished run's result (no test score, no export); a run's last
    checkpoint holds its result instead (`is_result_only`)."""
    if max_steps is not None and report and isinstance(report.get("step"), int) and report["step"] >= max_steps:
        raise UserError(f"--resume-from: {directory} is at step {report['step']}, not before train.max_steps="
                        f"{max_steps}; set train.max_steps above {report['step']} (the run's own: resume to train "
                        "on), or resume from an earlier checkpoint")


def is_result_only(directory: str | Path, report: dict | None) -> bool:
    """A finished run's last checkpoint: its final report, no training state (the loop writes none at the last
    step: a resume there reports the result again, and nothing trains on from it)."""
    return bool(report and report.get("final") and isinstance(report.get("step"), int)
                and not (Path(directory) / "state").is_dir())


def check_files(directory: str | Path) -> None:
    """Before anything starts: every checkpoint file under `directory` is a readable archive that holds only what
    the weights-only unpickler rebuilds (read without unpickling); else a one-line UserError naming the file."""
    import torch

    allowed = {f"{t.__module__}.{t.__qualname__}" for t in _deepspeed_types()}
    for f in sorted(Path(directory).rglob("*.pt")):
        if _corrupt_file(f.parent, f.name):
            raise UserError(f"checkpoint {directory}: {f.relative_to(directory)} is corrupt or incomplete")
        unsafe = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(str(f))) - allowed)
        if unsafe:
            raise UserError(f"checkpoint {directory}: {f.relative_to(directory)} refused, it holds "
                            f"{', '.join(unsafe[:3])}, not only weights; checkpoints are loaded weights-only")


def _corrupt_file(folder: Path, pattern: str = "*.pt") -> str | None:
    """The first checkpoint file in `folder` that is not a readable torch zip archive, else None."""
    for f in sorted(folder.glob(pattern)):
        try:
            with zipfile.ZipFile(f) as z:
                if z.testzip() is not None:
                    return f.name
        except (zipfile.BadZipFile, OSError, EOFError):
            return f.name
    return None


def from_rank0(value):
    """Rank 0's `value` on every rank (the others' are not used): what rank 0 found in the storage decides for all,
    so ranks whose listings differ (a network file system's cached directory) still run the same collectives.
    Every rank calls this."""
    import torch
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    return value


EXPORTS = ("model", "task_params", "config.yaml", "metrics.jsonl")


def upload_exports(out_dir: Path, path: str, filesystem) -> None:
    """Copy a finished run's exports (not its checkpoints) to `path` in a pyarrow filesystem (a bucket)."""
    from pyarrow import fs

    local = fs.LocalFileSystem()
    for name in EXPORTS:
        source = Path(out_dir) / name
        if source.is_dir():
            fs.copy_files(str(source), f"{path}/{name}", source_filesystem=local, destination_filesystem=filesystem)
        elif source.is_file():
            with source.open("rb") as src, filesystem.open_output_stream(f"{path}/{name}") as out:
                out.write(src.read())


MANIFEST = "manifest_rank_{}.json"


def write_manifest(directory: str | Path, rank: int) -> None:
    """This rank's files in a checkpoint folder it is about to report, with their sizes (see the module docstring).
    A folder reported again (a finished run's result, a checkpoint Tune never took) already has this very manifest:
    left as it is (the folder may be a stored checkpoint, or the user's, read-only). Else written beside and renamed
    over: a kill never leaves a stored checkpoint with a half-written manifest, which made it look incomplete."""
    directory = Path(directory)
    files = {str(f.relative_to(directory)): f.stat().st_size for f in sorted(directory.rglob("*"))
             if f.is_file() and not (f.name.lstrip(".").startswith("manifest_rank_") and f.parent == directory)}
    path, text = directory / MANIFEST.format(rank), json.dumps(files) + "\n"
    with suppress(OSError):
        if path.read_text() == text:
            return
    write_whole(path, text)


def write_whole(path: Path, text: str) -> None:
    """`text` into `path` by a rename over it (written beside first, `temporary_beside`): a kill leaves the old
    file or the new one, never part of one."""
    partial = temporary_beside(path)
    partial.write_text(text)
    os.replace(partial, path)


def complete_step(filesystem, path: str, world: int) -> int | None:
    """The step of the checkpoint at `path` (a pyarrow filesystem path) if every one of `world` ranks' files is there
    in full (their manifests), else None."""
    from pyarrow import fs
    try:
        sizes = {info.path[len(path.rstrip("/")) + 1:]: info.size
                 for info in filesystem.get_file_info(fs.FileSelector(path, recursive=True))
                 if info.type == fs.FileType.File}
        listed = {}
        for rank in range(world):
            with filesystem.open_input_stream(f"{path}/{MANIFEST.format(rank)}") as f:
                listed.update(json.loads(f.read()))
    except (OSError, ValueError, KeyError, TypeError):  # absent, half-written or not ours
        return None
    step = reported_step(filesystem, path)
    return step if step >= 0 and all(sizes.get(name) == size for name, size in listed.items()) else None


def newest_complete(filesystem, experiment_path: str, world: int) -> tuple[int, str] | None:
    """(step, path) of the complete checkpoint with the highest step among the `checkpoint_*` folders of a Ray Train
    run's storage, else None."""
    from pyarrow import fs
    try:
        folders = [i.path for i in filesystem.get_file_info(fs.FileSelector(experiment_path, allow_not_found=True))
                   if i.type == fs.FileType.Directory and i.base_name.startswith("checkpoint_")]
    except OSError:
        return None
    found = [(step, path) for path in folders if (step := complete_step(filesystem, path, world)) is not None]
    return max(found) if found else None


def newest_unreported(filesystem, experiment_path: str, world: int, taken) -> tuple[tuple[int, str] | None, bool]:
    """The newest complete checkpoint under `experiment_path` (`newest_complete`), and whether Ray never took its
    report: it is newer than `taken`, the checkpoint Ray or Tune hands back (an object with `filesystem` and `path`;
    None: none). A worker killed after writing it but before Ray polled its report leaves it so; the loop then
    reports it again when it resumes from it."""
    newest = newest_complete(filesystem, experiment_path, world)
    step = reported_step(taken.filesystem, taken.path) if taken is not None else -1
    return newest, newest is not None and newest[0] > step


def resume_choice(filesystem, experiment_path: str, world: int, taken, rank: int):
    """`newest_unreported` as rank 0 finds it, on every rank (`from_rank0`): which checkpoint a restarted or resumed
    run continues from, and whether it reports it again, drive collectives. Every rank calls this."""
    return from_rank0(newest_unreported(filesystem, experiment_path, world, taken) if rank == 0 else None)


_PARTITION = re.compile(r"(?:^|_)zero_pp_rank_(\d+)_")  # DeepSpeed's per-rank ZeRO files (optimizer; ZeRO-3 model)


def download_for_rank(filesystem, path: str, rank: int | None) -> str:
    """A local copy of the checkpoint at `path` (a pyarrow filesystem path) holding what `rank` loads: every file but
    the other ranks' ZeRO partitions (`zero_pp_rank_<r>_*`: a non-elastic ZeRO load reads its own rank's only), so N
    ZeRO ranks resuming fetch the partitioned state about once in all, not N times each; `rank=None`: every file (a
    copy that is reported again as the whole checkpoint). The caller removes it; a failed fetch leaves nothing."""
    def mine(name: str) -> bool:
        other = _PARTITION.search(name)
        return not other or rank is None or int(other.group(1)) == rank

    local = tempfile.mkdtemp(prefix="hpsearch-resume-")
    try:
        download_dir(filesystem, path, Path(local), keep=mine)
    except BaseException:
        shutil.rmtree(local, ignore_errors=True)
        raise
    return local


def reported_step(filesystem, path: str) -> int:
    """The step a checkpoint (a pyarrow filesystem path) was reported at; -1 if it carries no readable report."""
    try:
        with filesystem.open_input_stream(f"{path}/{REPORT}") as f:
            return int(json.loads(f.read())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


BEST = "best.json"


def write_best(directory: str | Path, best: dict) -> None:
    """The best so far ({score, step, weights: the path of its weights}) a checkpoint refers to."""
    (Path(directory) / BEST).write_text(json.dumps(best) + "\n")


def read_best(directory: str | Path) -> dict | None:
    try:
        best = json.loads((Path(directory) / BEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return best if isinstance(best, dict) and isinstance(best.get("weights"), str) else None


def write_report(directory: Path, metrics: dict) -> None:
    (Path(directory) / REPORT).write_text(json.dumps(metrics) + "\n")


def read_report(directory: str | Path) -> dict | None:
    path = Path(directory) / REPORT
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise UserError(f"checkpoint {directory}: {REPORT} is corrupt or incomplete") from None


def rng_state() -> dict:
    """Every rank's random state, {"ranks": [{"cpu": ..., "cuda": ...} of rank 0, of rank 1, ...]} (a collective:
    every rank calls it). DeepSpeed writes the client state only into rank 0's file at ZeRO stages 0-2, so a state
    of each rank's own would resume every rank with rank 0's (its dropout masks on every rank). "cuda": the rank's own
    device, so a resume on a node with another number of visible devices still applies. Gathered as byte tensors
    (nothing is pickled between the ranks)."""
    import torch
    import torch.distributed as dist

    own = [torch.get_rng_state()]
    if torch.cuda.is_available():
        own.append(torch.cuda.get_rng_state())
    flat = torch.cat(own)  # uint8: the CPU generator's state, then the device's
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        states = [flat]
    else:
        nccl = dist.get_backend() == "nccl"
        mine = flat.to(torch.device("cuda", torch.cuda.current_device())) if nccl else flat
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        states = [g.cpu() for g in gathered]
    n = own[0].numel()
    return {"ranks": [{"cpu": state[:n].clone(), **({"cuda": state[n:].clone()} if len(own) > 1 else {})}
                      for state in states]}


def set_rng_state(state: dict, rank: int) -> bool:
    """Set this rank's random state from `rng_state()`'s (or, from a checkpoint written before it kept every
    rank's, the one state it kept). False when the checkpoint has none for this rank (it was written by fewer ranks):
    the rank keeps the stream it was seeded with."""
    import torch

    if "ranks" in state:
        if rank >= len(state["ranks"]):
            return False
        state = state["ranks"][rank]
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if isinstance(cuda, (list, tuple)):  # the older form: every visible device's
            torch.cuda.set_rng_state_all(cuda[:torch.cuda.device_count()])
        else:
            torch.cuda.set_rng_state(cuda)
    return True
