"""Copies out of a pyarrow filesystem (a bucket, or a folder through pyarrow's local filesystem), torch-free: the
study's driver and the training workers both use them."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def download_dir(filesystem, path: str, target: Path, keep: Callable[[str], bool] | None = None) -> None:
    """Copy the files under `path` (a path of the pyarrow `filesystem`) to the local folder `target`, streamed,
    creating its folders (pyarrow's copy_files does not create local folders); a file whose name `keep` refuses is
    left out."""
    from pyarrow import fs

    root = path.rstrip("/")
    for info in filesystem.get_file_info(fs.FileSelector(root, recursive=True)):
        if info.type != fs.FileType.File or (keep is not None and not keep(info.base_name)):
            continue
        local = Path(target, info.path[len(root) + 1:])
        local.parent.mkdir(parents=True, exist_ok=True)
        with filesystem.open_input_stream(info.path) as src, open(local, "wb") as out:
            while chunk := src.read(1 << 24):
                out.write(chunk)
