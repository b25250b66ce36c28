"""DeepSpeed's JIT-compiled ops, built once per machine without the stale-lock hang.

On CPU, `deepspeed.init_distributed` compiles its shared-memory comm op with `torch.utils.cpp_extension.load`
(DeepSpeed's CPU Adam op is never needed: ZeRO-Offload steps torch's AdamW or Adafactor on the CPU, see dsconfig.py).
Every load, even of an op already built, creates `<build dir>/lock` for a moment and waits, forever, while that
file exists. A process killed inside that moment (a trial stopped by ASHA, a job
cancelled during the first ~45 s compile) leaves the file behind, and every later DeepSpeed run on the machine
hangs in `FileBaton.wait`.

`load_ops` loads the ops this run needs before DeepSpeed asks for them, under an `flock` on
`<build dir>/hpsearch.flock` that the kernel releases when its holder dies. Every hpsearch process takes that flock
before it touches the build directory, and DeepSpeed's own later loads are served from its in-process cache
(`OpBuilder._loaded_ops`) without touching the directory (so does `load_ops` itself in a process that loaded the op
already: a reused trial actor, a kept rank). A `lock` found while holding the flock is stale when no process has it
open (torch keeps its lock file open until it removes it): it is removed. One that a process still has open is
another program loading the op (torch or DeepSpeed used directly; removing it under that program made its own
release fail): the process says so and waits for it. Where this machine's /proc cannot tell (a lock of another
user, whose open files it cannot read; a build directory on a file system other machines share, such as an NFS
home's `~/.cache/torch_extensions`), the lock is waited for until it is 5 min old, with a line naming it.

Every build runs the `ninja` installed with DeepSpeed (the `ninja` package), whatever `PATH` finds first. A
machine often has two (the system's 1.11 and the package's 1.13 here), their build logs hash commands differently,
and torch runs the first on `PATH`: a process with the environment's `bin` on `PATH` (an activated venv, a node
started with `ray start` from it) and one without each took the other's build for stale and rebuilt the op, about
30-40 s every time runs alternated.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

SHM_COMM = "ShareMemCommBuilder"  # deepspeed.comm's CPU all-reduce, built by init_distributed
# the JIT ops a run loads (those its accelerator lacks are skipped): the comm op only. An offloaded optimizer is
# torch's AdamW or Adafactor, not DeepSpeedCPUAdam, so its op (40 s to compile on a new install here) is never built
RUN_OPS = (SHM_COMM,)


def import_deepspeed():
    """`import deepspeed`, without importing MLflow. DeepSpeed's autotuner (`deepspeed --autotuning`, which nothing
    here runs) imports MLflow when it is installed, as DeepSpeed itself is imported: 1.1 of the 1.4 s that import
    took here after torch's, paid by every rank and every trial's worker. MLflow is hidden for that moment only (an
    `import mlflow` later works as ever); a process that already has MLflow keeps it."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed
        return deepspeed
    sys.modules["mlflow"] = None  # `import mlflow` raises ImportError, which the autotuner catches
    try:
        import deepspeed
    finally:
        if "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    return deepspeed


def load_ops(names: Sequence[str] = RUN_OPS) -> list[str]:
    """Build (first time) or load each named DeepSpeed op this accelerator has (by default those a run needs);
    returns the names loaded."""
    deepspeed = import_deepspeed()
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory

    loaded = []
    for name in names:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            continue  # the same test deepspeed.comm applies: this accelerator does not use the op
        if builder.name in getattr(builder, "_loaded_ops", {}):  # loaded in this process: DeepSpeed's cache serves it
            loaded.append(name)
            continue
        build_dir = Path(_get_build_directory(builder.name, verbose=False))
        with open(build_dir / "hpsearch.flock", "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)  # released by the kernel if this process dies
            try:
                _clear_stale_lock(build_dir / "lock")
                _ninja_of_this_environment()
                with contextlib.redirect_stdout(sys.stderr):  # the builder prints; stdout is a run's result
                    builder.load(verbose=False)
            finally:
                fcntl.flock(guard, fcntl.LOCK_UN)
        loaded.append(name)
    return loaded


# file systems other machines (or containers) may share: /proc here does not show their processes
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
                       "afs", "fuse.glusterfs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs",
                       "fuse.cephfs", "fuse.lustre", "fuse.mfs")
UNSURE_LOCK_S = 300.0  # a lock no process here can be shown to hold is taken for stale once it is this old


def holders(path: Path) -> list[int] | None:
    """The pids of this machine's processes that have `path` open, matched by device and inode (a path spelled
    through a symlink, or relative, still matches); None when that cannot be told: no /proc, or a process of the
    lock's owner (torch's baton is held by the process that created the file) whose open files this user cannot
    read. Processes elsewhere (other machines on a shared file system, other PID namespaces) are never seen."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    try:
        lock = path.stat()
    except FileNotFoundError:
        return []
    except PermissionError:  # a folder this user cannot look into
        return None
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list(os.scandir(entry / "fd"))
        except FileNotFoundError:  # gone
            continue
        except PermissionError:  # another user's process: only the owner's could hold the lock
            with contextlib.suppress(OSError):
                if entry.stat().st_uid == lock.st_uid:
                    return None
            continue
        for fd in fds:
            try:
                st = os.stat(fd.path)  # the open file itself (the fd's link, followed)
            except OSError:  # closed meanwhile
                continue
            if (st.st_dev, st.st_ino) == (lock.st_dev, lock.st_ino):
                pids.append(int(entry.name))
                break
    return pids


def filesystem_type(path: Path, mountinfo: str | None = None) -> str | None:
    """The type of the file system `path` is on (`/proc/self/mountinfo`'s longest mount point above it), None
    without /proc."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    real, best, kind = os.path.realpath(path), "", None
    for line in mountinfo.splitlines():
        fields, _, after = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not after:
            continue
        point = parts[4].encode().decode("unicode_escape")  # mountinfo escapes spaces as \040
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, after.split()[0]
    return kind


def _clear_stale_lock(lock: Path, poll_s: float = 0.5, unsure_s: float = UNSURE_LOCK_S) -> None:
    """With the flock held: remove torch's `lock` when no process has it open (one died holding it); wait while a
    process does (another program loading the op). When nothing here can tell (another user's lock this user
    cannot look into, or no holder here of a lock on a file system other machines share, whose processes /proc
    does not show), the lock is waited for until it is `unsure_s` old, then taken for one a killed build left (it
    holds the file only while it builds: ~45 s for the CPU comm op here). No /proc at all: removed, as every lock
    was before."""
    if not Path("/proc").is_dir():
        lock.unlink(missing_ok=True)
        return
    said = False
    shared = (filesystem_type(lock.parent) or "") in NETWORK_FILESYSTEMS
    while lock.exists():
        pids = holders(lock)
        if pids == [] and not shared:
            time.sleep(0.2)  # a holder closes the file just before it removes it: let it finish
            if not lock.exists() or holders(lock) != []:
                continue
            lock.unlink(missing_ok=True)
            return
        if not pids:  # None, or none here of a shared file system's lock
            with contextlib.suppress(FileNotFoundError):
                age = time.time() - lock.stat().st_mtime
                if age >= unsure_s:
                    print(f"[hpsearch] {lock} is {age / 60:.0f} min old and no process here holds it: taken for "
                          "one a killed build left, and removed", file=sys.stderr, flush=True)
                    lock.unlink(missing_ok=True)
                    return
        if not said:
            who = (f"process {', '.join(map(str, pids))}, which is loading {lock.parent.name} ({lock})" if pids else
                   f"{lock}, which no process here can be shown to hold (a build by another user, or on another "
                   f"machine sharing this file system, or one a killed build left): remove it if no build of "
                   f"{lock.parent.name} is running; it is taken for stale when {unsure_s / 60:.0f} min old")
            print(f"[hpsearch] waiting for {who}", file=sys.stderr, flush=True)
            said = True
        time.sleep(poll_s)


def _ninja_of_this_environment() -> None:
    """`PATH` starts with the `ninja` package's folder from now on in this process (unchanged without the package):
    set once and never restored, so no other thread's build sees `PATH` change under it."""
    try:
        import ninja
        first = ninja.BIN_DIR
    except (ImportError, AttributeError):
        return
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != first:
        os.environ["PATH"] = os.pathsep.join([first, path]) if path else first
