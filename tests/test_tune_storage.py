"""Studies on S3: a real S3-protocol server (`moto` in server mode) on 127.0.0.1 holds a study's Tune state, its Ray
Train checkpoints and its exports; an interrupted study resumes from the bucket alone (a fresh local mirror)."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_tune_study import (
    SHORT,
    interrupt_after_first_trial,
    interrupt_when,
    run_keeping_worker_logs,
    second_trial_evaluated,
    steps,
    study_runs,
)

BUCKET = "hpsearch-studies"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 with one bucket; yields the environment that reaches it."""
    port = _free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    server = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p",
                               str(port)], stdout=log.open("w"), stderr=subprocess.STDOUT)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.time() < deadline and server.poll() is None, log.read_text()[-2000:]
            time.sleep(0.3)
    import boto3
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket=BUCKET)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.terminate()
        server.wait(timeout=30)


def bucket_files(prefix: str) -> set[str]:
    from pyarrow import fs
    filesystem, root = fs.FileSystem.from_uri(f"s3://{BUCKET}/{prefix}")
    infos = filesystem.get_file_info(fs.FileSelector(root, recursive=True, allow_not_found=True))
    return {i.path.removeprefix(f"{root}/") for i in infos if i.type == fs.FileType.File}


def test_storage_on_a_bucket_lists_copies_and_deletes(s3, tmp_path, monkeypatch):
    from hpsearch.errors import ConfigError
    from hpsearch.tune.storage import open_storage

    monkeypatch.setenv("HPSEARCH_STORAGE_CACHE", str(tmp_path / "mirror"))
    storage = open_storage(f"s3://{BUCKET}/unit")
    assert storage.remote and storage.root == f"{BUCKET}/unit" and storage.names() == []
    storage.check_writable()
    assert bucket_files("unit") == set()  # the probe object is gone again
    local = storage.study_dir("s1")
    assert local == tmp_path / "mirror" / "s3" / BUCKET / "unit" / "s1"
    (local / "trials" / "t1" / "model").mkdir(parents=True)
    (local / "trials" / "t1" / "model" / "w.bin").write_bytes(b"\0" * 10)
    (local / "state.json").write_text("{}")
    storage.push("s1", "state.json", "trials")
    assert bucket_files("unit") == {"s1/state.json", "s1/trials/t1/model/w.bin"}
    assert storage.names() == ["s1"] and storage.exists("s1") and not storage.exists("s2")
    other = open_storage(f"s3://{BUCKET}/unit")
    other.local_root = tmp_path / "elsewhere"
    (local / "trials" / "t1" / "config.yaml").write_text("model: {}\n")
    storage.push("s1", "trials")
    other.pull_each("s1", "trials", "config.yaml", "metrics.jsonl")  # only those files of each trial
    assert sorted(p.name for p in (tmp_path / "elsewhere" / "s1" / "trials" / "t1").iterdir()) == ["config.yaml"]
    other.pull("s1", "state.json", "trials", "missing.txt")
    assert (tmp_path / "elsewhere" / "s1" / "state.json").read_text() == "{}"
    assert (tmp_path / "elsewhere" / "s1" / "trials" / "t1" / "model" / "w.bin").stat().st_size == 10
    (local / "train" / "t1").mkdir(parents=True)
    from pyarrow import fs
    with storage.fs.open_output_stream(f"{BUCKET}/unit/s1/train/t1/checkpoint_000/shard.pt") as out:
        out.write(b"\0" * 7)
    with storage.fs.open_output_stream(f"{BUCKET}/unit/s1/train/t1/best/w.pt") as out:
        out.write(b"\0" * 5)
    for trial in ("trial_a", "trial_b"):  # a trial that trained in its own actor: Tune's pointer checkpoints
        with storage.fs.open_output_stream(f"{BUCKET}/unit/s1/{trial}/checkpoint_000001/report.json") as out:
            out.write(b"\0" * 3)
        with storage.fs.open_output_stream(f"{BUCKET}/unit/s1/{trial}/result.json") as out:
            out.write(b"{}")
    assert storage.delete("s1", "train/*/checkpoint_*") == 7
    assert bucket_files("unit/s1/train") == {"t1/best/w.pt"}
    assert storage.delete("s1", "trial_*/checkpoint_*") == 6  # every part of the pattern is a glob
    assert bucket_files("unit/s1") == {"state.json", "trials/t1/model/w.bin", "trials/t1/config.yaml",
                                       "train/t1/best/w.pt", "trial_a/result.json", "trial_b/result.json"}
    with storage.fs.open_output_stream(f"{BUCKET}/unit/s1/train/t1/.storage_marker") as out:
        out.write(b"\0" * 2)  # a file: a folder pattern leaves it, a file pattern takes it and no folder
    assert storage.delete("s1", "train/*/best") == 5 and storage.delete("s1", "nothing_*/x") == 0
    assert storage.delete("s1", "train/*/.storage_marker") == 0
    assert bucket_files("unit/s1/train") == {"t1/.storage_marker"}
    assert storage.delete("s1", "train/*/best", files=True) == 0
    assert storage.delete("s1", "train/*/.storage_marker", files=True) == 2
    assert bucket_files("unit/s1/train") == set()
    assert storage.ray_path("s1", "train") == (f"{BUCKET}/unit/s1/train", storage.fs)
    assert isinstance(storage.fs, fs.S3FileSystem)
    with pytest.raises(ConfigError, match="the bucket no-such-bucket does not exist"):
        open_storage("s3://no-such-bucket/studies").check_writable()
    with pytest.raises(ConfigError, match="expected a bucket"):
        open_storage("s3://")



def test_a_key_leading_out_of_the_folder_it_is_copied_to_is_refused(s3, tmp_path):
    """A bucket's keys may hold `..` or `//`, and pyarrow lists them as they are: copying a checkpoint or a study's
    files out of such a folder wrote `<target>/../../escaped.txt` (or `/abs.txt`) wherever the worker can write.
    It is refused in one line, before anything is written."""
    import boto3
    from pyarrow import fs

    from hpsearch.errors import UserError
    from hpsearch.remotefs import download_dir
    from hpsearch.train.checkpoints import download_for_rank

    client = boto3.client("s3", endpoint_url=s3["AWS_ENDPOINT_URL"], region_name="us-east-1")
    filesystem = fs.FileSystem.from_uri(f"s3://{BUCKET}/unit")[0]
    target = tmp_path / "a" / "b" / "copy"
    for name, key in (("dots", "../../escaped.txt"), ("slash", "/abs.txt")):
        folder = f"escape/{name}/ckpt"
        client.put_object(Bucket=BUCKET, Key=f"{folder}/report.json", Body=b"{}")
        client.put_object(Bucket=BUCKET, Key=f"{folder}/{key}", Body=b"owned")
        listed = [i.path for i in filesystem.get_file_info(fs.FileSelector(f"{BUCKET}/{folder}", recursive=True))]
        assert f"{BUCKET}/{folder}/{key}" in listed  # as it is: pyarrow does not clean it up
        with pytest.raises(UserError, match=f"refusing to copy '{BUCKET}/{folder}/{key}', whose name leads out"):
            download_dir(filesystem, f"{BUCKET}/{folder}", target)
        with pytest.raises(UserError, match="whose name leads out"):
            download_for_rank(filesystem, f"{BUCKET}/{folder}", 0)
        assert not target.exists() and not (tmp_path / "a" / "escaped.txt").exists()
    assert not Path("/abs.txt").exists()
    download_dir(filesystem, f"{BUCKET}/escape/dots/ckpt", target, keep=lambda name: name == "report.json")
    assert [p.name for p in target.iterdir()] == ["report.json"]  # a key left out is not looked at

def tune(tmp_path, *args, mirror: str, root: str):
    env = {**os.environ, "HPSEARCH_STORAGE_CACHE": str(tmp_path / mirror), "PYTHONWARNINGS": "ignore"}
    return [sys.executable, "-m", "hpsearch.tune", "--name", "s3study", "--storage-path", f"s3://{BUCKET}/{root}",
            "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", *args], env


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["groups", "1", "pool"])
def test_a_study_in_a_bucket_is_interrupted_and_resumes_from_the_bucket_alone(s3, tmp_path, workers):
    """A study in a bucket, interrupted (Ctrl-C), resumes on another machine from the bucket alone. `1`: one-worker
    trials training in their own actors; `pool`: two-worker trials on kept ranks; `groups`: two-worker trials saved
    while each launched Ray Train's worker group (as before kept ranks were the default; `worker_group=always`, then
    dropped from the saved overrides), interrupted during the second trial after its first evaluation: Tune gives
    the restored trial the study's placement now, and it continues on kept ranks from the checkpoint its worker
    group wrote to the bucket (every rank's files, Ray Train's layout), each rank fetching what it loads; no
    evaluation is logged twice."""
    from pyarrow import fs

    root = f"studies-{workers}"  # one bucket for the module: each case's study in a folder of its own
    # a trial in its own actor or on kept ranks is quick: 200 steps, so that the Ctrl-C comes while the second trains
    # `groups`: evaluations every 50 steps and no ASHA stop, so the resumed trial's evaluations are known
    evals, grace = ("50", "200") if workers == "groups" else ("100", "100")
    budget = ["budget.max_steps=200", f"budget.eval_every={evals}", f"budget.grace_period={grace}", *SHORT[3:]]
    resources = {"groups": ["resources.workers=2", "resources.worker_group=always", "resources.max_concurrent=1"],
                 "1": ["resources.workers=1"], "pool": ["resources.workers=2"]}[workers]  # several: kept ranks
    samples = "2" if workers == "groups" else "3"
    cmd, env = tune(tmp_path, "--num-samples", samples, *budget, *resources, mirror="mirror-a", root=root)
    if workers == "groups":
        err = interrupt_when(cmd, tmp_path, lambda: second_trial_evaluated(tmp_path, "s3study"), env)
    else:
        err = interrupt_after_first_trial(cmd, tmp_path, "s3study", env)
    assert f"--storage-path s3://{BUCKET}/{root} --resume" in err
    stored = bucket_files(f"{root}/s3study")
    assert {"hpsearch-study.json", "space.yaml"} <= stored
    assert any(f.startswith("experiment_state") for f in stored)          # Tune's state is in the bucket
    assert any(f.startswith("train/") and "/checkpoint_" in f for f in stored)  # and the trials' checkpoints
    if workers != "groups":  # and Tune's pointer checkpoints of the trials that trained in their own actor or ranks
        assert any(re.match(r"trial_[^/]+/checkpoint_", f) for f in stored), sorted(stored)
    # each checkpoint in the bucket lists both ranks' files (each rank's manifest), on kept ranks as in Ray Train's
    folders = {m.group(1) for f in stored if (m := re.match(r"(train/[^/]+/checkpoint_[^/]+)/", f))}
    ranks = ["manifest_rank_0.json"] + (["manifest_rank_1.json"] if workers != "1" else [])
    assert folders and all({f"{d}/{m}" for m in ranks} <= stored for d in folders), sorted(stored)
    if workers == "groups":  # the study from now on as if saved without `always`: kept ranks, the default
        state_fs, state_path = fs.FileSystem.from_uri(f"s3://{BUCKET}/{root}/s3study/hpsearch-study.json")
        with state_fs.open_input_stream(state_path) as f:
            state = json.loads(f.read())
        state["overrides"] = [o for o in state["overrides"] if o != "resources.worker_group=always"]
        with state_fs.open_output_stream(state_path) as f:
            f.write(json.dumps(state).encode())
    client, _, before = study_runs(tmp_path, "s3study")
    done_before = {c.data.tags["hpsearch.trial_id"]: c.info.end_time for c in before if c.info.status == "FINISHED"}
    evaluated = {c.info.run_id: steps(client, c.info.run_id) for c in before if c.info.status != "FINISHED"}

    # another machine: nothing local but the MLflow store; the study comes back from the bucket
    cmd, env = tune(tmp_path, "--resume", mirror="mirror-b", root=root)
    out, worker_logs = run_keeping_worker_logs(cmd, tmp_path, env)
    assert out.returncode == 0, out.stderr[-3000:]
    logs = "".join(worker_logs.values())
    client, parents, children = study_runs(tmp_path, "s3study")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(children) == int(samples) and all(c.info.status == "FINISHED" for c in children)
    if workers == "groups":
        assert "Train controller and worker group" not in logs  # no worker group after the resume
        assert logs.count("started 2 ranks for this actor's trials") == 1  # the restored trial on kept ranks
        resumed = [int(n) for n in re.findall(r"resumed from \S+ at step (\d+)", logs)]
        ((run_id, reported),) = evaluated.items()
        # once, from the worker group's newest checkpoint (at or after the last evaluation MLflow had at the Ctrl-C)
        assert len(resumed) == 1 and resumed[0] >= reported[-1] and resumed[0] % 50 == 0, (resumed, reported)
        assert steps(client, run_id) == [50, 100, 150, 200]  # every evaluation, once
    stored = bucket_files(f"{root}/s3study")
    complete = [c.data.tags["hpsearch.trial_id"] for c in children
                if c.data.tags.get("hpsearch.outcome") == "complete"]
    assert complete and done_before
    for child in children:  # a trial that finished before the interruption was not run again
        if child.data.tags["hpsearch.trial_id"] in done_before:
            assert child.info.end_time == done_before[child.data.tags["hpsearch.trial_id"]]
    for trial in complete:  # every finished trial's exports are in the bucket
        assert {f"trials/{trial}/model/model.safetensors", f"trials/{trial}/task_params/task_params.safetensors",
                f"trials/{trial}/config.yaml", f"trials/{trial}/metrics.jsonl"} <= stored, sorted(stored)
    assert any(f.startswith("report/") for f in stored)
    kept = sorted(f for f in stored if re.search(r"(^|/)checkpoint_[^/]*/", f))
    assert not kept, kept  # the checkpoints' folders (Tune's pointers too) are pruned at the end: only a resume
    # needed them
    if workers != "groups":  # no Ray Train run wrote its state under train/<trial id>/; the best weights went too
        assert not [f for f in stored if f.startswith("train/")], sorted(stored)
    # an export read back from the bucket loads
    from hpsearch.model import build_model
    from hpsearch.remotefs import download_dir
    filesystem, path = fs.FileSystem.from_uri(f"s3://{BUCKET}/{root}/s3study/trials/{complete[0]}/model")
    download_dir(filesystem, path, tmp_path / "model")
    assert build_model(str(tmp_path / "model")).extra_parameters()["total"] > 0


def test_a_missing_bucket_is_one_line_before_anything_starts(s3, tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "hpsearch.tune", "--storage-path", "s3://no-such-bucket/studies",
                           "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=env)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and err.splitlines() == [err] and "Traceback" not in err, err
    assert "--storage-path s3://no-such-bucket/studies: cannot write there (the bucket no-such-bucket does not " \
           "exist)" in err
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "optuna.db").exists()


def test_a_trials_exports_in_the_bucket_reach_its_mlflow_run_from_another_machine(s3, tmp_path, monkeypatch):
    """With a bucket, a trial's rank 0 on another node writes its exports to that node's mirror and the bucket;
    the driver logged `task_params/` from its own mirror, where they are not, and skipped them without a word. It
    now fetches them from the bucket first."""
    from types import SimpleNamespace

    from mlflow import MlflowClient

    from hpsearch.config import load_config
    from hpsearch.tracking import StudyRun
    from hpsearch.tune.storage import open_storage
    from hpsearch.tune.trialruns import TrialRuns

    monkeypatch.setenv("HPSEARCH_STORAGE_CACHE", str(tmp_path / "node"))
    node = open_storage(f"s3://{BUCKET}/exports")  # the GPU node's mirror: the exports written there, then pushed
    (node.study_dir("s") / "trials" / "t1" / "task_params").mkdir(parents=True)
    (node.study_dir("s") / "trials" / "t1" / "task_params" / "task_params.safetensors").write_bytes(b"w" * 12)
    node.push("s", "trials")
    monkeypatch.setenv("HPSEARCH_STORAGE_CACHE", str(tmp_path / "head"))
    head = open_storage(f"s3://{BUCKET}/exports")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    parent = StudyRun.create(uri, "s", space_path="space.yaml", space_text="x\n", command="c", params={})

    def trial_config(config, trial_id):
        cfg = load_config(None, [])
        cfg.train.output_dir = str(head.study_dir("s") / "trials" / trial_id)
        return cfg

    runs = TrialRuns(uri, parent.experiment_id, parent.run_id, "s", trial_config, lambda last, failed: "complete",
                     storage=head)
    trial = SimpleNamespace(trial_id="t1", config={}, last_result={"step": 1}, error_file=None, evaluated_params={})
    runs.log_trial_start(trial)
    runs.log_trial_end(trial)
    client = MlflowClient(uri)
    (child,) = [r for r in client.search_runs([parent.experiment_id]) if r.info.run_id != parent.run_id]
    assert [a.path for a in client.list_artifacts(child.info.run_id, "task_params")] == \
        ["task_params/task_params.safetensors"]


def test_two_starts_in_a_bucket_never_take_one_name(s3, tmp_path, monkeypatch):
    """Nothing in a bucket marked a study's name taken until the study saved its state, after Ray (and on a
    cluster, its nodes) had started: two starts took one name and pruned each other's checkpoints. A start now
    claims the name with an object of its own and loses when anything else is under the name; the second of two
    starts takes the next name (with --name, one line), and a start that never ran gives its name back."""
    from pyarrow import fs

    from hpsearch.tune.cli import parse_args, prepare
    from hpsearch.tune.storage import CLAIMS, open_storage

    monkeypatch.setenv("HPSEARCH_STORAGE_CACHE", str(tmp_path / "a"))
    first, other = open_storage(f"s3://{BUCKET}/claims"), open_storage(f"s3://{BUCKET}/claims")
    assert first.claim("s") and not other.claim("s")  # another machine's start: the name is taken
    assert [f.split("/")[0:2] for f in bucket_files("claims")] == [["s", CLAIMS]]  # the loser's claim withdrawn
    with first.fs.open_output_stream(first.remote_path("t", CLAIMS, "0-theirs")) as out:
        out.write(b"")  # a start under way that has not seen this one yet: this one loses
    assert not first.claim("t") and bucket_files("claims/t") == {f"{CLAIMS}/0-theirs"}
    assert first.claim("u") and "u" in first.names()
    first.release("u")  # a start that never ran: the name is free again
    assert "u" not in first.names() and first.fs.get_file_info(first.remote_path("u")).type == fs.FileType.NotFound
    args = ["--storage-path", f"s3://{BUCKET}/claims", "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"]
    one, two = prepare(parse_args(args))[0], prepare(parse_args(args))[0]
    assert (one.name, two.name) == ("default", "default-2")
    prepare(parse_args([*args, "--name", "mine"]))
    with pytest.raises(Exception, match=r"--name mine: hpsearch-studies/claims/mine holds a study that saved no "
                                        r"state yet \(a start of it under way"):
        prepare(parse_args([*args, "--name", "mine"]))
