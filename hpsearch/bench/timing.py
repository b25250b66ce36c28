"""Figures and the interleaved timer.

Every timed callable of a phase joins one `Pool`; the pool runs one untimed warm-up round, then `reps` rounds
that each time every entry once (the starting entry rotates from round to round). A ratio's numerator and
denominator are thus measured side by side, so load on a shared machine stretches both alike; a figure is the
ratio of the minima (the least disturbed repetition), the ratio of the medians goes along in its parts.
"""
from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Figure:
    """One benchmark result beside its goal. `better`: "lower" (value <= goal) or "higher" (value >= goal);
    `goal=None` marks a figure shown for contrast."""
    name: str
    value: float
    goal: float | None
    better: str
    unit: str  # "ratio", "fraction", "s", "x weights"
    what: str
    parts: dict = field(default_factory=dict)

    @property
    def meets_goal(self) -> bool | None:
        if self.goal is None:
            return None
        return self.value <= self.goal if self.better == "lower" else self.value >= self.goal

    def to_json(self) -> dict:
        return {"value": self.value, "goal": self.goal, "meets_goal": self.meets_goal,
                "goal_is": "max" if self.better == "lower" else "min", "unit": self.unit, "what": self.what,
                "parts": self.parts}


@dataclass
class Timing:
    times: list[float]

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    def to_json(self) -> dict:
        return {"min_s": self.min, "median_s": self.median, "reps": len(self.times)}


@dataclass
class Pool:
    """Named callables timed round-robin. `setup` runs untimed before each call (e.g. `model.train`)."""
    entries: dict[str, tuple[Callable, Callable | None]] = field(default_factory=dict)

    def add(self, name: str, fn: Callable, setup: Callable | None = None) -> None:
        self.entries[name] = (fn, setup)

    def run(self, reps: int, log=print) -> tuple[dict[str, Timing], dict[str, str]]:
        """({name: Timing}, {name: error}); an entry that fails in the warm-up is dropped and reported."""
        errors: dict[str, str] = {}
        # what is alive now (the models, their optimizers, the batches) goes to the collector's permanent
        # generation: the full collection before each call then only walks what the calls made (0.2 s a call
        # with a dozen models alive, most of a small run's wall time); unfrozen at the end, so it can be freed
        gc.collect()
        gc.freeze()
        try:
            for name, (fn, setup) in list(self.entries.items()):
                try:
                    _timed(fn, setup)
                except Exception as e:  # a method that builds but cannot run: report it, time the others
                    errors[name] = error_line(e)
                    del self.entries[name]
            names = list(self.entries)
            times: dict[str, list[float]] = {name: [] for name in names}
            for r in range(reps):
                for name in names[r % len(names):] + names[:r % len(names)] if names else []:
                    times[name].append(_timed(*self.entries[name]))
                log(f"round {r + 1}/{reps} done")
        finally:
            gc.unfreeze()
        return {name: Timing(t) for name, t in times.items()}, errors


def error_line(e: Exception) -> str:
    """An error as the benchmark reports it: its type and first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def _timed(fn: Callable, setup: Callable | None) -> float:
    if setup is not None:
        setup()
    gc.collect()
    gc.disable()  # no collector pause inside a timed call
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    finally:
        gc.enable()


def ratio(name: str, num: str, den: str, timings: dict[str, Timing], goal: float | None, what: str,
          better: str = "lower") -> Figure | None:
    """`num` ÷ `den` by their minimum times, or None when either was not measured."""
    if num not in timings or den not in timings:
        return None
    a, b = timings[num], timings[den]
    return Figure(name, a.min / b.min, goal, better, "ratio", what,
                  parts={"numerator": num, "denominator": den, "numerator_time": a.to_json(),
                         "denominator_time": b.to_json(), "median_ratio": a.median / b.median})

