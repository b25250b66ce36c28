"""The study's Tune callback that gives each trial its MLflow child run (the runs' layout: `hpsearch.tracking`).

It lives with the search, the one place that knows Ray Tune, so that importing `hpsearch.tracking` (the commands'
tracking-URI checks, the workers' system metrics) imports no Ray Tune (about 1.5 s here)."""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from ray.tune.logger import LoggerCallback

from hpsearch.tracking import (
    OUTCOME_TAG,
    PARENT_TAG,
    ROLE_TAG,
    STUDY_TAG,
    TRIAL_TAG,
    _client,
    _log_batches,
    _log_text,
    _metrics,
    _trial_runs,
)


class TrialRuns(LoggerCallback):
    """Tune callback: a child run per trial, found again by its trial-id tag after a retry or a resume.

    `trial_config(config, trial_id)` gives a trial's full run config; `outcome(last_result, failed)` names how it
    ended (complete, stopped, failed)."""

    storage = None  # a study saved before the attribute existed is restored from its pickle without it

    def __init__(self, tracking_uri: str, experiment_id: str, parent_run_id: str, study: str,
                 trial_config: Callable, outcome: Callable[[dict, bool], str], storage=None):
        self.tracking_uri, self.experiment_id, self.parent_run_id, self.study = (
            tracking_uri, experiment_id, parent_run_id, study)
        self.storage = storage  # the study's Storage: with a bucket, a trial's exports come from there
        self.trial_config, self.outcome = trial_config, outcome
        self._runs: dict[str, str] = {}        # trial id -> run id
        self._last: dict[str, tuple] = {}      # trial id -> (last logged step, final metrics logged)
        self._client = None

    def __getstate__(self):  # Tune pickles callbacks with the experiment: keep the client and caches out
        return {**self.__dict__, "_client": None, "_runs": {}, "_last": {}}

    @property
    def client(self):
        if self._client is None:
            self._client = _client(self.tracking_uri)
        return self._client

    def _run_id(self, trial) -> str:
        tid = trial.trial_id
        if tid in self._runs:
            return self._runs[tid]
        found = _trial_runs(self.client, self.experiment_id, self.parent_run_id, tid)
        if found:
            run = found[0]
            history = self.client.get_metric_history(run.info.run_id, "loss")  # logged at every evaluation
            self._last[tid] = (max((m.step for m in history), default=-1), "test_score" in run.data.metrics)
            self.client.update_run(run.info.run_id, status="RUNNING")
        else:
            run = self._create(trial)
            self._last[tid] = (-1, False)
        self._runs[tid] = run.info.run_id
        return run.info.run_id

    def _config(self, trial):
        """The trial's run config, or the one-line reason the run config refuses its searched values (a combination
        the space's checks could not see; the trial then fails on its own, the study goes on)."""
        from hpsearch.errors import UserError
        try:
            return self.trial_config(trial.config, trial.trial_id)
        except UserError as e:
            return str(e)

    def _create(self, trial):
        from mlflow.entities import Param
        cfg = self._config(trial)
        run = self.client.create_run(self.experiment_id, run_name=f"trial_{trial.trial_id}", tags={
            PARENT_TAG: self.parent_run_id, STUDY_TAG: self.study, TRIAL_TAG: trial.trial_id, ROLE_TAG: "trial",
            "hpsearch.searched": ",".join(sorted(trial.config))})
        if isinstance(cfg, str):  # its searched values as params, and why it cannot run
            _log_batches(self.client, run.info.run_id, params=[Param(k, str(v)) for k, v in trial.config.items()])
            self.client.set_tag(run.info.run_id, "hpsearch.error", cfg[:5000])
            return run
        active = {f"model.{name}" for name in cfg.model.active_fields()}  # a sep trial logs no layer_task_dim
        flat = {k: ",".join(map(str, v)) if isinstance(v, list) else v for k, v in cfg.flat().items()
                if not k.startswith("model.") or k in active}
        _log_batches(self.client, run.info.run_id, params=[Param(k, str(v)) for k, v in flat.items()])
        from hpsearch.config import dump_yaml
        _log_text(self.client, run.info.run_id, dump_yaml(cfg), "config.yaml")
        _log_text(self.client, run.info.run_id, json.dumps(trial.config, indent=2) + "\n", "searched.json")
        return run

    def log_trial_start(self, trial) -> None:
        self._run_id(trial)

    def log_trial_result(self, iteration: int, trial, result: dict) -> None:
        run_id, tid = self._run_id(trial), trial.trial_id
        step = int(result.get("step", iteration))
        last_step, final_logged = self._last[tid]
        final = "test_score" in result
        if step < last_step or (step == last_step and (final_logged or not final)):
            return  # already logged (a resumed trial replays nothing it has logged)
        values = {k: v for k, v in result.items() if not (isinstance(v, float) and math.isnan(v))}
        _log_batches(self.client, run_id, metrics=_metrics(values, step))
        self._last[tid] = (step, final_logged or final)

    def log_trial_end(self, trial, failed: bool = False) -> None:
        run_id = self._run_id(trial)
        outcome = self.outcome(trial.last_result or {}, failed)
        self.client.set_tag(run_id, OUTCOME_TAG, outcome)
        if failed and trial.error_file and Path(trial.error_file).is_file():
            error = Path(trial.error_file).read_text().strip().splitlines()
            self.client.set_tag(run_id, "hpsearch.error", (error[-1] if error else "")[:5000])
        cfg = self._config(trial)
        if isinstance(cfg, str):  # its values never made a run config: nothing ran, nothing to export
            failed = True
        exports = None if isinstance(cfg, str) else Path(cfg.train.output_dir, "task_params")
        if not failed and self.storage is not None and self.storage.remote:  # written on the node of its rank 0
            self.storage.pull(self.study, f"trials/{trial.trial_id}/task_params")
        if not failed and exports.is_dir():
            self.client.log_artifacts(run_id, str(exports), "task_params")
        self.client.set_terminated(run_id, status="FAILED" if failed else "FINISHED")

    def on_trial_recover(self, iteration: int, trials: list, trial, **info) -> None:
        run_id = self._run_id(trial)
        retries = int(self.client.get_run(run_id).data.tags.get("hpsearch.retries", "0")) + 1
        self.client.set_tag(run_id, "hpsearch.retries", str(retries))

    def on_experiment_end(self, trials: list, **info) -> None:
        for trial in trials:  # interrupted: a resume finishes these runs
            if trial.trial_id in self._runs and trial.status not in ("TERMINATED", "ERROR"):
                self.client.set_terminated(self._runs[trial.trial_id], status="KILLED")
