"""Small helpers shared by the data modules."""
import os
import uuid
from pathlib import Path


def cache_path(cache_dir: str | None, kind: str) -> Path:
    """`<data.cache_dir>/<kind>` (default ~/.cache/hpsearch), where the tokenizers and token ids are kept."""
    return Path(cache_dir or "~/.cache/hpsearch").expanduser() / kind


def temporary_beside(path: Path, suffix: str = "") -> Path:
    """A unique hidden name in `path`'s folder: write there, then `os.replace` it onto `path` (atomic, so
    processes writing the same file at once are safe). `suffix`: an extension the writer insists on."""
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp{suffix}")


def one_line(error: BaseException) -> str:
    """'TypeName: first line of the message', for wrapping a library's exception in a one-line UserError."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
