"""Bad input is one line on stderr, exit code 2, before anything starts: no traceback, no run folder, no MLflow
store, no Ray session. Each case is a command a careless or hostile user ran (the audit of issue 13)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def write(path: Path, data: bytes | str) -> str:
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(path)


def _pretrained_tokenizer(folder: Path, cache: Path) -> None:
    """A byte-level BPE saved by transformers, as `python -m hpsearch.pretrain` saves its backbone's."""
    from hpsearch.data.tokenizer import train_tokenizer

    train_tokenizer(["a sentence", "another sentence"], 300, cache).save_pretrained(folder)


def cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (arguments after `python -m`, a phrase the line must hold)."""
    notckpt = tmp / "not-a-checkpoint"
    notckpt.mkdir()
    (notckpt / "notes.txt").write_text("hello")
    noval = tmp / "no-validation" / "rte"  # one validation row: halved into 0 validation rows and 1 test row
    noval.mkdir(parents=True)
    row = lambda i: json.dumps({"sentence1": f"a sentence {i}", "sentence2": f"another {i}", "label": i % 2})
    (noval / "train.jsonl").write_text("".join(row(i) + "\n" for i in range(30)))
    (noval / "validation.jsonl").write_text(row(0) + "\n")
    pretrained = tmp / "pretrained"  # a checkpoint with the tokenizer python -m hpsearch.pretrain writes
    pretrained.mkdir()
    (pretrained / "config.json").write_text("{}")
    (pretrained / "model.safetensors").write_text("")
    _pretrained_tokenizer(pretrained, tmp / "tokenizer-cache")
    notok = tmp / "no-tokenizer"  # a checkpoint without its tokenizer: every word became <unk>
    notok.mkdir()
    (notok / "config.json").write_text("{}")
    (notok / "model.safetensors").write_text("")
    study = tmp / "runs" / "broken"
    study.mkdir(parents=True)
    (study / "hpsearch-study.json").write_text('{"name": "broken", "space_te')
    half = tmp / "runs" / "half"
    half.mkdir(parents=True)
    (half / "hpsearch-study.json").write_text(json.dumps({"name": "half"}))
    # a store in a folder that does not exist yet: a check that fails leaves no such folder behind
    tune = ["hpsearch.tune", "--storage-path", str(tmp / "runs"), "--tracking-uri", f"sqlite:///{tmp}/new/mlflow.db"]
    pretrain = ["hpsearch.pretrain", "--tracking-uri", f"sqlite:///{tmp}/mlflow.db", "data.source=synthetic",
                "model.backbone=t5-tiny", f"train.output_dir={tmp}/pretrain-out"]
    rte = [f"data.source={ROOT.parent / 'shared' / 'data' / 'glue'}", "data.tasks=rte", f"data.cache_dir={tmp}/cache"]
    leaky = tmp / "leaky-corpus"
    (leaky / "rte").mkdir(parents=True)
    (leaky / "rte" / "train.jsonl").write_text('{"text": "fine"}\n')
    (leaky / "rte" / "validation.jsonl").write_text('{"text": "scored on"}\n')
    return {
        "yaml key twice": ([*tune, "--space", write(tmp / "dup.yaml", "budget: {trials: 2}\nbudget: {trials: 3}\n")],
                           "dup.yaml:2: 'budget' is given twice (first on line 1)"),
        "python tag": ([*tune, "--space", write(tmp / "tag.yaml", "name: !!python/object/apply:os.system [id]\n")],
                       "tag.yaml:1: malformed YAML"),
        "not utf-8": ([*tune, "--space", write(tmp / "latin.yaml", b"name: x\ndescription: caf\xe9\n")],
                      "latin.yaml:2: not UTF-8"),
        "server down": (["hpsearch.tune", "--storage-path", str(tmp / "runs"), "--tracking-uri",
                         "http://127.0.0.1:9/"], "no MLflow server answers"),
        "sqlite nowhere": (["hpsearch.tune", "--storage-path", str(tmp / "runs"), "--tracking-uri",
                            "sqlite:////proc/x/mlflow.db"], "cannot create /proc/x"),
        "sqlite folder": (["hpsearch.tune", "--storage-path", str(tmp / "runs"), "--tracking-uri", f"sqlite:///{tmp}"],
                          "is a folder; expected the path of a database file"),
        "sqlite not a database": (["hpsearch.tune", "--storage-path", str(tmp / "runs"), "--tracking-uri",
                                   f"sqlite:///{write(tmp / 'notes.db', 'hello')}"], "notes.db is not an SQLite "
                                                                                      "database"),
        "server url no port": (["hpsearch.compare", "--storage-path", str(tmp / "runs"), "--tracking-uri",
                                "http://127.0.0.1:abc"], "--tracking-uri http://127.0.0.1:abc: not a valid URL"),
        # a bucket whose endpoint does not answer (MinIO not started): it was a 27-line traceback
        "bucket unreachable": (["hpsearch.tune", "--storage-path", "s3://b/p?endpoint_override=http://127.0.0.1:9",
                                "--tracking-uri", f"sqlite:///{tmp}/mlflow.db"],
                               "--storage-path s3://b/p?endpoint_override=http://127.0.0.1:9: cannot reach it"),
        "storage nowhere": (["hpsearch.tune", "--storage-path", "/proc/x/runs", "--tracking-uri",
                             f"sqlite:///{tmp}/mlflow.db"], "--storage-path /proc/x/runs: cannot create it"),
        "optuna storage nowhere": ([*tune, "--optuna-storage", "sqlite:////proc/x/optuna.db"],
                                   "--optuna-storage sqlite:////proc/x/optuna.db: cannot be opened"),
        "optuna storage no driver": ([*tune, "--optuna-storage", "nosuchdb://127.0.0.1:9/optuna"],
                                     "--optuna-storage nosuchdb://127.0.0.1:9/optuna: cannot be opened"),
        "too many workers": ([*tune, "resources.workers=64"], "one trial needs 57.7 CPU"),
        "no gpu here": ([*tune, "resources.gpus_per_worker=1"], "GPU"),
        "argparse type": ([*tune, "--num-samples", "abc"], "invalid int value: 'abc'"),
        "train argparse": (["hpsearch.train", "--bogus"], "unrecognized arguments: --bogus"),
        "data argparse": (["hpsearch.data", "--bogus"], "python -m hpsearch.data: unrecognized arguments: --bogus"),
        # said before the transfer runs (it was said after it, its results lost)
        "transfer out nowhere": (["hpsearch.transfer", "--from", str(tmp), "--task", "scitail", "--out", "/proc/x"],
                                 "--out /proc/x: /proc cannot be written; expected a folder"),
        "train output nowhere": (["hpsearch.train", "--local", "train.output_dir=/proc/x/y"],
                                 "train.output_dir: /proc/x/y: /proc cannot be written; expected a folder"),
        "pretrain too many workers": ([*pretrain, "train.num_workers=64"], "train.num_workers: 64 workers x 2 CPU"),
        "pretrain output nowhere": ([*pretrain[:-1], "train.output_dir=/proc/x/y"], "/proc cannot be written"),
        # a private Ray would wait for workers this machine can never hold (Ray Train times out and retries)
        "train too many workers": (["hpsearch.train", "train.num_workers=64", f"train.output_dir={tmp}/train-out"],
                                   "train.num_workers: 64 workers x 0.9 CPU need 57.6 CPU but this machine has"),
        "train no gpu here": (["hpsearch.train", "train.use_gpu=true", f"train.output_dir={tmp}/train-out"],
                              "workers x 1 GPU need 2 GPU but this machine has 0; lower train.num_workers or "
                              "train.gpus_per_worker; or train.use_gpu=false"),
        "corrupt study state": ([*tune, "--name", "broken", "--resume"], "hpsearch-study.json is corrupt"),
        "incomplete study state": ([*tune, "--name", "half", "--resume"], "hpsearch-study.json is incomplete"),
        "study backbone not a checkpoint": ([*tune, f"model.backbone={notckpt}"], "not-a-checkpoint"),
        "params backbone not a checkpoint": (["hpsearch.params", f"model.backbone={notckpt}"], "is not a checkpoint"),
        "params unknown backbone": (["hpsearch.params", "model.backbone=./no-such-folder"], "no such directory"),
        "params too many tasks": (["hpsearch.params", "--num-tasks", "100000000", "model.backbone=t5-11b"],
                                  "--num-tasks: 100000000"),
        "params argparse": (["hpsearch.params", "--num-tasks", "x"], "invalid int value: 'x'"),
        "train backbone not a checkpoint": (["hpsearch.train", f"model.backbone={notckpt}",
                                             f"train.output_dir={tmp}/train-out"], "is not a checkpoint"),
        "study backbone not pretrained yet": ([*tune, "model.backbone=runs/pretrain/backbone"],
                                              "no such directory; to make a pretrained backbone there, run "
                                              "python -m hpsearch.pretrain"),
        "pretrain corpus missing": ([*pretrain, "corpus.path=./no-such-corpus"], "corpus.path: ./no-such-corpus"),
        "pretrain validation file": ([*pretrain, f"corpus.path={leaky}"], "validation.jsonl is a validation or test"),
        "pretrain not plain": ([*pretrain, "model.method=hyperprompt"], "pretraining trains the plain backbone"),
        "pretrain unknown field": ([*pretrain, "corpus.noise=0.2"], "unknown field 'corpus.noise'"),
        "pretrain bad density": ([*pretrain, "corpus.noise_density=1.5"], "corpus.noise_density: 1.5"),
        "train no validation rows": (["hpsearch.train", f"data.source={noval.parent}", "data.tasks=rte",
                                      f"train.output_dir={tmp}/train-out"], "no task has validation rows"),
        "train backbone without tokenizer": (["hpsearch.train", f"model.backbone={notok}",
                                              f"train.output_dir={tmp}/train-out"],
                                             "no-tokenizer has no tokenizer (tokenizer.json or spiece.model)"),
        "study backbone without tokenizer": ([*tune, f"model.backbone={notok}"], "has no tokenizer"),
        "study searched backbone not a checkpoint": (
            [*tune, "--space", write(tmp / "bb.yaml", "search:\n  model.backbone: {type: categorical, choices: "
                                                     f"[t5-tiny, {notckpt}]}}\n")],
            "not-a-checkpoint is not a checkpoint"),
        # a label word cut by the target length: each worker said it, with a traceback, after Ray had started
        "train target cut": (["hpsearch.train", *rte, "data.max_target_length=2", f"train.output_dir={tmp}/train-out"],
                             "data.max_target_length: 2 cuts rte's target 'not_entailment' ("),
        "study target cut": ([*tune, *rte, "train.max_new_tokens=1"],
                             "train.max_new_tokens: 1 cannot generate rte's target 'not_entailment' ("),
        "train checkpoint target cut": (["hpsearch.train", f"model.backbone={pretrained}", *rte,
                                         "train.max_new_tokens=1", f"train.output_dir={tmp}/train-out"],
                                        "train.max_new_tokens: 1 cannot generate rte's target 'not_entailment' ("),
        # what a method sizes from the backbone's width: every worker said it after Ray had started
        "train no bottleneck": (["hpsearch.train", "model.method=hyperformer", "model.reduction_factor=100",
                                 f"train.output_dir={tmp}/train-out"],
                                "model.reduction_factor: 100 leaves no bottleneck for t5-tiny (d_model 64 // 100"),
        "study no bottleneck": ([*tune, "--space", write(tmp / "hf.yaml", "model: {method: hyperformer, "
                                                        "reduction_factor: 2000, backbone: t5-base}\nsearch:\n  "
                                                        "train.lr: {type: loguniform, low: 1.0e-4, high: 1.0e-3}\n")],
                                "model.reduction_factor: 2000 leaves no bottleneck for t5-base (d_model 768"),
    }


NAMES = ["yaml key twice", "python tag", "not utf-8", "server down", "sqlite nowhere", "sqlite folder",
         "sqlite not a database", "server url no port", "bucket unreachable", "storage nowhere",
         "optuna storage nowhere", "optuna storage no driver",
         "too many workers", "no gpu here", "argparse type", "train argparse", "data argparse", "transfer out nowhere",
         "train too many workers", "train no gpu here", "train output nowhere", "pretrain too many workers",
         "pretrain output nowhere", "corrupt study state",
         "incomplete study state", "study backbone not a checkpoint", "params backbone not a checkpoint",
         "params unknown backbone", "params too many tasks", "params argparse", "train backbone not a checkpoint",
         "study backbone not pretrained yet", "pretrain corpus missing", "pretrain validation file",
         "pretrain not plain", "pretrain unknown field", "pretrain bad density", "train target cut",
         "study target cut", "train no validation rows", "train backbone without tokenizer",
         "study backbone without tokenizer", "study searched backbone not a checkpoint", "train no bottleneck",
         "study no bottleneck", "train checkpoint target cut"]


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    return tmp, cases(tmp)


def test_every_case_is_listed(table):
    assert sorted(table[1]) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_bad_input_is_one_line_before_anything_starts(name, table, tmp_path):
    tmp, table = table
    args, phrase = table[name]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "RAY_ADDRESS": ""}
    env.pop("RAY_ADDRESS")
    before = set(Path("/tmp/ray").glob("session_2*")) if Path("/tmp/ray").is_dir() else set()
    proc = subprocess.run([sys.executable, "-m", *args], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=env)
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, err[-2000:])
    assert err.splitlines() == [err] and err.startswith("error: ") and "Traceback" not in err, err
    assert phrase in err, err
    assert not proc.stdout.strip(), proc.stdout[-500:]
    assert not list(tmp_path.iterdir())  # nothing written where the command ran
    assert not (tmp / "mlflow.db").exists() and not (tmp / "optuna.db").exists()  # no MLflow or Optuna store
    assert not (tmp / "new").exists()  # nor the folder of one
    assert sorted(p.name for p in (tmp / "runs").iterdir()) == ["broken", "half"]  # no study folder
    after = set(Path("/tmp/ray").glob("session_2*")) if Path("/tmp/ray").is_dir() else set()
    assert after <= before  # no Ray session was started


def test_reading_and_checking_a_config_imports_no_heavy_library():
    """The checks before anything starts parse arguments and read and validate the space and run config (and the
    benchmark's options); none of that needs torch, transformers, scikit-learn, Ray, MLflow, Optuna, DeepSpeed or
    the model library beyond its configs, so a mistake is said at once (importing them took ~5 s a command here)."""
    code = ("import sys\n"
            "import hpsearch.tune.cli as cli\n"
            "import hpsearch.bench.__main__ as bench\n"
            "from hpsearch.config import load_config\n"
            "cli.parse_args(['--num-samples', '2'])\n"
            "load_config(None, ['model.method=lora', 'train.lr=1e-3'])\n"
            "import hpsearch.tune.prepare as prepare\n"
            "prepare.load_space(str(prepare.DEFAULT_SPACE), ['budget.trials=2'])\n"
            "bench.parse_args(['--batch', '8x32+4', '--methods', 'lora', 'hyperprompt-sep', '--shape', 't5-base'])\n"
            "heavy = ('torch', 'transformers', 'sklearn', 'ray', 'mlflow', 'optuna', 'deepspeed', 'tokenizers')\n"
            "light = ('hpsearch.model.backbones', 'hpsearch.model.config')\n"
            "print(sorted(m for m in heavy if m in sys.modules)\n"
            "      + sorted(m for m in sys.modules if m.startswith('hpsearch.model.') and m not in light))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


HEAVY = ("torch", "transformers", "sklearn", "ray", "mlflow", "optuna", "deepspeed")


def test_checking_a_runs_data_imports_no_heavy_library(tmp_path):
    """The drivers' data check (`config.check_run_data`: rows, and every target in an offline shape's tokenizer)
    trains or reads the BPE with `tokenizers` alone: ~0.2 s on the GLUE rows here, no torch or transformers."""
    glue = ROOT.parent / "shared" / "data" / "glue"
    code = ("import sys\n"
            "from hpsearch.config import check_run_data, load_config\n"
            f"check_run_data(load_config(None, ['data.source={glue}', 'data.tasks=rte,stsb', "
            f"'data.cache_dir={tmp_path}']))\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]" and list((tmp_path / "tokenizers").glob("*.json"))  # it did tokenize


@pytest.mark.parametrize("module, args, phrase", [
    ("hpsearch.tune.cli", ["resources.workers=64"], "one trial needs 57.7 CPU"),
    ("hpsearch.params", ["model.backbone=./no-such-folder"], "no such directory"),
    ("hpsearch.params", ["--num-tasks", "0"], "--num-tasks: 0"),
    ("hpsearch.compare.cli", ["methods.mtl.method=nope"], "'nope' is not a method"),
    ("hpsearch.compare.cli", ["--from-study", "nope"], "no study 'nope'"),
    ("hpsearch.compare.cli", ["resources.workers=64"], "one trial needs"),
    ("hpsearch.pretrain.__main__", ["data.source=synthetic", "model.backbone=t5-tiny", "corpus.path=leaky"],
     "validation.jsonl is a validation or test file"),
], ids=["tune fits", "params backbone", "params tasks", "compare method", "compare study", "compare fits",
        "pretrain corpus"])
def test_a_mistake_is_said_before_any_heavy_library_loads(module, args, phrase, tmp_path):
    """The commands check everything they can before importing torch, transformers, Ray or MLflow (each took ~5 s
    to say these mistakes, importing them first): the error is raised with none of them loaded."""
    (tmp_path / "leaky" / "rte").mkdir(parents=True)
    (tmp_path / "leaky" / "rte" / "validation.jsonl").write_text('{"text": "scored on"}\n')
    code = ("import importlib, json, sys\n"
            "from hpsearch.errors import UserError\n"
            f"main = importlib.import_module({module!r}).main\n"
            "try:\n"
            f"    main({args!r})\n"
            "    message = None\n"
            "except UserError as e:\n"
            "    message = str(e)\n"
            f"print(json.dumps([message, sorted(m for m in {HEAVY!r} if m in sys.modules)]))\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    message, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert message and phrase in message, message
    assert loaded == [], loaded


@pytest.mark.parametrize("ending, code", [("return 3", 3), ("raise UserError('no such field: x')", 2)])
def test_a_command_skips_the_last_collection_at_exit_and_still_flushes_its_files(ending, code, tmp_path):
    """`run_main`'s exit: what the process left alive is frozen (the interpreter's last collection walks none of
    it), whether main returns or fails in one line; a file only that collection would have flushed (a module's
    global) is flushed; in a process that catches the exit (a test), the collector is as before until it exits."""
    script = f"""
import atexit, gc, sys
import hpsearch.cli
from hpsearch.cli import run_main
from hpsearch.errors import UserError
calls, skip = [], hpsearch.cli._skip_last_collection
hpsearch.cli._skip_last_collection = lambda: calls.append(skip())  # counted
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, "calls:", len(calls), flush=True))
buffered = open(sys.argv[1], "w")  # never closed: the module's dict and main are a cycle

def main(argv):
    buffered.write("kept")
    {ending}

for attempt in range(2):  # a caller running main twice: the exit handler still runs once
    try:
        run_main(main, [])
    except SystemExit as e:
        print("caught", e.code, "frozen now:", gc.get_freeze_count() > 0, flush=True)
        code = e.code
sys.exit(code)
"""
    out = tmp_path / "out.txt"
    proc = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout.splitlines() == [f"caught {code} frozen now: False"] * 2 + ["frozen at exit: True calls: 1"]
    assert out.read_text() == "kept" * 2


def test_a_searched_target_length_is_left_to_each_trial(tmp_path):
    """A study checks the targets against its fixed config only when no field they depend on is searched: searching
    `train.max_new_tokens` over values that fit must not be refused for the default that does not."""
    from hpsearch.config import load_config
    from hpsearch.errors import ConfigError
    from hpsearch.tune.prepare import check_data

    glue = ROOT.parent / "shared" / "data" / "glue"
    cfg = load_config(None, [f"data.source={glue}", "data.tasks=rte", "train.max_new_tokens=1",
                             f"data.cache_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="train.max_new_tokens: 1 cannot generate rte's target"):
        check_data(cfg)
    with pytest.raises(ConfigError, match="train.max_new_tokens: 1 cannot generate rte's target"):
        check_data(cfg, {"train.lr"})
    check_data(cfg, {"train.max_new_tokens"})
    check_data(cfg, {"model.backbone"})
    cfg.data.tasks = ["nosuchtask"]  # the rows are still checked
    with pytest.raises(ConfigError):
        check_data(cfg, {"train.max_new_tokens"})


def test_the_backbones_width_is_read_without_torch_and_a_searched_width_field_is_left_to_each_trial(tmp_path):
    """The width a method sizes from comes from a named shape or a local checkpoint's config.json (None for a hub
    id, an export, or a config without d_model: those are checked when built); a study checks its fixed config only
    when no field the check reads is searched, as with the target lengths."""
    import json

    from hpsearch.errors import ConfigError
    from hpsearch.model.backbones import backbone_width
    from hpsearch.tune.prepare import check_backbone
    from hpsearch.tune.spacefile import load_space

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"d_model": 48}))
    (ckpt / "model.safetensors").write_text("")
    (ckpt / "tokenizer.json").write_text("{}")
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"d_model": "wide"}))
    assert [backbone_width(b) for b in ("t5-tiny", "t5-base", str(ckpt), str(odd), "google-t5/t5-small")] == \
        [64, 768, 48, None, None]
    space = tmp_path / "space.yaml"
    for field, choices, refused in (("train.lr", "[0.001]", True), ("model.reduction_factor", "[8, 64]", False),
                                    ("model.backbone", f"[t5-tiny, {ckpt}]", False)):
        space.write_text(f"model: {{method: hyperformer, reduction_factor: 64, backbone: {ckpt}}}\n"
                         f"search:\n  {field}: {{type: categorical, choices: {choices}}}\n")
        loaded = load_space(space)
        if refused:
            with pytest.raises(ConfigError, match=f"reduction_factor: 64 leaves no bottleneck for {ckpt} "
                                                  r"\(d_model 48 // 64 = 0\); expected at most 48"):
                check_backbone(loaded.config, loaded.params)
        else:
            check_backbone(loaded.config, loaded.params)


def test_a_study_searching_the_generation_length_starts(tmp_path):
    """The same through the command line: the space searches train.max_new_tokens (its default, 8, cuts RTE's
    label word at a 259-token vocabulary), so the study passes the data check and stops at the next one."""
    glue = ROOT.parent / "shared" / "data" / "glue"
    space = tmp_path / "space.yaml"
    space.write_text("name: long\nmodel: {backbone: t5-tiny, method: mtl}\n"
                     f"data: {{source: {glue}, tasks: [rte], vocab_size: 259, max_target_length: 32, "
                     f"cache_dir: {tmp_path / 'cache'}}}\n"
                     "search:\n  train.max_new_tokens: {type: categorical, choices: [24, 32]}\n")
    out = subprocess.run([sys.executable, "-m", "hpsearch.tune", "--space", str(space), "--storage-path",
                          str(tmp_path / "runs"), "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db",
                          "resources.workers=64"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    assert out.returncode == 2 and "one trial needs" in out.stderr, out.stderr[-2000:]


def test_train_still_loads_hub_data_in_its_driver(tmp_path):
    """`python -m hpsearch.train` loads the hub's rows before Ray starts (a study leaves them to its trials)."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-m", "hpsearch.train", "data.source=hub", "data.tasks=rte",
                          f"data.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path / 'out'}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    err = out.stderr.strip()
    assert out.returncode == 2 and err.splitlines() == [err] and "rte" in err and "hub" in err, err[-2000:]
    assert not (tmp_path / "out").exists()


def test_a_comparison_checks_each_methods_targets(tmp_path):
    """`hpsearch.compare` checks every method's data and target lengths before anything starts (a method that
    overrides `train.max_new_tokens` too)."""
    from hpsearch.compare.cli import main
    from hpsearch.errors import ConfigError

    glue = ROOT.parent / "shared" / "data" / "glue"
    common = ["--storage-path", str(tmp_path / "runs"), "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db",
              f"data.source={glue}", "data.tasks=rte", f"data.cache_dir={tmp_path / 'cache'}"]
    with pytest.raises(ConfigError, match="data.max_target_length: 2 cuts rte's target 'not_entailment'"):
        main([*common, "data.max_target_length=2"])
    with pytest.raises(ConfigError, match="train.max_new_tokens: 1 cannot generate rte's target 'not_entailment'"):
        main([*common, "methods.mtl.train.max_new_tokens=1"])
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command", ["hpsearch.train", "hpsearch.tune", "hpsearch.compare"])
def test_a_ray_address_where_nothing_answers_is_one_line(command, tmp_path):
    """After `ray stop` with RAY_ADDRESS still exported, ray.init retried the dead address every 30 s until Ctrl-C
    (then a traceback): the address is probed once before anything starts."""
    from hpsearch.train.launch import free_port

    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    args = {"hpsearch.train": [f"train.output_dir={tmp_path / 'out'}"],
            "hpsearch.tune": ["--storage-path", str(tmp_path / "runs"), "--tracking-uri",
                              f"sqlite:///{tmp_path}/mlflow.db"],
            "hpsearch.compare": ["--storage-path", str(tmp_path / "runs"), "--tracking-uri",
                                 f"sqlite:///{tmp_path}/mlflow.db"]}[command]
    out = subprocess.run([sys.executable, "-m", command, *args], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "RAY_ADDRESS": address, "PYTHONWARNINGS": "ignore"})
    err = out.stderr.strip()
    assert out.returncode == 2 and err.splitlines() == [err], err[-2000:]
    assert f"RAY_ADDRESS={address}: no Ray cluster answers there" in err
    assert not list(tmp_path.iterdir())  # nothing written
