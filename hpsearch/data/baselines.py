"""Yardsticks for a score: what always predicting the training set's majority class scores on a split, and what
guessing at random scores, with the same metrics as the model (`score_task`).

    baselines(suite, "validation") -> {"rte": {"majority": 52.7, "chance": 49.8, "rows": 138}, ...}

Majority: the most frequent training label (regression: the mean training label, on the task's grid); NaN for a
task without training labels, and then for the suite (its score averages every task). Chance: the
mean score of `CHANCE_DRAWS` seeded uniform draws over the labels (regression: over the label range). A model that
does not beat the majority has learnt nothing a constant would not.
"""
from __future__ import annotations

import math
import random
from collections import Counter

from hpsearch.data.metrics import score_task, suite_score
from hpsearch.data.tasks import get_task

CHANCE_DRAWS = 20


def task_baselines(task: str, train, rows) -> dict[str, float]:
    spec = get_task(task)
    labels = [e.label for e in train if e.label is not None]
    if not labels:  # an evaluation-only task: no training label to take the majority of (class 0 stood in for it)
        majority = math.nan
    else:
        constant = spec.target_text(sum(labels) / len(labels) if spec.is_regression
                                    else Counter(labels).most_common(1)[0][0])
        majority = score_task(task, [constant] * len(rows), rows)["score"]
    rng = random.Random(0)
    draws = []
    for _ in range(CHANCE_DRAWS):
        if spec.is_regression:
            low, high = spec.label_range
            guesses = [spec.target_text(rng.uniform(low, high)) for _ in rows]
        else:
            guesses = [rng.choice(spec.labels) for _ in rows]
        draws.append(score_task(task, guesses, rows)["score"])
    return {"majority": majority, "chance": sum(draws) / len(draws), "rows": float(len(rows))}


def baselines(suite, split: str) -> dict[str, dict[str, float]]:
    """Per task with rows on `split`: majority and chance scores and the number of rows; plus "suite"."""
    out = {task: task_baselines(task, suite.split(task, "train"), suite.split(task, split))
           for task in suite.tasks if suite.split(task, split)}
    if out:
        out["suite"] = {"majority": suite_score({t: v["majority"] for t, v in out.items()}),
                        "chance": suite_score({t: v["chance"] for t, v in out.items()}),
                        "rows": float(sum(v["rows"] for v in out.values()))}
    return out


def flat_metrics(table: dict[str, dict[str, float]], prefix: str) -> dict[str, float]:
    """{"<prefix>majority_score": .., "<prefix>chance_score": .., "task/<t>/majority": .., "task/<t>/rows": ..}."""
    out = {}
    for task, values in table.items():
        if task == "suite":
            out.update({f"{prefix}majority_score": values["majority"], f"{prefix}chance_score": values["chance"]})
        else:
            tag = "test" if prefix else "task"
            out.update({f"{tag}/{task}/{k}": v for k, v in values.items()})
    return out
