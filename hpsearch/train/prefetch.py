"""The next training batch, made on the host while the current step runs (one batch ahead, one thread).

    batches = Prefetch(objective.batch, sampler.state_dict, device)
    batch = batches.next()          # host tensors (pinned on GPU); the one after it is already being made
    batches.state()                 # the sampler's state after the batches handed out (for a checkpoint)

The thread calls `make` in order, so the batches are the same as without it. Because the sampler runs one batch
ahead, a checkpoint must not save `sampler.state_dict()` (it would skip the prefetched batch on resume) but
`state()`: the state recorded just before the pending batch was made.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class Prefetch:
    def __init__(self, make: Callable[[], dict], state: Callable[[], dict], device=None):
        import torch

        self._make, self._state = make, state
        self._pin = device is not None and torch.device(device).type == "cuda"
        # the thread's CUDA device is its own: pin for this rank's GPU, not cuda:0 (as torch's DataLoader does)
        init = (lambda: torch.cuda.set_device(device)) if self._pin else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hpsearch-prefetch", initializer=init)
        self._pending: Future | None = None

    def _produce(self) -> tuple[dict, dict]:
        before = self._state()
        batch = self._make()
        if self._pin:
            batch = {k: v.pin_memory() if hasattr(v, "pin_memory") else v for k, v in batch.items()}  # tensors
        return before, batch

    def next(self) -> dict:
        current = self._pending or self._pool.submit(self._produce)
        self._pending = self._pool.submit(self._produce)  # runs after `current` (one worker, in order)
        return current.result()[1]

    def state(self) -> dict:
        """The sampler's state after every batch `next()` returned, none prefetched."""
        return self._pending.result()[0] if self._pending is not None else self._state()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
