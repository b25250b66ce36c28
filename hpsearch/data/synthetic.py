"""The built-in synthetic suite: five tasks over one input distribution, generated in code from a seed.

Every task reads the same kind of input -- 4 to 8 colour words drawn uniformly with replacement from
`COLORS`, e.g. "red blue red white" -- and the tasks share the very same input rows, so the same input
gets different targets from different tasks. A model that ignores which task it is solving cannot do
well: `first` and `last` disagree whenever the first and last words differ, and `lacks` is the exact
opposite of `contains` on every input.

| task     | target                                    | kind                   | train rows (config)        |
|----------|-------------------------------------------|------------------------|----------------------------|
| first    | the first word                            | 6 classes              | synthetic_train_rows       |
| last     | the last word                             | 6 classes              | synthetic_train_rows       |
| count    | how many times "red" occurs ("0".."8")    | number, correlations  | synthetic_train_rows       |
| contains | "yes" if "blue" occurs, else "no"         | 2 classes              | synthetic_train_rows       |
| lacks    | "yes" if "blue" does not occur, else "no" | 2 classes, few rows    | synthetic_small_train_rows |

Each task also gets `synthetic_eval_rows` rows as its original "validation" split, which the split protocol
halves into validation and test like any small GLUE task. Train and validation inputs never overlap.
Generation uses only `random.Random(seed).random()`, whose stream Python guarantees across versions.
"""
from __future__ import annotations

import random
from collections.abc import Callable

from hpsearch.data.spec import TaskSpec

COLORS = ("red", "blue", "green", "yellow", "black", "white")
MIN_WORDS, MAX_WORDS = 4, 8
SMALL_TASK = "lacks"

_LABELERS: dict[str, Callable[[list[str]], int | float]] = {
    "first": lambda w: COLORS.index(w[0]),
    "last": lambda w: COLORS.index(w[-1]),
    "count": lambda w: float(w.count("red")),
    "contains": lambda w: int("blue" in w),
    "lacks": lambda w: int("blue" not in w),
}

_ACC = ("accuracy",)
SYNTHETIC_TASKS: dict[str, TaskSpec] = {t.name: t for t in [  # see the table above
    TaskSpec("first", ("words",), _ACC, COLORS),
    TaskSpec("last", ("words",), _ACC, COLORS),
    TaskSpec("count", ("words",), ("pearson", "spearman"), None, label_range=(0, MAX_WORDS), grid=1.0),
    TaskSpec("contains", ("words",), _ACC, ("no", "yes")),
    TaskSpec("lacks", ("words",), _ACC, ("no", "yes")),
]}
SYNTHETIC_SUITE = list(SYNTHETIC_TASKS)


def _sequence(rng: random.Random) -> tuple[str, ...]:
    length = MIN_WORDS + int(rng.random() * (MAX_WORDS - MIN_WORDS + 1))
    return tuple(COLORS[int(rng.random() * len(COLORS))] for _ in range(length))


def _unique_inputs(rng: random.Random, count: int, taken: set) -> list[tuple[str, ...]]:
    inputs = []
    while len(inputs) < count:
        words = _sequence(rng)
        if words not in taken:
            taken.add(words)
            inputs.append(words)
    return inputs


def generate(tasks: list[str], train_rows: int, small_train_rows: int, eval_rows: int,
             seed: int) -> dict[str, dict[str, list[dict]]]:
    """Raw rows {"words": ..., "label": ...} per task and split ("train", "validation")."""
    rng = random.Random(seed)
    taken: set = set()
    train_pool = _unique_inputs(rng, max(train_rows, small_train_rows), taken)
    eval_pool = _unique_inputs(rng, eval_rows, taken)
    out = {}
    for task in tasks:
        n_train = small_train_rows if task == SMALL_TASK else train_rows
        label = _LABELERS[task]
        out[task] = {split: [{"words": " ".join(w), "label": label(list(w))} for w in pool]
                     for split, pool in (("train", train_pool[:n_train]), ("validation", eval_pool))}
    return out
