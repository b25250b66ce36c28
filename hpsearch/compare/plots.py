"""The paper's analyses, from what the trials measured.

- `attention.png` (Fig. 3): per layer of the encoder and the decoder, the attention mass on the prompt positions
  (methods that prompt self-attention: HyperPrompt) and the entropy of the attention over the real tokens, for
  HyperPrompt vs MTL; mean over seeds with the spec's interval. The probe computed both with
  `model.attention_stats` on the exported model of every trial, teacher-forced on the same validation rows.
- `sweep.png` (Fig. 4): the suite test score against the swept field (e.g. the prompt length), mean and interval
  over seeds, when the spec has a sweep.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

from hpsearch.compare.stats import interval
from hpsearch.compare.table import SUITE, Row, Table

ATTN = re.compile(r"attn/(encoder|decoder)/(\d+)/(prompt_mass|token_entropy)")


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def error_bars(ivs) -> list[list[float]]:
    """matplotlib's yerr (below, above) of intervals; 0 where an interval is undefined (one seed)."""
    return [[iv.mean - iv.low if iv.defined else 0 for iv in ivs],
            [iv.high - iv.mean if iv.defined else 0 for iv in ivs]]


def attention_rows(table: Table) -> list[Row]:
    """HyperPrompt methods and the MTL baseline(s), in the table's order."""
    return [r for r in table.rows if r.entry.method in ("hyperprompt", "mtl")]


def attention_series(row: Row, side: str, key: str, stats) -> tuple[list[int], list]:
    """(layers, [Interval over seeds per layer]) of one row's `attn/<side>/<layer>/<key>`."""
    per_layer: dict[int, list[float]] = {}
    for t in row.trials:
        for name, value in t.probe.items():
            m = ATTN.fullmatch(name)
            if m and m.group(1) == side and m.group(3) == key and isinstance(value, (int, float)):
                per_layer.setdefault(int(m.group(2)), []).append(float(value))
    layers = sorted(per_layer)
    return layers, [interval(per_layer[i], stats) for i in layers]


def attention_plot(table: Table, path: Path) -> Path | None:
    rows = [r for r in attention_rows(table) if any(ATTN.fullmatch(k) for t in r.trials for k in t.probe)]
    if not rows:
        return None
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    colour = {row.label: f"C{i}" for i, row in enumerate(rows)}  # one colour per method in every panel
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), squeeze=False)
    panels = [("prompt_mass", "attention mass on prompts"), ("token_entropy", "token-attention entropy (nats)")]
    for i, side in enumerate(("encoder", "decoder")):
        for j, (key, title) in enumerate(panels):
            ax = axes[i][j]
            for row in rows:
                if key == "prompt_mass" and row.entry.method != "hyperprompt":
                    continue  # no prompts: nothing to attend to
                if key == "prompt_mass" and side not in row.entry.config.model.prompted_sides():
                    continue
                layers, ivs = attention_series(row, side, key, table.spec.stats)
                if not layers:
                    continue
                ax.errorbar(layers, [iv.mean for iv in ivs], yerr=error_bars(ivs), marker="o", capsize=3,
                            color=colour[row.label], label=row.label)
            ax.set_title(f"{side}: {title}", fontsize=10)
            ax.set_xlabel("layer")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
            else:
                ax.text(0.5, 0.5, "no prompted layer", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"{table.spec.name}: attention per layer (exported models, validation rows; mean and interval over "
                 "seeds)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def sweep_plot(table: Table, path: Path) -> Path | None:
    if not table.sweep:
        return None
    sw = table.spec.sweep
    plt = _pyplot()
    xs = [r.entry.config.flat()[sw.field] for r in table.sweep]
    ivs = [r.scores[SUITE] for r in table.sweep]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    means = [iv.mean for iv in ivs]
    ax.errorbar(xs, means, yerr=error_bars(ivs), marker="o", capsize=3, label=sw.method)
    base = table.row(table.spec.baseline)
    if base is not None and math.isfinite(base.scores[SUITE].mean):
        ax.axhline(base.scores[SUITE].mean, color="grey", linestyle="--", label=f"{base.label} (mean)")
    numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs)
    if numeric and min(xs) > 0 and max(xs) / min(xs) >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(sw.field)
    ax.set_ylabel("suite test score")
    ax.set_title(f"{table.spec.name}: {sw.method}, score vs {sw.field.split('.', 1)[1]}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
