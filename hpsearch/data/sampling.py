"""Multi-task sampling with temperature, deterministic per seed and shared by data-parallel ranks.

Every rank runs the same sampler (same seed, sizes, world size) and so makes the same choices; each global
batch has `batch_size * world_size` slots and rank r keeps slots [r*batch_size, (r+1)*batch_size), so the
ranks read disjoint rows. The task of a step comes from a generator seeded by (seed, step) and each task's
rows from a seeded permutation per epoch of that task, so the whole state is the step counter and how many
rows of each task were consumed: `state_dict()` is small and `load_state_dict()` resumes exactly.
"""
from __future__ import annotations

import math

import numpy as np

from hpsearch.data.config import BATCHING
from hpsearch.errors import DataError


def task_probabilities(sizes: list[int], temperature: float) -> np.ndarray:
    """p_i ∝ n_i^(1/T); tasks without rows get 0. T = 1: proportional; T -> inf: uniform."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    sizes_arr = np.asarray(sizes, dtype=float)
    if sizes_arr.size == 0 or (sizes_arr < 0).any():
        raise ValueError(f"need one size per task, none negative; got {sizes}")
    if not (sizes_arr > 0).any():
        raise DataError(f"no task has training rows (sizes {sizes}); nothing to train on -- add a task with "
                        "a train split (see python -m hpsearch.data)")
    logs = np.log(np.where(sizes_arr > 0, sizes_arr, 1.0)) / temperature
    weights = np.where(sizes_arr > 0, np.exp(logs - logs.max()), 0.0)
    return weights / weights.sum()


class MultiTaskSampler:
    """An infinite iterator of batches; a batch is this rank's list of (task index, row index)."""

    def __init__(self, sizes: list[int], batch_size: int, temperature: float, batching: str = "task",
                 seed: int = 0, rank: int = 0, world_size: int = 1):
        if batching not in BATCHING:
            raise ValueError(f"batching must be one of {BATCHING}, got {batching!r}")
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size or seed < 0:
            raise ValueError(f"need batch_size >= 1, 0 <= rank < world_size, seed >= 0; got {batch_size=}, "
                             f"{rank=}, {world_size=}, {seed=}")
        self.sizes = [int(n) for n in sizes]
        self.probabilities = task_probabilities(self.sizes, temperature)
        self.batch_size, self.batching, self.seed = batch_size, batching, seed
        self.rank, self.world_size = rank, world_size
        self.temperature = temperature
        self._step = 0
        self._consumed = [0] * len(self.sizes)
        self._permutations: dict[int, tuple[int, np.ndarray]] = {}

    def __iter__(self):
        return self

    def __next__(self) -> list[tuple[int, int]]:
        rng = np.random.default_rng([self.seed, 0, self._step])
        slots = self.batch_size * self.world_size
        if self.batching == "task":
            tasks = [int(rng.choice(len(self.sizes), p=self.probabilities))] * slots
        else:
            tasks = [int(t) for t in rng.choice(len(self.sizes), size=slots, p=self.probabilities)]
        rows = [self._next_row(t) for t in tasks]
        self._step += 1
        self.last_all_ranks = list(zip(tasks, rows))  # every rank's picks of this batch (the loss's token count)
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        return self.last_all_ranks[mine]

    def _next_row(self, task: int) -> int:
        epoch, position = divmod(self._consumed[task], self.sizes[task])
        cached = self._permutations.get(task)
        if cached is None or cached[0] != epoch:
            order = np.random.default_rng([self.seed, 1, task, epoch]).permutation(self.sizes[task])
            self._permutations[task] = cached = (epoch, order)
        self._consumed[task] += 1
        return int(cached[1][position])

    def state_dict(self) -> dict:
        return {"step": self._step, "consumed": list(self._consumed), "sizes": list(self.sizes),
                "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["sizes"] != self.sizes or state["seed"] != self.seed:
            raise ValueError(f"sampler state is for sizes {state['sizes']} and seed {state['seed']}; "
                             f"this sampler has sizes {self.sizes} and seed {self.seed}")
        self._step = int(state["step"])
        self._consumed = [int(c) for c in state["consumed"]]
        self._permutations.clear()

    @property
    def epochs(self) -> list[float]:
        """How many passes over each task's rows have been made (all ranks together)."""
        return [c / n if n else math.nan for c, n in zip(self._consumed, self.sizes)]
