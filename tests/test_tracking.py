"""The MLflow store: two studies starting together on a new sqlite file both get their parent run."""
from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

CREATE = """
import sys
from hpsearch.tracking import StudyRun
run = StudyRun.create(sys.argv[1], sys.argv[2], space_path="space.yaml", space_text="name: x\\n", command="c",
                      params={"trials": 1})
run.finish()
"""


def test_two_studies_on_a_new_sqlite_file(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    procs = [subprocess.Popen([sys.executable, "-c", CREATE, uri, name], stderr=subprocess.PIPE, text=True)
             for name in ("one", "two")]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-1500:] for e in errors]
    client = MlflowClient(uri)
    for name in ("one", "two"):
        experiment = client.get_experiment_by_name(f"hpsearch/{name}")  # beside MLflow's own Default
        assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI opens on runs
        (run,) = client.search_runs([experiment.experiment_id])
        assert run.info.status == "FINISHED"


def test_a_study_saved_when_the_callback_lived_in_tracking_still_resumes():
    """Tune pickles the study's callbacks into its state (tuner.pkl); a study saved before the callback moved to
    hpsearch.tune.trialruns names it `hpsearch.tracking.TrialRuns`, and `--resume` unpickles that name."""
    import pickle

    from hpsearch.tune.trialruns import TrialRuns

    callback = TrialRuns("sqlite:///x.db", "1", "parent", "study", trial_config=dict, outcome=max)
    new = pickle.dumps(callback, protocol=0)
    assert b"hpsearch.tune.trialruns\nTrialRuns\n" in new
    old = new.replace(b"hpsearch.tune.trialruns\nTrialRuns\n", b"hpsearch.tracking\nTrialRuns\n")
    restored = pickle.loads(old)
    assert type(restored) is TrialRuns
    assert (restored.tracking_uri, restored.parent_run_id, restored.study) == ("sqlite:///x.db", "parent", "study")
    import hpsearch.tracking
    with pytest.raises(AttributeError):
        hpsearch.tracking.NoSuchName  # noqa: B018


UNREACHABLE = """
import http.server, json, socket, sys, threading, time
from mlflow import MlflowClient
from hpsearch.tracking import unreachable

def error(uri):
    try:
        MlflowClient(tracking_uri=uri).get_run("0" * 32)
    except Exception as e:
        return e
    raise AssertionError("no error")

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

class Down(http.server.BaseHTTPRequestHandler):  # a proxy in front of a server that is down
    def do_GET(self):
        self.send_response(503); self.end_headers(); self.wfile.write(b"down")
    def log_message(self, *a):
        pass

class NoRun(Down):  # a server that answers: the run is not there (MLflow's own error, not an outage)
    def do_GET(self):
        body = json.dumps({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "Run not found"}).encode()
        self.send_response(404); self.send_header("Content-Type", "application/json"); self.end_headers()
        self.wfile.write(body)

servers = {}
for name, handler in (("down", Down), ("no_run", NoRun)):
    servers[name] = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=servers[name].serve_forever, daemon=True).start()
silent = socket.socket(); silent.bind(("127.0.0.1", 0)); silent.listen(50)  # accepts, never answers
threading.Thread(target=lambda: [silent.accept() for _ in range(20)], daemon=True).start()
full = socket.socket(); full.bind(("127.0.0.1", 0)); full.listen(0)  # accept queue full: connecting times out
fillers = []
for _ in range(4):
    c = socket.socket(); c.setblocking(False)
    try:
        c.connect(full.getsockname())
    except BlockingIOError:
        pass
    fillers.append(c)
time.sleep(0.3)
uris = {"refused": f"http://127.0.0.1:{free_port()}", "read timeout": f"http://127.0.0.1:{silent.getsockname()[1]}",
        "connect timeout": f"http://127.0.0.1:{full.getsockname()[1]}",
        "503": f"http://127.0.0.1:{servers['down'].server_address[1]}",
        "no such run": f"http://127.0.0.1:{servers['no_run'].server_address[1]}"}
print(json.dumps({case: [uri, unreachable(error(uri)), str(error(uri))[:300]] for case, uri in uris.items()}))
"""


def test_an_mlflow_server_that_stopped_answering_is_told_from_mlflows_own_errors():
    """Real MLflow client errors, retries cut short: refused, a read or connect timeout and a 503 are an outage
    (the study stops with one line naming the server); an answer of the server (no such run) is not."""
    import json
    import os
    env = {**os.environ, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",
           "MLFLOW_HTTP_REQUEST_TIMEOUT": "1"}
    proc = subprocess.run([sys.executable, "-c", UNREACHABLE], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    for case in ("refused", "read timeout", "connect timeout", "503"):
        uri, server, text = seen[case]
        assert server == uri, (case, text)
    assert seen["no such run"][1] is None, seen["no such run"][2]


def test_passwords_in_urls_are_never_logged_to_mlflow_nor_printed(tmp_path):
    """A study's command line, parameters and report named its URLs whole: a PostgreSQL Optuna storage's password
    and a bucket's secret key (`s3://KEY:SECRET@bucket`) reached MLflow (tag, params, command.txt, the report's
    dashboard command). Every URL's password and secret query values are now `***` there and on the console."""
    from mlflow import MlflowClient

    from hpsearch.cli import redacted
    from hpsearch.tracking import StudyRun, ui_command
    from hpsearch.tune.optuna_store import dashboard_command

    db, bucket = "postgresql://hpsearch:S3cretPassw0rd@db.internal:5432/optuna", "s3://AKIAX:wJalrXUtnFEMI@b/studies"
    command = f"python -m hpsearch.tune --storage-path {bucket} --optuna-storage {db}"
    assert redacted(command) == ("python -m hpsearch.tune --storage-path s3://AKIAX:***@b/studies --optuna-storage "
                                 "postgresql://hpsearch:***@db.internal:5432/optuna")
    assert redacted("s3://b/p?region=x&secret_key=abc&session_token=t") == \
        "s3://b/p?region=x&secret_key=***&session_token=***"
    harmless = "sqlite:////tmp/m.db http://127.0.0.1:5000 http://host:8080/path@x http://[::1]:5000/x@y eos_token=1"
    assert redacted(harmless) == harmless  # nothing secret (a port and a path are no password): unchanged
    # a password holding '/' (AWS secret keys do; SQLAlchemy reads it whole), a token as the user part, SAS keys
    assert redacted("postgresql://u:pa/ss@h/db s3://AKIA:wJal/K7MD@b/p https://ghp_TOK@github.com/x") == \
        "postgresql://u:***@h/db s3://AKIA:***@b/p https://***@github.com/x"
    assert redacted("az://c/p?sas_token=abc&sig=zz --token=t") == "az://c/p?sas_token=***&sig=*** --token=***"
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    study = StudyRun.create(uri, "s", space_path="space.yaml", space_text="name: s\n", command=command,
                            params={"optuna_storage": db, "trials": 2})
    study.log_report({}, {}, {"summary.txt": f"open the dashboard: optuna-dashboard {db}\n"}, tmp_path / "none")
    client = MlflowClient(uri)
    run = client.get_run(study.run_id)
    logged = [run.data.tags["hpsearch.command"], *run.data.params.values()]
    for artifact in ("command.txt", "report/summary.txt"):
        logged.append(Path(client.download_artifacts(study.run_id, artifact, str(tmp_path))).read_text())
    assert len(logged) == 5 and all("***" in text for text in logged[:2] + logged[3:]), logged
    assert not any(secret in text for text in logged for secret in ("S3cretPassw0rd", "wJalrXUtnFEMI")), logged
    shown = dashboard_command(db) + ui_command("http://u:pw@mlflow.internal:5000")
    assert "S3cretPassw0rd" not in shown and "pw@" not in shown and "hpsearch:***@" in shown
    # an error line names the URL it could not open: printed redacted too
    import subprocess
    import sys
    code = ("from hpsearch.cli import run_main\nfrom hpsearch.errors import ConfigError\n"
            f"def main(argv):\n    raise ConfigError('--optuna-storage {db}: cannot be opened')\nrun_main(main, [])\n")
    error = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert error.returncode == 2 and error.stderr.strip() == ("error: --optuna-storage postgresql://hpsearch:***@"
                                                              "db.internal:5432/optuna: cannot be opened")


def test_a_node_that_cannot_reach_the_store_records_no_system_metrics_and_says_so(tmp_path, capsys):
    """On a cluster, a trial's ranks on other nodes sampled system metrics into the study's MLflow store; the
    clusters' `http://127.0.0.1:5000` is the head's alone, and MLflow's sampler failed silently there, holding the
    trial's end for minutes as it retried. Such a node now says so in one line and samples nothing; a store it
    reaches gets the samples."""
    import time

    from hpsearch.tracking import StudyRun, system_metrics_monitor

    started = time.monotonic()
    assert system_metrics_monitor("http://127.0.0.1:9", "run", 1.0, node_id="node_1") is None
    assert system_metrics_monitor(f"sqlite:///{tmp_path}/elsewhere.db", "run", 1.0) is None
    assert time.monotonic() - started < 30
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 2 and all("are not recorded: the MLflow store cannot be reached" in line for line in said)
    assert "system metrics of node_1" in said[0] and "no such file on this node" in said[1]
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run = StudyRun.create(uri, "s", space_path="space.yaml", space_text="x\n", command="c", params={})
    monitor = system_metrics_monitor(uri, run.run_id, 0.5)
    time.sleep(1.5)
    monitor.finish()
    assert any(k.startswith("system/") for k in MlflowClient(uri).get_run(run.run_id).data.metrics)


def test_a_trial_callback_pickled_before_it_had_a_storage_still_ends_trials(tmp_path):
    """Tune restores a study's callbacks from its pickle: one saved before `TrialRuns.storage` existed had no such
    attribute, and every completed trial of its `--resume` raised AttributeError in the callback (the study ended
    FAILED, and so did every later resume)."""
    import pickle
    from types import SimpleNamespace

    from hpsearch.tracking import StudyRun
    from hpsearch.tune.trialruns import TrialRuns

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    parent = StudyRun.create(uri, "s", space_path="space.yaml", space_text="x\n", command="c", params={})
    runs = TrialRuns(uri, parent.experiment_id, parent.run_id, "s", functools.partial(_trial_config, tmp_path),
                     _complete)
    del runs.__dict__["storage"]  # the state an older pickle holds
    restored = pickle.loads(pickle.dumps(runs))
    trial = SimpleNamespace(trial_id="t1", config={}, last_result={"step": 1}, error_file=None, evaluated_params={})
    restored.log_trial_start(trial)
    restored.log_trial_end(trial)
    (child,) = [r for r in MlflowClient(uri).search_runs([parent.experiment_id]) if r.info.run_id != parent.run_id]
    assert child.info.status == "FINISHED"


def _trial_config(root, config, trial_id):
    from hpsearch.config import load_config
    cfg = load_config(None, [])
    cfg.train.output_dir = str(root / "trials" / trial_id)
    return cfg


def _complete(last_result, failed):
    return "complete"


def test_a_sqlite_stores_artifacts_are_kept_beside_it_not_where_the_command_ran(tmp_path, monkeypatch):
    """MLflow's default artifact root is `./mlruns` in whatever folder a command runs in: a study's report, configs
    and task parameters went there (the test suite's into the repository), away from the database they belong to."""
    from hpsearch.tracking import SingleRun, StudyRun

    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    study = StudyRun.create(uri, "s", space_path="space.yaml", space_text="x\n", command="c", params={})
    study.finish()
    single = SingleRun(uri, "pretrain", "run", params={}, command="python -m hpsearch.pretrain")
    single.log_artifact(write_file(tmp_path / "notes.txt"))
    client = MlflowClient(uri)
    for name, run_id, artifact in (("hpsearch/s", study.run_id, "command.txt"),
                                   ("hpsearch/pretrain", single.run_id, "notes.txt")):
        experiment = client.get_experiment_by_name(name)
        folder = tmp_path / "store" / "mlruns" / name.replace("/", "-")
        assert experiment.artifact_location in (str(folder), folder.as_uri()), experiment.artifact_location
        assert (folder / run_id / "artifacts" / artifact).is_file()
    assert not list(cwd.iterdir())


def write_file(path: Path) -> Path:
    path.write_text("hello\n")
    return path
