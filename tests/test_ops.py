"""Who holds torch's extension-build lock (`hpsearch.train.ops`), where /proc can tell and where it cannot.

The whole path (a stale lock removed, a live program's lock waited for and left to it) runs real builds in
test_train.py; these check the rules on a lock file of their own."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpsearch.train import ops


def test_a_holder_is_found_by_the_file_whatever_the_spelling_of_its_path(tmp_path, monkeypatch):
    real = tmp_path / "build" / "lock"
    real.parent.mkdir()
    (tmp_path / "link").symlink_to(real.parent)  # TORCH_EXTENSIONS_DIR set through a symlink, or relative
    real.touch()
    assert ops.holders(real) == []
    with open(real):
        for spelling in (real, tmp_path / "link" / "lock", Path("build/lock")):
            monkeypatch.chdir(tmp_path)
            assert ops.holders(spelling) == [os.getpid()], spelling
    assert ops.holders(tmp_path / "link" / "lock") == []
    assert ops.holders(tmp_path / "gone") == []



def test_a_holder_busy_opening_and_closing_other_files_is_always_found(tmp_path):
    """A file closing while its process is scanned must not hide that process's hold on the lock."""
    lock = tmp_path / "lock"
    lock.touch()
    code = ("import time; fs = [open('/dev/null') for _ in range(50)]\n"  # below the lock's fd: scanned first
            f"f = open({str(lock)!r}); print('held', flush=True); t = time.time()\n"
            "while time.time() - t < 60:\n    [g.close() for g in fs]; fs = [open('/dev/null') for _ in range(50)]")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        found = [ops.holders(lock) for _ in range(100)]
        assert all(f == [holder.pid] for f in found), [f for f in found if f != [holder.pid]][:3]
    finally:
        holder.kill()
        holder.wait()

@pytest.mark.skipif(os.geteuid() != 0 or not Path("/proc").is_dir(), reason="needs root to become another user")
def test_another_users_lock_is_not_taken_for_stale(tmp_path):
    """A user who cannot read the lock owner's open files cannot tell whether it is held: None (wait), not []."""
    folder = Path(f"/tmp/hpsearch-ops-{os.getpid()}")  # readable by the other user (pytest's tmp_path is not)
    folder.mkdir(mode=0o755)
    lock = folder / "lock"
    code = ("import os; from pathlib import Path; from hpsearch.train.ops import holders; "  # imported as root
            f"os.setgid(65534); os.setuid(65534); print(holders(Path({str(lock)!r})))")
    as_other = lambda: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    try:
        with open(lock, "w"):
            os.chmod(lock, 0o644)
            held = as_other()
            assert ops.holders(lock) == [os.getpid()]
        assert held.returncode == 0, held.stderr[-2000:]
        assert held.stdout.split() == ["None"]
        # nobody holds it now, but the other user still cannot read the owner's processes: None again, never []
        # on a guess
        assert as_other().stdout.split() == ["None"]
        assert ops.holders(lock) == []  # root sees every process: nobody
    finally:
        lock.unlink(missing_ok=True)
        folder.rmdir()


def test_the_file_system_of_a_path_is_read_from_mountinfo():
    mountinfo = "\n".join([
        "22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/sda1 rw",
        "40 22 0:35 / /home rw,relatime shared:2 - nfs4 server:/export/home rw,vers=4.2",
        "41 40 0:36 / /home/u/scratch\\040space rw - tmpfs tmpfs rw",
        "42 22 0:37 / /homework rw - xfs /dev/sdb1 rw",
    ])
    kind = lambda p: ops.filesystem_type(Path(p), mountinfo)
    assert kind("/home/u/.cache/torch_extensions/py312_cpu") == "nfs4"
    assert kind("/home/u/scratch space/x") == "tmpfs"  # the longest mount point, its escaped space read
    assert kind("/homework/x") == "xfs"  # a prefix of the name is not a parent folder
    assert kind("/var/tmp") == "ext4"
    assert ops.filesystem_type(Path("/")) is not None  # this machine's own mountinfo


def _clear_in_thread(lock: Path, **kw) -> threading.Thread:
    thread = threading.Thread(target=ops._clear_stale_lock, args=(lock,), kwargs={"poll_s": 0.05, **kw},
                              daemon=True)
    thread.start()
    return thread


def test_a_lock_on_a_shared_file_system_is_waited_for_until_it_is_old(tmp_path, monkeypatch, capsys):
    """Other machines' processes are not in this /proc: a lock no local process holds on NFS may be another
    machine's build. It is waited for until it is old enough that no build is still holding it, with a line saying
    which file and what to do; an old one goes at once; one a local process holds stays while held."""
    monkeypatch.setattr(ops, "filesystem_type", lambda path, mountinfo=None: "nfs4")
    lock = tmp_path / "lock"
    lock.touch()
    started = time.monotonic()
    _clear_in_thread(lock, unsure_s=1.5).join(timeout=30)
    waited = time.monotonic() - started
    assert not lock.exists() and waited >= 1.0, waited  # not removed on sight
    err = capsys.readouterr().err
    assert f"waiting for {lock}, which no process here can be shown to hold" in err
    assert "remove it if no build of" in err and "taken for one a killed build left, and removed" in err

    lock.touch()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))  # left an hour ago
    started = time.monotonic()
    _clear_in_thread(lock, unsure_s=1.5).join(timeout=30)
    assert not lock.exists() and time.monotonic() - started < 1.0

    lock.touch()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    with open(lock):  # held here, however old
        thread = _clear_in_thread(lock, unsure_s=1.5)
        time.sleep(0.5)
        assert lock.exists() and thread.is_alive()
        assert f"waiting for process {os.getpid()}" in capsys.readouterr().err
    lock.unlink()  # what the holder's release does
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_lock_on_a_local_file_system_that_no_process_holds_goes_at_once(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()  # created this moment: its age does not matter here, /proc can tell
    started = time.monotonic()
    _clear_in_thread(lock, unsure_s=3600).join(timeout=30)
    assert not lock.exists() and time.monotonic() - started < 5
