"""Where a rank's reports and checkpoints go: stdout and a local folder (`--local`), or Ray Train.

Both also keep the best weights (`best_dir()`, a folder of a pyarrow filesystem: `best/step_<N>.safetensors`, or
`step_<N>.<k>.safetensors` when that name is another run's (bestweights.best_weights_path), written once when
validation improves, see bestweights.save_best); every checkpoint refers to the version it needs (its
`best.json`), and `prune_best` removes the versions no kept checkpoint refers to."""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from hpsearch.config import RunConfig
from hpsearch.train import checkpoints

STAGING = ".staging"


@contextlib.contextmanager
def staged(root: str | Path | None, rank: int):
    """The folder a rank writes a checkpoint into before it reports it. Under `root`, the folder its session keeps
    checkpoints in (on the same file system), so storing it there is a rename, not a second write of every byte:
    `<root>/.staging/rank_<r>`, emptied first of what an attempt killed while writing left, and removed after (with
    `.staging` once no rank's folder is left in it).
    `root` None (Ray Train uploads the checkpoint, or a bucket keeps it): a temporary folder."""
    if root is None:
        with tempfile.TemporaryDirectory(prefix="hpsearch-ckpt-") as folder:
            yield folder
        return
    folder = Path(root) / STAGING / f"rank_{rank}"
    for attempt in range(100):  # another rank leaving may remove the empty .staging between our two mkdirs
        shutil.rmtree(folder, ignore_errors=True)
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            folder.mkdir()
            break
        except FileNotFoundError:  # .staging went in between: again (a race lost 100 times in a row is none)
            if attempt == 99:
                raise
    try:
        yield str(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):  # the last rank out removes .staging (another's folder keeps it)
            folder.parent.rmdir()


def move_into(source: Path, target: Path) -> None:
    """Every file under `source` to the same place under `target`, renamed where both are on one file system, beside
    what is there already (another rank's files of the same checkpoint); files named manifest_* last (a checkpoint
    is complete once its manifests are there)."""
    files = sorted((p for p in source.rglob("*") if p.is_file()), key=lambda p: p.name.startswith("manifest_"))
    target.mkdir(parents=True, exist_ok=True)
    for f in files:
        destination = target / f.relative_to(source)
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(f), str(destination))


class LocalSession:
    """`--local`: report to stdout, checkpoints under output_dir/checkpoints/step_N."""

    def __init__(self, cfg: RunConfig, resume_from: str | None):
        self.dir = Path(cfg.train.output_dir) / "checkpoints"
        self.resume_from = resume_from
        self.keep = cfg.train.keep_checkpoints
        self.history: list[dict] = []
        # the checkpoints kept, oldest first: an earlier run's in this folder (by step), then this run's as it
        # stores them, so a run resumed here from an older copy keeps its own newest, not the abandoned run's
        # higher-numbered ones
        self.kept = sorted((p for p in self.dir.glob("step_*") if p.name[5:].isdigit()), key=_step_number)

    rank, world_size, local_rank, local_world_size, node_rank, nodes = 0, 1, 0, 1, 0, 1
    unregistered = False  # the checkpoint it resumes from is the user's folder

    def staging(self):
        """Where the loop writes a checkpoint: beside the kept ones (see `staged`)."""
        return staged(self.dir, self.rank)

    def get_checkpoint_dir(self) -> str | None:
        return self.resume_from

    def release_checkpoint_dir(self) -> None:
        pass  # the user's folder

    def best_dir(self):
        from pyarrow import fs
        return fs.LocalFileSystem(), str((self.dir / "best").resolve())

    def prune_best(self, current: str) -> None:
        """Remove best-weight versions that neither `current` nor a kept checkpoint (its best.json) refers to."""
        filesystem, folder = self.best_dir()
        refs = [checkpoints.read_best(step) for step in self.dir.glob("step_*")]
        keep = {current} | {ref["weights"] for ref in refs if ref}
        _remove_unreferenced(filesystem, folder, keep)

    def report(self, metrics: dict, checkpoint_dir: str | None) -> None:
        if checkpoint_dir:
            source, target = Path(checkpoint_dir), self.dir / f"step_{metrics['step']}"
            if source.resolve() != target.resolve():
                if target.is_symlink():  # a link of the user's: replaced, what it points to left alone
                    target.unlink()
                shutil.rmtree(target, ignore_errors=True)
                if source.resolve().parent == (self.dir / STAGING).resolve():  # written for this report: renamed
                    source.rename(target)  # whole: a kill leaves no part of it as step_N (no manifest says)
                else:  # the user's folder (the finished run this one resumed from, reported again): copied
                    shutil.copytree(source, target)
            metrics = {**metrics, "checkpoint": str(target)}
            self.kept = [p for p in self.kept if p.name != target.name] + [target]
            for old in self.kept[:-self.keep]:  # the newest `train.keep_checkpoints` stay
                shutil.rmtree(old, ignore_errors=True)
            self.kept = self.kept[-self.keep:]
        self.history.append(metrics)


def _step_number(folder: Path) -> int:
    return int(folder.name.split("_", 1)[1])


class RaySession:
    """Inside a Ray Train worker: ray.train.report (every rank, its own ZeRO shard) and get_checkpoint.

    A run restarted by Ray Train (worker failure) or resumed by Tune continues from the newest complete checkpoint in
    the run's storage: Ray's latest, or a newer one a worker uploaded just before it died, before Ray's controller
    polled its report (checkpoints.newest_complete); else from `resume_from` (`python -m hpsearch.train
    --resume-from DIR`: a folder every worker can read)."""

    def __init__(self, resume_from: str | None = None):
        import ray.train
        ctx = ray.train.get_context()
        self.rank, self.world_size = ctx.get_world_rank(), ctx.get_world_size()
        self.local_rank, self.node_rank = ctx.get_local_rank(), ctx.get_node_rank()
        self.local_world_size = ctx.get_local_world_size()
        self.nodes = self.world_size // max(1, self.local_world_size)
        self._ckpt = ray.train.get_checkpoint()
        storage = ctx.get_storage()
        newest, self.unregistered = checkpoints.resume_choice(
            storage.storage_filesystem, storage.experiment_fs_path, self.world_size, self._ckpt, self.rank)
        if self.unregistered:  # Ray (and so Tune, MLflow) never got its report: the loop reports it again
            self._ckpt = ray.train.Checkpoint(newest[1], filesystem=storage.storage_filesystem)
        self._resume_from = resume_from
        self._resume_dir = None

    def staging(self):
        """Beside the run's checkpoints when its storage is a local file system (a shared one on a cluster): Ray's
        upload of the checkpoint is then a rename (`store_in_ray_storage`). Else (a bucket) a temporary folder Ray
        uploads."""
        import ray.train
        from pyarrow import fs
        storage = ray.train.get_context().get_storage()
        local = isinstance(storage.storage_filesystem, fs.LocalFileSystem)
        return staged(storage.experiment_fs_path if local else None, self.rank)

    def get_checkpoint_dir(self) -> str | None:
        if self._ckpt is None:
            return self._resume_from
        # rank 0 reports a checkpoint whose report Ray never took again, from this copy (loop.py): then it is whole
        mine = None if self.unregistered and self.rank == 0 else self.rank
        self._resume_dir = checkpoints.download_for_rank(self._ckpt.filesystem, self._ckpt.path, mine)
        return self._resume_dir

    def release_checkpoint_dir(self) -> None:
        if self._resume_dir:  # a downloaded copy of the Ray checkpoint
            shutil.rmtree(self._resume_dir, ignore_errors=True)

    def best_dir(self):
        import ray.train
        storage = ray.train.get_context().get_storage()
        return storage.storage_filesystem, f"{storage.experiment_fs_path}/best"

    def prune_best(self, current: str) -> None:
        """Ray keeps one checkpoint (the latest), which refers to `current`: remove every other version."""
        _remove_unreferenced(*self.best_dir(), {current})

    def report(self, metrics: dict, checkpoint_dir: str | None) -> None:
        import ray.train
        if checkpoint_dir:
            checkpoints.write_manifest(checkpoint_dir, self.rank)
        ckpt = ray.train.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
        ray.train.report(metrics, checkpoint=ckpt, checkpoint_upload_fn=store_in_ray_storage if ckpt else None)


def store_in_ray_storage(checkpoint, dir_name: str):
    """Ray Train's upload of a reported checkpoint (`ray.train.report(checkpoint_upload_fn=...)`, called on each rank
    with that rank's folder): a folder written in the run's own staging area (`RaySession.staging`, on the storage's
    file system) is moved into the checkpoint's folder, every rank's files into the one folder as Ray merges them,
    after Ray's own check that this node sees the storage; any other (a copy downloaded for a resume, a bucket's
    run) is uploaded as Ray does it."""
    import ray.train
    from pyarrow import fs
    storage = ray.train.get_context().get_storage()
    source = Path(checkpoint.path)
    staging = (Path(storage.experiment_fs_path) / STAGING).resolve()
    if not isinstance(storage.storage_filesystem, fs.LocalFileSystem) or source.resolve().parent != staging:
        return storage.persist_current_checkpoint(checkpoint, dir_name)
    storage._check_validation_file()  # as persist_current_checkpoint: a node that does not see the storage fails
    target = storage.build_checkpoint_path_from_name(dir_name)
    move_into(source, Path(target))
    return ray.train.Checkpoint(filesystem=storage.storage_filesystem, path=target)



def _remove_unreferenced(filesystem, folder: str, keep: set[str]) -> None:
    from pyarrow import fs
    for info in filesystem.get_file_info(fs.FileSelector(folder, allow_not_found=True)):
        if info.type == fs.FileType.File and info.path not in keep:
            filesystem.delete_file(info.path)
