"""Shared command-line plumbing: user errors become one line on stderr and exit code 2."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from hpsearch.errors import UserError


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (usage stays with --help): `error: <prog>: <what>; see --help`."""

    def error(self, message: str):
        raise UserError(f"{self.prog}: {message}; see --help")


def run_main(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> None:
    """Run `main(argv)`; a `UserError` prints `error: <message>` (one line) and exits 2."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        code = main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code or 0)
