"""A trial that trains in its own Tune actor (`resources.worker_group=auto` with one worker): no Ray Train worker
group, so no Train controller and no worker actor to start per trial, and Tune reuses the actor (its imports,
DeepSpeed's loaded ops) for the next trial.

`TuneSession` is what the training loop reports through there, as `RaySession` is in a Ray Train worker: reports
and checkpoints go to Tune (`ray.tune.report`), which keeps the newest checkpoint (`CheckpointConfig(num_to_keep=1)`)
in the trial's folder and hands it back when it retries the trial or resumes the study; the best weights live where
a Ray Train trial keeps them (`<study>/train/<trial id>/best`). A checkpoint Tune never registered (the actor died
after uploading it, before Tune took the report) is found by its manifest, as in `RaySession`."""
from __future__ import annotations

import shutil
import tempfile

from hpsearch.train import checkpoints


class TuneSession:
    rank, world_size, local_rank, local_world_size, node_rank, nodes = 0, 1, 0, 1, 0, 1

    def __init__(self, best_path: str, best_filesystem):
        import ray.tune
        self._best = (best_path, best_filesystem)
        self._ckpt = ray.tune.get_checkpoint()
        storage = ray.tune.get_context().get_storage()
        self.unregistered = False
        newest = checkpoints.newest_complete(storage.storage_filesystem, storage.trial_fs_path, 1)
        if newest is not None and (self._ckpt is None or newest[0] > checkpoints.reported_step(
                self._ckpt.filesystem, self._ckpt.path)):
            self._ckpt = ray.tune.Checkpoint(newest[1], filesystem=storage.storage_filesystem)
            self.unregistered = True  # Tune (and so MLflow) never got its report: the loop reports it again
        self._resume_dir = None

    def get_checkpoint_dir(self) -> str | None:
        if self._ckpt is None:
            return None
        self._resume_dir = tempfile.mkdtemp(prefix="hpsearch-resume-")
        return self._ckpt.to_directory(self._resume_dir)

    def release_checkpoint_dir(self) -> None:
        if self._resume_dir:
            shutil.rmtree(self._resume_dir, ignore_errors=True)

    def best_dir(self):
        path, filesystem = self._best
        if filesystem is None:  # a local folder
            from pyarrow import fs
            return fs.LocalFileSystem(), path
        return filesystem, path

    def prune_best(self, current: str) -> None:
        """Tune keeps one checkpoint (the latest), which refers to `current`: remove every other version."""
        from hpsearch.train.sessions import _remove_unreferenced
        _remove_unreferenced(*self.best_dir(), {current})

    def report(self, metrics: dict, checkpoint_dir: str | None) -> None:
        """Uploads the checkpoint and waits until Tune took the report (or stops this trial there: ASHA)."""
        import ray.tune
        if checkpoint_dir:
            checkpoints.write_manifest(checkpoint_dir, self.rank)
        ray.tune.report(metrics, checkpoint=ray.tune.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir
                        else None)
