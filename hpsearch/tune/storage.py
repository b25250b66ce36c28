"""Where studies keep their state: a local folder, or a URI (`s3://bucket/prefix`, `gs://...`, `hdfs://...`) opened
as a pyarrow filesystem, the way Ray opens it.

    storage = open_storage("s3://bucket/studies")     # or "runs/tune"
    storage.study_dir("default")                       # the local folder hpsearch writes the study's own files in
    storage.ray_path("default")                        # (storage_path, storage_filesystem) for Ray Tune / Train

With a URI, Ray Tune's experiment state and Ray Train's checkpoints go to the bucket directly (Ray's own storage
layer, given our filesystem); the study's own files (`hpsearch-study.json`, `space.yaml`, each finished trial's
exports `trials/<id>/{model,task_params,config.yaml,metrics.jsonl}`, `report/`) are written to a local mirror
(`~/.cache/hpsearch/storage/<scheme>/<bucket>/<prefix>/<name>`, or under `HPSEARCH_STORAGE_CACHE`) and copied to
the bucket at once, so `--resume` on another machine starts from the bucket alone. A custom endpoint (MinIO, moto,
a private S3) is given in the URI (`s3://bucket/prefix?endpoint_override=http://host:port`) or by
`AWS_ENDPOINT_URL`; credentials come from the usual AWS variables and files.
"""
from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from hpsearch.errors import ConfigError
from hpsearch.remotefs import download_dir

_URI = re.compile(r"[a-z][a-z0-9+.-]*://")

STORAGE_MARKER = ".storage_marker"  # a trial's thread leaves it in train/<trial id>/ for its kept ranks to see
CLAIMS = ".claims"  # in a bucket, `<name>/.claims/`: the starts that took the name (Storage.claim)


def is_uri(text: str) -> bool:
    return bool(_URI.match(text)) and not text.startswith("file://")


@dataclass
class Storage:
    uri: str                 # as given (printed in resume commands); a local path made absolute
    fs: object | None        # pyarrow FileSystem of a URI; None for a local folder
    root: str                # the path inside `fs` (bucket/prefix), or the local folder
    local_root: Path         # where hpsearch writes: the folder itself, or the URI's local mirror

    @property
    def remote(self) -> bool:
        return self.fs is not None

    def study_dir(self, name: str) -> Path:
        return self.local_root / name

    def remote_path(self, name: str, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), name, *parts])

    def ray_path(self, name: str | None = None, *parts: str) -> tuple[str, object | None]:
        """(storage_path, storage_filesystem) for Ray: the bucket path with our filesystem, or the local folder."""
        if self.remote:
            return (self.remote_path(name, *parts) if name else self.root), self.fs
        return str(Path(self.root, *(p for p in (name, *parts) if p))), None

    # ---- what exists ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _reaching(self):
        """A bucket that does not answer (an endpoint not started, no network): one line naming it."""
        try:
            yield
        except OSError as e:
            if not self.remote:
                raise
            raise ConfigError(f"--storage-path {self.uri}: cannot reach it ({str(e).splitlines()[0][:240]})") \
                from None

    def names(self) -> list[str]:
        """The study names under the storage (folders)."""
        if not self.remote:
            root = Path(self.root)
            return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        from pyarrow import fs
        with self._reaching():
            infos = self.fs.get_file_info(fs.FileSelector(self.root, allow_not_found=True))
        return sorted(i.base_name for i in infos if i.type == fs.FileType.Directory)

    def exists(self, name: str, *parts: str) -> bool:
        """Whether the study's folder (or a file in it) exists."""
        if not self.remote:
            return self.study_dir(name).joinpath(*parts).exists()
        from pyarrow import fs
        with self._reaching():
            return self.fs.get_file_info(self.remote_path(name, *parts)).type != fs.FileType.NotFound

    def claim(self, name: str) -> bool:
        """Take the study's folder for a new study, or False when another start has it. Nothing else marks a name
        taken until the study saves its state, after Ray has started (and, on a cluster, its nodes), so two starts
        took one name (one folder, one Optuna study, each pruning the other's checkpoints). A local folder is made,
        failing if it exists. In a bucket, which has no create-if-absent here, a claim is an object of its own
        (`<name>/.claims/<time>-<random>`): after writing it, a start that sees anything else under the name (an
        earlier claim, a study) withdraws its claim and loses; of two starts at once each sees the other and both
        lose, never both win (a listing shows every object written before it)."""
        if not self.remote:
            try:
                self.study_dir(name).mkdir(parents=True)
                return True
            except FileExistsError:
                return False
        import time
        import uuid

        from pyarrow import fs
        key = self.remote_path(name, CLAIMS, f"{time.time_ns():020d}-{uuid.uuid4().hex}")
        with self._reaching():
            with self.fs.open_output_stream(key) as out:
                out.write(b"")
            found = self.fs.get_file_info(fs.FileSelector(self.remote_path(name), recursive=True))
            if [i.path for i in found if i.type == fs.FileType.File] == [key]:
                self._claims = {**getattr(self, "_claims", {}), name: key}
                return True
            self.fs.delete_file(key)
        return False

    def release(self, name: str) -> None:
        """Give up a claimed name of a study that never started (its folder still empty, or this start's claim)."""
        if not self.remote:
            with contextlib.suppress(OSError):
                self.study_dir(name).rmdir()
            return
        key = getattr(self, "_claims", {}).pop(name, None)
        if key is None:
            return
        from pyarrow import fs
        with contextlib.suppress(OSError):
            self.fs.delete_file(key)
            left = self.fs.get_file_info(fs.FileSelector(self.remote_path(name), recursive=True))
            if not [i for i in left if i.type == fs.FileType.File]:  # nothing else was written under the name
                self.fs.delete_dir(self.remote_path(name))

    def check_writable(self) -> None:
        """One line if the folder cannot be created or written (local), or the bucket is missing or refuses a
        write (a probe object, removed again)."""
        if not self.remote:
            root = Path(self.root)
            try:
                root.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"--storage-path {root}: cannot create it ({e.strerror})") from None
            if not os.access(root, os.W_OK | os.X_OK):
                raise ConfigError(f"--storage-path {root}: not writable by this user")
            return
        probe = f"{self.root.rstrip('/')}/.hpsearch-write-probe-{os.getpid()}"
        try:
            with self.fs.open_output_stream(probe) as out:
                out.write(b"probe")
            self.fs.delete_file(probe)
        except OSError as e:
            reason = str(e).split(": ", 1)[-1] if "NO_SUCH_BUCKET" not in str(e) else \
                f"the bucket {self.root.split('/')[0]} does not exist"
            raise ConfigError(f"--storage-path {self.uri}: cannot write there ({reason.splitlines()[0][:200]})") \
                from None

    # ---- the study's own files --------------------------------------------------------------------------------
    def push(self, name: str, *relative: str) -> None:
        """Copy files or folders of the study's local mirror to the bucket (nothing to do for a local folder)."""
        if not self.remote:
            return
        from pyarrow import fs
        local = fs.LocalFileSystem()
        for rel in relative:
            source = self.study_dir(name) / rel
            if source.is_dir():
                fs.copy_files(str(source), self.remote_path(name, rel), source_filesystem=local,
                              destination_filesystem=self.fs)
            elif source.is_file():
                with source.open("rb") as src, self.fs.open_output_stream(self.remote_path(name, rel)) as out:
                    out.write(src.read())

    def pull(self, name: str, *relative: str) -> None:
        """Copy files of the study from the bucket to its local mirror (those that exist)."""
        if not self.remote:
            return
        from pyarrow import fs
        for rel in relative:
            with self._reaching():
                info = self.fs.get_file_info(self.remote_path(name, rel))
            target = self.study_dir(name) / rel
            if info.type == fs.FileType.File:
                target.parent.mkdir(parents=True, exist_ok=True)
                with self.fs.open_input_stream(info.path) as src:
                    target.write_bytes(src.read())
            elif info.type == fs.FileType.Directory:
                download_dir(self.fs, info.path, target)

    def pull_each(self, name: str, folder: str, *files: str) -> None:
        """Copy `files` of every sub-folder of the study's `folder` (e.g. each trial's config.yaml) from the bucket
        to the mirror, not the sub-folders' other contents (their models)."""
        if not self.remote:
            return
        from pyarrow import fs
        for info in self.fs.get_file_info(fs.FileSelector(self.remote_path(name, folder), allow_not_found=True)):
            if info.type == fs.FileType.Directory:
                self.pull(name, *(f"{folder}/{info.base_name}/{file}" for file in files))

    def delete(self, name: str, pattern: str, files: bool = False) -> int:
        """Remove the bucket's folders `<name>/<a>/<b>/...` matching the glob `pattern`, one glob per level (e.g.
        `train/*/checkpoint_*`, `trial_*/checkpoint_*`), or its files there when `files`; returns the bytes
        removed."""
        if not self.remote:
            return 0
        import fnmatch

        from pyarrow import fs
        matched = [(self.remote_path(name), None)]
        parts = pattern.split("/")
        for i, part in enumerate(parts):  # every level listed before anything is deleted
            kind = fs.FileType.File if files and i == len(parts) - 1 else fs.FileType.Directory
            matched = [(info.path, info.size) for folder, _ in matched
                       for info in self.fs.get_file_info(fs.FileSelector(folder, allow_not_found=True))
                       if info.type == kind and fnmatch.fnmatchcase(info.base_name, part)]
        freed = 0
        for path, size in matched:
            if files:
                freed += size or 0
                self.fs.delete_file(path)
                continue
            inside = fs.FileSelector(path, recursive=True, allow_not_found=True)
            freed += sum(f.size or 0 for f in self.fs.get_file_info(inside))
            self.fs.delete_dir(path)
        return freed


def open_storage(text: str) -> Storage:
    """A local folder (made absolute) or a URI opened as a pyarrow filesystem; a URI pyarrow cannot open is a
    one-line ConfigError."""
    if not is_uri(text):
        path = Path(text.removeprefix("file://")).expanduser().resolve()
        return Storage(str(path), None, str(path), path)
    from pyarrow import fs
    try:
        filesystem, root = fs.FileSystem.from_uri(text)
    except (ValueError, OSError, TypeError) as e:  # unknown scheme, bad options, no such endpoint
        raise ConfigError(f"--storage-path {text}: cannot be opened ({str(e).splitlines()[0][:200]}); expected a "
                          "local folder or s3://bucket/prefix, gs://bucket/prefix (endpoint: "
                          "?endpoint_override=http://host:port or AWS_ENDPOINT_URL)") from None
    root = root.rstrip("/")
    if not root:
        raise ConfigError(f"--storage-path {text}: expected a bucket (and a prefix), e.g. s3://bucket/studies")
    scheme = text.split("://", 1)[0]
    cache = Path(os.environ.get("HPSEARCH_STORAGE_CACHE") or "~/.cache/hpsearch/storage").expanduser()
    return Storage(text, filesystem, root, cache / scheme / root)
