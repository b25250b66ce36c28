"""train.host_allocator: a CPU worker's malloc keeps freed tensor memory for reuse (hpsearch/train/hostmem.py).

Each check runs in a fresh process (malloc's settings are per process and cannot be read back) and probes what
glibc does with them, through `mallinfo2`: whether tensors of 20, 30 and 64 MiB get a mapping of their own (fresh
pages, faulted in and zeroed by the kernel on every use) or come from the heap (reused)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hpsearch.train import hostmem

pytestmark = pytest.mark.skipif(not hasattr(hostmem.glibc(), "mallinfo2"),
                                reason="malloc settings are glibc's; the probe needs glibc >= 2.33 (mallinfo2)")

PROBE = """
import ctypes, json
import torch

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2

def own_mapping(mib):
    mapped = libc.mallinfo2().hblks
    block = torch.ones(mib << 18)
    return libc.mallinfo2().hblks - mapped  # 1: the tensor got a mapping of its own (0: from the heap)

def probe():  # in this order: glibc's dynamic threshold rises to the size of a mapped block freed
    return {f"mapped_{mib}": own_mapping(mib) for mib in (20, 30, 64)}
"""

APPLY = PROBE + """
import sys
from hpsearch.train import hostmem
for setting in sys.argv[1:-1]:  # in order, as trials in one reused actor
    did = hostmem.apply(setting, sys.argv[-1] == "gpu")
print(json.dumps({"did": did, **probe()}))
"""

AFTER_A_RUN = PROBE + """
import sys
from hpsearch.config import load_config
from hpsearch.train import loop_config
from hpsearch.train.loop import train_loop
from hpsearch.train.sessions import LocalSession

cfg = load_config(None, sys.argv[1:])
train_loop(loop_config(cfg), LocalSession(cfg, None))
print(json.dumps(probe()))
"""


def run(script: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_reuse_serves_large_tensors_from_the_heap_and_keeps_freed_memory():
    reuse = run(APPLY, "auto", "cpu")
    assert reuse == {"did": "reuse", "mapped_20": 0, "mapped_30": 0, "mapped_64": 0}  # all from the heap
    system = run(APPLY, "system", "cpu")  # glibc's: mapped above a threshold that starts at 128 KiB
    assert system == {"did": "system", "mapped_20": 1, "mapped_30": 1, "mapped_64": 1}
    back = run(APPLY, "reuse", "system", "cpu")  # a later trial in the same process asks for glibc's values again
    assert back == {"did": "system", "mapped_20": 1, "mapped_30": 1, "mapped_64": 1}


def test_auto_leaves_gpu_workers_to_glibc():
    assert hostmem.resolve("auto", use_gpu=True) == "system"
    assert hostmem.resolve("auto", use_gpu=False) == "reuse"
    assert hostmem.resolve("reuse", use_gpu=True) == "reuse"
    gpu = run(APPLY, "auto", "gpu")
    assert gpu == {"did": "system", "mapped_20": 1, "mapped_30": 1, "mapped_64": 1}


def test_a_cpu_training_run_sets_it_in_its_process(tmp_path):
    """The loop applies `train.host_allocator` (auto: reuse on CPU) before it builds anything; a t5-tiny run alone
    leaves glibc's dynamic threshold below 20 MiB, so without it the probe's block would get its own mapping."""
    after = run(AFTER_A_RUN, "train.max_steps=2", "train.eval_every=2", "train.micro_batch_size=8",
                "data.synthetic_train_rows=64", "data.synthetic_eval_rows=16", f"train.output_dir={tmp_path}")
    assert after["mapped_20"] == after["mapped_30"] == after["mapped_64"] == 0, after


GIVE_BACK = """
import json, sys
import psutil, torch
from hpsearch.train import hostmem

hostmem.apply("reuse", use_gpu=False)
rss = lambda: psutil.Process().memory_info().rss
before = rss()
blocks = [torch.ones(64 << 18) for _ in range(8)]  # 8 x 64 MiB, touched
del blocks
kept = rss()  # freed, and kept by malloc for reuse (512 MiB is below the 1 GiB trim threshold)
gave = hostmem.give_back() if sys.argv[1] == "give" else False
print(json.dumps({"kept_mib": (kept - before) >> 20, "after_mib": (rss() - before) >> 20, "gave": gave}))
"""


def test_give_back_returns_the_kept_memory_to_the_os():
    """What `reuse` keeps of freed tensors stays resident until `give_back()` (glibc's malloc_trim) returns it: the
    benchmark's process kept 11 GiB of freed models, and the kernel killed it while its memory group ran."""
    kept = run(GIVE_BACK, "keep")
    assert kept["kept_mib"] >= 500 and kept["after_mib"] >= 500 and kept["gave"] is False, kept
    given = run(GIVE_BACK, "give")
    assert given["kept_mib"] >= 500 and given["after_mib"] < 100 and given["gave"] is True, given
