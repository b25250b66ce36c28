"""The offline GLUE/SuperGLUE folder (../shared/data/glue): row counts, the split protocol, targets, and the
hub source through the same code. Skipped when the folder is absent (set HPSEARCH_GLUE_DIR to move it)."""
import collections
import json
import os
from pathlib import Path

import pytest

from hpsearch.data import DataConfig, MultiTaskSampler, get_task, load_suite, score_task
from hpsearch.data.__main__ import main
from hpsearch.data.sources import load_raw
from hpsearch.errors import DataError

GLUE_DIR = Path(os.environ.get("HPSEARCH_GLUE_DIR") or Path(__file__).resolve().parents[1] / ".." / "shared" /
                "data" / "glue").resolve()
pytestmark = pytest.mark.skipif(not GLUE_DIR.is_dir(),
                                reason=f"offline GLUE data not found at {GLUE_DIR} (set HPSEARCH_GLUE_DIR)")

# Official split sizes (GLUE, SuperGLUE, SciTail papers / HF datasets): what the folder holds.
OFFICIAL = {
    "rte": {"train": 2490, "validation": 277}, "mrpc": {"train": 3668, "validation": 408},
    "cola": {"train": 8551, "validation": 1043}, "stsb": {"train": 5749, "validation": 1500},
    "sst2": {"train": 67349, "validation": 872}, "qnli": {"validation": 5463},
    "cb": {"train": 250, "validation": 56}, "boolq": {"validation": 3270}, "wic": {"validation": 638},
    "wsc": {"train": 554, "validation": 104}, "copa": {"train": 400, "validation": 100},
    "mnli": {"validation_matched": 9815}, "scitail": {"test": 2126},
}
# After the protocol: < 10k official train rows -> validation halved (floor, rest to test); larger -> 1000
# train rows to validation, validation to test; SciTail keeps its published splits.
PROTOCOL = {
    "rte": (2490, 138, 139), "mrpc": (3668, 204, 204), "cola": (8551, 521, 522), "stsb": (5749, 750, 750),
    "sst2": (66349, 1000, 872), "qnli": (0, 0, 5463), "cb": (250, 28, 28), "boolq": (0, 1635, 1635),
    "wic": (0, 319, 319), "wsc": (554, 52, 52), "copa": (400, 50, 50), "mnli": (0, 0, 9815),
    "scitail": (0, 0, 2126),
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def suite(cache):
    return load_suite(DataConfig(source=str(GLUE_DIR), cache_dir=cache))


def test_row_counts_match_the_official_sizes(cache):
    cfg = DataConfig(source=str(GLUE_DIR), cache_dir=cache)
    raw = load_raw(cfg, list(OFFICIAL))
    counts = {task: {split: len(rows) for split, rows in splits.items()} for task, splits in raw.items()}
    assert counts == OFFICIAL


def test_default_tasks_of_a_folder_are_the_tasks_it_holds(suite):
    assert sorted(suite.tasks) == sorted(OFFICIAL)
    assert "qqp" not in suite.tasks


def test_protocol_split_sizes(suite):
    for task, (train, validation, test) in PROTOCOL.items():
        assert suite.sizes("train")[suite.tasks.index(task)] == train, task
        sizes = [len(suite.split(task, s)) for s in ("train", "validation", "test")]
        assert sizes == [train, validation, test]


def test_protocol_partitions_the_source_splits(suite, cache):
    raw = load_raw(DataConfig(source=str(GLUE_DIR), cache_dir=cache), ["rte", "sst2"])
    rte = get_task("rte")
    original = collections.Counter(rte.example(r).source for r in raw["rte"]["validation"])
    halves = [collections.Counter(e.source for e in suite.split("rte", s)) for s in ("validation", "test")]
    assert halves[0] + halves[1] == original
    sst2 = get_task("sst2")
    train = collections.Counter(sst2.example(r).source for r in raw["sst2"]["train"])
    rest = suite.split("sst2", "train") + suite.split("sst2", "validation")
    assert collections.Counter(e.source for e in rest) == train
    original_validation = [sst2.example(r).source for r in raw["sst2"]["validation"]]
    assert [e.source for e in suite.split("sst2", "test")] == original_validation


def test_protocol_is_seeded(suite, cache):
    same = load_suite(DataConfig(source=str(GLUE_DIR), tasks=["cb"], cache_dir=cache))
    other = load_suite(DataConfig(source=str(GLUE_DIR), tasks=["cb"], data_seed=1, cache_dir=cache))
    assert same.split("cb", "test") == suite.split("cb", "test")
    assert other.split("cb", "test") != suite.split("cb", "test")


def test_missing_splits_are_reported_and_such_tasks_are_still_evaluated(suite):
    tasks = suite.describe()["tasks"]
    for task in ("boolq", "wic", "qnli", "mnli", "scitail"):
        assert any("no train split" in note for note in tasks[task]["notes"]), task
    assert any("validation is empty" in note for note in tasks["mnli"]["notes"])
    assert not tasks["rte"]["notes"]
    sampler = MultiTaskSampler(suite.sizes(), 4, 10.0, "task", seed=0)
    sampled = {suite.tasks[t] for batch in zip(range(400), sampler) for t, _ in batch[1]}
    assert sampled.isdisjoint({"boolq", "wic", "qnli", "mnli", "scitail"}) and "rte" in sampled
    boolq = suite.split("boolq", "test")
    assert score_task("boolq", [e.target for e in boolq], boolq)["score"] == 100.0


def test_gold_targets_score_perfectly_on_every_task(suite):
    for task in suite.tasks:
        test = suite.split(task, "test")
        scores = score_task(task, [e.target for e in test], test)
        if task == "stsb":  # targets are rounded to the 0.2 grid
            assert scores["pearson"] > 99 and scores["spearman"] > 99
        else:
            assert scores["score"] == 100.0, task


def test_label_conventions_on_real_rows(suite):
    first = {task: (suite.split(task, "train") or suite.split(task, "test"))[0] for task in suite.tasks}
    assert first["rte"].target == "not_entailment" and first["rte"].label == 1   # README: label 1
    assert first["stsb"].target == "5.0" and first["stsb"].label == 5.0
    assert first["cb"].target == "entailment" and first["copa"].target == "choice1"
    assert first["wsc"].source.startswith("wsc text: Mark told Pete") and first["wsc"].target == "false"
    scitail = collections.Counter(e.target for e in suite.split("scitail", "test"))
    assert scitail == {"entailment": 842, "neutral": 1284}  # README label counts
    mnli = collections.Counter(e.label for e in suite.split("mnli", "test"))
    assert mnli == {0: 3479, 1: 3123, 2: 3213}


def test_row_caps(cache):
    capped = load_suite(DataConfig(source=str(GLUE_DIR), tasks=["sst2", "rte"], max_train_rows=500,
                                   max_eval_rows=40, cache_dir=cache))
    assert capped.sizes("train") == [500, 500] and capped.sizes("validation") == [40, 40]
    assert capped.sizes("test") == [40, 40]
    assert any("train capped to 500 of 66349" in n for n in capped.describe()["tasks"]["sst2"]["notes"])


def test_cli_json_describes_the_folder(capsys, cache):
    argv = ["--json", f"data.source={GLUE_DIR}", "data.tasks=rte,STS-B,mnli", f"data.cache_dir={cache}"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["tasks"] and list(out["tasks"]) == ["rte", "stsb", "mnli"]
    for task, (train, validation, test) in PROTOCOL.items():
        if task in out["tasks"]:
            info = out["tasks"][task]
            assert info["splits"] == {"train": train, "validation": validation, "test": test}
            assert isinstance(info["protocol"], str) and info["protocol"]
            assert info["example"]["source"].startswith(task + " ") and info["example"]["target"]
    assert "validation_matched -> test" in out["tasks"]["mnli"]["protocol"]


def test_cli_text_describes_the_folder(capsys, cache):
    assert main([f"data.source={GLUE_DIR}", "data.tasks=boolq,copa", f"data.cache_dir={cache}"]) == 0
    out = capsys.readouterr().out
    assert "boolq" in out and "1635" in out and "no train split" in out and "copa premise:" in out


def test_hub_source_goes_through_the_same_code(monkeypatch, suite, cache):
    """`data.source=hub` with `datasets.load_dataset` stubbed by the folder's rows: identical suite."""
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name))
        task = {"nyu-mll/glue": name, "aps/super_glue": (name or "").replace(".fixed", "")}[path]
        files = {p.stem: str(p) for p in (GLUE_DIR / task).glob("*.jsonl")}
        return datasets.DatasetDict({split: datasets.Dataset.from_list([json.loads(line) for line in open(f)])
                                     for split, f in files.items()})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    hub = load_suite(DataConfig(source="hub", tasks=["rte", "wsc", "mnli"], cache_dir=cache))
    assert calls == [("nyu-mll/glue", "rte"), ("aps/super_glue", "wsc.fixed"), ("nyu-mll/glue", "mnli")]
    for task in hub.tasks:
        for split in ("train", "validation", "test"):
            assert hub.split(task, split) == suite.split(task, split)
    assert hub.describe()["tasks"]["mnli"] == suite.describe()["tasks"]["mnli"]


def test_hub_errors_are_one_line(monkeypatch):
    import datasets

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'nyu-mll/glue' on the Hub (LocalEntryNotFoundError)\nmore")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(DataError) as e:
        load_suite(DataConfig(source="hub"))  # default tasks with the hub: the GLUE suite, cola first
    assert str(e.value) == ("task cola: could not load hub dataset nyu-mll/glue (cola): ConnectionError: "
                            "Couldn't reach 'nyu-mll/glue' on the Hub (LocalEntryNotFoundError)")
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([{"sentence": "x", "label": 7, "idx": 0}])}))
    with pytest.raises(DataError, match="has no 'validation' split"):
        load_suite(DataConfig(source="hub", tasks=["cola"]))
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.DatasetDict(
        {"validation": datasets.Dataset.from_list([{"sentence": "x", "label": 7, "idx": 0}])}))
    with pytest.raises(DataError, match=r"split validation row 0: label 7 out of range for task cola"):
        load_suite(DataConfig(source="hub", tasks=["cola"]))


def test_a_file_replaced_by_one_with_the_same_time_is_read_as_it_is_now(tmp_path, cache):
    """The `datasets` cache knows a local file by path and modification time: a validation file replaced by one
    with flipped labels and the same time (rsync -a, cp -p, tar) read as the old rows. Rows are read as they are."""
    folder = tmp_path / "glue" / "rte"
    folder.mkdir(parents=True)
    for split in ("train", "validation"):
        (folder / f"{split}.jsonl").write_bytes((GLUE_DIR / "rte" / f"{split}.jsonl").read_bytes())
    cfg = DataConfig(source=str(tmp_path / "glue"), tasks=["rte"], cache_dir=cache)
    before = load_raw(cfg, ["rte"])["rte"]["validation"]
    path = folder / "validation.jsonl"
    stat = path.stat()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "label": 1 - r["label"]}) + "\n" for r in rows))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = load_raw(cfg, ["rte"])["rte"]["validation"]
    assert [r["label"] for r in after] == [1 - r["label"] for r in before] and len(after) == 277
