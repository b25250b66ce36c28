"""Scoring generated targets: each task's metrics (scikit-learn / scipy), its score and the suite's score.

All values are on the papers' 0-100 scale. A task's score is the mean of its metrics; a suite's score is
the mean of its tasks' scores. A prediction that does not parse counts as wrong, as T5's GLUE metrics (and
HyperFormer's) count it: for a class it is the class -1, which no row has (accuracy: wrong; Matthews
correlation: a class of its own, so all-unparseable answers correlate 0, not -100; macro F1: averaged over the
task's classes only), except for binary F1, where it is the class opposite the row's (T5's
`f1_score_with_invalid`: a false positive or a false negative); for a number, -1, outside every valid range.
A correlation that is undefined (constant predictions) is 0.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
from scipy import stats
from sklearn import metrics as skm

from hpsearch.data.spec import Example
from hpsearch.data.tasks import get_task

UNPARSEABLE_NUMBER = -1.0
UNPARSEABLE_CLASS = -1


def _correlation(fn, y_true, y_pred) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        value = fn(y_true, y_pred)[0] if len(y_true) > 1 else math.nan
    return 0.0 if math.isnan(value) else float(value)


def _opposite_when_unparseable(t, p):
    return np.where(p == UNPARSEABLE_CLASS, 1 - t, p)


def _classes(t, p):
    return sorted(set(np.unique(t)) | set(np.unique(p[p != UNPARSEABLE_CLASS])))


METRICS = {
    "accuracy": lambda t, p: skm.accuracy_score(t, p),
    "f1": lambda t, p: skm.f1_score(t, _opposite_when_unparseable(t, p), pos_label=1, zero_division=0.0),
    "macro_f1": lambda t, p: skm.f1_score(t, p, labels=_classes(t, p), average="macro", zero_division=0.0),
    "matthews_corr": lambda t, p: skm.matthews_corrcoef(t, p),
    "pearson": lambda t, p: _correlation(stats.pearsonr, t, p),
    "spearman": lambda t, p: _correlation(stats.spearmanr, t, p),
}


def score_task(task: str, predictions: Sequence[str], examples: Sequence[Example]) -> dict[str, float]:
    """Each of the task's metrics and their mean ("score"), 0-100, for generated `predictions`."""
    spec = get_task(task)
    if len(predictions) != len(examples):
        raise ValueError(f"{task}: {len(predictions)} predictions for {len(examples)} examples")
    if not examples:
        raise ValueError(f"{task}: nothing to score")
    if any(e.label is None for e in examples):
        raise ValueError(f"{task}: cannot score unlabelled examples")
    truth = [e.label for e in examples]
    parsed = [spec.parse(p) for p in predictions]
    if spec.is_regression:
        y_true = np.asarray(truth, dtype=float)
        y_pred = np.asarray([UNPARSEABLE_NUMBER if p is None else p for p in parsed], dtype=float)
    else:
        y_true = np.asarray(truth, dtype=int)
        y_pred = np.asarray([UNPARSEABLE_CLASS if p is None else p for p in parsed], dtype=int)
    scores = {name: 100.0 * float(METRICS[name](y_true, y_pred)) for name in spec.metrics}
    scores["score"] = sum(scores.values()) / len(scores)
    return scores


def suite_score(per_task_scores: dict[str, float]) -> float:
    """The mean of the tasks' scores."""
    if not per_task_scores:
        raise ValueError("no task scores to average")
    return sum(per_task_scores.values()) / len(per_task_scores)
