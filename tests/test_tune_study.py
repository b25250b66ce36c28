"""End to end: `python -m hpsearch.tune` runs short studies (Ray Tune + Optuna + ASHA launching the training
recipe's Ray Train trainer per trial) on this machine; the MLflow store is read back with `MlflowClient`."""
import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import psutil
import pytest
from mlflow import MlflowClient

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["budget.max_steps=20", "budget.eval_every=10", "budget.grace_period=10", "train.log_every=10",
         "data.synthetic_train_rows=200", "data.synthetic_eval_rows=40"]


def tune_cmd(tmp_path, name, *args):
    return [sys.executable, "-m", "hpsearch.tune", "--name", name, "--storage-path", str(tmp_path / "runs"),
            "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", *args]


def study_runs(tmp_path, name):
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name(f"hpsearch/{name}")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("hpsearch.role") == "study"]
    children = [r for r in runs if r.data.tags.get("hpsearch.role") == "trial"]
    return client, parents, children


def artifacts(client, run_id, path=None):
    return {a.path for a in client.list_artifacts(run_id, path)}


def steps(client, run_id, key="loss"):
    return [m.step for m in client.get_metric_history(run_id, key)]


def run_auditing_sockets(cmd, cwd, timeout, commands=None):
    """Run `cmd` to the end; every second, the listening sockets of its process tree that are not on loopback (and
    into `commands`, a set, the command lines of its processes)."""
    out_path, err_path = Path(cwd) / "stdout.txt", Path(cwd) / "stderr.txt"
    exposed, seen = set(), 0
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=err, text=True)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                tree = {proc.pid} | {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                break
            for pid in tree if commands is not None else ():
                with contextlib.suppress(psutil.Error):
                    commands.add(" ".join(psutil.Process(pid).cmdline()))
            for c in psutil.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN and c.pid in tree:
                    seen += 1
                    if not ipaddress.ip_address(c.laddr.ip.removeprefix("::ffff:")).is_loopback:
                        exposed.add((c.laddr.ip, c.laddr.port, psutil.Process(c.pid).name()))
            time.sleep(1)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    result = subprocess.CompletedProcess(cmd, proc.returncode, out_path.read_text(), err_path.read_text())
    return result, exposed, seen


@pytest.mark.slow
def test_study_runs_trials_one_after_another_and_tracks_them_in_mlflow(tmp_path):
    commands = set()
    out, exposed, seen = run_auditing_sockets(tune_cmd(tmp_path, "e2e", "--num-samples", "3", *SHORT), tmp_path,
                                              timeout=900, commands=commands)
    assert out.returncode == 0, out.stderr[-3000:]
    # a private local Ray: its GCS, raylet, workers, dashboard and agents listen on loopback only; its dashboard
    # without its web front-end and modules (the trials train in their own actors: no Ray Train worker group asks
    # its State API)
    assert seen > 10 and not exposed, exposed
    heads = [c for c in commands if "ray/dashboard/dashboard.py" in c]
    assert heads and all("--disable-frontend" in c for c in heads), heads
    assert "1 at a time" in out.stdout
    # the console: one line per trial event, no Tune table, no worker output, the report last
    console = out.stdout + out.stderr
    assert "TrainingReport(" not in console and "== Status ==" not in console and "built successfully" not in console
    assert "A new study created" not in console and "Tuner.restore" not in console
    events = [ln for ln in out.stdout.splitlines() if ln.startswith("[hpsearch.tune] ")]
    assert len(events) == len(set(events))  # nothing printed twice
    assert sum(" started (" in ln for ln in events) == 3 and sum("study: " in ln for ln in events) == 3
    assert out.stdout.rstrip().splitlines()[-1].startswith("MLflow: ")  # nothing after the final report
    assert len(out.stdout.splitlines()) + len(out.stderr.splitlines()) < 80
    for text in ("Best trial", "All trials:", "Pareto front", "Hyperparameter importances",
                 f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlflow.db --host 127.0.0.1",
                 f"Optuna: study 'e2e' in sqlite:///{tmp_path}/optuna.db; open the dashboard: ",
                 f"optuna-dashboard sqlite:///{tmp_path}/optuna.db --host 127.0.0.1"):
        assert text in out.stdout

    client, parents, children = study_runs(tmp_path, "e2e")
    assert len(parents) == 1 and len(children) == 3
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["mlflow.source.git.commit"] != ""
    assert parent.data.tags["hpsearch.command"].startswith("python -m hpsearch.tune --name e2e")
    assert {"default.yaml", "command.txt", "report"} <= artifacts(client, parent.info.run_id)
    report = artifacts(client, parent.info.run_id, "report")
    assert {"report/summary.txt", "report/trials.csv", "report/best_config.yaml", "report/plots"} <= report
    plots = artifacts(client, parent.info.run_id, "report/plots")
    assert {"report/plots/optimization_history.png", "report/plots/pareto_front.png"} <= plots
    assert "best_score" in parent.data.metrics and parent.data.metrics["trials_failed"] == 0

    assert len({c.data.tags["hpsearch.trial_id"] for c in children}) == 3
    # the Optuna study in its database: one trial per Tune trial, COMPLETE or PRUNED as the MLflow outcome says
    ostudy = optuna.load_study(study_name="e2e", storage=f"sqlite:///{tmp_path}/optuna.db")
    states = sorted(t.state.name for t in ostudy.trials)
    outcomes = sorted({"complete": "COMPLETE", "stopped": "PRUNED"}[c.data.tags["hpsearch.outcome"]] for c in children)
    assert states == outcomes
    for child in children:
        run_id = child.info.run_id
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.info.status == "FINISHED"
        searched = child.data.tags["hpsearch.searched"].split(",")
        assert {"model.variant", "model.placement", "train.lr"} <= set(searched)
        assert child.data.params["model.backbone"] == "t5-tiny"
        params = child.data.params  # only what the trial used: no inactive conditional field
        assert set(searched) - {"model.prompt_length_encoder", "model.prompt_length_decoder",
                                "model.layer_task_dim"} <= set(params)
        assert ("model.layer_task_dim" in params) == (params["model.variant"] == "global")
        assert ("model.prompt_length_decoder" in params) == (params["model.placement"] != "encoder")
        assert ("model.prompt_length_encoder" in params) == (params["model.placement"] != "decoder")
        assert "model.prompt_length" not in params and "model.reduction_factor" not in params
        outcome = child.data.tags["hpsearch.outcome"]
        expected = [10, 20] if outcome == "complete" else [10]
        assert outcome in ("complete", "stopped")
        for key in ("score", "task/first/score", "task/count/pearson", "loss", "extra_params"):
            assert steps(client, run_id, key) == expected, key  # every evaluation, once
        assert {"config.yaml", "searched.json"} <= artifacts(client, run_id)
        if outcome == "complete":
            assert "test_score" in child.data.metrics and "test/first/score" in child.data.metrics
            assert "task_params" in artifacts(client, run_id)
            assert artifacts(client, run_id, "task_params")
    assert any(c.data.tags["hpsearch.outcome"] == "complete" for c in children)
    # disk: the study keeps the exports of complete trials, not the checkpoints only a resume needed
    study_dir = tmp_path / "runs" / "e2e"
    left = [p for p in (*study_dir.glob("train/*/checkpoint_*"), *study_dir.glob("train/*/best")) if p.is_dir()]
    assert not left, left
    complete = [c.data.tags["hpsearch.trial_id"] for c in children if c.data.tags["hpsearch.outcome"] == "complete"]
    assert all((study_dir / "trials" / t / "model" / "model.safetensors").is_file() for t in complete)
    assert "MB of checkpoints only a resume needed were removed" in out.stdout
    # Tune keeps each trial's results (the report reads them), not TensorBoard files (MLflow has every metric)
    tune_dirs = list(study_dir.glob("trial_*"))
    assert len(tune_dirs) == 3 and all((d / "progress.csv").is_file() and (d / "result.json").is_file()
                                       for d in tune_dirs)
    assert not list(study_dir.rglob("events.out.tfevents*"))

    # one after another: each trial's run starts after the previous one ended
    spans = sorted((c.info.start_time, c.info.end_time) for c in children)
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:])), spans


def run_keeping_worker_logs(cmd, cwd, env=None):
    """Run a study to its end with Ray's session in a folder of its own: (the finished process, {file name: text}
    of its workers' logs)."""
    ray_tmp = tempfile.mkdtemp(prefix="r", dir="/tmp")  # short: Ray's socket paths have a length limit
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900,
                             env={**(env or os.environ), "RAY_TMPDIR": ray_tmp})
        logs = {p.name: p.read_text(errors="replace") for p in Path(ray_tmp).glob("ray/session_*/logs/worker-*.out")}
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return out, logs


def check_six_trials_with_a_stop_in_between(tmp_path, name, study_dir):
    """Six trials in MLflow under one finished parent, ASHA's stop before the last trial, Optuna's states as the
    outcomes say, each evaluation once, exports for complete trials only; returns the MLflow children."""
    client, parents, children = study_runs(tmp_path, name)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED" and len(children) == 6
    order = [c.data.tags["hpsearch.outcome"] for c in sorted(children, key=lambda c: c.info.start_time)]
    assert "stopped" in order[:-1], order
    ostudy = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path}/optuna.db")
    outcomes = sorted({"complete": "COMPLETE", "stopped": "PRUNED"}[c.data.tags["hpsearch.outcome"]] for c in children)
    assert sorted(t.state.name for t in ostudy.trials) == outcomes
    for child in children:
        outcome = child.data.tags["hpsearch.outcome"]
        assert steps(client, child.info.run_id) == ([10, 20] if outcome == "complete" else [10])
        trial = study_dir / "trials" / child.data.tags["hpsearch.trial_id"]
        assert (trial / "model" / "model.safetensors").is_file() == (outcome == "complete")
    return children


@pytest.mark.slow
def test_one_worker_trials_train_in_one_reused_actor_without_a_worker_group(tmp_path):
    """`resources.workers=1`: every trial trains in its own Tune actor (no Ray Train controller or worker actors),
    Tune reuses that actor for the next trial (one process for the study, whatever ASHA stopped), each evaluation
    reaches MLflow once with its Optuna state, and Tune's checkpoints are removed at the end like Ray Train's."""
    space = tmp_path / "loss.yaml"  # loss as ASHA's metric: trials differ at step 10, so ASHA stops one (the 4th)
    space.write_text((ROOT / "search_spaces" / "default.yaml").read_text().replace(
        "  - {metric: score, mode: max}", "  - {metric: loss, mode: min}"))
    out = subprocess.run(tune_cmd(tmp_path, "inproc", "--space", str(space), "--num-samples", "6", *SHORT,
                                  "resources.workers=1", "resources.max_concurrent=1"),
                         cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    study_dir = tmp_path / "runs" / "inproc"
    results = [[json.loads(line) for line in (d / "result.json").read_text().splitlines()]
               for d in sorted(study_dir.glob("trial_*"))]
    assert len(results) == 6 and all(results)
    assert len({row["pid"] for rows in results for row in rows}) == 1  # one actor trained every trial
    # no Ray Train run: Ray Train writes its run's state under train/<trial id>/ (here only the best weights were;
    # a staging folder left there would be gone anyway: the study's prune removes it, see test_train's for staged)
    assert not [p for p in study_dir.glob("train/*/*") if p.name != "best"]
    # ASHA stopped a trial inside its report, and the actor trained the next
    check_six_trials_with_a_stop_in_between(tmp_path, "inproc", study_dir)
    left = [p for pattern in ("trial_*/checkpoint_*", "train/*/best") for p in study_dir.glob(pattern)]
    assert not left, left
    assert "MB of checkpoints only a resume needed were removed" in out.stdout



@pytest.mark.slow
def test_a_time_budget_stops_trials_through_tune_so_optuna_and_mlflow_are_told(tmp_path):
    """`budget.time_budget_s`: Tune's own budget stopped every trial at once behind the searcher's and MLflow's
    backs (a running trial was never told to Optuna and failed as lost at the end; its MLflow run got no outcome).
    Now each running trial stops at its next evaluation through Tune's own stop, and no new trial starts: the study
    ends with fewer trials than asked for, every one told to Optuna (the one the budget stopped PRUNED, none FAIL)
    and ended in MLflow with its outcome (found by an independent review)."""
    from optuna.trial import TrialState

    budget = ["budget.max_steps=1000", "budget.eval_every=50", "budget.grace_period=1000",  # no ASHA stop
              "budget.time_budget_s=25", *SHORT[3:]]
    out = subprocess.run(tune_cmd(tmp_path, "timed", "--num-samples", "8", *budget, "resources.workers=1",
                                  "resources.max_concurrent=1"), cwd=tmp_path, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    _, parents, children = study_runs(tmp_path, "timed")
    assert parents[0].info.status == "FINISHED" and 1 <= len(children) < 8
    outcomes = [c.data.tags.get("hpsearch.outcome") for c in children]
    assert all(c.info.status == "FINISHED" for c in children) and "stopped" in outcomes, outcomes
    assert set(outcomes) <= {"complete", "stopped"}, outcomes
    states = [t.state for t in optuna.load_study(study_name="timed", storage=f"sqlite:///{tmp_path}/optuna.db").trials]
    assert len(states) == len(children) and TrialState.PRUNED in states, states
    assert set(states) <= {TrialState.COMPLETE, TrialState.PRUNED}, states

@pytest.mark.slow
def test_kept_ranks_train_every_trial_of_a_two_worker_study(tmp_path):
    """Two workers (`resources.worker_group=auto`, the default): the trial's Tune actor starts its two ranks once
    and Tune hands actor and ranks to every next trial, also after ASHA stopped one inside its report (every rank
    leaves its loop there, none is left waiting); each evaluation reaches MLflow once with its Optuna state, the
    checkpoints go at the end, and a trial's result does not depend on how it ran (the same trial with Ray Train's
    worker group scores the same)."""
    space = tmp_path / "loss.yaml"  # loss as ASHA's metric: trials differ at step 10, so ASHA stops one
    space.write_text((ROOT / "search_spaces" / "default.yaml").read_text().replace(
        "  - {metric: score, mode: max}", "  - {metric: loss, mode: min}"))
    out, logs = run_keeping_worker_logs(tune_cmd(tmp_path, "pool", "--space", str(space), "--num-samples", "6",
                                                 *SHORT, "resources.workers=2", "resources.max_concurrent=1"), tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    started = [line for text in logs.values() for line in text.splitlines() if "ranks for this actor's trials" in line]
    assert len(started) == 1 and "started 2 ranks" in started[0], started  # once, for all six trials
    firsts = {name: text.count("[hpsearch.train] start-up ") for name, text in logs.items()}
    assert sorted(n for n in firsts.values() if n) == [6], firsts  # one process was rank 0 of every trial
    # every trial after the first copied the backbone its ranks kept (the same t5-tiny and seed), not drew it again
    (rank0,) = [text for text in logs.values() if text.count("[hpsearch.train] start-up ") == 6]
    assert rank0.count("backbone: a copy of the initial weights this process kept from its last trial") == 5
    study_dir = tmp_path / "runs" / "pool"
    results = [[json.loads(line) for line in (d / "result.json").read_text().splitlines()]
               for d in sorted(study_dir.glob("trial_*"))]
    assert len(results) == 6 and all(results)
    assert len({row["pid"] for rows in results for row in rows}) == 1  # one Tune actor drove them
    assert not [p for p in study_dir.glob("train/*/*") if p.name != "best"]  # no Ray Train run
    # ASHA stopped a trial, and the same ranks trained the next
    children = check_six_trials_with_a_stop_in_between(tmp_path, "pool", study_dir)
    left = [p for pattern in ("trial_*/checkpoint_*", "train/*/checkpoint_*", "train/*/best")
            for p in study_dir.glob(pattern)]
    assert not left, left
    # the same study's first trial (the same seeded draw) with Ray Train's worker group: the same losses and scores
    again = subprocess.run(tune_cmd(tmp_path, "group", "--space", str(space), "--num-samples", "1", *SHORT,
                                    "resources.workers=2", "resources.worker_group=always"),
                           cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    first = min(children, key=lambda c: c.info.start_time)
    client, _, (alone,) = study_runs(tmp_path, "group")
    searched = lambda run: {k: v for k, v in run.data.params.items() if k.startswith("model.") or k == "train.lr"}
    assert searched(alone) == searched(first) and "model.variant" in searched(first)
    for key in ("loss", "score", "best_score"):
        assert [m.value for m in client.get_metric_history(alone.info.run_id, key)] == pytest.approx(
            [m.value for m in client.get_metric_history(first.info.run_id, key)], rel=1e-4), key


def wait_for(predicate, timeout, proc, poll=2.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            return False
        if predicate():
            return True
        time.sleep(poll)
    return False


def finished_children(tmp_path, name):
    try:
        _, _, children = study_runs(tmp_path, name)
    except Exception:  # the store or the experiment is not there yet
        return []
    return [c for c in children if c.info.status == "FINISHED"]


def interrupt_after_first_trial(cmd, tmp_path, name, env=None, how=signal.SIGINT) -> str:
    """Run a study and interrupt it (Ctrl-C, or `how`) once its first trial has finished and the second has started;
    returns its stderr after checking it exited 130."""
    return interrupt_when(cmd, tmp_path, lambda: len(finished_children(tmp_path, name)) >= 1
                          and len(study_runs(tmp_path, name)[2]) >= 2, env, how)


def second_trial_evaluated(tmp_path, name) -> bool:
    """Two trials in MLflow, the second running and with an evaluation logged (so with a checkpoint to resume)."""
    try:
        client, _, children = study_runs(tmp_path, name)
    except Exception:  # the store or the experiment is not there yet
        return False
    running = [c for c in children if c.info.status == "RUNNING"]
    return len(children) == 2 and len(running) == 1 and bool(steps(client, running[0].info.run_id))


def interrupt_when(cmd, tmp_path, predicate, env=None, how=signal.SIGINT) -> str:
    """Run a study and interrupt it (Ctrl-C, or `how`) once `predicate()` holds; its stderr, after checking it exited
    130."""
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        started = wait_for(predicate, 600, proc, poll=0.5)
        assert started, (proc.poll(), proc.stderr.read()[-3000:] if proc.poll() is not None else "")
        proc.send_signal(how)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    return err


def kept_rungs(study_dir: Path) -> dict:
    """{milestone: {trial id: score}} of ASHA's rungs as the study's saved searcher state holds them (Tune's own
    pickle, written by this test's study)."""
    import pickle
    path = max(study_dir.glob("searcher-state-*.pkl"), key=lambda p: p.stat().st_mtime)  # a session's each
    state = pickle.loads(path.read_bytes())
    [rungs] = state["asha_rungs"]  # one bracket
    return {milestone: recorded for milestone, recorded in rungs}


@pytest.mark.slow
def test_interrupted_study_resumes_without_rerunning_or_duplicating(tmp_path):
    """SIGTERM after the first trial (what `ray job stop`, `kill`, Kubernetes and SLURM send: the study stops as on
    Ctrl-C, its runs KILLED, not left RUNNING), then `--resume`. One-worker trials (in their own actors): the resume
    is Tune's and the searcher's, whatever trains the trial (the worker group's own resume: the driver-kill and
    bucket tests, after a Ctrl-C). 200 steps a trial: with 20, a trial in its actor took ~3 s, and the study ended
    before the signal."""
    budget = ["budget.max_steps=200", "budget.eval_every=100", "budget.grace_period=100", *SHORT[3:]]
    err = interrupt_after_first_trial(tune_cmd(tmp_path, "resume", "--num-samples", "3", *budget,
                                               "resources.workers=1"), tmp_path, "resume", how=signal.SIGTERM)
    assert "--resume" in err
    client, parents, before = study_runs(tmp_path, "resume")
    assert len(parents) == 1 and parents[0].info.status == "KILLED"
    assert not [c for c in before if c.info.status == "RUNNING"]  # the interrupted trial's run is ended too
    done_before = {c.data.tags["hpsearch.trial_id"]: c for c in before if c.info.status == "FINISHED"}
    assert done_before and len(before) < 3 + 1
    # ASHA's rungs are saved with the searcher (Tune saves no scheduler): the finished trial's score at step 100
    rungs_before = kept_rungs(tmp_path / "runs" / "resume")
    assert set(done_before) <= set(rungs_before[100])

    out = subprocess.run([sys.executable, "-m", "hpsearch.tune", "--name", "resume", "--storage-path",
                          str(tmp_path / "runs"), "--resume"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    client, parents, children = study_runs(tmp_path, "resume")
    assert len(parents) == 1 and parents[0].info.run_id == before[0].data.tags["mlflow.parentRunId"]
    assert parents[0].info.status == "FINISHED" and parents[0].data.tags["hpsearch.resumed"] == "1"
    assert "report" in artifacts(client, parents[0].info.run_id)
    assert len(children) == 3 and len({c.data.tags["hpsearch.trial_id"] for c in children}) == 3
    assert all(c.info.status == "FINISHED" for c in children)
    for child in children:
        history = steps(client, child.info.run_id)
        assert history == sorted(set(history)), history  # no evaluation logged twice
        old = done_before.get(child.data.tags["hpsearch.trial_id"])
        if old:  # finished before the interruption: not run again
            assert child.info.end_time == old.info.end_time
            assert history == steps(client, old.info.run_id)
    experiment_dirs = [p for p in (tmp_path / "runs" / "resume").iterdir() if p.name.startswith("trial_")]
    assert len(experiment_dirs) == 3
    # the resumed study's ASHA took the rungs over: the scores recorded before the interruption are in its saved
    # rungs (a fresh ASHA's would hold only trials seen since the resume)
    rungs_after = kept_rungs(tmp_path / "runs" / "resume")
    assert all(rungs_after[m].items() >= rungs_before[m].items() for m in rungs_before), (rungs_before, rungs_after)
    # Tune's result files for every trial, before and after the resume; no TensorBoard files either side
    assert all((d / "progress.csv").is_file() and (d / "result.json").is_file() for d in experiment_dirs)
    assert not list((tmp_path / "runs" / "resume").rglob("events.out.tfevents*"))
    # the resume continued the same Optuna study: three trials, none left RUNNING, none twice
    ostudy = optuna.load_study(study_name="resume", storage=f"sqlite:///{tmp_path}/optuna.db")
    assert len(ostudy.trials) == 3 and all(t.state.name in ("COMPLETE", "PRUNED") for t in ostudy.trials)
    assert [s.study_name for s in optuna.get_all_study_summaries(f"sqlite:///{tmp_path}/optuna.db")] == ["resume"]
    assert os.path.isfile(tmp_path / "runs" / "resume" / "hpsearch-study.json")
    # the report's time is the driver's over both runs, not the resume's alone
    summary = Path(client.download_artifacts(parents[0].info.run_id, "report/summary.txt", str(tmp_path))).read_text()
    minutes = float(re.search(r"3 trials in ([\d.]+) min", summary).group(1))
    state = json.loads((tmp_path / "runs" / "resume" / "hpsearch-study.json").read_text())
    assert state["finished"] == {"outcome": "report logged", "code": 0, "status": "FINISHED", "ended": True}
    assert minutes == round(state["elapsed_s"] / 60, 1)
    # a --resume of the finished study: nothing runs (no Ray), nothing is logged again, the report stays as it was
    parent = parents[0]
    logged = {k: client.get_metric_history(parent.info.run_id, k) for k in parent.data.metrics}
    stored = [a.path for a in client.list_artifacts(parent.info.run_id)]
    again = subprocess.run([sys.executable, "-m", "hpsearch.tune", "--name", "resume", "--storage-path",
                            str(tmp_path / "runs"), "--resume"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0 and "study 'resume' already finished (report logged): nothing to resume" in \
        again.stdout, again.stdout + again.stderr[-3000:]
    run = client.get_run(parent.info.run_id)
    assert (run.info.status, run.info.end_time, run.data.tags["hpsearch.resumed"]) == \
        ("FINISHED", parent.info.end_time, "1")
    assert {k: client.get_metric_history(parent.info.run_id, k) for k in run.data.metrics} == logged
    assert [a.path for a in client.list_artifacts(parent.info.run_id)] == stored  # no command-resume-*.txt added


@pytest.mark.slow
def test_driver_killed_while_a_trial_finishes_loses_nothing_on_resume(tmp_path):
    """SIGKILL the study's driver (and its Ray) as soon as a trial's final result reached it (its MLflow run has
    the test score), before Tune saved that result: after --resume the trial counts as complete with its score,
    is not trained again, and MLflow holds one parent and one child per trial, none left RUNNING. Two-worker trials
    on kept ranks, the default: what is under test is the driver's, whichever way a trial trains (every way reports
    through the trial's Tune actor)."""
    args = tune_cmd(tmp_path, "kill", "--num-samples", "2", *SHORT, "resources.max_concurrent=1",
                    "resources.workers=2")
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)

    def final_logged():
        try:
            return any("test_score" in c.data.metrics for c in study_runs(tmp_path, "kill")[2])
        except Exception:  # the store or the experiment is not there yet
            return False
    try:
        assert wait_for(final_logged, 600, proc, poll=0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything it started, at once
        proc.communicate(timeout=60)
    exports = tmp_path / "runs" / "kill" / "trials"
    (first,) = [p.parent.parent for p in exports.glob("*/task_params/task_params.safetensors")]
    exported = (first / "model" / "model.safetensors").stat().st_mtime_ns

    out = subprocess.run([sys.executable, "-m", "hpsearch.tune", "--name", "kill", "--storage-path",
                          str(tmp_path / "runs"), "--resume"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    client, parents, children = study_runs(tmp_path, "kill")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    # on kept ranks the next trial starts within a second: the kill may catch it started (its MLflow run open,
    # its Optuna trial asked) before Tune saved that it had; Tune runs that configuration again under a new trial,
    # and the lost one is neither a child run nor left RUNNING in the Optuna study
    assert len(children) == 2 and all(c.info.status == "FINISHED" for c in children), \
        [(c.data.tags.get("hpsearch.trial_id"), c.info.status) for c in children]
    ostudy = optuna.load_study(study_name="kill", storage=f"sqlite:///{tmp_path}/optuna.db")
    assert sum(t.state.name == "COMPLETE" for t in ostudy.trials) == 2
    assert all(t.state.name in ("COMPLETE", "FAIL") for t in ostudy.trials), ostudy.trials
    by_id = {c.data.tags["hpsearch.trial_id"]: c for c in children}
    done = by_id[first.name]
    assert done.data.tags["hpsearch.outcome"] == "complete"
    assert "test_score" in done.data.metrics and "best_score" in done.data.metrics
    assert steps(client, done.info.run_id) == [10, 20]  # every evaluation once
    assert (first / "model" / "model.safetensors").stat().st_mtime_ns == exported  # not trained again
    complete = sum(c.data.tags["hpsearch.outcome"] == "complete" for c in children)
    assert parents[0].data.metrics["trials_complete"] == complete
    assert "Best trial" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["2", "1", "pool"])  # Ray Train's worker group, training in the trial's actor,
def test_a_trial_whose_processes_are_killed_is_retried_from_its_checkpoint(tmp_path, workers):  # or kept ranks
    """What Ray's memory monitor does under pressure: SIGKILL a running trial's own driver (Tune's actor, owner of
    the Train run, or with one worker the process training it; with kept ranks, one of the two ranks) after its first
    evaluation. Tune retries the trial; its new Train run (or new ranks) starts once the old run's workers and
    placement group are released (no start-up timeout waited out), continues from the step-100 checkpoint (with kept
    ranks: complete only with both ranks' files), and the study finishes with one MLflow child holding each
    evaluation once. (100 steps between the evaluations: with 10, a one-worker trial of t5-tiny logged the second
    0.4 s after the first, and finished before the kill.)"""
    budget = ["budget.max_steps=200", "budget.eval_every=100", "budget.grace_period=100", *SHORT[3:]]
    resources = {"2": ["resources.workers=2", "resources.worker_group=always"], "1": ["resources.workers=1"],
                 "pool": ["resources.workers=2"]}[workers]  # several workers: kept ranks unless told otherwise
    victim = "ray::Rank" if workers == "pool" else "ImplicitFunc"
    ray_tmp = tempfile.mkdtemp(prefix="r", dir="/tmp")  # the workers' logs (short: Ray's socket paths)
    proc = subprocess.Popen(tune_cmd(tmp_path, "oom", "--num-samples", "1", *budget, *resources),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RAY_TMPDIR": ray_tmp})

    def evaluated_once():
        try:
            client, _, children = study_runs(tmp_path, "oom")
            return any(steps(client, c.info.run_id) == [100] for c in children)
        except Exception:  # the store or the experiment is not there yet
            return False
    try:
        assert wait_for(evaluated_once, 600, proc, poll=0.5), proc.stderr.read()[-3000:] if proc.poll() else ""
        victims = [p for p in psutil.Process(proc.pid).children(recursive=True) if victim in " ".join(p.cmdline())]
        assert len(victims) == (2 if workers == "pool" else 1), \
            [p.cmdline() for p in psutil.Process(proc.pid).children(recursive=True)]
        victims[-1].kill()
        out, err = proc.communicate(timeout=600)
        logs = "".join(p.read_text(errors="replace") for p in Path(ray_tmp).glob("ray/session_*/logs/worker-*.out"))
        # the dashboard's State API, which Ray Train's placement-group cleaner asks, runs only when a trial launches
        # Ray Train's worker group (without it the retried trial's worker group would wait for the old one forever)
        state_api = list(Path(ray_tmp).glob("ray/session_*/logs/dashboard_StateHead.log"))
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, err[-3000:]
    assert bool(state_api) == (workers == "2"), state_api
    assert out.count(" restarted after a failure") == 1 and out.count(" started (1/1)") == 1, out[-3000:]
    assert set(re.findall(r"resumed from \S+ at step (\d+)", logs)) == {"100"}, logs[-3000:]  # not from step 0
    client, parents, children = study_runs(tmp_path, "oom")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    (child,) = children
    assert child.info.status == "FINISHED" and child.data.tags["hpsearch.outcome"] == "complete"
    assert child.data.tags["hpsearch.retries"] == "1"
    assert steps(client, child.info.run_id) == [100, 200]  # went on from step 100, each evaluation logged once


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_the_runs_are_ended(tmp_path):
    """The storage path on a tiny tmpfs (a mount namespace of its own): the first checkpoint fills it; the trial
    fails naming the full disk, the study stops with one line (exit 2, no traceback) and ends its MLflow runs."""
    full = tmp_path / "full"
    full.mkdir()
    mount = ["unshare", "--mount", "bash", "-c", f'mount -t tmpfs -o size=8m tmpfs {full} && exec "$@"', "--"]
    if subprocess.run([*mount, "true"], capture_output=True).returncode != 0:
        pytest.skip("this machine allows no private tmpfs mount (needs root or user namespaces)")
    cmd = [sys.executable, "-m", "hpsearch.tune", "--name", "df", "--num-samples", "1", "--storage-path",
           str(full / "runs"), "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", *SHORT]
    out = subprocess.run([*mount, *cmd], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: no space left on device under {full / 'runs'}") and "--resume" in last, last
    failed = [ln for ln in out.stdout.splitlines() if " failed: " in ln]
    assert failed and "no space left on device writing" in failed[-1], out.stdout
    client, parents, children = study_runs(tmp_path, "df")
    assert [p.info.status for p in parents] == ["FAILED"]
    assert children and all(c.info.status == "FAILED" for c in children)


@pytest.mark.slow
def test_searched_values_the_run_config_refuses_fail_their_trial_not_the_study(tmp_path):
    """A combination of searched values that each pass the space's checks against the fixed config but not
    together (MTL has no task parameters to train alone) fails that trial in one line; the study goes on and
    finishes (it stopped after Ray had started, and `--resume` stopped the same way, for ever)."""
    space = tmp_path / "space.yaml"
    space.write_text("name: mixed\nmodel: {backbone: t5-tiny}\n"
                     "data: {source: synthetic, synthetic_train_rows: 50, synthetic_eval_rows: 10}\n"
                     "search:\n  model.method: {type: categorical, choices: [mtl, lora]}\n"
                     "  model.train_task_params_only: {type: categorical, choices: [false, true]}\n"
                     "objectives: [{metric: score, mode: max}]\n"
                     "budget: {trials: 2, max_steps: 2, eval_every: 1, grace_period: 1, max_failures: 0}\n"
                     "resources: {workers: 1}\npoints_to_evaluate:\n"
                     "  - {model.method: mtl, model.train_task_params_only: true}\n"
                     "  - {model.method: lora, model.train_task_params_only: true}\n")
    out = subprocess.run(tune_cmd(tmp_path, "mixed", "--space", str(space)), capture_output=True, text=True,
                         timeout=600, env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stdout + out.stderr
    client, parents, children = study_runs(tmp_path, "mixed")
    assert parents[0].info.status == "FINISHED" and len(children) == 2
    by_method = {c.data.params["model.method"]: c for c in children}
    bad, good = by_method["mtl"], by_method["lora"]
    assert bad.info.status == "FAILED" and "train_task_params_only" in bad.data.tags["hpsearch.error"], bad.data.tags
    assert good.info.status == "FINISHED" and "score" in good.data.metrics
    import optuna
    states = sorted(t.state.name for t in optuna.load_study(study_name="mixed",
                                                            storage=f"sqlite:///{tmp_path}/optuna.db").trials)
    assert states == ["COMPLETE", "FAIL"], states
