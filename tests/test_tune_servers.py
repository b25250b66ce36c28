"""A study against real servers on 127.0.0.1: an `mlflow server` (sqlite backend, artifacts served by the server)
receives the parent, the children, their metrics, system metrics and artifacts."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

pytestmark = pytest.mark.slow

SHORT = ["budget.max_steps=20", "budget.eval_every=10", "budget.grace_period=10", "train.log_every=10",
         "data.synthetic_train_rows=200", "data.synthetic_eval_rows=40"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return True
        except OSError:
            time.sleep(1)
    return False


@contextlib.contextmanager
def running_mlflow_server(tmp_path):
    """(its URI, its process, the leader of a session of its own: os.killpg stops the server and its workers)."""
    port = free_port()
    mlflow = Path(sys.executable).parent / "mlflow"
    log = open(tmp_path / "mlflow-server.log", "w")
    proc = subprocess.Popen([str(mlflow), "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{tmp_path}/server.db",
                             "--artifacts-destination", str(tmp_path / "server-artifacts"), "--workers", "1"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
    try:
        assert wait_http(f"http://127.0.0.1:{port}/health", proc, 240), (tmp_path / "mlflow-server.log").read_text()
        yield f"http://127.0.0.1:{port}", proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()


@pytest.fixture
def mlflow_server(tmp_path):
    with running_mlflow_server(tmp_path) as (uri, _):
        yield uri


def test_study_tracks_to_an_mlflow_server_with_system_metrics(tmp_path, mlflow_server):
    out = subprocess.run([sys.executable, "-m", "hpsearch.tune", "--name", "srv", "--storage-path",
                          str(tmp_path / "runs"), "--tracking-uri", mlflow_server, "--num-samples", "2",
                          "--system-metrics", "1", *SHORT, "resources.workers=1"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"mlflow ui --backend-store-uri {mlflow_server}" not in out.stdout  # a server needs no `mlflow ui`
    # its Optuna record beside the studies, not in the working directory (a `ray job`'s is a throwaway copy)
    state = json.loads((tmp_path / "runs" / "srv" / "hpsearch-study.json").read_text())
    assert state["optuna_storage"] == f"sqlite:///{tmp_path}/runs/optuna.db" and not (tmp_path / "optuna.db").exists()
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("hpsearch/srv")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("hpsearch.role") == "study"]
    children = [r for r in runs if r.data.tags.get("hpsearch.role") == "trial"]
    assert len(parents) == 1 and len(children) == 2
    parent = parents[0]
    assert parent.info.status == "FINISHED" and "best_score" in parent.data.metrics
    assert {"report/summary.txt", "report/trials.csv"} <= {a.path for a in client.list_artifacts(parent.info.run_id,
                                                                                                 "report")}
    # the artifacts went through the server into its artifact store, not into a local folder
    assert list((tmp_path / "server-artifacts").rglob("summary.txt"))
    for child in children:
        assert child.info.status == "FINISHED" and child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert [m.step for m in client.get_metric_history(child.info.run_id, "score")][0] == 10
        system = {k for k in child.data.metrics if k.startswith("system/")}
        assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= system, system
        assert client.get_metric_history(child.info.run_id, "system/cpu_utilization_percentage")
        assert "config.yaml" in {a.path for a in client.list_artifacts(child.info.run_id)}


def test_an_mlflow_outage_stops_the_study_in_one_line_naming_the_resume_command(tmp_path):
    """The server dies while a trial trains: once MLflow's retries are spent (cut short here), the study stops with
    one line naming the server and the `--resume` command; it did not wait out the retries again to end runs it
    cannot reach (about 4 min with MLflow's defaults), nor print Tune's wrapped tracebacks (390 lines)."""
    with running_mlflow_server(tmp_path) as (uri, server):
        env = {**os.environ, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
        study = subprocess.Popen([sys.executable, "-m", "hpsearch.tune", "--name", "outage", "--storage-path",
                                  str(tmp_path / "runs"), "--tracking-uri", uri, "--num-samples", "2",
                                  "budget.max_steps=600", "budget.eval_every=100", "budget.grace_period=600",
                                  "train.log_every=100", *SHORT[4:], "resources.workers=1",
                                  "resources.max_concurrent=1"], cwd=tmp_path, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env)
        try:
            client, deadline = MlflowClient(uri), time.time() + 600
            while time.time() < deadline and study.poll() is None:  # a trial's first evaluation reached MLflow
                with contextlib.suppress(Exception):
                    runs = client.search_runs([client.get_experiment_by_name("hpsearch/outage").experiment_id])
                    if any("score" in r.data.metrics for r in runs):
                        break
                time.sleep(0.5)
            assert study.poll() is None, study.stderr.read()[-3000:]
            os.killpg(server.pid, signal.SIGKILL)
            out, err = study.communicate(timeout=600)
        finally:
            if study.poll() is None:
                study.kill()
    assert study.returncode == 2, err[-3000:]
    assert f"error: the MLflow server {uri} stopped answering (MLflow's retries spent): the study stopped, its " \
        "MLflow runs left RUNNING; once the server answers, continue with: python -m hpsearch.tune --name outage " \
        f"--storage-path {tmp_path / 'runs'} --resume" in err.splitlines(), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
