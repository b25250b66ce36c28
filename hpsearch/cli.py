"""Shared command-line plumbing: user errors become one line on stderr and exit code 2."""
from __future__ import annotations

import argparse
import contextlib
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from hpsearch.errors import UserError


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (usage stays with --help): `error: <prog>: <what>; see --help`."""

    def error(self, message: str):
        raise UserError(f"{self.prog}: {message}; see --help")


def unwritable(folder: str | Path) -> str | None:
    """Why `folder` could not be created or written ("<nearest existing path> is not a folder" or "... cannot be
    written"), or None. Nothing is created: a probe file in the nearest existing folder, gone at once (permissions
    alone miss read-only mounts and /proc, and say yes to root)."""
    import tempfile

    path = Path(folder).expanduser().absolute()
    try:
        existing = next(p for p in (path, *path.parents) if p.exists())
    except OSError as e:  # a folder on the way this user cannot enter (exists() raises on EACCES)
        return f"{e.filename} cannot be reached ({e.strerror})"
    if not existing.is_dir():
        return f"{existing} is not a folder"
    try:
        with tempfile.TemporaryFile(dir=existing):
            return None
    except OSError:
        return f"{existing} cannot be written"


# user:password@ (a password may hold '/', as SQLAlchemy reads it, unless it reads as a port and a path:
# http://host:8080/a@b), or a user part alone (a token: https://TOKEN@host)
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?:(?P<user>[^/@\s:\[\]]*):(?!\d+(?:/|$))[^@\s]+|"
                       r"[^/@\s:\[\]]+)@")
_SECRET_KEYS = ("secret_key", "secret", "session_token", "password", "passwd", "pwd", "token", "access_token",
                "sas_token", "sig", "account_key", "client_secret", "api_key", "apikey", "aws_secret_access_key")
_SECRET_QUERY = re.compile(rf"(?P<key>(?:^|(?<=[?&;\s]))-{{0,2}}(?:{'|'.join(_SECRET_KEYS)})=)(?P<secret>[^&\s'\"]+)",
                           re.IGNORECASE)


def _userinfo(match: re.Match) -> str:
    user = match.group("user")
    return f"{match.group('scheme')}{user}:***@" if user is not None else f"{match.group('scheme')}***@"


def redacted(text: str) -> str:
    """`text` (a URL, a command line, a report) with the secrets of every URL in it replaced by `***`: a
    password in the user part (`postgresql://user:***@host/db`, `s3://KEY:***@bucket`) and secret query values
    (`?secret_key=***`). What is logged to MLflow or printed goes through this; the study's state file keeps the
    whole URL, which `--resume` needs."""
    return _SECRET_QUERY.sub(r"\g<key>***", _USERINFO.sub(_userinfo, text))


def run_main(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> None:
    """Run `main(argv)`; a `UserError` prints `error: <message>` (one line) and exits 2. At exit, the interpreter
    skips its last collection (`_skip_last_collection`). A caller that catches the `SystemExit` (a test) goes on
    collecting as before: that is an exit handler."""
    import atexit

    atexit.unregister(_skip_last_collection)  # once per process, however often a test calls run_main
    atexit.register(_skip_last_collection)  # handlers run last-registered first: after Ray's and MLflow's
    stop_on_sigterm_as_on_ctrl_c()
    argv = sys.argv[1:] if argv is None else argv
    try:
        code = main(argv)
    except UserError as e:
        print(f"error: {redacted(str(e))}", file=sys.stderr)  # a message may name a URL with its password
        sys.exit(2)
    sys.exit(code or 0)


def stop_on_sigterm_as_on_ctrl_c() -> None:
    """SIGTERM (`ray job stop`, `kill`, Kubernetes, SLURM) stops the program as Ctrl-C does: a study saves Tune's
    state and ends its MLflow runs KILLED, a run stops its workers. Python's default ended the process on the spot
    (and `ray.init` sets `sys.exit`, which skips the Ctrl-C path), leaving the runs RUNNING and Tune's last state
    unsaved. Set again after `ray.init`. Only the main thread sets handlers (a test's thread leaves it)."""
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, _stop_as_ctrl_c)


def _stop_as_ctrl_c(signum, frame) -> None:
    signal.raise_signal(signal.SIGINT)


def _skip_last_collection() -> None:
    """Flush every open file, then freeze what the process left alive out of the collector. The interpreter's
    last collection would walk every object of every module imported to free memory the OS takes back anyway: a
    study's driver (about 490,000 objects of Ray, Tune, MLflow, pandas, matplotlib) 1.5-1.7 s, a `--local` run
    (torch, transformers) 1.3-1.5 s of a 6.6 s run here. What is reachable only through reference cycles, which at
    exit includes every module's globals (a module and its functions are one), is then never finalized: an open
    file is flushed here, as its finalizer would have, but not closed, so a writer that finishes on close (gzip, zip,
    a pyarrow output stream) must be closed by its code, as every writer in hpsearch is (`with`)."""
    import _io  # the C base of every file object; `io.IOBase` is an ABC, 10x slower to test 500,000 objects against
    import gc

    for obj in gc.get_objects():
        if issubclass(type(obj), _io._IOBase):  # not isinstance: it would read proxies' `__class__`
            with contextlib.suppress(Exception):  # closed, read-only or detached: nothing to flush
                obj.flush()
    gc.freeze()
