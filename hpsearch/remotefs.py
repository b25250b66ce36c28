"""Copies out of a pyarrow filesystem (a bucket, or a folder through pyarrow's local filesystem), torch-free: the
study's driver and the training workers both use them."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hpsearch.errors import UserError


def download_dir(filesystem, path: str, target: Path, keep: Callable[[str], bool] | None = None) -> None:
    """Copy the files under `path` (a path of the pyarrow `filesystem`) to the local folder `target`, streamed,
    creating its folders (pyarrow's copy_files does not create local folders); a file whose name `keep` refuses is
    left out. A name that would lead out of `target` (a bucket's keys may hold `..` or `//`, and pyarrow lists
    them as they are) is refused in one line before anything is written."""
    from pyarrow import fs

    root, home = path.rstrip("/"), Path(target).resolve()
    files = []
    for info in filesystem.get_file_info(fs.FileSelector(root, recursive=True)):
        if info.type != fs.FileType.File or (keep is not None and not keep(info.base_name)):
            continue
        relative = info.path[len(root) + 1:]
        local = (home / relative).resolve()
        if not info.path.startswith(root + "/") or relative.startswith("/") or not local.is_relative_to(home) or \
                ".." in relative.split("/"):
            raise UserError(f"{root}: refusing to copy {info.path!r}, whose name leads out of the folder it is "
                            f"copied to ({target}); expected names below {root}/ without '..' or '//'")
        files.append((info.path, local))
    for remote, local in files:
        local.parent.mkdir(parents=True, exist_ok=True)
        with filesystem.open_input_stream(remote) as src, open(local, "wb") as out:
            while chunk := src.read(1 << 24):
                out.write(chunk)
