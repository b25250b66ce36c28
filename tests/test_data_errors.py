"""Bad input: each a one-line error naming file/line/field and what is valid, exit code 2, no traceback."""
import json
import subprocess
import sys

import pytest

from hpsearch.cli import run_main
from hpsearch.data import DataConfig, load_suite
from hpsearch.data.__main__ import main
from hpsearch.errors import ConfigError, DataError

RTE_ROWS = [{"sentence1": "A cat sat.", "sentence2": "A cat.", "label": 0, "idx": 0},
            {"sentence1": "A dog ran.", "sentence2": "A cat ran.", "label": 1, "idx": 1}]


def write(folder, task, split, rows):
    path = folder / task / f"{split}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "glue"
    write(root, "rte", "train", RTE_ROWS * 3)
    write(root, "rte", "validation", RTE_ROWS * 2)
    return root


def load(folder, **kwargs):
    return load_suite(DataConfig(source=str(folder), cache_dir=str(folder.parent / "cache"), **kwargs))


def one_line_error(capsys, argv):
    with pytest.raises(SystemExit) as e:
        run_main(main, argv)
    captured = capsys.readouterr()
    assert e.value.code == 2 and captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in captured.err
    return lines[0]


def test_a_good_folder_loads(folder):
    suite = load(folder)
    assert suite.tasks == ["rte"] and suite.sizes("train") == [6] and suite.sizes("test") == [2]


def test_unknown_task(folder, capsys):
    line = one_line_error(capsys, [f"data.source={folder}", "data.tasks=rte,wnli"])
    assert "unknown task 'wnli'" in line and "known: cola, sst2" in line and "scitail" in line


def test_missing_folder(tmp_path, capsys):
    line = one_line_error(capsys, [f"data.source={tmp_path / 'nope'}"])
    assert f"data.source: folder '{tmp_path / 'nope'}' does not exist" in line and "'hub'" in line


def test_folder_without_task_folders(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    line = one_line_error(capsys, [f"data.source={tmp_path / 'empty'}"])
    assert "no task folders" in line and "rte" in line


def test_missing_task_folder(folder, capsys):
    line = one_line_error(capsys, [f"data.source={folder}", "data.tasks=rte,cb"])
    assert f"{folder / 'cb'}: no such folder for task cb; task folders there: rte" in line


def test_missing_split_file(folder, capsys):
    (folder / "rte" / "validation.jsonl").unlink()
    line = one_line_error(capsys, [f"data.source={folder}"])
    assert f"{folder / 'rte' / 'validation.jsonl'}: not found" in line and "'validation' split" in line
    assert "found: train.jsonl" in line


def test_missing_train_split_is_a_note_not_an_error(folder):
    (folder / "rte" / "train.jsonl").unlink()
    suite = load(folder)
    assert suite.sizes("train") == [0] and suite.sizes("test") == [2]
    assert "no train split" in suite.describe()["tasks"]["rte"]["notes"][0]


def test_empty_required_split(folder):
    write(folder, "rte", "validation", [])
    with pytest.raises(DataError, match="validation.jsonl: no rows"):
        load(folder)


def test_line_that_does_not_parse(folder, capsys):
    path = write(folder, "rte", "train", [RTE_ROWS[0], "", '{"sentence1": "x", "sentence2": ', RTE_ROWS[1]])
    line = one_line_error(capsys, [f"data.source={folder}"])
    assert line.startswith(f"error: {path}:3: not valid JSON")  # blank line 2 is skipped but counted


@pytest.mark.parametrize("row, problem", [
    ({"sentence1": "x", "label": 0},
     "missing field 'sentence2' for task rte; expected fields sentence1, sentence2, label"),
    ({"sentence1": "x", "sentence2": "y"}, "missing field 'label'"),
    ({"sentence1": "x", "sentence2": None, "label": 0}, "missing field 'sentence2'"),
    ({"sentence1": "x", "sentence2": 3, "label": 0}, "field 'sentence2' is 3; expected a string"),
    ({"sentence1": "x", "sentence2": "y", "label": 2},
     "label 2 out of range for task rte; expected an integer in (0=entailment, 1=not_entailment)"),
    ({"sentence1": "x", "sentence2": "y", "label": -1}, "label -1 out of range"),
    ({"sentence1": "x", "sentence2": "y", "label": True}, "label True out of range"),
    ({"sentence1": "x", "sentence2": "y", "label": "entailment"}, "label 'entailment' out of range"),
    ('["a", "list"]', "expected a JSON object, got list"),
])
def test_bad_rows_name_file_line_and_field(folder, capsys, row, problem):
    path = write(folder, "rte", "validation", [RTE_ROWS[0], row])
    line = one_line_error(capsys, [f"data.source={folder}"])
    assert line.startswith(f"error: {path}:2: {problem}")
    assert "expected" in line  # and says what would be valid


def test_labels_out_of_range_for_numbers_and_strings(folder):
    write(folder, "stsb", "validation", [{"sentence1": "a", "sentence2": "b", "label": 5.5}])
    with pytest.raises(DataError, match=r"stsb/validation.jsonl:1: label 5.5 out of range for task stsb; "
                                        r"expected a number in \[0, 5\]"):
        load(folder, tasks=["stsb"])
    write(folder, "scitail", "test", [{"premise": "a", "hypothesis": "b", "label": "contradiction"}])
    with pytest.raises(DataError, match=r"label 'contradiction' out of range for task scitail; "
                                        r"expected one of 'neutral', 'entails', 'entailment'"):
        load(folder, tasks=["scitail"])


def test_not_utf8(folder):
    (folder / "rte" / "validation.jsonl").write_bytes(b'{"sentence1": "caf\xe9"}\n')
    with pytest.raises(DataError, match="validation.jsonl: not UTF-8 text"):
        load(folder)


def test_synthetic_and_real_tasks_do_not_mix(folder):
    with pytest.raises(ConfigError, match="data.tasks: rte is not a synthetic task"):
        load_suite(DataConfig(tasks=["first", "rte"]))
    with pytest.raises(ConfigError, match="data.tasks: first is a synthetic task"):
        load(folder, tasks=["rte", "first"])


def test_the_command_exits_2_without_traceback(folder):
    """The real entry point, in a separate process."""
    write(folder, "rte", "validation", [RTE_ROWS[0], {"sentence1": "x", "sentence2": "y", "label": 9}])
    result = subprocess.run([sys.executable, "-m", "hpsearch.data", f"data.source={folder}"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"error: {folder / 'rte' / 'validation.jsonl'}:2: label 9 out of range for task rte; "
        "expected an integer in (0=entailment, 1=not_entailment)"]


def test_empty_train_file_is_an_error_before_any_worker(folder):
    write(folder, "rte", "train", [])
    with pytest.raises(DataError, match="rte/train.jsonl: no rows"):
        load(folder)


def test_a_large_tasks_train_file_with_too_few_rows_for_its_validation_says_so(folder):
    sst2 = [{"sentence": f"s {i}", "label": i % 2} for i in range(500)]
    write(folder, "sst2", "train", sst2)
    write(folder, "sst2", "validation", sst2[:10])
    with pytest.raises(DataError, match=r"sst2/train.jsonl: 500 rows, all of them validation: sst2's protocol \(large: "
                                        r"1000 train rows -> validation.*expected more than 1000 rows"):
        load(folder, tasks=["sst2"])


def test_a_source_under_the_home_folder_is_checked_the_same(folder, monkeypatch):
    """`data.source=~/...`: the train-file check took the path without expanding `~` and never fired (SST-2 with
    its rows all taken for validation was described as evaluation-only)."""
    write(folder, "sst2", "train", [{"sentence": f"s {i}", "label": i % 2} for i in range(500)])
    write(folder, "sst2", "validation", [{"sentence": "v", "label": 0}])
    monkeypatch.setenv("HOME", str(folder.parent))
    with pytest.raises(DataError, match=r"sst2/train.jsonl: 500 rows, all of them validation"):
        load_suite(DataConfig(source=f"~/{folder.name}", tasks=["sst2"], cache_dir=str(folder.parent / "cache")))
