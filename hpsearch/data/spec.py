"""What a task is: how a raw row becomes an `Example` (T5 source/target text), and how a generated string
is parsed back to a label. Registries of concrete tasks live in `tasks.py` (GLUE, SuperGLUE, SciTail) and
`synthetic.py`."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

Label = int | float | None


@dataclass(frozen=True, slots=True)
class Example:
    """One text-to-text example. `label` is a class index, a number (regression) or None (unlabelled)."""

    source: str
    target: str
    label: Label


@dataclass(frozen=True)
class TaskSpec:
    """A task's text format, labels, metrics and where its splits come from.

    Classification tasks have `labels` (the target words, index = label). Regression tasks have
    `labels=None`, a `label_range` and a `grid`: the target is the label rounded to the grid ("3.8" on STS-B's
    0.2 grid) and a prediction is parsed as a number.
    """

    name: str
    fields: tuple[str, ...]                   # input fields, in the order they appear in the source text
    metrics: tuple[str, ...]                  # names in `metrics.METRICS`
    labels: tuple[str, ...] | None = None     # target words of a classification task
    label_range: tuple[float, float] = (0.0, 0.0)  # regression: valid label values (inclusive)
    grid: float = 0.0                         # regression: targets rounded to multiples of this
    raw_labels: Mapping[str, int] | None = None  # string labels in the source (SciTail) -> class index
    official_train: int | None = None         # official train size (protocol choice); None = count the rows
    hub: tuple[str, str | None] | None = None  # (path, config name) for `datasets.load_dataset`
    validation_split: str = "validation"      # the source's validation split (MNLI: validation_matched)
    test_split: str | None = None             # a labelled test split in the source (SciTail only)

    @property
    def is_regression(self) -> bool:
        return self.labels is None

    def source_text(self, row: Mapping, prefix: bool = True) -> str:
        """T5 style: "rte sentence1: ... sentence2: ..." (whitespace runs collapsed)."""
        parts = [f"{f}: {' '.join(str(row[f]).split())}" for f in self.fields]
        return " ".join(([self.name] if prefix else []) + parts)

    def target_text(self, label: int | float) -> str:
        if self.labels is not None:
            return self.labels[int(label)]
        # nearest grid point, halves up: the quotient rounded first (0.3 / 0.2 is 1.4999999999999998 in floats, and
        # 0.3 went down to 0.2 while 0.1 and 0.5 went up)
        steps = math.floor(round(float(label) / self.grid, 9) + 0.5)
        decimals = 0 if self.grid >= 1 else 1
        return f"{steps * self.grid:.{decimals}f}"

    def targets(self) -> list[str]:
        """Every target text the task has: its label words, or each grid point of its label range."""
        if self.labels is not None:
            return list(self.labels)
        low, high = self.label_range
        return [self.target_text(i * self.grid) for i in range(math.ceil(low / self.grid - 1e-9),
                                                                 math.floor(high / self.grid + 1e-9) + 1)]

    def parse(self, text: str) -> Label:
        """A generated target back to a label; None when it is not one (never raises)."""
        text = text.strip() if isinstance(text, str) else ""
        if self.labels is not None:
            lowered = text.lower()
            return next((i for i, word in enumerate(self.labels) if word.lower() == lowered), None)
        try:
            value = float(text)
        except ValueError:
            return None
        return value if math.isfinite(value) else None

    def label_of(self, row: Mapping) -> int | float:
        """The row's label as a class index or float (rows are validated before this is called)."""
        label = row["label"]
        if self.raw_labels is not None:
            return self.raw_labels[label]
        return float(label) if self.is_regression else int(label)

    def example(self, row: Mapping, prefix: bool = True) -> Example:
        label = self.label_of(row)
        return Example(self.source_text(row, prefix), self.target_text(label), label)

    def check_row(self, row: object, where: str) -> str | None:
        """Why a raw row is unusable (one line, naming `where` and the field), or None if it is fine."""
        if not isinstance(row, Mapping):
            return f"{where}: expected a JSON object, got {type(row).__name__}"
        for field in (*self.fields, "label"):
            if field not in row or row[field] is None:
                expected = ", ".join((*self.fields, "label"))
                return f"{where}: missing field '{field}' for task {self.name}; expected fields {expected}"
        for field in self.fields:
            if not isinstance(row[field], str):
                return f"{where}: field '{field}' is {row[field]!r}; expected a string"
        problem = self._check_label(row["label"])
        return f"{where}: {problem}" if problem else None

    def _check_label(self, label: object) -> str | None:
        if self.raw_labels is not None:
            if isinstance(label, str) and label in self.raw_labels:
                return None
            valid = ", ".join(repr(k) for k in self.raw_labels)
            return f"label {label!r} out of range for task {self.name}; expected one of {valid}"
        if self.labels is not None:
            if isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(self.labels):
                return None
            names = ", ".join(f"{i}={w}" for i, w in enumerate(self.labels))
            return f"label {label!r} out of range for task {self.name}; expected an integer in ({names})"
        low, high = self.label_range
        if (isinstance(label, int | float) and not isinstance(label, bool) and math.isfinite(label)
                and low <= label <= high):
            return None
        return f"label {label!r} out of range for task {self.name}; expected a number in [{low:g}, {high:g}]"
