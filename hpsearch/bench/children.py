"""The benchmark's child processes (training runs, studies, the memory group's ranks) die with it.

A benchmark killed outright (SIGKILL: the OOM killer, `kill -9`) runs no handler, so its children used to run on:
when the OOM killer took a benchmark (2026-11-27), the memory group's two t5-large ranks ran on to their end, about
half a minute, and a `python -m hpsearch.train` run would train to its end. Each child now asks
Linux to kill it when the benchmark's thread that started it dies (`prctl(PR_SET_PDEATHSIG, SIGKILL)`), first
thing, before its imports; a child whose parent is already gone by then exits at once. A training run's private
Ray goes down with its driver as ever (Ray's own processes share their driver's fate). Ctrl-C reaches the whole
process group anyway. Elsewhere than Linux nothing is set."""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int) -> None:
    """Be killed when `parent` (the pid that started this process) dies; exit now if it already has."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # refused (a sandbox): the child runs as before
    if os.getppid() != parent:  # the parent died before the request: nothing will signal this process
        os._exit(1)


def command(*, module: str | None = None, code: str | None = None, args=()) -> list[str]:
    """The argv of a child running `python -m module *args` (as `runpy` does it, so the module sees the same
    `sys.argv[1:]`) or `python -c code *args`, that dies with this process."""
    if (module is None) == (code is None):
        raise ValueError("command: give one of module, code")
    run = code if code is not None else \
        f"import runpy; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    prelude = f"from hpsearch.bench.children import die_with_parent; die_with_parent({os.getpid()})\n"
    return [sys.executable, "-c", prelude + run, *args]
