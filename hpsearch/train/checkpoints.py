"""Checkpoint files: loaded weights-only (no code runs from a checkpoint), per-rank copies, the report they carry.

DeepSpeed writes its checkpoints with `torch.save` (pickle) and loads them with `torch.load(weights_only=False)`:
a crafted `*_model_states.pt` would run code in every worker on resume. Every load here goes through torch's
weights-only unpickler (`TORCH_FORCE_WEIGHTS_ONLY_LOAD`, honoured by every `torch.load` call, DeepSpeed's too),
which rebuilds tensors, containers and numbers, plus the two DeepSpeed types a ZeRO checkpoint really holds
(an enum and the loss scaler, both plain data); anything else is refused. The metrics a checkpoint was reported
with travel beside it as JSON (`report.json`), so a run restored at its last step can report its result again.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import zipfile
from contextlib import contextmanager
from pathlib import Path

import torch

from hpsearch.errors import UserError

REPORT = "report.json"


class DiskFull(UserError):
    """A write found no space left: one line naming where; not worth retrying until space is freed."""


def disk_full(e: BaseException) -> bool:
    """An error that means the device is full: ENOSPC, or torch.save's message when a write came up short."""
    import errno
    text = str(e)
    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in text \
        or "unexpected pos" in text


def _deepspeed_types() -> list:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    return [ZeroStageEnum, LossScaler, DynamicLossScaler]


@contextmanager
def weights_only_loads():
    """Within: every `torch.load` (DeepSpeed's included) unpickles weights-only, with DeepSpeed's data types."""
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


def load(engine, directory: str | Path, tag: str, **kwargs) -> dict | None:
    """`engine.load_checkpoint` weights-only; a refused, corrupt or mismatching checkpoint is a one-line UserError.
    Returns DeepSpeed's client state."""
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
        detail = str(e).splitlines()[0][:200] if str(e) else ""
        raise UserError(f"checkpoint {directory} does not match this run's config ({type(e).__name__}: "
                        f"{detail})") from None
    if path is None:
        raise UserError(f"checkpoint {directory}: no '{tag}' checkpoint in it (incomplete)")
    return client


def check_resume_dir(directory: str | Path) -> None:
    """`--resume-from`: a checkpoint folder (holding state/) whose files are safe to load, or a one-line UserError,
    before anything starts (nothing is unpickled)."""
    if not (Path(directory) / "state").is_dir():
        raise UserError(f"--resume-from: {directory} is not a checkpoint (expected a directory holding "
                        "state/, e.g. <train.output_dir>/checkpoints/step_N)")
    check_files(directory)


def check_files(directory: str | Path) -> None:
    """Before anything starts: every checkpoint file under `directory` is a readable archive that holds only what
    the weights-only unpickler rebuilds (read without unpickling); else a one-line UserError naming the file."""
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


def copy_rank_files(src: Path, dst: Path, rank: int) -> None:
    """Copy this rank's files of a DeepSpeed checkpoint folder (rank 0 also the shared ones)."""
    for f in sorted(src.rglob("*")):
        if f.is_file() and (f"zero_pp_rank_{rank}_" in f.name or (rank == 0 and "zero_pp_rank_" not in f.name)):
            target = dst / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)


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
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
