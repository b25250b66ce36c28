"""Ray's `OptunaSearch`, told about the budget: a trial ASHA stopped early is PRUNED in the Optuna study.

Ray's `OptunaSearch.on_trial_complete` tells Optuna every trial that did not fail as COMPLETE with its last
score, so a trial ASHA stopped after one evaluation would count as finished with a truncated score: TPE would
learn from scores of different budgets. Here such a trial is told as PRUNED (single-objective TPE still ranks it by
its reported intermediate values, the last of them the result it was stopped on, which Tune does not hand a
searcher's `on_trial_result`; multi-objective TPE leaves it out).

A trial the study's Optuna storage already shows finished is not reported or told again: Optuna writes a trial's
end at once, Tune saves its own state (this searcher's included) every 10 s or more, so a driver killed in between
(SIGKILL, the OOM killer) restores a searcher that takes the trial for running, Tune runs it again, and telling
Optuna about a finished trial raises (`UpdateFinishedTrialError`, "Cannot tell a PRUNED trial"), which ended every
`--resume` of the study.
"""
from __future__ import annotations

import time

from ray.tune import Stopper
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search import Searcher
from ray.tune.search.optuna import OptunaSearch


class BudgetClock:
    """The seconds of a study's time budget (`budget.time_budget_s`) left, counted while the driver runs (not while
    it is down between an interruption and `--resume`, as Tune's own budget counts). Each object that needs it has
    its own clock: they tick at the same events."""

    def __init__(self, seconds: float):
        self.left, self._last = float(seconds), None

    def spent(self) -> bool:
        now = time.monotonic()
        if self._last is not None:
            self.left -= now - self._last
        self._last = now
        return self.left <= 0

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_last": None}  # another process's monotonic clock means nothing


class TimeBudget(Stopper):
    """`budget.time_budget_s`, trial by trial: once it is spent each running trial stops at its next report, through
    Tune's own stop (the searcher tells Optuna, MLflow ends the trial's run, as for an ASHA stop); the searcher then
    starts no new trial, and the study ends when the last one stopped. Tune's `time_budget_s` stopped every trial at
    once behind the searcher's and the callbacks' backs: running trials were never told to Optuna (failed as lost
    at the end), their MLflow runs got no outcome, and a trial that never started counted as stopped."""

    def __init__(self, seconds: float):
        self.clock = BudgetClock(seconds)

    def __call__(self, trial_id: str, result: dict) -> bool:
        return self.clock.spent()

    def stop_all(self) -> bool:
        self.clock.spent()  # ticks between reports too
        return False


class BudgetAwareOptunaSearch(OptunaSearch):
    def __init__(self, *args, max_steps: int, time_budget_s: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._max_steps = max_steps
        self._clock = BudgetClock(time_budget_s) if time_budget_s else None  # see TimeBudget
        self.asha_rungs: list | None = None  # the scheduler's rungs, saved with this searcher (RungKeepingASHA)

    def suggest(self, trial_id: str):
        if self._clock is not None and self._clock.spent():
            return Searcher.FINISHED  # the time budget is spent: no new trial
        return super().suggest(trial_id)

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
        if self._clock is not None:
            self._clock.spent()
        if not self._told_before(trial_id):
            super().on_trial_result(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if self._told_before(trial_id) or trial_id in self._completed_trials:
            return
        stopped_early = bool(result) and not error and result.get("step", 0) < self._max_steps
        if stopped_early and trial_id in self._ot_trials:
            from optuna.trial import TrialState
            self._report_stopping_result(trial_id, result)
            self._ot_study.tell(self._ot_trials[trial_id], state=TrialState.PRUNED, skip_if_finished=True)
            self._completed_trials.add(trial_id)
            return
        super().on_trial_complete(trial_id, result=result, error=error)

    def _report_stopping_result(self, trial_id: str, result: dict) -> None:
        """The result a trial was stopped on, as its last intermediate value. Tune gives a searcher only the results
        of trials it lets go on (a STOP decision skips `on_trial_result`), so a trial ASHA stopped at its first rung
        had no value at all, and one stopped later was ranked by the rung before."""
        if isinstance(self.metric, list) or self.metric not in result:  # multi-objective: Optuna takes no values
            return
        from ray.tune.result import TRAINING_ITERATION
        trial, step = self._ot_trials[trial_id], result.get(TRAINING_ITERATION)
        if step is not None and step not in trial.storage.get_trial(trial._trial_id).intermediate_values:
            trial.report(result[self.metric], step)


class RungKeepingASHA(ASHAScheduler):
    """Tune's ASHA, whose rungs (each trial's score at each milestone) survive `--resume`. Tune saves the searcher's
    state with the experiment's but not the scheduler's (the restored tuner holds the scheduler as it was built), so
    a resumed study's ASHA started with empty rungs: the first trial to reach a rung passed it whatever its score
    (an empty rung has no cutoff), and later trials were compared only with those seen since the resume. The rungs
    live in the searcher's saved state (`BudgetAwareOptunaSearch.asha_rungs`), so they are saved and restored at the
    same moments as the trials and the searcher; a restored trial keeps its id, so its recorded scores stay its
    own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._shared = False

    @staticmethod
    def _keeper(controller):
        """The study's searcher, under Tune's wrappers (SearchGenerator, ConcurrencyLimiter)."""
        alg = getattr(controller, "search_alg", None)
        while alg is not None and not hasattr(alg, "asha_rungs"):
            alg = getattr(alg, "searcher", None)
        return alg

    def _share_rungs(self, controller) -> None:
        """Once, before the first trial: take the rungs a restored searcher kept (same milestones), then keep ours
        in it (by reference: each save of the searcher writes the rungs as they are then)."""
        if self._shared:
            return
        self._shared = True
        keeper = self._keeper(controller)
        if keeper is None:
            return
        for bracket, kept in zip(self._brackets, keeper.asha_rungs or []):
            if [m for m, _ in bracket._rungs] == [m for m, _ in kept]:
                bracket._rungs = [(m, dict(recorded)) for m, recorded in kept]
        keeper.asha_rungs = [bracket._rungs for bracket in self._brackets]

    def on_trial_add(self, tune_controller, trial) -> None:
        self._share_rungs(tune_controller)
        super().on_trial_add(tune_controller, trial)
