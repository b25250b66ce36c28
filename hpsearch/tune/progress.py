"""The study's console: one line per trial event and a study-level progress line with an ETA.

Tune's status table, the workers' own output and Ray's bookkeeping stay out of the console (they are in Ray's
session logs and in each trial's folder); a user sees what happened to each trial and how far the study is:

    [hpsearch.tune] trial 7a025337 started (1/6): model.variant=global, model.placement=both, train.lr=0.00082
    [hpsearch.tune] trial 7a025337 step 10/20: score 41.2 (best 41.2), loss 3.10; trial ETA 25 s
    [hpsearch.tune] trial 7a025337 complete: best_score 44.0 at step 20, test_score 43.1 (0.9 min)
    [hpsearch.tune] study: 1/6 trials done (1 complete, 0 stopped, 0 failed); ETA 4.5 min
"""
from __future__ import annotations

import math
import sys
import time

from ray.tune import Callback


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


class TrialEvents(Callback):
    """A Tune callback printing one line per trial event (started, evaluated, complete / stopped / failed)."""

    def __init__(self, total_trials: int, max_steps: int, concurrency: int, outcome, stoppers: str = "ASHA"):
        self.total, self.max_steps, self.concurrency, self.outcome = total_trials, max_steps, concurrency, outcome
        self.stoppers = stoppers  # what stops a trial early: "ASHA", or "ASHA or the time budget"
        self._started: dict[str, float] = {}
        self._seen: dict[str, int] = {}
        self._ended: dict[str, str] = {}
        self._durations: list[float] = []

    def __getstate__(self):  # Tune pickles callbacks with the experiment: start afresh on resume
        return {**self.__dict__, "_started": {}, "_seen": {}, "_ended": {}, "_durations": []}

    def _say(self, text: str) -> None:
        print(f"[hpsearch.tune] {text}", file=sys.stdout, flush=True)

    def on_trial_start(self, iteration, trials, trial, **info):
        if trial.trial_id in self._started:  # Tune retries it (budget.max_failures): not a new trial
            self._say(f"trial {trial.trial_id} restarted after a failure (from its last checkpoint, if any)")
            return
        self._started[trial.trial_id] = time.time()
        values = ", ".join(f"{k}={_fmt(v)}" for k, v in sorted(trial.config.items()))
        self._say(f"trial {trial.trial_id} started ({len(self._started)}/{self.total}): {values}")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        step = int(result.get("step", 0))
        if step <= self._seen.get(trial.trial_id, 0):
            return  # a restored trial replays nothing new
        self._seen[trial.trial_id] = step
        elapsed = time.time() - self._started.get(trial.trial_id, time.time())
        eta = elapsed / max(step, 1) * (self.max_steps - step)
        self._say(f"trial {trial.trial_id} step {step}/{self.max_steps}: score {_fmt(result.get('score'))} "
                  f"(best {_fmt(result.get('best_score'))}), loss {_fmt(result.get('loss'))}; trial ETA {eta:.0f} s")

    def _end(self, trials, trial, failed: bool) -> None:
        if trial.trial_id in self._ended:
            return
        result = trial.last_result or {}
        outcome = self.outcome(result, failed)
        self._ended[trial.trial_id] = outcome
        took = time.time() - self._started.get(trial.trial_id, time.time())
        self._durations.append(took)
        if outcome == "complete":
            what = (f"complete: best_score {_fmt(result.get('best_score'))} at step {result.get('best_step')}, "
                    f"test_score {_fmt(result.get('test_score'))}")
        elif outcome == "stopped":
            what = f"stopped by {self.stoppers} at step {result.get('step')} (score {_fmt(result.get('score'))})"
        else:
            what = f"failed: {_last_line(trial.error_file) or 'see its error file'}"
        self._say(f"trial {trial.trial_id} {what} ({took / 60:.1f} min)")
        counts = {k: sum(v == k for v in self._ended.values()) for k in ("complete", "stopped", "failed")}
        done = len(self._ended)
        left = max(self.total - done, 0)
        mean = sum(self._durations) / len(self._durations)
        eta = mean * math.ceil(left / max(self.concurrency, 1))
        self._say(f"study: {done}/{self.total} trials done ({counts['complete']} complete, {counts['stopped']} "
                  f"stopped, {counts['failed']} failed); ETA {eta / 60:.1f} min")

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._end(trials, trial, failed=False)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._end(trials, trial, failed=True)


def _last_line(path) -> str:
    try:
        lines = open(path).read().strip().splitlines() if path else []
    except OSError:
        return ""
    return lines[-1] if lines else ""
