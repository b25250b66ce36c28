"""`load_suite`: a validated multi-task suite with the split protocol applied."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hpsearch.data.config import DataConfig
from hpsearch.data.protocol import LARGE_VALIDATION_ROWS, apply_protocol, cap_rows
from hpsearch.data.sources import load_raw, resolve_tasks
from hpsearch.data.spec import Example, TaskSpec
from hpsearch.data.tasks import get_task
from hpsearch.errors import DataError

SPLITS = ("train", "validation", "test")


@dataclass
class TaskData:
    spec: TaskSpec
    splits: dict[str, list[Example]]
    protocol: str
    notes: list[str] = field(default_factory=list)


class Suite:
    """The tasks of a run, in order: a task's id (the model's `task_ids`) is its index in `tasks`."""

    def __init__(self, source: str, data: dict[str, TaskData]):
        self.source = source
        self.data = data
        self.tasks: list[str] = list(data)

    def split(self, task: str, name: str) -> list[Example]:
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; expected one of {', '.join(SPLITS)}")
        return self.data[task].splits[name]

    def sizes(self, split: str = "train") -> list[int]:
        """Rows per task, in task order (the sampler's `sizes`)."""
        return [len(self.split(t, split)) for t in self.tasks]

    def spec(self, task: str) -> TaskSpec:
        return self.data[task].spec

    def describe(self) -> dict:
        """{"tasks": {task: {"splits": {split: rows}, "protocol": str, "example": {"source", "target"},
        "notes": [str]}}}, what `python -m hpsearch.data --json` prints."""
        tasks = {}
        for task, data in self.data.items():
            first = next((rows[0] for rows in (data.splits[s] for s in SPLITS) if rows), None)
            tasks[task] = {
                "splits": {s: len(data.splits[s]) for s in SPLITS},
                "protocol": data.protocol,
                "example": {"source": first.source, "target": first.target} if first else None,
                "notes": data.notes,
            }
        return {"tasks": tasks}


def load_suite(cfg: DataConfig) -> Suite:
    """Validate the config, read the source, turn rows into examples and apply the split protocol."""
    cfg.validate()
    tasks = resolve_tasks(cfg)
    raw = load_raw(cfg, tasks)
    data = {}
    for task in tasks:
        spec = get_task(task)
        examples = {split: [spec.example(row, cfg.task_prefix) for row in rows]
                    for split, rows in raw[task].items()}
        splits, protocol, notes = apply_protocol(spec, examples, cfg.data_seed)
        for split, limit in (("train", cfg.max_train_rows), ("validation", cfg.max_eval_rows),
                             ("test", cfg.max_eval_rows)):
            capped = cap_rows(splits[split], limit, cfg.data_seed, split)
            if len(capped) < len(splits[split]):
                notes.append(f"{split} capped to {len(capped)} of {len(splits[split])} rows")
            splits[split] = capped
        train_file = (Path(cfg.source).expanduser() / task / "train.jsonl") if cfg.source not in ("synthetic", "hub") \
            else None
        if not splits["train"] and train_file is not None and train_file.is_file():  # present but empty
            rows = len(raw[task].get("train", []))
            if rows:  # a large task's protocol took every row for validation
                raise DataError(f"{train_file}: {rows} rows, all of them validation: {task}'s protocol ({protocol}) "
                                f"takes the first {LARGE_VALIDATION_ROWS} shuffled training rows for validation; "
                                f"expected more than {LARGE_VALIDATION_ROWS} rows (or remove the file: evaluation "
                                "only)")
            raise DataError(f"{train_file}: no rows; remove the file (evaluation only) or give it training rows")
        data[task] = TaskData(spec, splits, protocol, notes)
    return Suite(cfg.source, data)
