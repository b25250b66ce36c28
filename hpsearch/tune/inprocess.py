"""A trial that trains in its own Tune actor (`resources.worker_group=auto` with one worker): no Ray Train worker
group, so no Train controller and no worker actor to start per trial, and Tune reuses the actor (its imports,
DeepSpeed's loaded ops) for the next trial.

`TuneSession` is what the training loop reports through there, as `RaySession` is in a Ray Train worker. The
checkpoints live where a Ray Train trial keeps them (`<study>/train/<trial id>/checkpoint_<step>`, with the best
weights beside them in `best/`), each with its manifest; the newest complete one is where a retried or resumed trial
continues (`checkpoints.newest_complete`), and older ones go as soon as a newer one is complete. Tune itself gets
a small pointer checkpoint with each report (the report only, every one kept): Tune restores a trial from the
pointer its saved state names, which therefore always exists (a study resumed from an older saved state would
otherwise name a checkpoint already removed, and fail the trial), and the pointer's step tells whether the newest
checkpoint's report reached Tune (else the loop reports it again)."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hpsearch.train import checkpoints


def free_trial_memory() -> None:
    """A trial's DeepSpeed engine (model, optimizer state, buffers) ends in reference cycles that only a full
    collection frees: a reused actor collects them when a trial returns and before the next one builds its model (a
    trial ASHA stopped or that failed leaves its engine held by its exception until then), so it never holds two; on
    GPU the allocator's cached blocks go back too."""
    import gc

    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def start_reused_trial() -> None:
    """What a process that trains trial after trial (a trial's own Tune actor, a kept rank) does as each trial
    starts: free what its last trial left, and keep random backbones, so a trial with the same backbone and seed as
    the last one copies its initial weights instead of drawing them again
    (`hpsearch.model.backbones.keep_random_backbones`). What the process imported is frozen by the loop, in its
    first trial (`hpsearch.train.startup.freeze_imports`): every later full collection, two a trial here, skips it
    (0.25 s each over the imports here, under 10 ms after); the first trial's collection here is the one that walks
    them (the few objects the trial makes before the loop's freeze are frozen with them: a few kilobytes once)."""
    from hpsearch.model.backbones import keep_random_backbones

    free_trial_memory()
    keep_random_backbones()


class TuneSession:
    rank, world_size, local_rank, local_world_size, node_rank, nodes = 0, 1, 0, 1, 0, 1

    def __init__(self, train_path: str, filesystem):
        """`train_path`: this trial's folder for checkpoints and best weights (a path of the pyarrow `filesystem`;
        None: a local folder)."""
        import ray.tune
        from pyarrow import fs
        self.fs, self.path = filesystem or fs.LocalFileSystem(), train_path
        self.local = filesystem is None
        self._newest, self.unregistered = checkpoints.newest_unreported(self.fs, self.path, 1,
                                                                        ray.tune.get_checkpoint())
        self._resume_dir = None

    def staging(self):
        """Where the loop writes a checkpoint: in this trial's folder when it is local (stored by a rename), else a
        temporary folder (uploaded)."""
        from hpsearch.train.sessions import staged
        return staged(self.path if self.local else None, self.rank)

    def get_checkpoint_dir(self) -> str | None:
        if self._newest is None:
            return None
        if self.local:
            return self._newest[1]
        self._resume_dir = checkpoints.download_for_rank(self.fs, self._newest[1], self.rank)  # this rank's part
        return self._resume_dir

    def release_checkpoint_dir(self) -> None:
        if self._resume_dir:  # a downloaded copy
            shutil.rmtree(self._resume_dir, ignore_errors=True)

    def best_dir(self):
        return self.fs, f"{self.path}/best"

    def prune_best(self, current: str) -> None:
        """The one checkpoint kept refers to `current`: remove every other version."""
        from hpsearch.train.sessions import _remove_unreferenced
        _remove_unreferenced(self.fs, f"{self.path}/best", {current})

    def report(self, metrics: dict, checkpoint_dir: str | None) -> None:
        """Store the checkpoint and remove the older ones, then report (with its pointer) and wait until Tune took
        the report, or stop this trial there (ASHA)."""
        import ray.tune
        if not checkpoint_dir:
            ray.tune.report(metrics)
            return
        checkpoints.write_manifest(checkpoint_dir, self.rank)
        target = f"{self.path}/checkpoint_{int(metrics['step']):06d}"
        self._store(Path(checkpoint_dir), target)
        # the new one is complete: the older ones go now, not after the report, where ASHA may stop the trial (at its
        # last step too); a restart finds this one, and reports it again if Tune never took it
        self._remove_all_but(target)
        with tempfile.TemporaryDirectory(prefix="hpsearch-pointer-") as pointer:
            checkpoints.write_report(Path(pointer), metrics)
            ray.tune.report(metrics, checkpoint=ray.tune.Checkpoint.from_directory(pointer))

    def _store(self, source: Path, target: str) -> None:
        from pyarrow import fs
        if checkpoints.complete_step(self.fs, target, 1) is not None:  # the checkpoint it resumed from, again
            return
        if self.local:  # moved (renamed: it was written in this folder's staging area), not copied
            from hpsearch.train.sessions import move_into
            shutil.rmtree(target, ignore_errors=True)  # a part of one an earlier attempt left (killed while storing)
            move_into(source, Path(target))
            return
        self.fs.delete_dir_contents(target, missing_dir_ok=True)
        fs.copy_files(str(source), target, source_filesystem=fs.LocalFileSystem(), destination_filesystem=self.fs,
                      use_threads=False)  # as Ray uploads to S3 (apache/arrow#32372)

    def _remove_all_but(self, keep: str) -> None:
        from pyarrow import fs
        for info in self.fs.get_file_info(fs.FileSelector(self.path, allow_not_found=True)):
            if info.type == fs.FileType.Directory and info.base_name.startswith("checkpoint_") and \
                    info.path.rstrip("/") != keep.rstrip("/"):
                self.fs.delete_dir(info.path)
