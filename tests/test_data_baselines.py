"""The yardsticks: majority-class and chance scores computed with the tasks' own metrics, checked by hand."""
from types import SimpleNamespace

import pytest

from hpsearch.data import Example
from hpsearch.data.baselines import baselines, flat_metrics


def suite(splits):
    return SimpleNamespace(tasks=list(splits), split=lambda task, split: splits[task][split])


def ex(labels):
    return [Example("x", "", label) for label in labels]


def test_majority_and_chance_by_hand():
    s = suite({"rte": {"train": ex([0, 0, 1]), "validation": ex([0, 1, 1, 1])},
               "mrpc": {"train": ex([1, 1, 0]), "validation": ex([1, 1, 0])}})
    table = baselines(s, "validation")
    assert table["rte"]["majority"] == pytest.approx(25.0)                # "entailment" for all: 1 of 4
    assert table["mrpc"]["majority"] == pytest.approx((80.0 + 200 / 3) / 2)  # F1 2*2/(2*2+1), accuracy 2/3
    assert table["rte"]["rows"] == 4 and table["suite"]["rows"] == 7
    assert table["suite"]["majority"] == pytest.approx((25.0 + (80.0 + 200 / 3) / 2) / 2)
    assert 20 <= table["rte"]["chance"] <= 80 and table["rte"]["chance"] != table["rte"]["majority"]
    assert baselines(s, "validation") == table  # seeded: the same every time
    flat = flat_metrics(table, "")
    assert flat["majority_score"] == table["suite"]["majority"] and flat["task/rte/rows"] == 4
    assert set(flat_metrics(table, "test_")) >= {"test_majority_score", "test_chance_score", "test/mrpc/majority"}


def test_regression_majority_is_the_mean_and_scores_zero_correlation():
    s = suite({"stsb": {"train": ex([1.0, 2.0, 4.0]), "validation": ex([0.0, 2.5, 5.0])}})
    table = baselines(s, "validation")
    assert table["stsb"]["majority"] == 0.0  # a constant has no correlation (defined as 0 here)


def test_a_task_without_training_labels_has_no_majority():
    """An evaluation-only task (BoolQ, WiC, QNLI in the shared folder have no train file) had class 0 for its
    "majority": BoolQ's 38.3 where always answering its commoner class scores 61.7. Without a training label there is
    no majority class: NaN, and NaN for the suite's (the model's suite score averages every task); chance stays."""
    import math

    s = suite({"rte": {"train": ex([0, 0, 1]), "validation": ex([0, 1, 1, 1])},
               "boolq": {"train": [], "validation": ex([1, 1, 1, 0])}})
    table = baselines(s, "validation")
    assert math.isnan(table["boolq"]["majority"]) and math.isnan(table["suite"]["majority"])
    assert table["rte"]["majority"] == pytest.approx(25.0) and 0 < table["boolq"]["chance"] < 100
