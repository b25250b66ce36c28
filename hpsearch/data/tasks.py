"""The task registry: GLUE, SuperGLUE and SciTail as text-to-text tasks, plus the synthetic suite.

Field names and label conventions are Hugging Face's (`glue/<task>`, `super_glue/<task>`, `scitail`
tsv_format), which is also what the offline folder `<task>/<split>.jsonl` holds.
"""
from __future__ import annotations

from hpsearch.data.spec import TaskSpec
from hpsearch.data.synthetic import SYNTHETIC_TASKS
from hpsearch.errors import ConfigError

_GLUE = "nyu-mll/glue"
_SUPERGLUE = "aps/super_glue"
_ACC = ("accuracy",)
_F1_ACC = ("f1", "accuracy")
_NLI2 = ("entailment", "not_entailment")
_NO_YES = ("false", "true")


def _glue(name, fields, labels, metrics, train, **kw) -> TaskSpec:
    return TaskSpec(name, fields, metrics, labels, official_train=train, hub=(_GLUE, name), **kw)


def _superglue(name, fields, labels, train, config=None, metrics=_ACC) -> TaskSpec:
    return TaskSpec(name, fields, metrics, labels, official_train=train, hub=(_SUPERGLUE, config or name))


GLUE_TASKS: dict[str, TaskSpec] = {t.name: t for t in [
    _glue("cola", ("sentence",), ("unacceptable", "acceptable"), ("matthews_corr",), 8551),
    _glue("sst2", ("sentence",), ("negative", "positive"), _ACC, 67349),
    _glue("mrpc", ("sentence1", "sentence2"), ("not_equivalent", "equivalent"), _F1_ACC, 3668),
    _glue("qqp", ("question1", "question2"), ("not_duplicate", "duplicate"), _F1_ACC, 363846),
    _glue("stsb", ("sentence1", "sentence2"), None, ("pearson", "spearman"), 5749,
          label_range=(0.0, 5.0), grid=0.2),
    _glue("mnli", ("premise", "hypothesis"), ("entailment", "neutral", "contradiction"), _ACC, 392702,
          validation_split="validation_matched"),
    _glue("qnli", ("question", "sentence"), _NLI2, _ACC, 104743),
    _glue("rte", ("sentence1", "sentence2"), _NLI2, _ACC, 2490),
    _superglue("boolq", ("question", "passage"), _NO_YES, 9427),
    _superglue("cb", ("premise", "hypothesis"), ("entailment", "contradiction", "neutral"), 250,
               metrics=("accuracy", "macro_f1")),  # SuperGLUE's CB score: the mean of accuracy and macro-F1
    _superglue("copa", ("premise", "question", "choice1", "choice2"), ("choice1", "choice2"), 400),
    _superglue("wic", ("word", "sentence1", "sentence2"), _NO_YES, 5428),
    _superglue("wsc", ("text", "span1_text", "span2_text"), _NO_YES, 554, config="wsc.fixed"),
    # SciTail ships a labelled test split, so it keeps its own three splits (as in HyperFormer's code).
    TaskSpec("scitail", ("premise", "hypothesis"), _ACC, ("neutral", "entailment"), official_train=23596,
             hub=("allenai/scitail", "tsv_format"), test_split="test",
             raw_labels={"neutral": 0, "entails": 1, "entailment": 1}),
]}

# HyperFormer's GLUE suite (WNLI left out): the tasks of `data.source=hub` when data.tasks is left at default.
GLUE_SUITE = ["cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte"]

TASKS: dict[str, TaskSpec] = {**GLUE_TASKS, **SYNTHETIC_TASKS}


def canonical_name(name: str) -> str:
    """'STS-B' -> 'stsb', 'SST_2' -> 'sst2'."""
    return name.strip().lower().replace("-", "").replace("_", "")


def get_task(name: str) -> TaskSpec:
    spec = TASKS.get(canonical_name(name))
    if spec is None:
        raise ConfigError(f"data.tasks: unknown task '{name}'; known: {', '.join(TASKS)}")
    return spec
