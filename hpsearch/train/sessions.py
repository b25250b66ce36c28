"""Where a rank's reports and checkpoints go: stdout and a local folder (`--local`), or Ray Train."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hpsearch.config import RunConfig


class LocalSession:
    """`--local`: report to stdout, checkpoints under output_dir/checkpoints/step_N."""

    def __init__(self, cfg: RunConfig, resume_from: str | None):
        self.dir = Path(cfg.train.output_dir) / "checkpoints"
        self.resume_from = resume_from
        self.keep = cfg.train.keep_checkpoints
        self.history: list[dict] = []

    rank, world_size, local_rank, node_rank, nodes = 0, 1, 0, 0, 1

    def get_checkpoint_dir(self) -> str | None:
        return self.resume_from

    def release_checkpoint_dir(self) -> None:
        pass  # the user's folder

    def report(self, metrics: dict, checkpoint_dir: str | None) -> None:
        if checkpoint_dir:
            target = self.dir / f"step_{metrics['step']}"
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(checkpoint_dir, target)
            metrics = {**metrics, "checkpoint": str(target)}
            steps = sorted(int(p.name.split("_", 1)[1]) for p in self.dir.glob("step_*") if p.name[5:].isdigit())
            for old in steps[:-self.keep]:  # the newest `train.keep_checkpoints` stay
                shutil.rmtree(self.dir / f"step_{old}", ignore_errors=True)
        self.history.append(metrics)


class RaySession:
    """Inside a Ray Train worker: ray.train.report (every rank, its own ZeRO shard) and get_checkpoint.

    A run restarted by Ray Train (worker failure) or resumed by Tune continues from Ray's latest checkpoint; else
    from `resume_from` (`python -m hpsearch.train --resume-from DIR`: a folder every worker can read)."""

    def __init__(self, resume_from: str | None = None):
        import ray.train
        ctx = ray.train.get_context()
        self.rank, self.world_size = ctx.get_world_rank(), ctx.get_world_size()
        self.local_rank, self.node_rank = ctx.get_local_rank(), ctx.get_node_rank()
        self.nodes = self.world_size // max(1, ctx.get_local_world_size())
        self._ckpt = ray.train.get_checkpoint()
        self._resume_from = resume_from
        self._resume_dir = None

    def get_checkpoint_dir(self) -> str | None:
        if self._ckpt is None:
            return self._resume_from
        self._resume_dir = tempfile.mkdtemp(prefix="hpsearch-resume-")
        return self._ckpt.to_directory(self._resume_dir)

    def release_checkpoint_dir(self) -> None:
        if self._resume_dir:  # a downloaded copy of the Ray checkpoint
            shutil.rmtree(self._resume_dir, ignore_errors=True)

    def report(self, metrics: dict, checkpoint_dir: str | None) -> None:
        import ray.train
        ckpt = ray.train.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
        ray.train.report(metrics, checkpoint=ckpt)

