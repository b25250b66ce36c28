"""The HyperFormer split protocol (Karimi Mahabadi et al., 2021), followed by PHA and hpsearch.

- fewer than 10,000 training rows: the original validation split is shuffled (seeded) and cut in half,
  the first half (rounded down) is validation, the rest test; train is kept;
- larger: 1,000 shuffled training rows become validation, the rest stays train, and the original
  validation split (MNLI: validation_matched) is the test set;
- a task whose source has its own labelled test split (SciTail) keeps train / validation / test as published.

"Training rows" means the official train size for registered tasks (so the test set does not depend on
how much of the train split a folder holds) and the actual count for synthetic tasks.
"""
from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from hpsearch.data.spec import TaskSpec

T = TypeVar("T")
SMALL_LIMIT = 10_000
LARGE_VALIDATION_ROWS = 1000


def _rng(seed: int, purpose: str) -> np.random.Generator:
    """The same for every task (as in HyperFormer), so synthetic tasks, which share inputs, split alike."""
    return np.random.default_rng([seed, zlib.crc32(purpose.encode())])


def _take(rows: Sequence[T], indices) -> list[T]:
    return [rows[i] for i in sorted(int(i) for i in indices)]


def protocol_kind(spec: TaskSpec, train_rows: int) -> str:
    """"original", "small" or "large" (see the module docstring)."""
    if spec.test_split:
        return "original"
    size = spec.official_train if spec.official_train is not None else train_rows
    return "small" if size < SMALL_LIMIT else "large"


def describe_protocol(spec: TaskSpec, kind: str) -> str:
    return {
        "original": f"original: train / {spec.validation_split} / {spec.test_split} as published",
        "small": f"small: {spec.validation_split} halved (seeded) into validation / test",
        "large": f"large: {LARGE_VALIDATION_ROWS} train rows -> validation; {spec.validation_split} -> test",
    }[kind]


def apply_protocol(spec: TaskSpec, raw: dict[str, list[T]], seed: int
                   ) -> tuple[dict[str, list[T]], str, list[str]]:
    """Source splits -> {"train", "validation", "test"}, the protocol's description, and notes on gaps."""
    train = raw.get("train", [])
    validation = raw.get(spec.validation_split, [])
    kind = protocol_kind(spec, len(train))
    protocol = describe_protocol(spec, kind)
    notes = []
    if "train" not in raw:
        notes.append("the source has no train split: evaluation only (sampling weight 0)")
    if kind == "original":
        if spec.validation_split not in raw:
            notes.append(f"the source has no {spec.validation_split} split: validation is empty")
        return {"train": train, "validation": validation, "test": raw[spec.test_split]}, protocol, notes
    if kind == "small":
        order = _rng(seed, "validation/test").permutation(len(validation))
        half = len(validation) // 2
        splits = {"train": train, "validation": _take(validation, order[:half]),
                  "test": _take(validation, order[half:])}
        return splits, protocol, notes
    order = _rng(seed, "train/validation").permutation(len(train))
    if "train" not in raw:
        notes.append("validation is empty: it is taken from the missing train split")
    splits = {"train": _take(train, order[LARGE_VALIDATION_ROWS:]),
              "validation": _take(train, order[:LARGE_VALIDATION_ROWS]), "test": validation}
    return splits, protocol, notes


def cap_rows(rows: list[T], limit: int | None, seed: int, split: str) -> list[T]:
    """A seeded subset of `limit` rows (original order kept), or all rows."""
    if limit is None or len(rows) <= limit:
        return rows
    return _take(rows, _rng(seed, f"cap {split}").permutation(len(rows))[:limit])
