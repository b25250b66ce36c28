"""One comparison on Ray Tune: its folder, its trials (methods x seeds as one grid) and their results.

A trial is a study's trial (`hpsearch.tune.study.run_trial`: the training recipe's Train V2 trainer, so a
comparison scales out exactly as a study does) followed by the probe of the exported model (`probe`), whose
figures go to Tune as one more report. No scheduler stops a trial early and no searcher proposes anything: every
(method, seed) runs its whole budget. Layout of `<storage>/<name>/`: as a study's (Tune's files, `trial_<id>/`,
`train/<id>/`, `trials/<id>/` with the export and `probe.json`), `spec.yaml`, `hpsearch-compare.json`, `report/`.
"""
from __future__ import annotations

import copy
import json
import math
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpsearch.compare.spec import Method, Spec
from hpsearch.config import RunConfig
from hpsearch.tune.storage import Storage, open_storage
from hpsearch.tune.trialruns import TrialRuns

STATE_FILE, SPEC_COPY = "hpsearch-compare.json", "spec.yaml"
LABEL_TAG, SEED_TAG, METHOD_TAG = "hpsearch.label", "hpsearch.seed", "hpsearch.method"


@dataclass
class Comparison:
    name: str
    dir: Path                    # <storage>/<name>, absolute
    spec: Spec
    _entries: dict[str, Method] = field(default_factory=dict, repr=False)
    system_metrics: dict | None = None  # as Study.system_metrics (run_trial reads it); comparisons do not sample
    storage: Storage | None = None      # as Study.storage (default: the folder holding `dir`)

    def __post_init__(self):
        if self.storage is None:
            self.storage = open_storage(str(self.dir.parent))

    @property
    def storage_path(self) -> str:
        return self.storage.uri

    def ray_path(self, *parts: str) -> tuple[str, object | None]:
        return self.storage.ray_path(self.name, *parts)

    # the interface of hpsearch.tune.study.Study that run_trial and TrialRuns use
    def entry(self, label: str) -> Method:
        if not self._entries:
            self._entries = {m.label: m for m in self.spec.entries()}
        return self._entries[label]

    def trial_config(self, values: dict[str, Any], trial_id: str) -> RunConfig:
        """The run config of one (method, seed): the method's config, the seed, the trial's own output folder."""
        cfg = copy.deepcopy(self.entry(values["method"]).config)
        cfg.train.seed = cfg.data.seed = int(values["seed"])  # initialisation, dropout, sampling order
        cfg.train.output_dir = str(self.dir / "trials" / trial_id)
        cfg.validate()
        return cfg

    @property
    def in_process(self) -> bool:
        from hpsearch.tune.cluster import in_process
        return in_process(self.spec)

    @property
    def pooled(self) -> bool:
        from hpsearch.tune.cluster import pooled
        return pooled(self.spec)

    @property
    def reuses_actors(self) -> bool:
        return self.in_process or self.pooled

    def outcome(self, last_result: dict, failed: bool) -> str:
        if failed:
            return "failed"
        return "complete" if last_result.get("step", 0) >= self.spec.config.train.max_steps else "stopped"

    def save_state(self, state: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
        (self.dir / SPEC_COPY).write_text(self.spec.text)
        self.storage.push(self.name, STATE_FILE, SPEC_COPY)


# ---- one trial (runs in a Tune actor) -----------------------------------------------------------------------------
def run_comparison_trial(config: dict[str, Any], comparison: Comparison) -> None:
    """Train one (method, seed) as a study trial does, then probe its export and report the probe to Tune."""
    import ray.tune

    from hpsearch.compare.probe import probe
    from hpsearch.tune.study import run_trial

    run_trial(config, comparison)  # raises TrialFailed with the reason in one line
    cfg = comparison.trial_config(config, ray.tune.get_context().get_trial_id())
    metrics: dict[str, Any] = {"step": cfg.train.max_steps, "probe": 1.0, **_final_scores(cfg)}
    try:
        metrics.update(probe(cfg, comparison.spec.probe.rows_per_task, comparison.spec.probe.reps))
    except Exception as e:  # the scores stand without the probe: say why in the table, do not retrain
        traceback.print_exc()
        metrics.update(probe=0.0, probe_error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    Path(cfg.train.output_dir, "probe.json").write_text(json.dumps(metrics, indent=1) + "\n")
    ray.tune.report(metrics)


def _final_scores(cfg: RunConfig) -> dict[str, float]:
    """The final report's suite scores (from the run's metrics.jsonl), so that the probe's report, the trial's
    last, still carries them for the console's "complete" line."""
    try:
        lines = Path(cfg.train.output_dir, "metrics.jsonl").read_text().splitlines()
        final = json.loads(lines[-1]) if lines else {}
    except (OSError, json.JSONDecodeError):
        return {}
    keys = ("score", "best_score", "best_step", "test_score")
    return {k: final[k] for k in keys if isinstance(final.get(k), (int, float))}


def make_tuner(comparison: Comparison, callbacks: list, max_concurrent: int | None, running: int):
    import ray.tune
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    from hpsearch.tune.cluster import trial_placement
    from hpsearch.tune.progress import TrialEvents
    from hpsearch.tune.study import results_only_loggers, trial_dirname

    spec = comparison.spec
    fn = ray.tune.with_parameters(run_comparison_trial, comparison=comparison)
    fn = ray.tune.with_resources(fn, trial_placement(spec))
    # seed-major: every method's seed 0, then seed 1, ...: the methods see the same neighbours on a shared machine
    param_space = {"method": ray.tune.grid_search([m.label for m in spec.entries()]),
                   "seed": ray.tune.grid_search(spec.seeds)}
    tune_config = ray.tune.TuneConfig(num_samples=1, max_concurrent_trials=max_concurrent,
                                      trial_dirname_creator=trial_dirname, reuse_actors=comparison.reuses_actors)
    trials = len(spec.entries()) * len(spec.seeds)
    events = TrialEvents(trials, spec.config.train.max_steps, running, comparison.outcome)
    # the console: a study's one line per trial event instead of Tune's status table (verbose=0)
    storage_path, storage_fs = comparison.storage.ray_path()
    results_only_loggers()  # the table reads each trial's result files: their loggers are given, as a study's are
    run_config = ray.tune.RunConfig(name=comparison.name, storage_path=storage_path, storage_filesystem=storage_fs,
                                    callbacks=[*callbacks, events, CSVLoggerCallback(), JsonLoggerCallback()],
                                    verbose=0,
                                    failure_config=ray.tune.FailureConfig(max_failures=spec.budget.max_failures))
    return ray.tune.Tuner(fn, param_space=param_space, tune_config=tune_config, run_config=run_config)


# ---- MLflow: a child run per (method, seed) -----------------------------------------------------------------------
class ComparisonRuns(TrialRuns):
    """A study's child runs (every run-config field as a param, every evaluation's metrics, config.yaml,
    task_params/), named `<label>/seed<seed>` and tagged with the label, the method and the seed; the probe's
    report (after the final one, at the same step) is logged too."""

    def __init__(self, tracking_uri: str, experiment_id: str, parent_run_id: str, comparison: Comparison):
        super().__init__(tracking_uri, experiment_id, parent_run_id, comparison.name, comparison.trial_config,
                         comparison.outcome, storage=comparison.storage)
        self.methods = {m.label: m.method for m in comparison.spec.entries()}

    def _create(self, trial):
        run = super()._create(trial)
        label, seed = trial.config["method"], trial.config["seed"]
        for key, value in {"mlflow.runName": f"{label}/seed{seed}", LABEL_TAG: label, SEED_TAG: str(seed),
                           METHOD_TAG: self.methods.get(label, "")}.items():
            self.client.set_tag(run.info.run_id, key, value)
        return run

    def log_trial_result(self, iteration: int, trial, result: dict) -> None:
        if "probe" not in result:
            return super().log_trial_result(iteration, trial, result)
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(result.get("step", 0))
        keep = lambda k, v: ((k.startswith(("gen_", "attn/")) or k in ("probe", "backbone_params"))
                             and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
        metrics = [Metric(k, float(v), now, step) for k, v in result.items() if keep(k, v)]
        run_id = self._run_id(trial)
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(run_id, metrics=metrics[i:i + 1000])
        if result.get("probe_error"):
            self.client.set_tag(run_id, "hpsearch.probe_error", str(result["probe_error"])[:5000])


# ---- results ------------------------------------------------------------------------------------------------------
@dataclass
class TrialResult:
    trial_id: str
    label: str
    seed: int
    outcome: str                       # complete | stopped | failed
    final: dict[str, Any]              # the training's final report (test scores, best_score, extra_params ...)
    probe: dict[str, Any]              # generation time, attention statistics (empty if not measured)
    step_times: list[float]            # train.step_time of every evaluation interval, in step order
    error: str = ""

    @property
    def step_time(self) -> float:
        """The median step time over the evaluation intervals, the first left out when there are others (it
        holds the first steps' one-off costs)."""
        import statistics

        times = self.step_times[1:] if len(self.step_times) > 1 else self.step_times
        return statistics.median(times) if times else math.nan


def collect(comparison: Comparison, result_grid) -> list[TrialResult]:
    out = []
    for result in result_grid:
        config = dict(result.config or {})
        df = result.metrics_dataframe
        history = [{k: v for k, v in row.items() if not _missing(v)} for row in df.to_dict("records")] \
            if df is not None and not df.empty else []
        final = next((h for h in reversed(history) if "test_score" in h and "probe" not in h), {})
        probe = next((h for h in reversed(history) if "probe" in h), {})
        evals = sorted((h for h in history if "step_time" in h and "probe" not in h), key=lambda h: h["step"])
        times, seen = [], set()
        for h in evals:  # a retried trial replays nothing twice, but be safe
            if h["step"] not in seen:
                seen.add(h["step"])
                times.append(float(h["step_time"]))
        failed = result.error is not None
        error = str(result.error).strip().splitlines()[-1] if failed and str(result.error).strip() else ""
        last = dict(result.metrics or {})
        outcome = comparison.outcome(last, failed)
        if not failed and not final:
            outcome, error = "failed", error or "no final report"
        trial_id = last.get("trial_id") or Path(result.path).name.removeprefix("trial_")
        out.append(TrialResult(str(trial_id), config.get("method", "?"), int(config.get("seed", -1)), outcome,
                               final, probe, times, error))
    order = {m.label: i for i, m in enumerate(comparison.spec.entries())}
    return sorted(out, key=lambda r: (order.get(r.label, len(order)), r.seed))


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def unfinished(comparison: Comparison) -> int:
    from ray.tune import ExperimentAnalysis

    path, filesystem = comparison.ray_path()
    trials = ExperimentAnalysis(path, storage_filesystem=filesystem).trials
    expected = len(comparison.spec.entries()) * len(comparison.spec.seeds)
    return max(expected, len(trials)) - sum(t.status in ("TERMINATED", "ERROR") for t in trials)


def warn(text: str) -> None:
    print(f"[hpsearch.compare] {text}", file=sys.stderr, flush=True)
