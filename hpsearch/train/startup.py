"""Where a run's start-up goes: wall-clock marks from the driver's start to the end of the first step.

The driver marks its own phases (`python -m hpsearch.train`: its process start, Ray's start, the trainer's `fit`)
and hands them to the workers in the loop config; rank 0 adds its own and prints one line at the end of step 1:

    [hpsearch.train] start-up 17.9 s to the end of step 1: driver 4.4 s, Ray start 3.5 s, ...

`python -m hpsearch.bench` (group `trial`) reads that line for its breakdown of a trial's fixed cost.
"""
from __future__ import annotations

import re

# (mark, what the time from the previous mark to this one went to), in order; a run has a subset of them
PHASES = (
    ("process", ""),  # the driver's process start: where the count begins
    ("trial", ""),  # or a trial that trains in its own Tune actor: its start
    ("ray", "driver imports and checks"),
    ("ray_up", "Ray start"),
    ("fit", "trainer set-up"),
    ("worker", "Train controller and worker group"),
    ("imports", "imports"),
    ("model", "model and data"),
    ("engine", "DeepSpeed"),
    ("step", "step 1 (with resume and tokenization)"),
)
_LABELS = dict(PHASES)
_LINE = re.compile(r"start-up (\d+\.\d+) s to the end of step 1: (.*)$")


def process_start() -> float:
    """This process's start (wall clock), from the OS."""
    import psutil
    return psutil.Process().create_time()


def line(marks: dict[str, float]) -> str:
    """The start-up line: the total from the first mark to the last, and each phase's share."""
    present = [(name, marks[name]) for name, _ in PHASES if name in marks]
    parts = [f"{_LABELS[name]} {max(t - t_prev, 0.0):.1f} s"
             for (_, t_prev), (name, t) in zip(present, present[1:])]
    return f"start-up {present[-1][1] - present[0][1]:.1f} s to the end of step 1: {', '.join(parts)}"


def parse(text: str) -> dict | None:
    """{"total_s": ..., "<phase>": seconds, ...} from a start-up line in `text`, or None."""
    for candidate in reversed(text.splitlines()):
        match = _LINE.search(candidate)
        if match:
            parts = {"total_s": float(match.group(1))}
            for part in match.group(2).split(", "):
                label, _, seconds = part.rpartition(" ")[0].rpartition(" ")
                parts[label] = float(seconds)
            return parts
    return None


_frozen = False  # whether this process froze what the recipe imported (freeze_imports)


def freeze_imports() -> None:
    """Once per process, when the recipe has imported what it trains with (torch, transformers, DeepSpeed, the model
    library) and built nothing yet: the collector stops tracking what is alive then (`gc.freeze`), nearly all of it
    as long-lived as the process (400,000 objects here). DeepSpeed runs full collections itself, in ZeRO-3's set-up
    (`defragment`) and in `empty_partition_cache` (before the best weights are loaded), 0.2-0.45 s each over the
    imports here and under 10 ms after; so does every automatic full collection. Nothing is collected first (that
    would cost one such collection): 67 unreachable objects were alive after the imports here and stay, frozen with
    them. What the run builds after this stays collectable. In a process that trains trial after trial (a reused
    Tune actor, a kept rank) this happens in its first trial, right after `hpsearch.tune.inprocess.start_reused_trial`
    collected, and also freezes that trial's few small objects alive then (its config, session, system-metrics
    monitor) and Ray's and Tune's: never freed if they end in a reference cycle, a one-time cost of a few
    kilobytes."""
    import gc

    global _frozen
    if not _frozen:
        gc.freeze()
        _frozen = True
