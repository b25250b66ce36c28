"""One study on Ray Tune: its folder, its trials (each training with the training recipe) and the Tuner.

A trial is a Tune *function* trainable: a one-worker trial trains in its Tune actor (inprocess.py), a trial with
several workers on ranks its actor keeps from trial to trial (rankpool.py), and with `resources.worker_group=always`
it builds `hpsearch.train.build_trainer(...)` (Ray Train V2) and calls `.fit()`, `TuneReportCallback` forwarding
rank 0's reports to Tune. Layout of `<storage>/<name>/`: Tune's experiment files and `trial_<id>/` folders,
`train/<id>/` (the trial's checkpoints, so a retried or resumed trial continues from its last evaluation),
`trials/<id>/` (`train.output_dir`: config.yaml, task_params/, model/), `space.yaml` and `hpsearch-study.json`.
"""
from __future__ import annotations

import copy
import json
import os
import re
import shutil
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpsearch.config import RunConfig
from hpsearch.data._util import temporary_beside
from hpsearch.errors import UserError
from hpsearch.tune.cluster import trial_placement
from hpsearch.tune.space import SearchSpace
from hpsearch.tune.storage import STORAGE_MARKER, Storage, open_storage

STATE_FILE, SPACE_COPY = "hpsearch-study.json", "space.yaml"
STATE_KEYS = ("name", "space_text", "overrides", "tracking_uri", "parent_run_id")


class TrialFailed(RuntimeError):
    """A trial's training stopped: the reason in one line (Ray's wrapped worker traceback is in the trial's log)."""


@dataclass
class Study:
    name: str
    dir: Path                    # <storage>/<name>, absolute (with a bucket: its local mirror, see storage.py)
    space: SearchSpace
    optuna_storage: str | None = None  # the Optuna study's database URL (None: in memory, older studies)
    system_metrics: dict | None = None  # {tracking_uri, experiment_id, parent_run_id, interval}: sample each trial's
                                        # nodes into its MLflow run (--system-metrics)
    storage: Storage | None = None     # where the study lives (default: the folder holding `dir`)

    def __post_init__(self):
        if self.storage is None:
            self.storage = open_storage(str(self.dir.parent))

    @property
    def storage_path(self) -> str:
        """The storage as the user gave it: a local folder or a URI (what --resume takes)."""
        return self.storage.uri

    def ray_path(self, *parts: str) -> tuple[str, object | None]:
        """(storage_path, storage_filesystem) for Ray: the study's folder, or a folder of it (`train`)."""
        return self.storage.ray_path(self.name, *parts)

    def trial_config(self, values: dict[str, Any], trial_id: str) -> RunConfig:
        cfg = self.space.trial_config(values)
        cfg.train.output_dir = str(self.dir / "trials" / trial_id)
        return cfg

    @property
    def in_process(self) -> bool:
        """Trials train in their own Tune actor (one worker; cluster.in_process)."""
        from hpsearch.tune.cluster import in_process
        return in_process(self.space)

    @property
    def pooled(self) -> bool:
        """Trials train on ranks their Tune actor keeps from trial to trial (cluster.pooled)."""
        from hpsearch.tune.cluster import pooled
        return pooled(self.space)

    @property
    def reuses_actors(self) -> bool:
        """Tune hands a finished trial's actor (its imports, its ranks) to the next trial."""
        return self.in_process or self.pooled

    def outcome(self, last_result: dict, failed: bool) -> str:
        """complete (ran the whole budget), stopped (ASHA stopped it early, or interrupted) or failed."""
        if failed:
            return "failed"
        return "complete" if last_result.get("step", 0) >= self.space.config.train.max_steps else "stopped"

    def prune(self) -> tuple[int, int]:
        """At the study's end: remove what only a resume needed (each trial's checkpoints, optimizer states included:
        Ray Train's, or Tune's for a trial that trained in its own actor; its best weights, already exported); keep
        the exports (`trials/<id>/model`, `task_params`, config, metrics). Returns (bytes freed, bytes the study
        folder still holds)."""
        # .staging: a checkpoint part written by a trial killed while it wrote, never retried (sessions.staged)
        patterns = ("train/*/checkpoint_*", "train/*/best", "train/*/.staging", "trial_*/checkpoint_*")
        doomed = [p for pattern in patterns for p in self.dir.glob(pattern) if p.is_dir()]
        freed = sum(_size(p) for p in doomed) + sum(self.storage.delete(self.name, pattern) for pattern in patterns)
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)
        marks = f"train/*/{STORAGE_MARKER}"  # left by a trial on kept ranks that was interrupted (rankpool.py)
        self.storage.delete(self.name, marks, files=True)
        for path in self.dir.glob(marks):
            path.unlink(missing_ok=True)
        return freed, _size(self.dir)

    # ---- the state a resume needs -----------------------------------------------------------------------------
    @property
    def state_file(self) -> Path:
        return self.dir / STATE_FILE

    def save_state(self, state: dict) -> None:
        """The state a resume needs, and the study's own copy of its space file, each replaced whole: a write that
        fails (a full disk, a kill) leaves the last state, which `--resume` can read."""
        self.dir.mkdir(parents=True, exist_ok=True)
        _replace_text(self.state_file, json.dumps(state, indent=2) + "\n")
        _replace_text(self.dir / SPACE_COPY, state["space_text"])
        self.storage.push(self.name, STATE_FILE, SPACE_COPY)

    def update_state(self, **values) -> dict:
        """Set `values` in the saved state (the driver's time so far; that the study finished) and return it."""
        state = {**load_state(self.dir), **values}
        self.save_state(state)
        return state


def _replace_text(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, flush it to the disk, then rename it onto `path`."""
    temporary = temporary_beside(path)
    try:
        with open(temporary, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def load_state(study_dir: Path) -> dict:
    path = study_dir / STATE_FILE
    if not path.is_file():
        raise UserError(f"--resume: no study '{study_dir.name}' in {study_dir.parent} ({STATE_FILE} missing); "
                        "start it without --resume")
    try:
        state = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"--resume: {path} is corrupt or incomplete ({e}); the study cannot be resumed, start a new "
                        "--name") from None
    missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise UserError(f"--resume: {path} is incomplete (no {', '.join(missing)}); the study cannot be resumed, "
                        "start a new --name")
    return state


# ---- one trial (runs in a Tune actor) -----------------------------------------------------------------------------
def run_trial(config: dict[str, Any], study: Study) -> None:
    """A Tune function trainable: train this trial's run config with the training recipe, in this actor for one
    worker (`study.in_process`, see inprocess.py), on the ranks this actor keeps (`study.pooled`, rankpool.py), else
    with its Ray Train trainer."""
    import ray.tune

    from hpsearch.errors import UserError
    from hpsearch.train import failure_reason

    trial_id = ray.tune.get_context().get_trial_id()
    try:
        cfg = study.trial_config(config, trial_id)
    except UserError as e:  # a combination of searched values the run config refuses: this trial fails, in one line
        raise TrialFailed(f"the searched values {json.dumps(config, default=str)} make no valid run config: {e}"
                          ) from None
    marker = Path(cfg.train.output_dir, "FAILED")
    if marker.is_file():  # a deterministic failure (non-finite loss, bad data or config): a retry would fail again
        raise TrialFailed(marker.read_text().strip())
    watch = None
    if study.system_metrics:
        from hpsearch.tracking import find_trial_run
        sm = study.system_metrics
        run_id = find_trial_run(sm["tracking_uri"], sm["experiment_id"], sm["parent_run_id"], trial_id)
        watch = {"tracking_uri": sm["tracking_uri"], "run_id": run_id, "interval": sm["interval"]} if run_id else None
    storage_path, storage_fs = study.ray_path("train")
    export_to = study.ray_path("trials", trial_id) if study.storage.remote else None
    try:
        if study.in_process:
            _train_in_this_actor(cfg, f"{storage_path}/{trial_id}", storage_fs, watch, export_to)
        elif study.pooled:
            _train_on_kept_ranks(cfg, f"{storage_path}/{trial_id}", storage_fs, watch, export_to)
        else:
            _train_with_ray_train(cfg, trial_id, storage_path, storage_fs, watch, export_to)
    except Exception as e:  # Ray Train wraps the worker's error with its traceback; ours is raised here as it is
        reason = failure_reason(e if not study.in_process else RuntimeError(f"{type(e).__name__}: {e}"))
        if deterministic(reason):
            try:
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text(reason + "\n")
            except OSError:  # e.g. the disk is full: the retry then fails the same way, and says so again
                marker.unlink(missing_ok=True)
        if (study.in_process or study.pooled) and not deterministic(reason):
            traceback.print_exc()  # the trial's log keeps the traceback, as a Train worker's does
        raise TrialFailed(reason) from None


def _train_with_ray_train(cfg: RunConfig, trial_id: str, storage_path: str, storage_fs, watch, export_to) -> None:
    from ray.tune.integration.ray_train import TuneReportCallback

    from hpsearch.train import build_trainer
    trainer = build_trainer(cfg, name=trial_id, storage_path=storage_path, storage_filesystem=storage_fs,
                            callbacks=[TuneReportCallback()], system_metrics=watch,  # rank 0's reports go to Tune
                            export_to=export_to)
    trainer.fit()


def _train_in_this_actor(cfg: RunConfig, train_path: str, train_fs, watch, export_to) -> None:
    """The training loop on one rank, here; ASHA stops it inside its report (Tune's SystemExit, not an error)."""
    started = time.time()
    from hpsearch.train import loop_config
    from hpsearch.train.loop import train_loop
    from hpsearch.tune.inprocess import TuneSession, free_trial_memory, start_reused_trial

    start_reused_trial()  # also frees what the actor's last trial left when ASHA stopped it or it failed
    train_loop(loop_config(cfg, system_metrics=watch, export_to=export_to, startup={"trial": started}),
               TuneSession(train_path, train_fs))
    free_trial_memory()  # nothing held while the actor waits for its next trial (or compare probes in it)


def _train_on_kept_ranks(cfg: RunConfig, train_path: str, train_fs, watch, export_to) -> None:
    started = time.time()
    from hpsearch.train import loop_config
    from hpsearch.tune.rankpool import train_in_pool

    train_in_pool(cfg, train_path, train_fs, loop_config(cfg, system_metrics=watch, export_to=export_to,
                                                         startup={"trial": started}))


def deterministic(reason: str) -> bool:
    """A failure that a retry would repeat: a non-finite loss, or a user error (config, data, checkpoint) that only
    showed in a worker. Crashes, lost nodes and the like are retried."""
    return "non-finite loss" in reason or "no space left on device" in reason or \
        bool(re.match(r"(hpsearch\.errors\.)?(User|Config|Data)Error\b", reason))


# ---- Ray and the Tuner --------------------------------------------------------------------------------------------
def trial_dirname(trial) -> str:
    return f"trial_{trial.trial_id}"


def make_searcher(space: SearchSpace, storage_url: str | None = None, study_name: str | None = None):
    """Optuna TPE behind Ray's OptunaSearch; with `storage_url`, the Optuna study `study_name` lives in that
    database (`optuna_store`)."""
    import optuna

    from hpsearch.tune.searcher import BudgetAwareOptunaSearch

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # not "A new study created in memory ..."

    objectives = space.objectives
    with warnings.catch_warnings():  # multivariate and group are "experimental" in Optuna (and recommended)
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=space.sampler.seed, n_startup_trials=space.sampler.n_startup_trials,
                                             multivariate=space.sampler.multivariate,
                                             group=space.sampler.multivariate)
    metric = [o.final_metric for o in objectives] if space.multi_objective else space.primary.final_metric
    mode = [o.mode for o in objectives] if space.multi_objective else space.primary.mode
    stored = {}
    if storage_url:
        from hpsearch.tune.optuna_store import open_storage
        stored = {"storage": open_storage(storage_url), "study_name": study_name}
    return BudgetAwareOptunaSearch(space=space.define_by_run(), metric=metric, mode=mode, sampler=sampler,
                                   points_to_evaluate=copy.deepcopy(space.points_to_evaluate) or None,
                                   max_steps=space.config.train.max_steps,
                                   time_budget_s=space.budget.time_budget_s, **stored)


def trainable(study: Study):
    import ray.tune

    fn = ray.tune.with_parameters(run_trial, study=study)
    return ray.tune.with_resources(fn, trial_placement(study.space))


def early_stoppers(space: SearchSpace) -> str:
    """What stops a trial before its last step, as the console and the report say it."""
    return "ASHA or the time budget" if space.budget.time_budget_s else "ASHA"


def make_tuner(study: Study, callbacks: list, max_concurrent: int | None, running: int):
    """The study's Tuner: at most `max_concurrent` trials at once (None: as many as the cluster fits as it grows;
    `running`: how many that is now, for the console's estimates)."""
    import ray.tune
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    from hpsearch.tune.progress import TrialEvents
    from hpsearch.tune.searcher import RungKeepingASHA, TimeBudget

    space = study.space
    primary = space.primary
    scheduler = RungKeepingASHA(time_attr="step", metric=primary.metric, mode=primary.mode,
                                max_t=space.config.train.max_steps, grace_period=space.grace_period,
                                reduction_factor=space.budget.reduction_factor)
    searcher = make_searcher(space, study.optuna_storage, study.name)
    tune_config = ray.tune.TuneConfig(search_alg=searcher, scheduler=scheduler,
                                      num_samples=space.budget.trials, max_concurrent_trials=max_concurrent,
                                      trial_dirname_creator=trial_dirname,
                                      reuse_actors=study.reuses_actors)  # the next trial keeps the actor's imports
    events = TrialEvents(space.budget.trials, space.config.train.max_steps, running, study.outcome,
                         stoppers=early_stoppers(space))
    # the console: our one line per trial event instead of Tune's status table (verbose=0)
    storage_path, storage_fs = study.storage.ray_path()
    results_only_loggers()
    budget = space.budget.time_budget_s
    run_config = ray.tune.RunConfig(name=study.name, storage_path=storage_path, storage_filesystem=storage_fs,
                                    stop=TimeBudget(budget) if budget else None,  # not Tune's time_budget_s
                                    callbacks=[*callbacks, events, CSVLoggerCallback(), JsonLoggerCallback()],
                                    failure_config=ray.tune.FailureConfig(max_failures=space.budget.max_failures),
                                    verbose=0)
    return ray.tune.Tuner(trainable(study), tune_config=tune_config, run_config=run_config)


def results_only_loggers() -> None:
    """Tune's result files (the report reads them; the tuner is given their loggers), not its TensorBoard files:
    MLflow tracks every metric, and tensorboardX imports torch into the driver (1.5 s a study);
    TUNE_DISABLE_AUTO_CALLBACK_LOGGERS=0 brings them back."""
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")


def restore_tuner(study: Study, results_only: bool):
    """The saved tuner; `results_only`: it was made with the result files' loggers (see `results_only_loggers`), a
    study saved before that gets Tune's default loggers again."""
    import ray.tune
    if results_only:
        results_only_loggers()
    path, filesystem = study.ray_path()
    return ray.tune.Tuner.restore(path, trainable(study), resume_unfinished=True, resume_errored=False,
                                  storage_filesystem=filesystem)


def fit(tuner):
    """Run the trials; Ctrl-C (SIGINT) stops them cleanly and keeps the state for `--resume`."""
    import logging
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # the classic (quiet at verbose=0) output
    for name in ("ray.tune", "ray.train", "ray.air"):  # their hints (e.g. `Tuner.restore(...)`) and a failed
        logging.getLogger(name).setLevel(logging.CRITICAL)  # trial's traceback (in its error.txt): ours is printed
    return tuner.fit()


def unfinished(study: Study) -> int:
    """Trials an interruption left to do (0 when the study ran to its end), from the state Tune saved."""
    from ray.tune import ExperimentAnalysis

    path, filesystem = study.ray_path()
    trials = ExperimentAnalysis(path, storage_filesystem=filesystem).trials
    return trials_left([t.status for t in trials], study.space.budget.trials, study.space.budget.time_budget_s,
                       load_state(study.dir).get("elapsed_s", 0.0))


def trials_left(statuses: list[str], trials: int, time_budget_s: float | None, elapsed_s: float) -> int:
    """What is left of a study whose trials Tune saved with `statuses`, asked for `trials` and `time_budget_s`,
    with the driver's time so far `elapsed_s` (at least the time the budget counted). Once the time budget is spent,
    what did not start never will; before, a study interrupted between two trials still has its other trials to go
    (it was counted finished, and its budget lost)."""
    done = sum(s in ("TERMINATED", "ERROR") for s in statuses)
    if time_budget_s and elapsed_s >= time_budget_s:
        return len(statuses) - done
    return max(trials, len(statuses)) - done
