"""Ray's `OptunaSearch`, told about the budget: a trial ASHA stopped early is PRUNED in the Optuna study.

Ray's `OptunaSearch.on_trial_complete` tells Optuna every trial that did not fail as COMPLETE with its last
score, so a trial ASHA stopped after one evaluation would count as finished with a truncated score: TPE would
learn from scores of different budgets. Here such a trial is told as PRUNED (single-objective TPE still ranks it by
its reported intermediate values; multi-objective TPE leaves it out).
"""
from __future__ import annotations

from ray.tune.search.optuna import OptunaSearch


class BudgetAwareOptunaSearch(OptunaSearch):
    def __init__(self, *args, max_steps: int, **kwargs):
        super().__init__(*args, **kwargs)
        self._max_steps = max_steps

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        stopped_early = bool(result) and not error and result.get("step", 0) < self._max_steps
        if stopped_early and trial_id in self._ot_trials and trial_id not in self._completed_trials:
            from optuna.trial import TrialState
            self._ot_study.tell(self._ot_trials[trial_id], state=TrialState.PRUNED)
            self._completed_trials.add(trial_id)
            return
        super().on_trial_complete(trial_id, result=result, error=error)
