"""Host memory on CPU workers: glibc malloc settings that keep a training process's freed tensor memory for reuse.

PyTorch takes CPU tensors from malloc. glibc serves a block above its mmap threshold (dynamic, from 128 KiB up to
32 MiB) with fresh pages from the kernel and gives them back on free, and it gives the top of the heap back once
more than its trim threshold (twice the mmap threshold) is free there. A train step frees and allocates its
activations and gradients again every step, so the kernel maps and zeroes them again every step: measured here,
102,000-128,000 minor page faults per t5-small train step (batch 32 x 64 tokens) with glibc's defaults, 46,000-63,000
with these settings; the step's minimum 2 % faster and its median 3-7 % (docs/performance.md). GPU tensors come from the
CUDA caching allocator and never see this, so `train.host_allocator=auto` applies it to CPU workers only.

`reuse_freed_memory()` sets, through `mallopt`:
- M_MMAP_THRESHOLD = 32 MiB, glibc's largest on 64-bit: blocks up to it come from the heap (this also turns off
  the dynamic threshold);
- M_TRIM_THRESHOLD = 1 GiB: freed heap memory stays mapped for the next step unless a whole GiB is free at its top;
- M_TOP_PAD = 64 MiB: the heap grows in larger pieces;
- M_MMAP_MAX = 0: no block gets a mapping of its own, so also those above 32 MiB come from the heap (the t5-small
  embedding's gradient, 63 MiB, is zero-filled twice per step: 220 ms of a 2.0 s step in fresh pages; MTL step
  median 2.10-2.32 s -> 1.96-2.01 s, in the main thread and in a worker thread as Ray Train runs the loop). When
  the heap cannot grow (or a thread's heap cannot hold a block), glibc still maps the block.
A process's resident memory then stays near its peak between steps (and between trials in a reused Tune actor)
instead of falling back after each one; the peak itself grew by 2 % in one measurement and 0.5-1.3 % in four
more (t5-small MTL steps). `give_back()` returns what is kept to the OS when a process is done with its big work
(glibc's `malloc_trim`). Not glibc (macOS, musl): nothing is set.
"""
from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4  # glibc's malloc.h
SETTINGS = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 1 << 30, M_TOP_PAD: 64 << 20, M_MMAP_MAX: 0}
GLIBC_START = {M_MMAP_THRESHOLD: 128 << 10, M_TRIM_THRESHOLD: 128 << 10, M_TOP_PAD: 128 << 10,
               M_MMAP_MAX: 65536}  # its initial values
_reusing = False  # this process's malloc was set to reuse (a reused Tune actor runs trial after trial)


def glibc():
    """The C library when it is glibc (it has `mallopt`), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl has mallopt but none of these parameters)
        return libc
    except (OSError, AttributeError):
        return None


def resolve(host_allocator: str, use_gpu: bool) -> str:
    """"reuse" or "system": what `train.host_allocator` means for these workers (auto: reuse on CPU workers)."""
    if host_allocator == "auto":
        return "system" if use_gpu else "reuse"
    return host_allocator


def _mallopt(settings: dict[int, int]) -> bool:
    libc = glibc()
    if libc is None:
        return False
    libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(libc.mallopt(param, value) == 1 for param, value in settings.items())


def reuse_freed_memory() -> bool:
    """Set this process's malloc to keep freed memory for reuse (see the module docstring); True when it took."""
    global _reusing
    _reusing = _mallopt(SETTINGS) or _reusing
    return _reusing


def apply(host_allocator: str, use_gpu: bool) -> str:
    """Apply `train.host_allocator` in this process; returns what it did: "reuse", "system" or "unavailable".
    "system" after "reuse" in the same process (a reused Tune actor) puts glibc's initial values back; its dynamic
    threshold, which any explicit setting turns off, stays off."""
    global _reusing
    if resolve(host_allocator, use_gpu) == "system":
        if _reusing:
            _reusing = not _mallopt(GLIBC_START)
        return "system"
    return "reuse" if reuse_freed_memory() else "unavailable"


def give_back() -> bool:
    """Return the freed memory malloc keeps to the OS: glibc's `malloc_trim(0)`, which releases every whole free
    page of every arena whatever the trim threshold. For a process that is done with its big work and goes on to
    something else: the benchmark kept 11.0-11.2 GiB resident after its in-process groups at t5-small, freed
    models that the ranks of its memory group then needed (the kernel killed it for them); 0.4-0.5 GiB after this.
    5.5 GiB took 0.4 s here. True when memory was released; nothing happens without glibc."""
    libc = glibc()
    if libc is None:
        return False
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return libc.malloc_trim(0) == 1
