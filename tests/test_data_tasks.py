"""Task registry (text format, target -> parse -> label round trip); metrics against hand-computed values."""
import math

import pytest

from hpsearch.data import TASKS, Example, get_task, score_task, suite_score
from hpsearch.errors import ConfigError

ISSUE_TASKS = ["rte", "cb", "mrpc", "cola", "stsb", "sst2", "qnli", "mnli", "qqp", "boolq", "wic", "wsc",
               "copa", "scitail"]


def examples(task, labels):
    spec = get_task(task)
    return [Example("x", spec.target_text(label), label) for label in labels]


def test_every_task_of_the_issue_is_registered_under_its_usual_spellings():
    for name in ISSUE_TASKS:
        assert name in TASKS
    assert [get_task(n).name for n in ("STS-B", "SST-2", "MNLI", "sts_b")] == ["stsb", "sst2", "mnli", "stsb"]


def test_unknown_task_lists_the_known_ones():
    with pytest.raises(ConfigError) as e:
        get_task("wnli")
    message = str(e.value)
    assert "unknown task 'wnli'" in message and "\n" not in message
    assert all(name in message for name in ISSUE_TASKS)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_target_parse_label_round_trip_for_every_label(task):
    spec = get_task(task)
    if spec.is_regression:
        low, high = spec.label_range
        values = [low + i * (high - low) / 40 for i in range(41)] + [0.3, 2.5, 4.75, 1.1]
        for value in values:
            target = spec.target_text(value)
            parsed = spec.parse(target)
            assert abs(parsed - value) <= spec.grid / 2 + 1e-9, (value, target)
            assert abs(parsed / spec.grid - round(parsed / spec.grid)) < 1e-9  # on the grid
        if spec.grid == 0.2:  # halves up, every one (floats made 0.3, 0.7, 4.1 go down and 0.1, 0.5, 3.1 up)
            halves = [0.1, 0.3, 0.5, 0.7, 0.9, 2.5, 3.1, 4.1, 4.9]
            assert [spec.target_text(v) for v in halves] == ["0.2", "0.4", "0.6", "0.8", "1.0", "2.6", "3.2", "4.2",
                                                             "5.0"]
            assert [spec.target_text(v) for v in (0.29, 3.09, 4.0)] == ["0.2", "3.0", "4.0"]
    else:
        for label in range(len(spec.labels)):
            target = spec.target_text(label)
            assert spec.parse(target) == label
            assert spec.parse(f"  {target.upper()} ") == label  # case and surrounding space do not matter
    for junk in ["", "   ", "maybe", "nan", "inf", "1e999", "entailment entailment", "\x00", "-"]:
        assert spec.parse(junk) is None, junk
    assert spec.parse(None) is None


def test_stsb_targets_are_on_the_point_two_grid():
    stsb = get_task("stsb")
    assert [stsb.target_text(x) for x in (5.0, 4.75, 3.8, 0.0, 0.1, 2.5, 1.299)] == \
        ["5.0", "4.8", "3.8", "0.0", "0.2", "2.6", "1.2"]
    assert stsb.parse("3.8") == 3.8 and stsb.parse(" 4 ") == 4.0


def test_source_text_is_t5_style():
    rte = get_task("rte")
    row = {"sentence1": "A  cat\tsat.", "sentence2": "A cat sat.", "label": 0}
    assert rte.source_text(row) == "rte sentence1: A cat sat. sentence2: A cat sat."
    assert rte.source_text(row, prefix=False) == "sentence1: A cat sat. sentence2: A cat sat."
    assert rte.example(row) == Example("rte sentence1: A cat sat. sentence2: A cat sat.", "entailment", 0)
    scitail = get_task("scitail")
    assert scitail.example({"premise": "p", "hypothesis": "h", "label": "entails"}).label == 1


def test_metric_names_per_task():
    assert get_task("cola").metrics == ("matthews_corr",)
    assert set(get_task("mrpc").metrics) == set(get_task("qqp").metrics) == {"f1", "accuracy"}
    assert set(get_task("stsb").metrics) == {"pearson", "spearman"}
    for task in ["rte", "sst2", "qnli", "mnli", "boolq", "wic", "wsc", "copa", "scitail"]:
        assert get_task(task).metrics == ("accuracy",)
    assert get_task("cb").metrics == ("accuracy", "macro_f1")  # SuperGLUE's CB score


def test_accuracy_by_hand():
    ex = examples("rte", [0, 1, 1, 0])
    scores = score_task("rte", ["entailment", "not_entailment", "entailment", "entailment"], ex)
    assert scores == pytest.approx({"accuracy": 75.0, "score": 75.0})


def test_f1_and_accuracy_by_hand():
    # truth 1 1 0 0 1, predicted 1 0 1 0 1: TP=2, FP=1, FN=1 -> F1 = 4/6; accuracy 3/5
    ex = examples("mrpc", [1, 1, 0, 0, 1])
    words = ["equivalent", "not_equivalent", "equivalent", "not_equivalent", "equivalent"]
    scores = score_task("mrpc", words, ex)
    assert scores["f1"] == pytest.approx(100 * 4 / 6)
    assert scores["accuracy"] == pytest.approx(60.0)
    assert scores["score"] == pytest.approx((100 * 4 / 6 + 60) / 2)


def test_cb_is_mean_of_accuracy_and_macro_f1_by_hand():
    # truth 0 1 2 0, predicted 0 1 1 2: F1 per class 2/3 (P 1, R 1/2), 2/3 (P 1/2, R 1), 0 -> macro 4/9; accuracy 1/2
    scores = score_task("cb", ["entailment", "contradiction", "contradiction", "neutral"], examples("cb", [0, 1, 2, 0]))
    assert scores["macro_f1"] == pytest.approx(100 * 4 / 9)
    assert scores["accuracy"] == pytest.approx(50.0)
    assert scores["score"] == pytest.approx((50 + 400 / 9) / 2)


def test_matthews_by_hand():
    # truth 1 1 0 0, predicted 1 0 0 0: TP=1 TN=2 FP=0 FN=1 -> (1*2 - 0*1) / sqrt(1*2*2*3)
    ex = examples("cola", [1, 1, 0, 0])
    scores = score_task("cola", ["acceptable", "unacceptable", "unacceptable", "unacceptable"], ex)
    assert scores["matthews_corr"] == pytest.approx(100 * 2 / math.sqrt(12))
    assert scores["score"] == scores["matthews_corr"]


def test_pearson_and_spearman_by_hand():
    # x = 1 2 3 4, y = 1.2 1.8 3.4 3.6: sum dx*dy = 4.4, sum dx^2 = 5, sum dy^2 = 4.2; same ranks
    ex = [Example("x", "", label) for label in (1.0, 2.0, 3.0, 4.0)]
    scores = score_task("stsb", ["1.2", "1.8", "3.4", "3.6"], ex)
    assert scores["pearson"] == pytest.approx(100 * 4.4 / math.sqrt(5 * 4.2))
    assert scores["spearman"] == pytest.approx(100.0)
    assert scores["score"] == pytest.approx((100 * 4.4 / math.sqrt(21) + 100) / 2)


def test_unparseable_predictions_count_as_wrong_and_never_crash():
    # binary F1 (T5's f1_score_with_invalid): an unparseable answer is the class opposite the row's
    scores = score_task("mrpc", ["???", ""], examples("mrpc", [1, 0]))
    assert scores == pytest.approx({"f1": 0.0, "accuracy": 0.0, "score": 0.0})
    # by hand: rows 1 1 0 0, answers 1 ? 0 ? -> F1 over 1 1 0 1: tp 1, fp 1, fn 1 -> 0.5
    scores = score_task("mrpc", ["equivalent", "?", "not_equivalent", "?"], examples("mrpc", [1, 1, 0, 0]))
    assert scores["f1"] == pytest.approx(50.0) and scores["accuracy"] == pytest.approx(50.0)
    # CB: macro F1 over its three classes only; the unparseable answer is wrong, its own class not averaged in
    scores = score_task("cb", ["entailment", "gibberish", "neutral"], examples("cb", [0, 1, 2]))
    assert scores["accuracy"] == pytest.approx(200 / 3)
    assert scores["macro_f1"] == pytest.approx(100 * (1 + 0 + 1) / 3)  # class 1: no true positive
    # Matthews correlation (CoLA): an unparseable answer is a class of its own (T5): a model that never answers
    # correlates 0, not -100 (the opposite of every row would be perfectly anti-correlated)
    cola = examples("cola", [0, 1, 1, 0, 1, 0])
    assert score_task("cola", ["?"] * 6, cola)["matthews_corr"] == 0.0
    # half right, half unparseable: sklearn's multi-class MCC with the -1 class, computed independently by hand
    answers = ["unacceptable", "acceptable", "?", "?", "?", "unacceptable"]  # -> 0 1 -1 -1 -1 0
    t, p = [0, 1, 1, 0, 1, 0], [0, 1, -1, -1, -1, 0]
    classes = [-1, 0, 1]
    c = [[sum(a == i and b == j for a, b in zip(t, p)) for j in classes] for i in classes]  # confusion t x p
    n, correct = len(t), sum(c[k][k] for k in range(3))
    tk = [sum(c[k]) for k in range(3)]
    pk = [sum(c[i][k] for i in range(3)) for k in range(3)]
    mcc = (correct * n - sum(a * b for a, b in zip(tk, pk))) / math.sqrt(
        (n * n - sum(b * b for b in pk)) * (n * n - sum(a * a for a in tk)))
    assert mcc > 0 and score_task("cola", answers, cola)["matthews_corr"] == pytest.approx(100 * mcc)
    # numbers: unparseable -> -1; y = -1 2 3 4 against 1 2 3 4 (ranks identical, Pearson by hand)
    ex = [Example("x", "", label) for label in (1.0, 2.0, 3.0, 4.0)]
    scores = score_task("stsb", ["one", "2", "3", "4"], ex)
    dy = [-1 - 2, 2 - 2, 3 - 2, 4 - 2]
    dx = [-1.5, -0.5, 0.5, 1.5]
    expected = sum(a * b for a, b in zip(dx, dy)) / math.sqrt(sum(a * a for a in dx) * sum(b * b for b in dy))
    assert scores["pearson"] == pytest.approx(100 * expected)
    assert scores["spearman"] == pytest.approx(100.0)


def test_constant_predictions_have_zero_correlation():
    ex = [Example("x", "", label) for label in (1.0, 2.0, 3.0)]
    assert score_task("stsb", ["2.0"] * 3, ex) == {"pearson": 0.0, "spearman": 0.0, "score": 0.0}
    assert score_task("stsb", ["nope"] * 3, ex)["score"] == 0.0


def test_scoring_checks_its_inputs():
    with pytest.raises(ValueError):
        score_task("rte", ["entailment"], examples("rte", [0, 1]))
    with pytest.raises(ValueError):
        score_task("rte", [], [])
    with pytest.raises(ValueError):
        score_task("rte", ["entailment"], [Example("x", "entailment", None)])


def test_suite_score_is_the_mean_of_task_scores():
    assert suite_score({"rte": 70.0, "cola": 40.0, "stsb": 88.0}) == pytest.approx(66.0)
    with pytest.raises(ValueError):
        suite_score({})
