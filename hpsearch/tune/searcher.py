"""Ray's `OptunaSearch`, told about the budget: a trial ASHA stopped early is PRUNED in the Optuna study.

Ray's `OptunaSearch.on_trial_complete` tells Optuna every trial that did not fail as COMPLETE with its last
score, so a trial ASHA stopped after one evaluation would count as finished with a truncated score: TPE would
learn from scores of different budgets. Here such a trial is told as PRUNED (single-objective TPE still ranks it by
its reported intermediate values; multi-objective TPE leaves it out).

A trial the study's Optuna storage already shows finished is not reported or told again: Optuna writes a trial's
end at once, Tune saves its own state (this searcher's included) every 10 s or more, so a driver killed in between
(SIGKILL, the OOM killer) restores a searcher that takes the trial for running, Tune runs it again, and telling
Optuna about a finished trial raises (`UpdateFinishedTrialError`, "Cannot tell a PRUNED trial"), which ended every
`--resume` of the study.
"""
from __future__ import annotations

from ray.tune.search.optuna import OptunaSearch


class BudgetAwareOptunaSearch(OptunaSearch):
    def __init__(self, *args, max_steps: int, **kwargs):
        super().__init__(*args, **kwargs)
        self._max_steps = max_steps

    def _told_before(self, trial_id: str) -> bool:
        """Whether the storage shows the trial finished (told by a driver whose state this one did not restore);
        then it counts as completed here too."""
        trial = self._ot_trials.get(trial_id)
        if trial is None or trial_id in self._completed_trials:
            return False
        if not self._ot_study._storage.get_trial(trial._trial_id).state.is_finished():
            return False
        self._completed_trials.add(trial_id)
        return True

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if not self._told_before(trial_id):
            super().on_trial_result(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if self._told_before(trial_id) or trial_id in self._completed_trials:
            return
        stopped_early = bool(result) and not error and result.get("step", 0) < self._max_steps
        if stopped_early and trial_id in self._ot_trials and trial_id not in self._completed_trials:
            from optuna.trial import TrialState
            self._ot_study.tell(self._ot_trials[trial_id], state=TrialState.PRUNED, skip_if_finished=True)
            self._completed_trials.add(trial_id)
            return
        super().on_trial_complete(trial_id, result=result, error=error)
