"""The comparison's table, from the trials' results: what the paper prints, measured here.

Per method (trials that ran their whole budget): the test score of every task and of the suite (the checkpoint
each trial delivers: its best validation step), mean and interval over seeds; extra parameters, absolute and as
a percentage of the backbone; train step time (the recipe's `step_time`) and generation time (the probe's) as
ratios to the baseline (`references[0]`, normally MTL) measured in the same run; and, seed by seed, the
difference to each reference with its interval and how many seeds it wins. A sweep (Fig. 4) gets its own rows.

Written as Markdown (`comparison.md`), CSV (`comparison.csv`: one row per method; `paired.csv`: every paired
difference, per task too; `per_seed.csv`: every trial) and a bar chart with the intervals (`plots/scores.png`).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from hpsearch.compare.run import TrialResult
from hpsearch.compare.spec import Method, Spec, metric_name
from hpsearch.compare.stats import Interval, Paired, interval, paired

SUITE = "suite"


@dataclass
class Row:
    entry: Method
    trials: list[TrialResult]          # complete ones, by seed
    scores: dict[str, Interval]        # task -> test score; SUITE -> suite test score; "validation" -> best_score
    extra_params: float
    backbone_params: float
    step_time: float                   # seconds, mean over seeds of each trial's median
    gen_ms: float                      # ms per row, mean over seeds
    step_ratio: float = math.nan
    gen_ratio: float = math.nan

    @property
    def label(self) -> str:
        return self.entry.label

    @property
    def extra_pct(self) -> float:
        return 100.0 * self.extra_params / self.backbone_params if self.backbone_params else math.nan

    def per_seed(self, metric: str) -> dict[int, float]:
        key = {SUITE: "test_score", "validation": "best_score"}.get(metric, f"test/{metric}/score")
        return {t.seed: float(t.final[key]) for t in self.trials if _finite(t.final.get(key))}


@dataclass
class PairedRow:
    label: str
    reference: str
    metric: str                        # a task or SUITE
    result: Paired


@dataclass
class Table:
    spec: Spec
    tasks: list[str]
    rows: list[Row]                    # the spec's methods
    sweep: list[Row]                   # the sweep's method at each value (its own value included)
    paired: list[PairedRow]
    trials: list[TrialResult]
    notes: list[str] = field(default_factory=list)

    def row(self, label: str) -> Row | None:
        return next((r for r in self.rows + self.sweep if r.label == label), None)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _mean(values) -> float:
    values = [float(v) for v in values if _finite(v)]
    return statistics.fmean(values) if values else math.nan


def build(spec: Spec, trials: list[TrialResult], tasks: list[str], backbone_params: dict[str, float],
          notes: list[str] = ()) -> Table:
    """The table of `trials`; `backbone_params[label]`: the backbone's size (the probe's count wins)."""
    notes = list(spec.notes) + list(notes)
    by_label: dict[str, list[TrialResult]] = {}
    for t in trials:
        if t.outcome == "complete":
            by_label.setdefault(t.label, []).append(t)
        else:
            notes.append(f"{t.label} seed {t.seed} (trial {t.trial_id}): {t.outcome}"
                         + (f" ({t.error})" if t.error else "") + "; left out")
        if t.outcome == "complete" and not t.probe.get("probe"):
            notes.append(f"{t.label} seed {t.seed}: no generation time or attention statistics "
                         f"({t.probe.get('probe_error', 'the probe did not report')})")

    def make(entry: Method) -> Row:
        done = sorted(by_label.get(entry.label, []), key=lambda t: t.seed)
        measured = [t.probe["backbone_params"] for t in done if _finite(t.probe.get("backbone_params"))]
        size = _mean(measured) if measured else backbone_params.get(entry.label, math.nan)
        row = Row(entry, done, {}, _mean(t.final.get("extra_params") for t in done), size,
                  _mean(t.step_time for t in done), _mean(t.probe.get("gen_ms_per_row") for t in done))
        for metric in [*tasks, SUITE, "validation"]:
            row.scores[metric] = interval(list(row.per_seed(metric).values()), spec.stats)
        return row

    rows = [make(m) for m in spec.methods]
    sweep = []
    if spec.sweep:
        parent = next(r for r in rows if r.label == spec.sweep.method)
        sweep = sorted([parent] + [make(m) for m in spec.sweep_entries()],
                       key=lambda r: r.entry.config.flat()[spec.sweep.field])
    base = next((r for r in rows if r.label == spec.baseline), None)
    for row in rows + [r for r in sweep if r not in rows]:
        if base is not None and _finite(base.step_time) and base.step_time > 0:
            row.step_ratio = row.step_time / base.step_time
        if base is not None and _finite(base.gen_ms) and base.gen_ms > 0:
            row.gen_ratio = row.gen_ms / base.gen_ms
    pairs = []
    for i, ref in enumerate(spec.references):
        reference = next(r for r in rows if r.label == ref)
        for row in rows:
            if row is reference or row.label in spec.references[:i]:  # an earlier reference: already paired
                continue
            mine = [PairedRow(row.label, ref, metric, paired(row.per_seed(metric), reference.per_seed(metric),
                                                             spec.stats)) for metric in [SUITE, *tasks]]
            pairs += mine
            notes += _pairing_notes(row, reference, mine[0].result)
    return Table(spec, tasks, rows, sweep, pairs, trials, notes)


def _pairing_notes(row: Row, reference: Row, suite: Paired) -> list[str]:
    """What a paired suite difference stands on, when it is not every seed of both methods: the rows' means are
    over each method's own seeds, the difference over the seeds both finished."""
    mine, theirs = sorted(row.per_seed(SUITE)), sorted(reference.per_seed(SUITE))
    what = f"{row.label} vs {reference.label}"
    if not suite.seeds:
        return [f"{what}: no seed both finished; no paired difference"] if mine and theirs else []
    notes = []
    if suite.seeds != mine or suite.seeds != theirs:
        notes.append(f"{what}: paired over the seeds both finished ({', '.join(map(str, suite.seeds))}), while "
                     f"the means above are over each method's own ({row.label}: {len(mine)}, "
                     f"{reference.label}: {len(theirs)})")
    if len(suite.seeds) == 1:
        notes.append(f"{what}: one seed in common, so the difference has no interval: it is one run's, "
                     f"not evidence of a difference")
    return notes


# ---- text ----------------------------------------------------------------------------------------------------------
def _interval_name(spec: Spec) -> str:
    s = spec.stats
    what = "Student-t" if s.interval == "t" else f"bootstrap ({s.bootstrap_method}, {s.resamples} resamples)"
    return f"mean ± {100 * s.confidence:g} % {what} interval over seeds" if s.interval == "t" else \
        f"mean [{100 * s.confidence:g} % {what} interval] over seeds"


def _num(v: float, fmt: str) -> str:
    return format(v, fmt) if _finite(v) else "–"


def _params(v: float) -> str:
    return f"{int(round(v)):,}" if _finite(v) else "–"


def _pct(v: float) -> str:
    if not _finite(v):
        return "–"
    return "0 %" if v == 0 else f"{v:.3g} %"


def _md(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header)))
           + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def markdown(table: Table) -> str:
    spec = table.spec
    base = spec.baseline
    seeds = ", ".join(map(str, spec.seeds))
    lines = [f"## Comparison '{spec.name}': {len(spec.methods)} methods x {len(spec.seeds)} seeds ({seeds}), "
             f"{spec.config.train.max_steps} steps, {spec.config.model.backbone}",
             "", f"Test score of the best-validation checkpoint (0-100), {_interval_name(spec)}; n = seeds that ran "
             f"their whole budget. Times relative to {base}, measured in this run.", ""]
    header = ["method", *table.tasks, "suite", "n", "extra params", "% of backbone", f"step time ÷ {base}",
              f"generation ÷ {base}"]
    body = [[r.label, *(r.scores[t].text() for t in table.tasks), r.scores[SUITE].text(), str(len(r.trials)),
             _params(r.extra_params), _pct(r.extra_pct), _num(r.step_ratio, ".2f"), _num(r.gen_ratio, ".2f")]
            for r in table.rows]
    lines += _md(header, body)
    if table.paired:
        refs = spec.references
        lines += ["", "Paired difference in suite test score, method − reference on the same seed "
                  f"({_interval_name(spec)}; wins = seeds where the method scores higher):", ""]
        header = ["method", *(f"vs {ref}" for ref in refs), *(f"wins vs {ref}" for ref in refs)]
        body = []
        for r in table.rows:
            cells = {p.reference: p.result for p in table.paired if p.label == r.label and p.metric == SUITE}
            if not cells:
                continue
            body.append([r.label, *(_signed(cells[ref].diff) if ref in cells else "–" for ref in refs),
                         *(f"{cells[ref].wins}/{len(cells[ref].seeds)}" if ref in cells else "–" for ref in refs)])
        lines += _md(header, body)
    if table.sweep:
        sw = spec.sweep
        short = sw.field.split(".", 1)[1]
        lines += ["", f"Sweep of {sw.field} for {sw.method} (suite test score, {_interval_name(spec)}):", ""]
        header = [short, "suite", "validation", "n", "extra params", f"step time ÷ {base}", f"generation ÷ {base}"]
        body = [[str(r.entry.config.flat()[sw.field]), r.scores[SUITE].text(), r.scores["validation"].text(),
                 str(len(r.trials)), _params(r.extra_params), _num(r.step_ratio, ".2f"), _num(r.gen_ratio, ".2f")]
                for r in table.sweep]
        lines += _md(header, body)
    lines += ["", "Absolute: " + "; ".join(f"{r.label} {_num(r.step_time * 1000, '.1f')} ms/step, "
                                          f"{_num(r.gen_ms, '.2f')} ms/row generated" for r in table.rows)]
    origins = [f"{m.label}: {m.origin}" for m in spec.methods if m.origin != "spec"]
    if origins:
        lines += ["", "Configurations from a study: " + "; ".join(origins)]
    if table.notes:
        lines += ["", *(f"Note: {n}" for n in table.notes)]
    return "\n".join(lines) + "\n"


def _signed(iv: Interval) -> str:
    if iv.n == 0:
        return "–"
    text = iv.text()
    return text if text.startswith("-") else "+" + text


# ---- CSV -----------------------------------------------------------------------------------------------------------
def comparison_frame(table: Table):
    import pandas as pd

    records = []
    for r in table.rows + [s for s in table.sweep if s not in table.rows]:
        rec = {"label": r.label, "method": r.entry.method, "sweep_of": r.entry.parent or "", "origin": r.entry.origin,
               "n": len(r.trials), "seeds": " ".join(str(t.seed) for t in r.trials)}
        for metric in [SUITE, "validation", *table.tasks]:
            iv = r.scores[metric]
            rec.update({f"{metric}_mean": iv.mean, f"{metric}_low": iv.low, f"{metric}_high": iv.high})
        rec.update(extra_params=r.extra_params, backbone_params=r.backbone_params, extra_pct=r.extra_pct,
                   step_time_s=r.step_time, step_time_ratio=r.step_ratio, gen_ms_per_row=r.gen_ms,
                   gen_time_ratio=r.gen_ratio)
        if table.spec.sweep and r in table.sweep:
            rec[table.spec.sweep.field] = r.entry.config.flat()[table.spec.sweep.field]
        records.append(rec)
    return pd.DataFrame.from_records(records)


def paired_frame(table: Table):
    import pandas as pd
    return pd.DataFrame.from_records([
        {"label": p.label, "reference": p.reference, "metric": p.metric, "mean_diff": p.result.diff.mean,
         "low": p.result.diff.low, "high": p.result.diff.high, "n": p.result.diff.n, "wins": p.result.wins,
         "losses": p.result.losses, "seeds": " ".join(map(str, p.result.seeds))} for p in table.paired])


def per_seed_frame(table: Table):
    import pandas as pd

    keys = ["test_score", "best_score", "best_step", *(f"test/{t}/score" for t in table.tasks), "extra_params"]
    return pd.DataFrame.from_records([
        {"label": t.label, "seed": t.seed, "trial": t.trial_id, "outcome": t.outcome,
         **{k: t.final.get(k) for k in keys}, "step_time_s": t.step_time,
         "gen_ms_per_row": t.probe.get("gen_ms_per_row"), "error": t.error} for t in table.trials])


# ---- the bar chart -------------------------------------------------------------------------------------------------
def bar_chart(table: Table, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    groups = [*table.tasks, SUITE]
    rows = table.rows
    width = 0.8 / max(1, len(rows))
    fig, ax = plt.subplots(figsize=(min(16, max(8, 0.9 * len(groups) + 0.22 * len(groups) * len(rows) + 2.5)), 5))
    x = np.arange(len(groups))
    for i, r in enumerate(rows):
        means = np.array([r.scores[g].mean for g in groups], dtype=float)
        low = np.array([r.scores[g].low for g in groups], dtype=float)
        high = np.array([r.scores[g].high for g in groups], dtype=float)
        err = np.vstack([np.where(np.isfinite(low), means - low, 0), np.where(np.isfinite(high), high - means, 0)])
        shown = np.isfinite(means)  # a score no seed produced gets no bar (a 0 would read as measured)
        label = r.label if shown.any() else f"{r.label} (no finished seed)"
        ax.bar((x - 0.4 + width * (i + 0.5))[shown], means[shown], width, yerr=err[:, shown], capsize=2, label=label)
    ax.set_xticks(x, groups)
    ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
    ax.set_ylabel("test score")
    ax.set_title(f"{table.spec.name}: test score, {_interval_name(table.spec)}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---- the parent run's summary --------------------------------------------------------------------------------------
def summary(table: Table) -> dict[str, float]:
    out: dict[str, float] = {"trials_complete": sum(t.outcome == "complete" for t in table.trials),
                             "trials_failed": sum(t.outcome != "complete" for t in table.trials)}
    for r in table.rows + [s for s in table.sweep if s not in table.rows]:
        iv = r.scores[SUITE]
        values = {"test_score_mean": iv.mean, "test_score_low": iv.low, "test_score_high": iv.high,
                  "extra_params": r.extra_params, "step_time_ratio": r.step_ratio, "gen_time_ratio": r.gen_ratio}
        out.update({metric_name(f"{r.label}/{k}"): v for k, v in values.items() if _finite(v)})
    for p in table.paired:
        if p.metric == SUITE and _finite(p.result.diff.mean):
            out[metric_name(f"{p.label}/diff_vs_{p.reference}")] = p.result.diff.mean
    return out
