"""The end of a study: the best trial, a table of all trials, the Pareto front, importances and plots.

Built from Tune's results in an Optuna study of its own in which only trials that ran the whole budget are
COMPLETE: ASHA-stopped trials are PRUNED and failed ones FAIL, so truncated scores never reach the Pareto front
or the importances. Plots are Optuna's matplotlib ones, saved as PNG.
"""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpsearch.tune.study import Study, early_stoppers

FEW_TRIALS = 10  # complete trials below which importances are caveated
SUMMARY_METRICS = ("step", "score", "best_score", "best_step", "test_score", "extra_params", "step_time", "loss")


@dataclass
class TrialRow:
    trial_id: str
    outcome: str                       # complete | stopped | failed
    config: dict[str, Any]             # the searched values
    metrics: dict[str, Any]            # the last result
    history: list[dict] = field(default_factory=list)  # every result: (step, metric...) for intermediate values
    error: str = ""


@dataclass
class Report:
    study: Study
    rows: list[TrialRow]
    best: TrialRow | None
    pareto: list[TrialRow]
    importances: dict[str, dict[str, float]]  # "<evaluator> / <objective>" -> {param: importance}
    notes: list[str]
    plots: dict[str, Path]

    def counts(self) -> dict[str, int]:
        return {k: sum(r.outcome == k for r in self.rows) for k in ("complete", "stopped", "failed")}


def collect(study: Study, result_grid) -> list[TrialRow]:
    rows = []
    for result in result_grid:
        metrics = dict(result.metrics or {})
        trial_id = metrics.get("trial_id") or Path(result.path).name.removeprefix("trial_")
        df = result.metrics_dataframe
        history = df.to_dict("records") if df is not None and not df.empty else []
        failed = result.error is not None
        error = str(result.error).strip().splitlines()[-1] if failed and str(result.error).strip() else ""
        rows.append(TrialRow(trial_id, study.outcome(metrics, failed), dict(result.config or {}), metrics, history,
                             error))
    return rows


def analysis_study(study: Study, rows: list[TrialRow]):
    import optuna
    from optuna.trial import TrialState, create_trial

    space = study.space
    directions = ["maximize" if o.mode == "max" else "minimize" for o in space.objectives]
    ostudy = optuna.create_study(directions=directions, study_name=study.name)
    for row in rows:
        params, dists = row.config, space.distributions(row.config)
        attrs = {"trial_id": row.trial_id, "outcome": row.outcome}
        values = [o.final_value(row.metrics) for o in space.objectives]
        if row.outcome == "complete" and all(_finite(v) for v in values):
            trial = create_trial(values=values, params=params, distributions=dists, user_attrs=attrs)
        elif row.outcome == "stopped" and not space.multi_objective:
            curve = {int(h["step"]): h[space.primary.metric] for h in row.history
                     if "step" in h and _finite(h.get(space.primary.metric))}
            trial = create_trial(state=TrialState.PRUNED, params=params, distributions=dists, user_attrs=attrs,
                                 intermediate_values=curve)
        else:
            state = TrialState.PRUNED if row.outcome == "stopped" else TrialState.FAIL
            trial = create_trial(state=state, params=params, distributions=dists, user_attrs=attrs)
        ostudy.add_trial(trial)
    return ostudy


def build(study: Study, result_grid, plot_dir: Path) -> Report:
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rows = collect(study, result_grid)
    space = study.space
    ostudy = analysis_study(study, rows)
    complete = [r for r in rows if r.outcome == "complete"]
    sign = 1 if space.primary.mode == "max" else -1
    primary = space.primary
    scored = [r for r in complete if _finite(primary.final_value(r.metrics))]
    best = max(scored, key=lambda r: sign * primary.final_value(r.metrics)) if scored else None
    by_id = {r.trial_id: r for r in rows}
    pareto = []
    if space.multi_objective:
        pareto = [by_id[t.user_attrs["trial_id"]] for t in ostudy.best_trials]
    notes: list[str] = []
    importances = _importances(ostudy, space, notes)
    plots = _plots(ostudy, space, plot_dir, notes, importances)
    return Report(study, rows, best, pareto, importances, notes, plots)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _targets(space):
    """(name, target) per objective: Optuna needs a target for multi-objective importances and plots."""
    if not space.multi_objective:
        return [(space.primary.final_metric, None)]
    return [(o.final_metric, (lambda t, i=i: t.values[i])) for i, o in enumerate(space.objectives)]


def _importances(ostudy, space, notes: list[str]) -> dict[str, dict[str, float]]:
    from optuna.trial import TrialState

    n = len(ostudy.get_trials(states=(TrialState.COMPLETE,)))
    if n < 2:
        notes.append(f"importances: need at least 2 trials that ran the whole budget, have {n}")
        return {}
    from optuna.importance import (  # 1.3 s of imports (scikit-learn), only when there is something to compute
        MeanDecreaseImpurityImportanceEvaluator,
        get_param_importances,
    )
    if n < FEW_TRIALS:
        notes.append(f"importances: from only {n} trials that ran the whole budget; indicative at best "
                     f"(below {FEW_TRIALS} they mostly reflect which values happened to be drawn)")
    out = {}
    # variance-based, so the same for a maximised and a minimised target (PED-ANOVA's top quantile is not)
    evaluators = {"fANOVA": _fanova,
                  "MDI": lambda: MeanDecreaseImpurityImportanceEvaluator(seed=0)}
    for name, target in _targets(space):
        for label, make in evaluators.items():
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    out[f"{label} / {name}"] = get_param_importances(ostudy, evaluator=make(), target=target)
            except (ValueError, RuntimeError, ZeroDivisionError) as e:
                notes.append(f"importances ({label}, {name}): not computed ({str(e).splitlines()[0]})")
    return out


def _fanova():
    from optuna.importance import FanovaImportanceEvaluator  # imported only when importances are computed
    return FanovaImportanceEvaluator(seed=0)


def _plot_evaluator(importances: dict[str, float] | None):
    """The evaluator of the importance plot: the report's own fANOVA importances when it has them (one forest
    fitted, not two: the plot then shows the very numbers the report prints), else fANOVA afresh."""
    if importances is None:
        return _fanova()
    from optuna.importance import BaseImportanceEvaluator

    class Computed(BaseImportanceEvaluator):
        def evaluate(self, study, params=None, *, target=None) -> dict[str, float]:
            return {p: importances[p] for p in (params or importances)}
    return Computed()


def _plots(ostudy, space, plot_dir: Path, notes: list[str], importances: dict) -> dict[str, Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as vis

    plot_dir.mkdir(parents=True, exist_ok=True)
    name, target = _targets(space)[0]
    valid_importances = not any(n.startswith("importances: need") for n in notes)
    kw = {"target": target, "target_name": name} if target else {"target_name": name}
    jobs = {"optimization_history": lambda: vis.plot_optimization_history(ostudy, **kw),
            "parallel_coordinates": lambda: vis.plot_parallel_coordinate(ostudy, **kw),
            "importances": lambda: vis.plot_param_importances(
                ostudy, evaluator=_plot_evaluator(importances.get(f"fANOVA / {name}")), **kw)}
    if not valid_importances:  # never a plot the report calls invalid
        del jobs["importances"]
    if space.multi_objective:
        names = [o.final_metric for o in space.objectives]
        jobs["pareto_front"] = lambda: vis.plot_pareto_front(ostudy, target_names=names)
    else:
        jobs["intermediate_values"] = lambda: vis.plot_intermediate_values(ostudy)
    saved = {}
    for label, draw in jobs.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ax = draw()
            fig = (ax.flat[0] if hasattr(ax, "flat") else ax).get_figure()
            fig.set_size_inches(10, 6)
            fig.tight_layout()
            fig.savefig(plot_dir / f"{label}.png", dpi=100)
            saved[label] = plot_dir / f"{label}.png"
        except Exception as e:  # a plot Optuna cannot draw for this study (e.g. too few complete trials)
            notes.append(f"plot {label}: not drawn ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
        finally:
            plt.close("all")
    return saved


# ---- text ----------------------------------------------------------------------------------------------------------
def trials_table(report: Report):
    import pandas as pd

    space = report.study.space
    metrics = [*dict.fromkeys([*SUMMARY_METRICS, *(o.metric for o in space.objectives)])]
    records = []
    for row in report.rows:
        rec = {"trial": row.trial_id, "outcome": row.outcome, "method": _method(report, row)}
        rec.update({m: row.metrics.get(m) for m in metrics})
        majority = row.metrics.get("majority_score")
        rec["beats_majority"] = (None if not (_finite(majority) and _finite(row.metrics.get("best_score")))
                                 else bool(row.metrics["best_score"] > majority))
        rec.update({p.name: row.config.get(p.name) for p in space.params})
        rec["error"] = row.error
        records.append(rec)
    df = pd.DataFrame.from_records(records)
    if not df.empty and df["error"].eq("").all():
        df = df.drop(columns="error")
    return df


def pareto_table(report: Report):
    import pandas as pd
    space = report.study.space
    return pd.DataFrame.from_records([{"trial": r.trial_id, "method": _method(report, r),
                                       **{o.final_metric: o.final_value(r.metrics)
                                                                 for o in space.objectives}, **r.config}
                                      for r in report.pareto])


def _method(report: Report, row: TrialRow) -> str:
    """The trial's method, with HyperPrompt's variant (the method is searched or fixed by the space)."""
    cfg = report.study.space.config.model
    method = row.config.get("model.method", cfg.method)
    if method == "hyperprompt":
        return f"hyperprompt-{row.config.get('model.variant', cfg.variant)}"
    return method


def importance_table(report: Report):
    """Parameter x (evaluator / objective); `-` where a conditional parameter is missing from some complete trial
    (Optuna rates only parameters every trial has)."""
    import pandas as pd
    return pd.DataFrame(report.importances).round(3).fillna("-")


def render(report: Report, elapsed_s: float, mlflow_line: str) -> str:
    import pandas as pd

    space = report.study.space
    counts = report.counts()
    objectives = ", ".join(f"{o.metric} ({o.mode})" for o in space.objectives)
    lines = [f"Study '{report.study.name}' ({space.path}): {len(report.rows)} trials in {elapsed_s / 60:.1f} min "
             f"({counts['complete']} ran the whole budget, {counts['stopped']} stopped early by "
             f"{early_stoppers(space)}, {counts['failed']} failed); objectives: {objectives}", ""]
    best = report.best
    if best:
        shown = ", ".join(f"{m}={_fmt(best.metrics.get(m))}"
                          for m in ("best_score", "best_step", "score", "test_score", "extra_params"))
        lines += [f"Best trial {best.trial_id} by {space.primary.final_metric}: {shown}"]
        lines += _yardstick_lines(report)
        lines += [f"  {k} = {v}" for k, v in sorted(best.config.items())]
        config = Path(report.study.dir, "trials", best.trial_id, "config.yaml")
        lines += [f"  its run config: {config}", ""]
    else:
        lines += ["No trial ran its whole budget: no best trial.", ""]
    with pd.option_context("display.width", 250, "display.max_columns", 50, "display.max_colwidth", 60):
        lines += ["All trials:", trials_table(report).to_string(index=False), ""]
        if space.multi_objective:
            lines += [f"Pareto front ({objectives}; trials that ran the whole budget):"]
            lines += [pareto_table(report).to_string(index=False) if report.pareto else "  (empty)", ""]
        if report.importances:
            lines += ["Hyperparameter importances (complete trials):", importance_table(report).to_string(), ""]
    lines += [f"Note: {n}" for n in report.notes]
    if report.plots:
        lines += [f"Plots: {', '.join(str(p) for p in report.plots.values())}"]
    lines += [mlflow_line]
    return "\n".join(lines)


def _yardstick_lines(report: Report) -> list[str]:
    """The best trial's scores beside majority-class and chance on the same splits; a tie when it leads the
    runner-up by less than one example's worth of the score it is ranked by (the suite's, or one task's; other
    objectives, a loss or a time, have no such yardstick)."""
    best, m = report.best, report.best.metrics
    lines = []
    for split, score, prefix in (("validation", "best_score", ""), ("test", "test_score", "test_")):
        majority, chance = m.get(f"{prefix}majority_score"), m.get(f"{prefix}chance_score")
        if _finite(m.get(score)) and _finite(majority):
            verdict = "beats" if m[score] > majority else "DOES NOT beat"
            lines.append(f"  {split}: {m[score]:.1f} vs majority class {majority:.1f}, chance {chance:.1f} "
                         f"({verdict} always predicting the majority class)")
    primary = report.study.space.primary
    rows = {k.split("/")[1]: m[k] for k in m if k.startswith("task/") and k.endswith("/rows") and _finite(m[k])
            and m[k] > 0}
    task = primary.metric.split("/")[1] if primary.metric.startswith("task/") else None
    if primary.metric in ("score", "best_score") and rows:
        step = 100.0 / (len(rows) * min(rows.values()))  # one example of the smallest task, in suite-score points
    elif task in rows:
        step = 100.0 / rows[task]  # one example of that task
    else:
        step = None
    if step is not None:
        others = sorted((primary.final_value(r.metrics) for r in report.rows
                         if r is not best and r.outcome == "complete" and _finite(primary.final_value(r.metrics))),
                        reverse=primary.mode == "max")
        if others and abs(primary.final_value(m) - others[0]) < step:
            lines.append(f"  a tie: the best leads the next trial by {abs(primary.final_value(m) - others[0]):.2f} "
                         f"points, less than one example's worth ({step:.2f}); the ranking is not meaningful")
    return lines


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)



# ---- for the parent MLflow run --------------------------------------------------------------------------------
def summary(report: Report) -> tuple[dict[str, float], dict[str, str]]:
    """(metrics, tags): trial counts, the best trial's objectives and test score, its id and searched values."""
    metrics: dict[str, float] = {f"trials_{k}": v for k, v in report.counts().items()}
    if not report.best:
        return metrics, {}
    best = report.best
    objectives = report.study.space.objectives
    values = {o.metric: o.final_value(best.metrics) for o in objectives}
    values["test_score"] = best.metrics.get("test_score")
    metrics.update({f"best_{m}": v for m, v in values.items() if _finite(v)})
    yardsticks = ("majority_score", "chance_score", "test_majority_score", "test_chance_score")
    metrics.update({k: best.metrics[k] for k in yardsticks if _finite(best.metrics.get(k))})
    return metrics, {"hpsearch.best_trial": best.trial_id, "hpsearch.best_config": json.dumps(best.config)}


def files(report: Report, text: str) -> dict[str, str]:
    """The report's files: summary, trial table, the best trial's run config, Pareto front, importances."""
    from hpsearch.config import dump_yaml

    out = {"summary.txt": text + "\n", "trials.csv": trials_table(report).to_csv(index=False)}
    if report.best:
        out["best_config.yaml"] = dump_yaml(report.study.trial_config(report.best.config, report.best.trial_id))
    if report.pareto:
        out["pareto_front.csv"] = pareto_table(report).to_csv(index=False)
    if report.importances:
        out["importances.json"] = json.dumps(report.importances, indent=2) + "\n"
    return out
