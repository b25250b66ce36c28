"""Raw rows from one of three sources, chosen by `data.source`; everything downstream is the same.

- "synthetic": generated in code (`synthetic.generate`), needs nothing from outside.
- "hub": `datasets.load_dataset(path, config)` from the Hugging Face hub (needs internet).
- a folder `<task>/<split>.jsonl` with HF field names and labels: `datasets.load_dataset("json", ...)`,
  after every line has been checked here so that a bad line is reported with file, line and field.

A source returns, per task, the rows of the splits it has: {split name: [row dict, ...]}.
"""
from __future__ import annotations

import json
from pathlib import Path

from hpsearch.data._util import one_line
from hpsearch.data.config import DataConfig
from hpsearch.data.spec import TaskSpec
from hpsearch.data.synthetic import SYNTHETIC_SUITE, generate
from hpsearch.data.tasks import GLUE_SUITE, GLUE_TASKS, get_task
from hpsearch.errors import DataError

RawSplits = dict[str, list[dict]]


def resolve_tasks(cfg: DataConfig) -> list[str]:
    """Canonical task names; the synthetic default stands for the source's own suite (see DataConfig)."""
    names = [get_task(t).name for t in cfg.tasks]
    if cfg.source == "synthetic" or names != SYNTHETIC_SUITE:
        return names
    if cfg.source == "hub":
        return list(GLUE_SUITE)
    folder = Path(cfg.source).expanduser()
    found = [t for t in GLUE_TASKS if (folder / t).is_dir()]
    if not found:
        raise DataError(f"{folder}: no task folders; expected sub-folders named after tasks "
                        f"({', '.join(GLUE_TASKS)}) holding <split>.jsonl files")
    return found


def source_splits(spec: TaskSpec) -> tuple[str, list[str]]:
    """(the split the protocol's test set comes from -- required, the other splits -- optional)."""
    required = spec.test_split or spec.validation_split
    optional = ["train"] + ([spec.validation_split] if spec.test_split else [])
    return required, optional


def load_raw(cfg: DataConfig, tasks: list[str]) -> dict[str, RawSplits]:
    if cfg.source == "synthetic":
        return generate(tasks, cfg.synthetic_train_rows, cfg.synthetic_small_train_rows,
                        cfg.synthetic_eval_rows, cfg.data_seed)
    cache = str(Path(cfg.cache_dir).expanduser() / "datasets") if cfg.cache_dir else None
    load = _load_hub if cfg.source == "hub" else _load_folder
    return {task: load(cfg.source, get_task(task), cache) for task in tasks}


def _load_hub(_source: str, spec: TaskSpec, cache_dir: str | None) -> RawSplits:
    import datasets

    path, config = spec.hub
    where = f"hub dataset {path}" + (f" ({config})" if config else "")
    try:
        dataset = datasets.load_dataset(path, config, cache_dir=cache_dir)
    except Exception as e:  # network, missing dataset, ...: one line, no traceback
        raise DataError(f"task {spec.name}: could not load {where}: {one_line(e)}") from e
    required, optional = source_splits(spec)
    if required not in dataset:
        raise DataError(f"task {spec.name}: {where} has no '{required}' split (it has {', '.join(dataset)})")
    out = {}
    for split in [required, *optional]:
        if split in dataset:
            rows = dataset[split].to_list()
            for i, row in enumerate(rows):
                _check(spec, row, f"{where} split {split} row {i}")
            out[split] = rows
    return out


def _load_folder(source: str, spec: TaskSpec, cache_dir: str | None) -> RawSplits:
    task_dir = Path(source).expanduser() / spec.name
    if not task_dir.is_dir():
        present = sorted(p.name for p in task_dir.parent.iterdir() if p.is_dir())
        raise DataError(f"{task_dir}: no such folder for task {spec.name}; "
                        f"task folders there: {', '.join(present) or 'none'}")
    required, optional = source_splits(spec)
    files = {split: task_dir / f"{split}.jsonl" for split in [required, *optional]}
    if not files[required].is_file():
        found = ", ".join(sorted(p.name for p in task_dir.glob("*.jsonl"))) or "no .jsonl files"
        raise DataError(f"{files[required]}: not found; task {spec.name} needs its '{required}' split "
                        f"(found: {found})")
    # the rows as read and checked here: the `datasets` cache knows a local file by its path and modification time
    # only, so a file replaced by one with the same time (rsync -a, cp -p, tar) read as the old rows
    out = {split: _read_jsonl(path, spec) for split, path in files.items() if path.is_file()}
    if not out[required]:
        raise DataError(f"{files[required]}: no rows; task {spec.name} needs its '{required}' split")
    return out


def _read_jsonl(path: Path, spec: TaskSpec) -> list[dict]:
    """The rows of a JSONL file, every line checked (file, line number and field in the error)."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}, column {e.colno}); "
                                    "expected one JSON object per line") from None
                _check(spec, row, f"{path}:{lineno}")
                rows.append(row)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return rows


def _check(spec: TaskSpec, row: object, where: str) -> None:
    problem = spec.check_row(row, where)
    if problem:
        raise DataError(problem)

