"""DataConfig: defaults, validation messages, task resolution per source, and the CLI's config loading."""
import dataclasses
import json
import typing

import pytest

from hpsearch.cli import run_main
from hpsearch.data import GLUE_SUITE, DataConfig
from hpsearch.data.__main__ import main
from hpsearch.data.sources import resolve_tasks
from hpsearch.data.synthetic import SYNTHETIC_SUITE
from hpsearch.errors import ConfigError

PLAIN_TYPES = {str, int, float, bool, list[str], str | None, int | None}


def test_defaults_are_plain_typed_and_valid():
    cfg = DataConfig()
    cfg.validate()
    hints = typing.get_type_hints(DataConfig)
    assert all(hints[f.name] in PLAIN_TYPES for f in dataclasses.fields(DataConfig))
    assert (cfg.source, cfg.tasks) == ("synthetic", SYNTHETIC_SUITE)
    assert (cfg.temperature, cfg.batching) == (10.0, "task")
    assert DataConfig().tasks is not DataConfig().tasks


@pytest.mark.parametrize("field, value, message", [
    ("tasks", [], "data.tasks: empty"),
    ("tasks", ["first", "FIRST"], "data.tasks: task first listed twice"),
    ("temperature", 0.0, "data.temperature: 0.0; expected a number > 0"),
    ("temperature", float("nan"), "data.temperature: nan"),
    ("batching", "round-robin", "data.batching: 'round-robin'; expected 'task' or 'mixed'"),
    ("seed", -1, "data.seed: -1; expected an integer >= 0"),
    ("max_source_length", 4, "data.max_source_length: 4; expected an integer >= 8"),
    ("max_target_length", 1, "data.max_target_length: 1; expected an integer >= 2"),
    ("synthetic_eval_rows", 1, "data.synthetic_eval_rows: 1; expected an integer >= 2"),
    ("synthetic_train_rows", 10**7,
     "data.synthetic_train_rows: 10000000; expected an integer >= 0 and <= 200000"),
    ("max_train_rows", 0, "data.max_train_rows: 0; expected an integer >= 1"),
    ("vocab_size", 100, "data.vocab_size: 100; expected an integer >= 259"),
    ("source", "/no/such/folder",
     "data.source: folder '/no/such/folder' does not exist; expected 'synthetic'"),
])
def test_validation_messages(field, value, message):
    with pytest.raises(ConfigError) as e:
        dataclasses.replace(DataConfig(), **{field: value}).validate()
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_default_tasks_stand_for_the_source_suite(tmp_path):
    assert resolve_tasks(DataConfig()) == SYNTHETIC_SUITE
    assert resolve_tasks(DataConfig(source="hub")) == GLUE_SUITE == \
        ["cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte"]
    for task in ("wsc", "cola", "notatask"):
        (tmp_path / task).mkdir()
    assert resolve_tasks(DataConfig(source=str(tmp_path))) == ["cola", "wsc"]  # registry order
    assert resolve_tasks(DataConfig(source="hub", tasks=["STS-B", "rte"])) == ["stsb", "rte"]


def test_the_command_reads_the_shared_run_config(tmp_path, capsys):
    """`python -m hpsearch.data` takes the same --config file and overrides as the other commands."""
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  backbone: t5-tiny\ntrain:\n  max_steps: 3\n"
                    "data:\n  tasks: [first, count]\n  synthetic_eval_rows: 50\n")
    assert main(["--json", "--config", str(path), "data.synthetic_train_rows=30", "train.lr=0.01"]) == 0
    tasks = json.loads(capsys.readouterr().out)["tasks"]
    assert list(tasks) == ["first", "count"]
    assert tasks["count"]["splits"] == {"train": 30, "validation": 25, "test": 25}


@pytest.mark.parametrize("overrides, message", [
    (["data.nope=1"], "unknown field 'data.nope'"),
    (["data.seed=1.5"], "data.seed: '1.5' is not an integer"),
    (["data.batching=zigzag"], "data.batching: 'zigzag'; expected 'task' or 'mixed'"),
    (["data.tasks=first,first"], "data.tasks: task first listed twice"),
])
def test_bad_overrides_are_one_line_errors(overrides, message, capsys):
    with pytest.raises(SystemExit) as e:
        run_main(main, overrides)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and message in err and len(err.splitlines()) == 1
