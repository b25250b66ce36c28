"""MLflow tracking of a study: one parent run per study, one child run per trial (tag `mlflow.parentRunId`).

The parent holds the space file, the command line, the git commit and, at the end, the best result and the
report (trial table, Pareto front, importances, plots). A child holds every run-config field as a flat param
(the UI's parallel-coordinates view compares them), every numeric metric at every evaluation step (per task
too), the trial's `config.yaml` and, for a trial that finished, its `task_params/` export.

Runs are found again by tags (study, trial id), so a retried or resumed trial logs into the run it already has:
no duplicates. All logging happens in the Tune driver (`hpsearch.tune.trialruns.TrialRuns`, a Tune callback), the
only process that writes. This module imports no Ray: the commands check a tracking URI before Ray starts.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hpsearch.cli import redacted, unwritable
from hpsearch.errors import ConfigError, UserError

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
STUDY_TAG, TRIAL_TAG, ROLE_TAG, OUTCOME_TAG = "hpsearch.study", "hpsearch.trial_id", "hpsearch.role", "hpsearch.outcome"
PARENT_TAG = "mlflow.parentRunId"
# Tune's bookkeeping in every result: not metrics of the model
TUNE_KEYS = {"timestamp", "pid", "training_iteration", "time_this_iter_s", "time_since_restore",
             "iterations_since_restore", "done", "time_total_s"}
NOT_METRICS = {"step", "final", "best_step"}  # MLflow's own step axis, a flag, a step: not values to chart
EXPERIMENT_PREFIX = "hpsearch/"  # beside MLflow's own `Default`: studies are hpsearch/<name>
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}  # the UI opens on runs, not GenAI traces


def __getattr__(name: str):
    """`hpsearch.tracking.TrialRuns`, where the study's Tune callback lived until 2026-11-25: a study saved before
    then names it there in Tune's pickled state (tuner.pkl), and `--resume` unpickles that. Imported when asked for,
    so importing this module imports no Ray."""
    if name == "TrialRuns":
        from hpsearch.tune.trialruns import TrialRuns
        return TrialRuns
    raise AttributeError(f"module 'hpsearch.tracking' has no attribute {name!r}")


def experiment_name(study: str) -> str:
    return f"{EXPERIMENT_PREFIX}{study}"


def resolve_tracking_uri(uri: str) -> str:
    """An absolute sqlite URI (trials and the UI then find the same file from any directory); http(s) as is.
    A folder that cannot hold the database, or a server that does not answer, is a one-line ConfigError."""
    if uri.startswith("sqlite:///"):
        path = uri.removeprefix("sqlite:///")
        if not path.startswith("/"):  # sqlite:///relative.db; sqlite:////absolute.db
            path = str(Path(path).resolve())
        if Path(path).is_dir() or not Path(path).name:
            raise ConfigError(f"--tracking-uri {uri}: {path} is a folder; expected the path of a database file, "
                              "e.g. sqlite:///mlflow.db")
        if Path(path).is_file() and Path(path).stat().st_size and not _is_sqlite(Path(path)):
            raise ConfigError(f"--tracking-uri {uri}: {path} is not an SQLite database; expected a new file or "
                              "an MLflow store")
        folder = Path(path).parent
        why = unwritable(folder)  # creates nothing: the folder is made as the store is (store_folder)
        if why:
            raise ConfigError(f"--tracking-uri {uri}: cannot create {folder} ({why})")
        if Path(path).exists() and not os.access(path, os.W_OK):
            raise ConfigError(f"--tracking-uri {uri}: {path} is not writable")
        return f"sqlite:///{path}"
    if uri.startswith(("http://", "https://")):
        check_server(uri)
        return uri
    if uri.startswith("databricks"):
        return uri
    raise ConfigError(f"--tracking-uri: {uri!r}; expected sqlite:///path/to/mlflow.db or http(s)://host:port "
                      "(MLflow's file store is not supported)")


def _is_sqlite(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(16) == b"SQLite format 3\x00"


def check_experiment_active(uri: str, study: str) -> None:
    """A study's experiment deleted in the MLflow UI (moved to its trash) takes no runs: one line before anything
    starts, naming how to restore it, instead of MLflow's error after Ray has started."""
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        return  # a new store: nothing in it yet
    from mlflow.tracking import MlflowClient

    found = MlflowClient(uri).get_experiment_by_name(experiment_name(study))
    if found is not None and found.lifecycle_stage == "deleted":
        raise ConfigError(f"MLflow experiment {experiment_name(study)} is deleted in {uri}: restore it "
                          f"(MLFLOW_TRACKING_URI={uri} mlflow experiments restore --experiment-id "
                          f"{found.experiment_id}) or choose another --name")


def check_server(uri: str, timeout: float = 5.0) -> None:
    """One request to the MLflow server's health endpoint; no answer is a one-line ConfigError (no retries)."""
    import http.client
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout) as response:
            response.read(64)
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):  # a server that wants credentials (MLFLOW_TRACKING_TOKEN etc.): it is there
            return
        raise ConfigError(f"--tracking-uri {uri}: not an MLflow server (HTTP {e.code} from /health)") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ConfigError(f"--tracking-uri {uri}: no MLflow server answers ({reason}); start one (mlflow server "
                          "--host 127.0.0.1 --port PORT) or use sqlite:///path/mlflow.db") from None
    except (ValueError, http.client.InvalidURL) as e:  # a port that is no number, urllib's "Invalid IPv6 URL"
        raise ConfigError(f"--tracking-uri {uri}: not a valid URL ({e}); expected http(s)://host:port") from None


def open_store(uri: str) -> None:
    """Create (and migrate) a sqlite store once, under a file lock: two studies starting together on a new file
    would otherwise both run MLflow's schema migration and one would fail. Imports MLflow for any store."""
    import mlflow  # noqa: F401
    if not uri.startswith("sqlite:///"):
        return
    import fcntl
    import logging

    store_folder(uri)

    for name in ("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables..." etc.
        logging.getLogger(name).setLevel(logging.WARNING)
    path = Path(uri.removeprefix("sqlite:///"))
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            _client(uri).search_experiments(max_results=1)  # builds the tables or checks their version
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def experiment_id(client, uri: str, name: str) -> str:
    """The id of the experiment `name`, created when new. A sqlite store's experiment keeps its artifacts beside the
    database (`<its folder>/mlruns/<name>`): MLflow's default is `./mlruns` in whatever folder the command ran in."""
    found = client.get_experiment_by_name(name)
    if found:
        return found.experiment_id
    location = None
    if uri.startswith("sqlite:///"):
        location = str(Path(uri.removeprefix("sqlite:///")).parent / "mlruns" / name.replace("/", "-"))
    return client.create_experiment(name, artifact_location=location, tags=EXPERIMENT_TAGS)


def store_folder(uri: str) -> Path | None:
    """Create the folder of a sqlite store (and of the Optuna database beside it) once every check that writes
    nothing has passed (`resolve_tracking_uri` only checks that it could be created). Returns the outermost folder
    it created, or None."""
    if not uri.startswith("sqlite:///"):
        return None
    folder = Path(uri.removeprefix("sqlite:///")).parent
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    return missing[-1] if missing else None


def ui_command(tracking_uri: str) -> str:
    if tracking_uri.startswith("sqlite:"):  # this interpreter's mlflow: works without the venv on PATH
        mlflow = f"{shlex.quote(sys.executable)} -m mlflow"
        return f"{mlflow} ui --backend-store-uri {tracking_uri} --host 127.0.0.1 --port 5000"
    return f"open {redacted(tracking_uri)} in a browser"


def git_commit(cwd: str | Path = ".") -> str:
    """The commit of the working tree (`+dirty` when it has changes); in a Ray job, whose copy of the working
    directory has no `.git`, the `HPSEARCH_GIT_COMMIT` the job was submitted with; else `unknown`."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode == 0:
            dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
            return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("HPSEARCH_GIT_COMMIT") or "unknown"


_UNREACHABLE = re.compile(r"API request to (\w+://[^/\s]+)\S* failed with (?:timeout )?exception .*?"
                          r"(Max retries exceeded|Connection refused|timed out|Connection aborted|ConnectTimeout)")


def unreachable(e: BaseException) -> str | None:
    """The MLflow server an error says stopped answering (MLflow's own retries spent), or None. Also from the text
    of Tune's `TuneError`, which carries a callback's error as its traceback's text."""
    match = _UNREACHABLE.search(str(e))
    return match.group(1) if match else None


def outage(e: BaseException, what: str, then: str) -> UserError | None:
    """The one line for `e` when it says the MLflow server stopped answering (None otherwise): `what` (the study,
    the comparison) stopped, its runs left RUNNING (ending them would wait out MLflow's retries again, and fail),
    and `then`, what to do once the server answers."""
    server = unreachable(e)
    if server is None:
        return None
    return UserError(f"the MLflow server {server} stopped answering (MLflow's retries spent): the {what} stopped, its "
                     f"MLflow runs left RUNNING; {then}")


def _client(uri: str):
    from mlflow import MlflowClient
    return MlflowClient(tracking_uri=uri)


def _metrics(values: dict[str, Any], step: int):
    from mlflow.entities import Metric
    now = int(time.time() * 1000)
    return [Metric(k, float(v), now, step) for k, v in values.items()
            if k not in TUNE_KEYS and k not in NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool)]


def _trial_runs(client, experiment_id: str, parent_run_id: str, trial_id: str) -> list:
    """The child runs of `parent_run_id` tagged with this trial id (one, once the trial has started)."""
    return client.search_runs([experiment_id], f"tags.`{PARENT_TAG}` = '{parent_run_id}' and "
                                               f"tags.`{TRIAL_TAG}` = '{trial_id}'")


def _log_batches(client, run_id: str, metrics=(), params=()) -> None:
    metrics, params = list(metrics), list(params)
    for i in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[i:i + 1000])
    for i in range(0, len(params), 100):
        client.log_batch(run_id, params=params[i:i + 100])


def _log_text(client, run_id: str, text: str, name: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d, name)
        path.write_text(redacted(text))  # a command line or report may name a URL with its password
        client.log_artifact(run_id, str(path))


# ---- the parent run ---------------------------------------------------------------------------------------------
class StudyRun:
    """The parent run of one study, created once and reused on resume."""

    def __init__(self, tracking_uri: str, experiment_id: str, run_id: str):
        self.tracking_uri, self.experiment_id, self.run_id = tracking_uri, experiment_id, run_id
        self.client = _client(tracking_uri)

    @classmethod
    def create(cls, tracking_uri: str, study: str, *, space_path: str, space_text: str, command: str,
               params: dict[str, Any], description: str = "") -> StudyRun:
        open_store(tracking_uri)
        client = _client(tracking_uri)
        experiment = experiment_id(client, tracking_uri, experiment_name(study))
        commit = git_commit()
        run = client.create_run(experiment, run_name=study, tags={
            STUDY_TAG: study, ROLE_TAG: "study", "mlflow.source.git.commit": commit,
            "hpsearch.command": redacted(command),
            "mlflow.source.name": "python -m hpsearch.tune", "mlflow.note.content": description or study})
        self = cls(tracking_uri, experiment, run.info.run_id)
        from mlflow.entities import Param
        try:
            _log_batches(client, self.run_id, params=[Param(k, redacted(str(v))[:6000]) for k, v in params.items()])
            _log_text(client, self.run_id, space_text, Path(space_path).name)
            _log_text(client, self.run_id, command + "\n", "command.txt")
        except BaseException:  # the run is not left RUNNING
            client.set_terminated(self.run_id, status="FAILED")
            raise
        return self

    @classmethod
    def existing(cls, tracking_uri: str, run_id: str) -> tuple[StudyRun, Any]:
        """(the study's parent run `run_id` as it is, MLflow's record of it); a one-line error when the store does
        not hold it."""
        open_store(tracking_uri)
        client = _client(tracking_uri)
        try:
            run = client.get_run(run_id)
        except Exception as e:  # mlflow.exceptions.MlflowException: not in this store
            raise ConfigError(f"--resume: the study's parent run {run_id} is not in {tracking_uri} ({e})") from None
        return cls(tracking_uri, run.info.experiment_id, run_id), run

    @classmethod
    def reopen(cls, tracking_uri: str, run_id: str, command: str) -> StudyRun:
        self, run = cls.existing(tracking_uri, run_id)
        self.client.update_run(run_id, status="RUNNING")
        self.client.set_tag(run_id, "hpsearch.resumed", str(int(run.data.tags.get("hpsearch.resumed", "0")) + 1))
        _log_text(self.client, run_id, command + "\n", f"command-resume-{int(time.time())}.txt")
        return self

    def log_report(self, metrics: dict[str, float], tags: dict[str, str], files: dict[str, str],
                   folder: Path) -> None:
        """The study's result: metrics, tags, text files (name -> text) under `report/`, the files of `folder`
        (plots) under `report/plots/`."""
        _log_batches(self.client, self.run_id, metrics=_metrics(metrics, 0))
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, value)
        with tempfile.TemporaryDirectory() as d:
            for name, text in files.items():
                Path(d, name).write_text(redacted(text))
            self.client.log_artifacts(self.run_id, d, "report")
        if folder.is_dir() and any(folder.iterdir()):
            self.client.log_artifacts(self.run_id, str(folder), "report/plots")

    def finish(self, status: str = "FINISHED", over: bool = False) -> None:
        """End the study's run and any trial run still marked RUNNING (an interrupted or crashed study's trials:
        `--resume` reopens them) with `status`. At a study's end (`over`) a trial run still RUNNING with nothing
        logged belongs to a trial Tune lost (the driver was killed right after starting it, before Tune saved that
        it had; the resumed study ran its configuration under a new trial): it is deleted, not kept as a trial."""
        running = self.client.search_runs([self.experiment_id], f"tags.`{PARENT_TAG}` = '{self.run_id}' and "
                                          "attributes.status = 'RUNNING'")
        for run in running:
            if over and not run.data.metrics:
                self.client.delete_run(run.info.run_id)  # MLflow's soft delete (`mlflow gc` removes it for good)
                continue
            self.client.set_terminated(run.info.run_id, status="KILLED" if status == "FINISHED" else status)
        self.client.set_terminated(self.run_id, status=status)


# ---- system metrics (CPU, memory, disk, network; GPU where present) of a trial's nodes ----------------------------
def find_trial_run(uri: str, experiment_id: str, parent_run_id: str, trial_id: str, timeout: float = 120.0):
    """The child run of a trial (the study's callback creates it as the trial starts): its id, or None."""
    import time
    client = _client(uri)
    deadline, wait = time.monotonic() + timeout, 0.1
    while True:
        found = _trial_runs(client, experiment_id, parent_run_id, trial_id)
        if found or time.monotonic() > deadline:
            return found[0].info.run_id if found else None
        time.sleep(wait)  # the run is usually there within a poll or two: 0.1 s, then backing off to 1 s
        wait = min(2 * wait, 1.0)


def system_metrics_monitor(uri: str, run_id: str, interval: float, node_id: str | None = None):
    """MLflow's own system-metrics sampler for `run_id` (metrics `system/...`, or `system/<node_id>/...`),
    started; call `.finish()` at the end. None, said in one line, when this node cannot reach the store (the
    study's `http://127.0.0.1:5000` seen from another node of a cluster, or a sqlite file on the head alone):
    MLflow's sampler failed silently there and held the run's end for minutes while it retried."""
    import logging

    why = None
    if uri.startswith(("http://", "https://")):
        try:
            check_server(uri, timeout=3.0)
        except ConfigError as e:
            why = str(e)
    elif uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        why = f"{uri}: no such file on this node"
    if why:
        print(f"[hpsearch.train] system metrics of {node_id or 'this node'} are not recorded: the MLflow store "
              f"cannot be reached from it ({redacted(why)}); give the study a tracking URI every node reaches",
              flush=True)
        return None

    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # "Started monitoring system metrics"
    monitor = SystemMetricsMonitor(run_id, sampling_interval=interval, samples_before_logging=1, node_id=node_id,
                                   tracking_uri=uri)
    monitor.start()
    return monitor


# ---- one run outside a study (pretraining) ----------------------------------------------------------------------
class SingleRun:
    """One MLflow run of a Ray Train run that is not a study's trial (`hpsearch.pretrain`): params at the start,
    every report's metrics live (`callback()`, called in Ray Train's controller), artifacts and status at the end."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str, params: dict[str, Any], command: str):
        open_store(tracking_uri)
        self.tracking_uri, self.client = tracking_uri, _client(tracking_uri)
        self.run_id = self.client.create_run(experiment_id(self.client, tracking_uri, experiment_name(experiment)),
                                             run_name=run_name, tags={
            ROLE_TAG: experiment, "mlflow.source.git.commit": git_commit(), "hpsearch.command": redacted(command),
            "mlflow.source.name": command.split(" [")[0]}).info.run_id
        from mlflow.entities import Param
        _log_batches(self.client, self.run_id, params=[Param(k, redacted(str(v))[:6000]) for k, v in params.items()])

    def callback(self):
        from ray.train import UserCallback

        uri, run_id = self.tracking_uri, self.run_id

        class LogReports(UserCallback):  # pickled to the controller: it holds the run's address, not a client
            def after_report(self, run_context, metrics, checkpoint):
                if metrics and metrics[0]:
                    _log_batches(_client(uri), run_id, metrics=_metrics(metrics[0], int(metrics[0].get("step", 0))))

        return LogReports()

    def log_artifact(self, path: str | Path, folder: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), folder)

    def finish(self, status: str = "FINISHED", over: bool = False) -> None:
        self.client.set_terminated(self.run_id, status=status)
