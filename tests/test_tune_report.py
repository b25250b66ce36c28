"""The end-of-study report from trial results (no cluster): only trials that ran the whole budget reach the best
trial, the Pareto front and the importances; plots are written as PNG; failures are summarised in one line."""
from pathlib import Path

import pytest
from optuna.trial import TrialState

from hpsearch.train import failure_reason
from hpsearch.tune import report
from hpsearch.tune.report import TrialRow
from hpsearch.tune.spacefile import load_space
from hpsearch.tune.study import Study

SPACES = Path(__file__).resolve().parents[1] / "search_spaces"


def rows():
    def row(tid, outcome, step, score, extra, variant, lr):
        config = {"model.variant": variant, "model.placement": "encoder", "model.prompt_length_encoder": 4,
                  "model.bottleneck": 16, "train.lr": lr}
        history = [{"step": s, "score": score * s / step} for s in range(50, step + 1, 50)]
        return TrialRow(tid, outcome, config, {"step": step, "score": score, "extra_params": extra}, history)
    return [row("a", "complete", 150, 60.0, 50_000, "share", 1e-3),
            row("b", "complete", 150, 65.0, 90_000, "sep", 2e-3),
            row("c", "complete", 150, 55.0, 120_000, "sep", 5e-4),
            row("d", "complete", 150, 62.0, 40_000, "share", 1.5e-3),
            # stopped by ASHA at a rung: its score is not comparable; it must not be "best" nor on the front
            row("e", "stopped", 50, 99.0, 10_000, "share", 3e-3),
            TrialRow("f", "failed", {"model.variant": "sep", "model.placement": "encoder",
                                     "model.prompt_length_encoder": 4, "model.bottleneck": 16, "train.lr": 3e-3},
                     {}, [], "non-finite loss (nan) at step 12")]


def build(tmp_path, space_file="default.yaml"):
    study = Study("s", tmp_path / "s", load_space(SPACES / space_file))
    r = report.Report(study, rows(), None, [], {}, [], {})
    ostudy = report.analysis_study(study, r.rows)
    return study, r, ostudy


def test_only_whole_budget_trials_count(tmp_path):
    study, _, ostudy = build(tmp_path)
    states = {t.user_attrs["trial_id"]: t.state for t in ostudy.trials}
    assert states == {"a": TrialState.COMPLETE, "b": TrialState.COMPLETE, "c": TrialState.COMPLETE,
                      "d": TrialState.COMPLETE, "e": TrialState.PRUNED, "f": TrialState.FAIL}
    front = {t.user_attrs["trial_id"] for t in ostudy.best_trials}
    assert front == {"b", "d"}  # e has the best truncated score and the fewest parameters, but was stopped


def test_report_best_pareto_importances_and_plots(tmp_path, monkeypatch):
    import optuna.visualization.matplotlib as vis
    from optuna.importance import FanovaImportanceEvaluator

    study = Study("s", tmp_path / "s", load_space(SPACES / "default.yaml"))
    monkeypatch.setattr(report, "collect", lambda study, grid: rows())
    fitted, drawn = [], {}
    evaluate, plot = FanovaImportanceEvaluator.evaluate, vis.plot_param_importances
    monkeypatch.setattr(FanovaImportanceEvaluator, "evaluate", lambda self, *a, **k: fitted.append(1) or
                        evaluate(self, *a, **k))

    def plot_and_record(*a, **k):
        ax = plot(*a, **k)
        drawn.update({t.get_text(): bar.get_width() for t, bar in zip(ax.get_yticklabels(), ax.patches)})
        return ax
    monkeypatch.setattr(vis, "plot_param_importances", plot_and_record)
    built = report.build(study, None, tmp_path / "plots")
    # fANOVA is fitted once per objective; the plot shows the report's own numbers for the first one
    assert len(fitted) == 2
    assert drawn == pytest.approx(built.importances["fANOVA / best_score"])
    assert built.best.trial_id == "b"
    assert [r.trial_id for r in built.pareto] == ["b", "d"]
    assert set(built.importances) == {"fANOVA / best_score", "MDI / best_score", "fANOVA / extra_params",
                                      "MDI / extra_params"}
    fanova = built.importances["fANOVA / best_score"]
    assert set(fanova) == {"model.variant", "model.placement", "model.prompt_length_encoder", "model.bottleneck",
                           "train.lr"}
    assert fanova["model.variant"] + fanova["train.lr"] > 0.9  # the two that vary explain the scores
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {
        "optimization_history.png", "parallel_coordinates.png", "importances.png", "pareto_front.png"}
    text = report.render(built, 65.0, "MLflow: x")
    assert "Best trial b by best_score" in text and "Pareto front" in text and "1 failed" in text
    assert "1 stopped early by ASHA, " in text
    study.space.budget.time_budget_s = 600.0  # then a trial may have been stopped by the budget instead
    assert "1 stopped early by ASHA or the time budget, " in report.render(built, 65.0, "MLflow: x")
    assert "non-finite loss (nan) at step 12" in text
    assert report.trials_table(built)["outcome"].tolist() == ["complete"] * 4 + ["stopped", "failed"]


def test_trials_are_ranked_by_the_model_they_deliver(tmp_path, monkeypatch):
    """A trial that peaked early and then overfit delivers its best-validation checkpoint: it is ranked (best trial,
    Pareto front, Optuna's value) by best_score, not by its last score."""
    peaked = rows()
    peaked[2].metrics.update(score=40.0, best_score=80.0, best_step=50)  # c: 80 at step 50, 40 at the end
    for r in peaked[:2] + peaked[3:5]:
        r.metrics["best_score"] = r.metrics["score"]
    study = Study("s", tmp_path / "s", load_space(SPACES / "default.yaml"))
    monkeypatch.setattr(report, "collect", lambda study, grid: peaked)
    built = report.build(study, None, tmp_path / "plots")
    assert built.best.trial_id == "c"
    assert {r.trial_id for r in built.pareto} == {"b", "c", "d"}  # by its last score (40) c would be dominated
    values = {t.user_attrs["trial_id"]: t.values for t in report.analysis_study(study, peaked).trials
              if t.state == TrialState.COMPLETE}
    assert values["c"] == [80.0, 120_000]
    metrics, tags = report.summary(built)
    assert metrics["best_score"] == 80.0 and tags["hpsearch.best_trial"] == "c"
    assert study.space.primary.metric == "score" and study.space.primary.final_metric == "best_score"


def test_single_objective_report_has_intermediate_values(tmp_path, monkeypatch):
    study = Study("s", tmp_path / "s", load_space(SPACES / "default.yaml", []))
    study.space.objectives = study.space.objectives[:1]
    monkeypatch.setattr(report, "collect", lambda study, grid: rows())
    built = report.build(study, None, tmp_path / "plots")
    assert built.pareto == [] and "intermediate_values" in built.plots
    pruned = [t for t in report.analysis_study(study, built.rows).trials if t.state == TrialState.PRUNED]
    assert pruned[0].intermediate_values == {50: 99.0}


def test_failure_reason_is_the_non_finite_loss_line():
    wrapped = RuntimeError("Training failed.\nTraceback (most recent call last):\n  File x\n"
                           "hpsearch.train.NonFiniteLoss: non-finite loss (nan) at step 7: stopping the run\n")
    assert failure_reason(wrapped) == "non-finite loss (nan) at step 7: stopping the run"
    assert failure_reason(RuntimeError("a\nworker died")) == "worker died"


def test_no_importance_plot_when_the_report_says_none(tmp_path, monkeypatch):
    one = [r for r in rows() if r.trial_id in ("a", "e", "f")]  # one complete trial: importances cannot be computed
    study = Study("s", tmp_path / "s", load_space(SPACES / "default.yaml"))
    monkeypatch.setattr(report, "collect", lambda study, grid: one)
    built = report.build(study, None, tmp_path / "plots")
    assert built.importances == {} and any("need at least 2 trials" in n for n in built.notes)
    assert "importances" not in built.plots and not (tmp_path / "plots" / "importances.png").exists()
    text = report.render(built, 1.0, "MLflow: x")
    assert "Hyperparameter importances" not in text


def test_importances_from_few_trials_are_caveated(tmp_path, monkeypatch):
    study = Study("s", tmp_path / "s", load_space(SPACES / "default.yaml"))
    monkeypatch.setattr(report, "collect", lambda study, grid: rows())
    built = report.build(study, None, tmp_path / "plots")
    assert any("from only 4 trials" in n and "indicative" in n for n in built.notes)


def test_yardsticks_flag_trials_below_majority_and_ties(tmp_path, monkeypatch):
    tied = rows()
    for r in tied:
        r.metrics.update(majority_score=61.0, chance_score=40.0, test_majority_score=60.0, test_chance_score=41.0,
                         test_score=59.0, **{f"task/t{i}/rows": 50.0 for i in range(2)})
        r.metrics.setdefault("best_score", r.metrics.get("score"))
    tied[1].metrics["best_score"] = 62.5  # b leads d (62.0) by 0.5 < one example's worth: 100 / (2 x 50) = 1.0
    study = Study("s", tmp_path / "s", load_space(SPACES / "default.yaml"))
    monkeypatch.setattr(report, "collect", lambda study, grid: tied)
    built = report.build(study, None, tmp_path / "plots")
    text = report.render(built, 1.0, "MLflow: x")
    assert "validation: 62.5 vs majority class 61.0, chance 40.0 (beats always predicting" in text
    assert "test: 59.0 vs majority class 60.0, chance 41.0 (DOES NOT beat" in text
    assert "a tie: the best leads the next trial by 0.50 points" in text
    flags = dict(zip(report.trials_table(built)["trial"], report.trials_table(built)["beats_majority"]))
    assert flags["a"] is False and flags["b"] is True and flags["c"] is False  # 60, 62.5, 55 vs 61
    metrics, _ = report.summary(built)
    assert metrics["majority_score"] == 61.0 and metrics["test_majority_score"] == 60.0


def test_deterministic_failures_are_not_retried():
    from hpsearch.tune.study import deterministic
    assert deterministic("non-finite loss (nan) at step 7: stopping the run")
    assert deterministic("hpsearch.errors.DataError: data.tasks: rte has no training rows")
    assert deterministic("UserError: checkpoint /x: refused, it holds posix.system, not only weights")
    assert not deterministic("RuntimeError: Connection reset by peer")
    assert not deterministic("ray.exceptions.ActorDiedError: The actor died unexpectedly")


def test_a_task_objective_ranks_by_the_delivered_checkpoints_task_score_and_ties_by_that_tasks_rows(tmp_path,
                                                                                                   monkeypatch):
    from hpsearch.tune.space import Objective

    trials = [r for r in rows() if r.outcome == "complete"]
    for r, (last, at_best) in zip(trials, [(90.0, 70.0), (60.0, 71.5), (50.0, 72.0), (40.0, 55.0)]):
        # the task's score at the last evaluation, and at the best suite step (the checkpoint the trial delivers)
        r.metrics.update({"task/t0/score": last, "best_task/t0/score": at_best, "task/t0/rows": 50.0,
                          "task/t1/rows": 50.0, "best_score": r.metrics["score"]})
    study = Study("s", tmp_path / "s", load_space(SPACES / "default.yaml"))
    study.space.objectives = [Objective("task/t0/score", "max")]
    assert study.space.primary.final_metric == "best_task/t0/score"
    monkeypatch.setattr(report, "collect", lambda study, grid: trials)
    built = report.build(study, None, tmp_path / "plots")
    assert built.best.trial_id == "c"  # 72.0 at its best step; a (90 at its last step) delivers 70
    # c leads b by 0.5, less than one t0 example (100 / 50 = 2.0); in suite points (1.0) it would be so too, so
    # widen the lead to 1.5: a tie by t0's yardstick, not by the suite's
    trials[2].metrics["best_task/t0/score"] = 73.0
    text = report.render(report.build(study, None, tmp_path / "plots"), 1.0, "MLflow: x")
    assert "a tie: the best leads the next trial by 1.50 points, less than one example's worth (2.00)" in text
    # a loss, a time or a parameter count has no example's worth: never a tie line
    for metric, mode in (("loss", "min"), ("step_time", "min"), ("extra_params", "min")):
        for r, v in zip(trials, [0.80, 1.90, 0.81, 2.0]):
            r.metrics[metric] = v
        study.space.objectives = [Objective(metric, mode)]
        text = report.render(report.build(study, None, tmp_path / "plots"), 1.0, "MLflow: x")
        assert "a tie" not in text, metric


@pytest.mark.parametrize("objective,best", [("{metric: extra_params, mode: min}", "d"),
                                            ("{metric: extra_params, mode: max}", "c"),
                                            ("{metric: score, mode: max}", "b")])
def test_the_best_trial_follows_the_primary_objectives_direction(tmp_path, monkeypatch, objective, best):
    """The fewest extra parameters win under `min` (d: 40,000; e has fewer but was stopped), the most under `max`."""
    text = (SPACES / "default.yaml").read_text().replace(
        "  - {metric: score, mode: max}\n  - {metric: extra_params, mode: min}\n", f"  - {objective}\n")
    assert text.count(objective) == 1
    (tmp_path / "space.yaml").write_text(text)
    study = Study("s", tmp_path / "s", load_space(tmp_path / "space.yaml"))
    monkeypatch.setattr(report, "collect", lambda study, grid: rows())
    assert report.build(study, None, tmp_path / "plots").best.trial_id == best


def test_a_study_interrupted_between_trials_keeps_the_trials_its_time_budget_has_left():
    """With `budget.time_budget_s`, a Ctrl-C between two trials (every trial Tune saved has ended) counted the study
    as finished: its report came out and the rest of its budget was lost. It has trials to go until the driver's
    time has spent the budget; after that, only those Tune had started."""
    from hpsearch.tune.study import trials_left

    ended = ["TERMINATED", "TERMINATED", "ERROR"]
    assert trials_left(ended, 8, None, 100.0) == 5
    assert trials_left(ended, 8, 600.0, 100.0) == 5  # interrupted with 500 s of the budget left
    assert trials_left(ended, 8, 600.0, 600.0) == 0  # the budget ended the study
    assert trials_left([*ended, "PAUSED"], 8, 600.0, 700.0) == 1  # interrupted after it: the started one is left
    assert trials_left([*ended, "RUNNING"], 2, None, 0.0) == 1  # Tune's trials beyond the number asked for


def test_the_drivers_time_is_saved_while_the_trials_run():
    """With a time budget, whether a study has trials left depends on the driver's time so far, which was saved
    only when the trials returned: a driver killed outright (SIGKILL, the OOM killer) left none, and a study whose
    budget was spent then counted as interrupted at every --resume, never reporting. It is saved every few seconds
    meanwhile, counted from the study's time before this run."""
    import time

    from hpsearch.tune.cli import _ElapsedKeeper

    saved = []
    study = type("Study", (), {"update_state": lambda self, **values: saved.append(values["elapsed_s"])})()
    keeper = _ElapsedKeeper(study, 100.0, time.time(), every=0.05)
    time.sleep(0.4)
    keeper.stop()
    count = len(saved)
    time.sleep(0.15)
    assert count >= 3 and len(saved) == count  # stopped: no more writes
    assert all(100.0 < a < b < 101.0 for a, b in zip(saved, saved[1:]))
