"""`python -m hpsearch.tune`: the search. Ray Tune + Optuna TPE + ASHA over the training recipe, tracked in MLflow.

    python -m hpsearch.tune [--space FILE] [--name NAME] [--num-samples N] [--tracking-uri URI]
                            [--storage-path PATH] [--optuna-storage URL] [--resume] [key=value ...]

With no arguments it runs `search_spaces/default.yaml`. Overrides set run-config fields (`train.lr=1e-3`; a
searched field is then fixed) or the space's budget/resources/sampler (`budget.trials=3`). Everything is
validated before Ray starts; a mistake is one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

from hpsearch.cli import Parser, redacted
from hpsearch.errors import UserError
from hpsearch.tune.prepare import DEFAULT_SPACE, prepare
from hpsearch.tune.study import Study, load_state

INTERRUPTED = 130


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Parser(prog="python -m hpsearch.tune", description=__doc__.splitlines()[0])
    p.add_argument("--space", help=f"search space YAML (default: {DEFAULT_SPACE.parent.name}/default.yaml)")
    p.add_argument("--name", help="study name (default: the space's `name`); the MLflow experiment is "
                                       "hpsearch/<name>")
    p.add_argument("--num-samples", type=int, help="number of trials (the space's budget.trials)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: sqlite:///mlflow.db here)")
    p.add_argument("--storage-path", default="runs/tune", help="where studies keep their state: a folder or "
                   "s3://bucket/prefix, gs://... (default: runs/tune)")
    p.add_argument("--optuna-storage", help="SQLAlchemy URL of the Optuna study's database (default: sqlite "
                   "optuna.db beside a sqlite MLflow store, else in a local --storage-path, else here)")
    p.add_argument("--system-metrics", nargs="?", type=float, const=10.0, metavar="SECONDS",
                   help="log each trial's nodes' CPU, memory, disk, network (and GPU) to its MLflow run, sampled every "
                   "SECONDS (default 10)")
    p.add_argument("--resume", action="store_true", help="continue the interrupted study of this name")
    p.add_argument("overrides", nargs="*", help="key=value: model.*/data.*/train.* or budget.*/resources.*/sampler.*")
    return p.parse_intermixed_args(argv)  # overrides before or after the options


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    study, state = prepare(args)
    command = shlex.join(["python", "-m", "hpsearch.tune", *argv])
    if args.resume and state.get("finished"):  # its report is logged: nothing to run, nothing to log again
        return _already_finished(study, state)

    from concurrent.futures import ThreadPoolExecutor

    import ray.tune

    from hpsearch.tracking import StudyRun, open_store
    from hpsearch.train import init_ray, shutdown_ray
    from hpsearch.tune.cluster import at_a_time, concurrency, uses_ray_train, wait_for_nodes
    from hpsearch.tune.study import make_tuner, restore_tuner
    from hpsearch.tune.trialruns import TrialRuns

    space = study.space
    overlap = not args.resume and not os.environ.get("RAY_ADDRESS")  # a new study, a private Ray to start
    try:
        with ThreadPoolExecutor(1) as pool:  # then MLflow's schema is set up while Ray starts
            store = pool.submit(open_store, state["tracking_uri"]) if overlap else None
            # workers' output: Ray's session logs; the console: trial events
            init_ray(space.config, log_to_driver=False, dashboard=uses_ray_train(space))
        if store is not None:
            store.result()  # its error, if any, as it would have come from StudyRun.create below
        if os.environ.get("RAY_ADDRESS"):  # a cluster: nodes may still have to come (a private Ray was checked)
            wait_for_nodes(space, lambda text: print(f"[hpsearch.tune] {text}", flush=True))
        if args.resume:
            parent = StudyRun.reopen(state["tracking_uri"], state["parent_run_id"], command)
        else:
            parent = StudyRun.create(state["tracking_uri"], study.name, space_path=state["space_path"],
                                     space_text=state["space_text"], command=command, params=_study_params(study),
                                     description=space.description)
    except BaseException:  # the study never started (a cluster that can never place a trial): its name is free
        if not args.resume:
            with contextlib.suppress(OSError):
                study.storage.release(study.name)  # the name prepare claimed, while still empty
        raise

    def tuner():  # within _run_and_end: a failure from here on ends the study's MLflow run, not leaves it RUNNING
        if not args.resume:
            state.update(parent_run_id=parent.run_id, command=command, tune_loggers="results")
            study.save_state(state)
        if state.get("system_metrics"):
            study.system_metrics = {"tracking_uri": parent.tracking_uri, "experiment_id": parent.experiment_id,
                                    "parent_run_id": parent.run_id, "interval": state["system_metrics"]}
        limit, now = concurrency(space, ray.cluster_resources(), grows=bool(os.environ.get("RAY_ADDRESS")))
        restoring = args.resume and ray.tune.Tuner.can_restore(*study.ray_path())
        at_once = "as many at a time as when it started" if restoring else at_a_time(limit, now)  # Tune keeps its own
        print(f"[hpsearch.tune] study '{study.name}': {space.budget.trials} trials, {at_once}, "
              f"state in {study.dir}, MLflow {redacted(parent.tracking_uri)} (run {parent.run_id})", flush=True)
        if restoring:
            # with the callbacks, searcher and scheduler it saved
            return restore_tuner(study, results_only=state.get("tune_loggers") == "results")
        trial_runs = TrialRuns(parent.tracking_uri, parent.experiment_id, parent.run_id, study.name,
                               study.trial_config, study.outcome, storage=study.storage)
        return make_tuner(study, [trial_runs], limit, now)

    code = _run_and_end(study, parent, tuner)
    # now, not in Ray's exit handler, which first waits 0.5 s for workers' output (a study's goes to Ray's logs)
    shutdown_ray()
    return code


def _already_finished(study: Study, state: dict) -> int:
    """A --resume of a study whose report was logged: what its end left undone (the report's push to a bucket,
    ending the MLflow runs: the driver stopped after logging the report), then one line, before Ray starts."""
    from hpsearch.tracking import StudyRun, ui_command

    done = state["finished"]
    if not done.get("ended", True):
        study.storage.push(study.name, "report")
        StudyRun.existing(state["tracking_uri"], state["parent_run_id"])[0].finish(done["status"], over=True)
        study.update_state(finished={**done, "ended": True})
    print(f"[hpsearch.tune] study '{study.name}' already finished ({done['outcome']}): nothing to resume; its "
          f"report is in MLflow {redacted(state['tracking_uri'])}, run {state['parent_run_id']} (report/summary.txt); "
          f"open the UI: {ui_command(state['tracking_uri'])}", flush=True)
    return done["code"]


def _run_and_end(study: Study, parent, make_tuner) -> int:
    """`_run` of the tuner `make_tuner()` makes, with the study's MLflow run ended however it stops (also while the
    tuner is made: its state saved, Tune's restored), and a full disk said in one line."""
    try:
        return _run(study, parent, make_tuner())
    except KeyboardInterrupt:  # a second Ctrl-C: the study's runs are not left RUNNING
        parent.finish("KILLED")
        raise
    except UserError:  # already one line (the report's full-disk ending); ending the run again is harmless
        parent.finish("FAILED")
        raise
    except Exception as e:  # e.g. Tune's own state, a trial's error file or the report could not be written
        from hpsearch.errors import disk_full
        from hpsearch.tracking import outage
        down = outage(e, "study", f"once the server answers, continue with: {_resume_command(study)}")
        if down:  # a resume reopens the runs
            raise down from None
        parent.finish("FAILED")
        if disk_full(e) or (not study.storage.remote and shutil.disk_usage(study.dir.parent).free < 2**20):
            raise _no_space(study, resume=True) from None
        raise
    except BaseException:  # the driver crashed
        parent.finish("FAILED")
        raise


def _run(study: Study, parent, tuner) -> int:
    from hpsearch.tune.study import fit, unfinished

    started, before = time.time(), load_state(study.dir).get("elapsed_s", 0.0)
    # the driver's time over every run of the study (a resume's report said only its own: "in 0.0 min"); with a
    # time budget, saved every few seconds while the trials run too: a driver killed outright (SIGKILL, the OOM
    # killer) leaves its time, which decides whether the budget has trials left (`trials_left`)
    keeper = _ElapsedKeeper(study, before, started) if study.space.budget.time_budget_s else None
    try:
        result_grid = fit(tuner)
    finally:
        if keeper is not None:
            keeper.stop()
    elapsed = study.update_state(elapsed_s=before + time.time() - started)["elapsed_s"]
    left = unfinished(study)
    if left:
        parent.finish("KILLED")
        print(f"[hpsearch.tune] interrupted with {left} trial(s) to go; continue with: {_resume_command(study)}",
              file=sys.stderr)
        return INTERRUPTED
    return _report(study, parent, result_grid, elapsed)


class _ElapsedKeeper:
    """Saves the driver's time so far in the study's state every `every` seconds, in a thread of its own."""

    def __init__(self, study: Study, before: float, started: float, every: float = 10.0):
        import threading

        self._done = threading.Event()

        def keep():
            while not self._done.wait(every):
                with contextlib.suppress(Exception):  # a failed write loses a few seconds of the count, no more
                    study.update_state(elapsed_s=before + time.time() - started)
        self._thread = threading.Thread(target=keep, name="hpsearch-elapsed", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def _report(study: Study, parent, result_grid, elapsed: float) -> int:
    from hpsearch.tracking import ui_command
    from hpsearch.tune import report as reporting

    if study.optuna_storage:  # trials Tune lost to a killed driver are not left RUNNING in the Optuna study
        from hpsearch.tune.optuna_store import fail_lost_trials
        fail_lost_trials(study.optuna_storage, study.name)
    report_dir = study.dir / "report"
    shutil.rmtree(report_dir, ignore_errors=True)
    report = reporting.build(study, result_grid, report_dir / "plots")
    freed, kept = study.prune()  # the study is over: no resume will need its checkpoints
    ui = (f"MLflow: {redacted(parent.tracking_uri)}, study run {parent.run_id}; open the UI: "
          f"{ui_command(parent.tracking_uri)}")
    if study.optuna_storage:
        from hpsearch.tune.optuna_store import dashboard_command
        ui = (f"Optuna: study '{study.name}' in {redacted(study.optuna_storage)}; open the dashboard: "
              f"{dashboard_command(study.optuna_storage)}\n{ui}")
    disk = (f"Disk: {kept / 2**20:.1f} MB in {study.dir} (exports and logs; {freed / 2**20:.1f} MB of checkpoints "
            "only a resume needed were removed)")
    text = reporting.render(report, elapsed, f"{disk}\n{ui}")
    print(text, flush=True)
    metrics, tags = reporting.summary(report)
    parent.log_report(metrics, tags, reporting.files(report, text), report_dir / "plots")
    all_failed = report.counts()["failed"] == len(report.rows)
    done = {"outcome": "every trial failed" if all_failed else "report logged", "code": 1 if all_failed else 0,
            "status": "FAILED" if all_failed else "FINISHED"}
    study.update_state(finished={**done, "ended": False})  # logged once: a --resume only ends what is left
    study.storage.push(study.name, "report")
    parent.finish(done["status"], over=True)
    study.update_state(finished={**done, "ended": True})
    if all_failed and any("no space left on device" in row.error for row in report.rows):
        # the trials filled the disk (a checkpoint, an export) while the study's own writes still fit: one line, as
        # when they do not
        raise _no_space(study, resume=False)
    return 1 if all_failed else 0


def _resume_command(study: Study) -> str:
    return redacted(shlex.join(["python", "-m", "hpsearch.tune", "--name", study.name, "--storage-path",
                                str(study.storage_path), "--resume"]))


def _no_space(study: Study, resume: bool) -> UserError:
    """The one line for a full disk. `resume`: trials are left that `--resume` would run; otherwise every trial
    ended (failed), and a resume would not retry them."""
    then = (f"continue with: {_resume_command(study)}" if resume
            else "run the study again (--resume does not retry failed trials)")
    return UserError(f"no space left on device under {study.storage_path}; free space there, then {then}")


def _study_params(study: Study) -> dict:
    space = study.space
    return {"space": Path(space.path).name, "study": study.name, "trials": space.budget.trials,
            "objectives": ",".join(f"{o.metric}:{o.mode}" for o in space.objectives),
            "searched": ",".join(p.name for p in space.params), "max_steps": space.config.train.max_steps,
            "eval_every": space.config.train.eval_every, "grace_period": space.grace_period,
            "reduction_factor": space.budget.reduction_factor, "max_failures": space.budget.max_failures,
            "workers": space.config.train.num_workers, "seed": space.sampler.seed,
            "optuna_storage": study.optuna_storage or "memory",
            **{f"pinned.{k}": v for k, v in space.pinned.items()}}
