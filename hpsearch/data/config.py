"""`DataConfig`: the `data.*` section of a run's config."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hpsearch.data.synthetic import SYNTHETIC_SUITE
from hpsearch.errors import ConfigError

SOURCES = ("synthetic", "hub")
BATCHING = ("task", "mixed")
_MAX_SYNTHETIC_ROWS = 200_000
_MIN_VOCAB = 259  # 3 special tokens + 256 byte tokens of the byte-level BPE tokenizer


@dataclass
class DataConfig:
    """Where the tasks come from and how they are split, sampled and tokenized.

    `tasks` left at its default (the synthetic suite) with another source means "that source's suite":
    for `hub`, HyperFormer's eight GLUE tasks; for a folder, every known task that has a sub-folder there.
    """

    source: str = "synthetic"          # "synthetic" | "hub" | path of a folder <task>/<split>.jsonl
    tasks: list[str] = field(default_factory=lambda: list(SYNTHETIC_SUITE))
    seed: int = 0                      # sampling order (may change per trial)
    data_seed: int = 42                # the data itself: synthetic rows, validation/test split, row caps
    temperature: float = 10.0          # p_i ∝ n_i^(1/T): 1 = proportional, large = uniform
    batching: str = "task"             # "task": one task per batch (HyperFormer); "mixed"
    task_prefix: bool = True           # start the source text with the task name (T5 style)
    max_source_length: int = 128
    max_target_length: int = 16
    synthetic_train_rows: int = 1000   # train rows of each synthetic task except the low-resource one
    synthetic_small_train_rows: int = 100  # train rows of the low-resource synthetic task ("lacks")
    synthetic_eval_rows: int = 200     # original validation rows per task; halved into validation/test
    max_train_rows: int | None = None  # cap per task after the split protocol (seeded subset)
    max_eval_rows: int | None = None   # cap per task for validation and for test
    vocab_size: int = 8192             # trained tokenizer size (capped by the model's vocab size)
    cache_dir: str | None = None       # tokenizer and datasets caches; default ~/.cache/hpsearch
    token_cache_mb: float = 2048.0     # token ids kept in <cache_dir>/tokens: least recently used beyond it go; 0: off

    def validate(self, read: bool = True) -> None:
        """Every field; `read=False`: the source is not read (pretraining on a corpus folder), so its folder need
        not exist."""
        from hpsearch.data.tasks import GLUE_TASKS, SYNTHETIC_TASKS, get_task

        if read and self.source not in SOURCES and not Path(self.source).expanduser().is_dir():
            _fail("source", f"folder '{self.source}' does not exist",
                  "'synthetic', 'hub' or a folder laid out <task>/<split>.jsonl")
        if not self.tasks:
            _fail("tasks", "empty", "a comma-separated list of task names")
        names = [get_task(t).name for t in self.tasks]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            _fail("tasks", f"task {duplicates[0]} listed twice", "each task once")
        if self.source == "synthetic":
            wrong = [t for t in names if t not in SYNTHETIC_TASKS]
            if wrong:
                _fail("tasks", f"{wrong[0]} is not a synthetic task",
                      f"{', '.join(SYNTHETIC_TASKS)} with data.source=synthetic")
        elif names != SYNTHETIC_SUITE:  # the default stands for the source's own suite
            wrong = [t for t in names if t not in GLUE_TASKS]
            if wrong:
                _fail("tasks", f"{wrong[0]} is a synthetic task", f"data.source=synthetic for {wrong[0]}")
        for name in ("seed", "data_seed"):
            _at_least(self, name, 0)
        if not self.temperature > 0:  # also catches nan
            _fail("temperature", f"{self.temperature}", "a number > 0 (1 = proportional, large = uniform)")
        if self.batching not in BATCHING:
            _fail("batching", f"'{self.batching}'", " or ".join(f"'{b}'" for b in BATCHING))
        _at_least(self, "max_source_length", 8)
        _at_least(self, "max_target_length", 2)
        _at_least(self, "synthetic_train_rows", 0, _MAX_SYNTHETIC_ROWS)
        _at_least(self, "synthetic_small_train_rows", 0, _MAX_SYNTHETIC_ROWS)
        _at_least(self, "synthetic_eval_rows", 2, _MAX_SYNTHETIC_ROWS)
        for name in ("max_train_rows", "max_eval_rows"):
            if getattr(self, name) is not None:
                _at_least(self, name, 1)
        _at_least(self, "vocab_size", _MIN_VOCAB)
        size = self.token_cache_mb
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 <= size < float("inf"):
            _fail("token_cache_mb", f"{size!r}", "a number of megabytes >= 0 (0: no token-id cache on disk)")


def _fail(name: str, problem: str, expected: str) -> None:
    raise ConfigError(f"data.{name}: {problem}; expected {expected}")


def _at_least(cfg: DataConfig, name: str, low: int, high: int | None = None) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high and value > high):
        _fail(name, f"{value!r}", f"an integer >= {low}" + (f" and <= {high}" if high else ""))
