"""`python -m hpsearch.compare`: the spec's validation, the intervals (against scipy and by hand), --from-study, the
table and plots from given results, the one-line errors before Ray starts, and (slow) a tiny comparison end to end
with the MLflow store read back."""
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from hpsearch.compare.spec import Stats, load_spec
from hpsearch.compare.stats import bootstrap_interval, interval, paired, t_interval
from hpsearch.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SPACES = ROOT / "search_spaces"

TINY = """\
name: tiny
model: {backbone: t5-tiny}
data: {source: synthetic, synthetic_train_rows: 200, synthetic_eval_rows: 40}
train: {micro_batch_size: 16, warmup_steps: 2, log_every: 10}
methods:
  mtl: {method: mtl}
  hyperprompt-global: {method: hyperprompt, model.variant: global, model.prompt_length_encoder: 4,
                       model.prompt_length_decoder: 2, model.bottleneck: 8}
seeds: 2
budget: {max_steps: 10, eval_every: 10, max_failures: 0}
resources: {workers: 1, cpus_per_worker: 0.9, trial_cpus: 0.1}
probe: {rows_per_task: 4, reps: 1}
"""


def write(tmp_path, text, name="spec.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- intervals ----------------------------------------------------------------------------------------------------
def test_t_interval_by_hand():
    # mean 72, s = 2, t_{0.975, 2} = 4.302652729911275: half-width 4.302652729911275 * 2 / sqrt(3)
    iv = t_interval([70.0, 72.0, 74.0])
    half = 4.302652729911275 * 2 / math.sqrt(3)
    assert iv.mean == 72.0 and iv.n == 3
    assert iv.low == pytest.approx(72 - half, abs=1e-9) and iv.high == pytest.approx(72 + half, abs=1e-9)
    assert iv.low == pytest.approx(67.03172457649934) and iv.text() == "72.0 ± 5.0"


@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
@pytest.mark.parametrize("values", [[61.2, 64.8, 59.9], [0.5, -1.25, 3.0, 2.75, 1.0], [88.0, 90.5]])
def test_t_interval_matches_scipy(values, confidence):
    low, high = sps.t.interval(confidence, len(values) - 1, loc=np.mean(values), scale=sps.sem(values))
    iv = t_interval(values, confidence)
    assert (iv.low, iv.high) == (pytest.approx(low, abs=1e-9), pytest.approx(high, abs=1e-9))


@pytest.mark.parametrize("method", ["BCa", "percentile", "basic"])
def test_bootstrap_interval_matches_scipy_with_the_same_seed(method):
    values = [61.2, 64.8, 59.9, 66.3, 63.1, 60.4, 65.0, 62.7, 63.9, 61.8]
    ref = sps.bootstrap((np.array(values),), np.mean, confidence_level=0.95, n_resamples=2000, method=method,
                        random_state=np.random.default_rng(7), vectorized=True).confidence_interval
    iv = bootstrap_interval(values, 0.95, resamples=2000, seed=7, method=method)
    assert (iv.low, iv.high) == (pytest.approx(ref.low, abs=1e-9), pytest.approx(ref.high, abs=1e-9))
    assert iv.mean == pytest.approx(np.mean(values))
    again = interval(values, Stats(interval="bootstrap", resamples=2000, seed=7, bootstrap_method=method))
    assert again == iv  # seeded: the same interval every time
    # over fewer values (failed runs left fewer than the 10 seeds a bootstrap spec needs): the t interval
    fewer = interval(values[:9], Stats(interval="bootstrap", resamples=2000, seed=7, bootstrap_method=method))
    assert fewer == t_interval(values[:9]) and "±" in fewer.text()


def test_interval_edge_cases():
    assert math.isnan(t_interval([]).mean) and t_interval([]).text() == "–"
    one = t_interval([71.5])
    assert one.mean == 71.5 and math.isnan(one.low) and one.text() == "71.5"
    same = bootstrap_interval([3.0, 3.0, 3.0])
    assert (same.low, same.high) == (3.0, 3.0)
    assert interval([1.0, float("nan"), 3.0]).n == 2  # a missing score is left out, not averaged in


def test_paired_difference_on_the_seeds_both_have():
    a = {0: 71.0, 1: 74.0, 2: 70.0, 3: 69.0}
    b = {0: 70.0, 1: 71.0, 2: 71.0, 5: 50.0}
    p = paired(a, b)
    assert p.seeds == [0, 1, 2] and (p.wins, p.losses) == (2, 1)
    ref = t_interval([1.0, 3.0, -1.0])
    assert p.diff == ref and p.diff.mean == pytest.approx(1.0)


# ---- the spec -----------------------------------------------------------------------------------------------------
def test_shipped_specs_load():
    spec = load_spec(SPACES / "compare-synthetic.yaml")
    # the paper's table: HyperPrompt, its baselines and the wider design space: every method of the library
    from hpsearch.model.config import METHODS
    assert {m.method for m in spec.methods} == set(METHODS) and len(spec.methods) == 10
    assert spec.config.data.batching == "mixed"  # PHA's instance loss needs other tasks' rows
    assert spec.seeds == [0, 1, 2] and spec.config.train.num_workers == 1
    assert spec.references == ["mtl", "hyperprompt-global"] and spec.config.data.source == "synthetic"
    if (ROOT / "../shared/data/glue").is_dir():
        glue = load_spec(SPACES / "compare-glue-local.yaml")
        assert glue.sweep and glue.sweep.field == "model.prompt_length_encoder"
        assert glue.config.model.backbone == "runs/pretrain/backbone"  # python -m hpsearch.pretrain makes it
        assert [m.sweep_value for m in glue.sweep_entries()] == [4, 32]  # 16 is hyperprompt-global itself


def test_spec_methods_overrides_and_seeds(tmp_path):
    spec = load_spec(write(tmp_path, TINY), ["methods.mtl.train.lr=3e-3", "seeds=10", "budget.max_steps=40",
                                              "stats.interval=bootstrap"])
    mtl, hp = spec.methods
    assert mtl.config.train.lr == 3e-3 and hp.config.train.lr == 1e-3 and spec.seeds == list(range(10))
    with pytest.raises(ConfigError, match=r"stats.interval: 'bootstrap'; expected t with 3 seeds: a bootstrap needs "
                                          r"at least 10 \(over fewer it covers far less"):
        load_spec(write(tmp_path, TINY), ["seeds=3", "stats.interval=bootstrap"])
    assert hp.config.model.method == "hyperprompt" and hp.config.model.bottleneck == 8
    assert spec.config.train.max_steps == 40 and hp.config.train.max_steps == 40
    assert spec.stats.interval == "bootstrap"
    from hpsearch.compare.run import Comparison
    cfg = Comparison("tiny", tmp_path / "tiny", spec).trial_config({"method": "hyperprompt-global", "seed": 2}, "t1")
    assert (cfg.train.seed, cfg.data.seed, cfg.train.output_dir) == (2, 2, str(tmp_path / "tiny" / "trials" / "t1"))
    assert cfg.data.data_seed == spec.config.data.data_seed  # the same data for every seed


@pytest.mark.parametrize("change, line, message", [
    (("  mtl: {method: mtl}", "  mtl: {method: ia3}"), 6, "methods.mtl.method: 'ia3' is not a method; expected one "
     "of mtl, hyperprompt"),
    (("seeds: 2", "seeds: 0"), 9, "seeds: 0; expected an integer from 1 to 1000"),
    (("seeds: 2", "seeds: [1, 1]"), 9, "seeds: [1, 1]"),
    (("seeds: 2", "seeds: 1000000000000"), 9, "seeds: 1000000000000; expected an integer from 1 to 1000"),
    (("seeds: 2", "seeds: [0, 4294967296]"), 9, "a list of at most 1000 distinct integers from 0 to 4294967295"),
    (("  mtl: {method: mtl}", "  mtl: {method: mtl}\n  mt+l: {method: mtl}\n  mt_l: {method: mtl}"), 8,
     "methods: labels 'mt+l' and 'mt_l' are one MLflow metric name ('mt_l'); rename one"),
    (("seeds: 2", "seedz: 2"), 9, "unknown key 'seedz'"),
    (("  mtl: {method: mtl}", "  mtl: {method: mtl, model.variant: share}"), 6, "method mtl does not use variant"),
    (("  mtl: {method: mtl}", "  mtl: {method: mtl, data.temperature: 2}"), 6, "not set per method"),
    (("  mtl: {method: mtl}", "  mtl: {method: mtl, train.lr: 5}"), 6, "train.lr: 5.0 is out of range"),
    (("  mtl: {method: mtl}", "  mtl: {method: mtl, train.seed: 1}"), 6, "train.seed is not set here"),
    (("budget: {max_steps: 10,", "budget: {max_steps: 10, trials: 3,"), 10, "unknown key 'budget.trials'"),
    (("name: tiny", "name: tiny\nreferences: [adapter]"), 2, "references: 'adapter' is not a method of this spec"),
    (("name: tiny", "name: tiny\nsweep: {method: mtl, field: model.prompt_length_encoder, values: [4]}"), 2,
     "method mtl does not use prompt_length_encoder"),
    (("name: tiny", "name: tiny\nsweep: {method: hyperprompt-global, field: model.dropout, values: [null, 0.1]}"), 2,
     "sweep.values: [None, 0.1] has a null; expected each value written out"),
    # a sweep's rows are ordered by value, the method's own among them: its own must be set and of the values' kind
    # (a report sorting None or "auto" among numbers crashed after every trial had run)
    (("name: tiny", "name: tiny\nsweep: {method: hyperprompt-global, field: model.dropout, values: [0.0, 0.1]}"), 2,
     "sweep.field: model.dropout is unset in method hyperprompt-global (its default, null, is the backbone's"),
    (("name: tiny", "name: tiny\nsweep: {method: mtl, field: train.zero_stage, values: [0, 3]}"), 2,
     "sweep.values: [0, 3] and method mtl's own train.zero_stage, 'auto', are not of one kind (numbers and "
     "strings)"),
    (("  mtl: {method: mtl}", f"  {'m' * 65}: {{method: mtl}}"), 6, "expected up to 64 letters, digits"),
    (("probe: {rows_per_task: 4", "probe: {rows_per_task: 0"), 12, "probe.rows_per_task: 0; expected an integer >= 1"),
    (("trial_cpus: 0.1}", "trial_cpus: 0.1, worker_group: ray}"), 11,
     "resources.worker_group: 'ray'; expected auto or always or pool"),
])
def test_spec_mistakes_are_one_line_naming_file_and_line(tmp_path, change, line, message):
    old, new = change
    assert old in TINY
    path = write(tmp_path, TINY.replace(old, new, 1))
    with pytest.raises(ConfigError) as e:
        load_spec(path)
    text = str(e.value)
    assert text.startswith(f"{path}:{line}: ") and message in text and "\n" not in text


@pytest.mark.parametrize("override, message", [
    ("methods.lora.train.lr=1e-3", "no method 'lora' in the spec"),
    ("train.max_steps=5", "train.max_steps is not set here (set budget.max_steps)"),
    ("model.bottleneck=4", "model.bottleneck is set by method hyperprompt-global itself"),
    ("seeds=0", "seeds: 0; expected an integer from 1 to 1000"),
    ("sampler.seed=1", "'sampler.seed' cannot be overridden"),
])
def test_override_mistakes_name_the_override(tmp_path, override, message):
    with pytest.raises(ConfigError) as e:
        load_spec(write(tmp_path, TINY), [override])
    assert str(e.value).startswith(f"override {override!r}: ") and message in str(e.value)


# ---- --from-study -------------------------------------------------------------------------------------------------
SPACE = ("search:\n  model.variant: {type: categorical, choices: [share, global]}\n"
         "  model.bottleneck: {type: categorical, choices: [8, 16]}\n"
         "  train.lr: {type: loguniform, low: 1.0e-4, high: 1.0e-2}\n")


def fake_study(root: Path, name: str, trials: dict[str, tuple[dict, float]], space: str = SPACE) -> Path:
    """A finished study's folder as hpsearch.tune leaves it: state, space copy, trials/<id>/config.yaml+metrics."""
    from hpsearch.config import dump_yaml, load_config

    where = root / name
    (where / "trials").mkdir(parents=True)
    (where / "hpsearch-study.json").write_text(json.dumps({"name": name}))
    (where / "space.yaml").write_text(space)
    for trial_id, (fields, best) in trials.items():
        folder = where / "trials" / trial_id
        folder.mkdir()
        cfg = load_config(overrides=[f"{k}={v}" for k, v in fields.items()])
        (folder / "config.yaml").write_text(dump_yaml(cfg))
        lines = [{"step": 10, "score": best - 5, "best_score": best - 5},
                 {"step": 20, "score": best - 1, "best_score": best, "test_score": best - 2, "final": 1.0}]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (where / "trials" / "unfinished").mkdir()  # stopped by ASHA: no config.yaml, never a candidate
    return where


def test_from_study_takes_each_methods_best_searched_values(tmp_path):
    from hpsearch.compare.fromstudy import apply_best

    fake_study(tmp_path, "s1", {
        "a": ({"model.method": "hyperprompt", "model.variant": "share", "model.bottleneck": 16, "train.lr": 2e-3}, 70),
        "b": ({"model.method": "hyperprompt", "model.variant": "global", "model.bottleneck": 16, "train.lr": 3e-3}, 80),
        "c": ({"model.method": "hyperprompt", "model.variant": "global", "model.bottleneck": 8, "train.lr": 5e-4}, 75),
        "d": ({"model.method": "hyperprompt", "model.variant": "share", "model.bottleneck": 8, "train.lr": 9e-3,
               "model.prompt_length_encoder": 2}, 60),
    })
    text = TINY.replace("seeds: 2", "  hp-share: {method: hyperprompt, model.variant: share}\nseeds: 2")
    spec = load_spec(write(tmp_path, text))
    notes = apply_best(spec, tmp_path, "s1")
    mtl, glob, share = spec.methods
    assert mtl.origin == "spec" and mtl.config.train.lr == 1e-3  # no mtl trial in the study
    # global: the entry sets bottleneck 8 itself (a searched field): only global trials with bottleneck 8 are
    # candidates, so c (75), not b (80, bottleneck 16); the learning rate tuned for that shape travels
    assert glob.origin.startswith("study s1, trial c") and glob.config.train.lr == 5e-4
    assert glob.config.model.bottleneck == 8 and glob.config.model.prompt_length_encoder == 4
    # share: only share trials are candidates: a (70) beats d (60); unsearched fields never travel
    assert share.origin.startswith("study s1, trial a") and share.config.model.variant == "share"
    assert (share.config.train.lr, share.config.model.bottleneck, share.config.model.prompt_length_encoder) == \
        (2e-3, 16, 16)
    assert any("mtl" in n for n in notes) and any("trial c" in n for n in notes)


def test_from_study_never_gives_a_method_another_variants_values_and_keeps_continuous_overrides(tmp_path):
    from hpsearch.compare.fromstudy import apply_best

    # a study of global trials only, searching the bottleneck and the learning rate (the variant fixed, not searched)
    space = SPACE.replace("  model.variant: {type: categorical, choices: [share, global]}\n", "")
    fake_study(tmp_path, "s1", {
        "b": ({"model.method": "hyperprompt", "model.variant": "global", "model.bottleneck": 8, "train.lr": 3e-3}, 80),
        "c": ({"model.method": "hyperprompt", "model.variant": "global", "model.bottleneck": 8, "train.lr": 5e-4}, 75),
    }, space)
    text = TINY.replace("seeds: 2", "  hp-share: {method: hyperprompt, model.variant: share}\nseeds: 2")
    spec = load_spec(write(tmp_path, text))
    notes = apply_best(spec, tmp_path, "s1")
    _, glob, share = spec.methods
    assert glob.origin.startswith("study s1, trial b") and glob.config.train.lr == 3e-3
    assert share.origin == "spec" and share.config.train.lr == 1e-3 and share.config.model.bottleneck == 32
    assert "hp-share: study 's1' has no finished trial of this configuration (2 of method hyperprompt, none with " \
        "model.variant=share)" in " ".join(notes)
    # a command-line learning rate (searched, continuous) is kept, not matched: the best trial's other values travel
    spec = load_spec(write(tmp_path, TINY), ["train.lr=2e-3"])
    apply_best(spec, tmp_path, "s1")
    glob = spec.method("hyperprompt-global")
    assert glob.origin.startswith("study s1, trial b") and glob.config.train.lr == 2e-3
    # so is a shared override of a field the study did not search: tuned values carried to another backbone
    spec = load_spec(write(tmp_path, TINY), ["model.backbone=t5-small"])
    apply_best(spec, tmp_path, "s1")
    glob = spec.method("hyperprompt-global")
    assert glob.origin.startswith("study s1, trial b") and glob.config.model.backbone == "t5-small"
    # a float the study searched among fixed choices is matched like any categorical value
    space = SPACE + "  model.dropout: {type: categorical, choices: [0.0, 0.3]}\n"
    fake_study(tmp_path, "s2", {
        "b": ({"model.method": "hyperprompt", "model.variant": "global", "model.bottleneck": 8, "train.lr": 3e-3,
               "model.dropout": 0.0}, 80),
        "c": ({"model.method": "hyperprompt", "model.variant": "global", "model.bottleneck": 8, "train.lr": 5e-4,
               "model.dropout": 0.3}, 75),
    }, space)
    text = TINY.replace("model.bottleneck: 8}", "model.bottleneck: 8, model.dropout: 0.3}")
    spec = load_spec(write(tmp_path, text))
    apply_best(spec, tmp_path, "s2")
    glob = spec.method("hyperprompt-global")
    assert glob.origin.startswith("study s2, trial c") and glob.config.train.lr == 5e-4


def test_from_study_errors(tmp_path):
    from hpsearch.compare.fromstudy import apply_best

    spec = load_spec(write(tmp_path, TINY))
    with pytest.raises(ConfigError, match=r"--from-study nope: no study 'nope' in .*there is no study there"):
        apply_best(spec, tmp_path / "runs", "nope")
    fake_study(tmp_path / "runs", "prompts", {"a": ({"model.method": "prompt_tuning", "train.lr": 2e-3}, 70)})
    with pytest.raises(ConfigError, match="none of the spec's methods has a finished trial.*prompt_tuning"):
        apply_best(spec, tmp_path / "runs", "prompts")
    with pytest.raises(ConfigError, match="studies there: prompts"):
        apply_best(spec, tmp_path / "runs", "nope")


# ---- the table and the plots from given results ---------------------------------------------------------------------
def fake_results(spec, tasks):
    from hpsearch.compare.run import TrialResult

    out = []
    base = {"mtl": 60.0, "hyperprompt-global": 63.0}
    for label in [m.label for m in spec.entries()]:
        for seed in spec.seeds:
            score = base.get(label, 61.0) + seed + (0.5 if label.endswith("=8") else 0)
            final = {"test_score": score, "best_score": score + 1, "extra_params": 0 if label == "mtl" else 1000,
                     **{f"test/{t}/score": score + i for i, t in enumerate(tasks)}}
            probe = {"probe": 1.0, "gen_ms_per_row": 2.0 if label == "mtl" else 3.0, "backbone_params": 100000.0,
                     **{f"attn/{side}/{layer}/{k}": 0.1 * (layer + 1) for side in ("encoder", "decoder")
                        for layer in (0, 1) for k in ("prompt_mass", "token_entropy")}}
            times = [0.9, 0.1, 0.1] if label == "mtl" else [0.9, 0.2, 0.2]
            out.append(TrialResult(f"{label}-{seed}", label, seed, "complete", final, probe, times))
    out.append(TrialResult("x", "mtl", 9, "failed", {}, {}, [], "TrialFailed: non-finite loss"))
    return out


def test_table_markdown_csv_and_plots(tmp_path):
    from hpsearch.compare import plots
    from hpsearch.compare import table as tables

    text = TINY.replace("seeds: 2", "seeds: 3") + \
        "sweep: {method: hyperprompt-global, field: model.prompt_length_encoder, values: [2, 4, 8]}\n"
    spec = load_spec(write(tmp_path, text))
    tasks = ["first", "last"]
    table = tables.build(spec, fake_results(spec, tasks), tasks, {})
    mtl, hp = table.rows
    assert mtl.scores["suite"] == t_interval([60.0, 61.0, 62.0]) and len(mtl.trials) == 3
    assert hp.step_ratio == pytest.approx(2.0) and hp.gen_ratio == pytest.approx(1.5)  # first interval left out
    assert hp.extra_pct == pytest.approx(1.0)
    (vs_mtl,) = [p for p in table.paired if p.label == "hyperprompt-global" and p.metric == "suite"]
    assert vs_mtl.result.diff.mean == pytest.approx(3.0) and vs_mtl.result.wins == 3
    assert not [p for p in table.paired if p.label == "mtl" and p.reference == "hyperprompt-global"]
    assert [r.entry.config.model.prompt_length_encoder for r in table.sweep] == [2, 4, 8]
    md = tables.markdown(table)
    assert "| hyperprompt-global | 64.0 ± 2.5 | 65.0 ± 2.5 | 64.0 ± 2.5 | 3 | 1,000 | 1 % | 2.00 | 1.50 |" in md
    assert "+3.0 ± 0.0" in md and "Sweep of model.prompt_length_encoder" in md
    assert "mtl seed 9 (trial x): failed (TrialFailed: non-finite loss); left out" in md
    csv = tables.comparison_frame(table)
    assert list(csv["label"])[:2] == ["mtl", "hyperprompt-global"] and csv.loc[1, "suite_mean"] == 64.0
    assert set(tables.paired_frame(table)["metric"]) == {"suite", "first", "last"}
    assert len(tables.per_seed_frame(table)) == 3 * 4 + 1
    assert all("@" not in k and "=" not in k for k in tables.summary(table))  # valid MLflow metric names
    for path in (tables.bar_chart(table, tmp_path / "p" / "scores.png"),
                 plots.attention_plot(table, tmp_path / "p" / "attention.png"),
                 plots.sweep_plot(table, tmp_path / "p" / "sweep.png")):
        assert path.is_file() and path.stat().st_size > 10_000


def test_a_paired_difference_says_which_seeds_it_stands_on(tmp_path, monkeypatch):
    from hpsearch.compare import table as tables
    from hpsearch.compare.run import TrialResult

    spec = load_spec(write(tmp_path, TINY.replace("seeds: 2", "seeds: 3")))
    tasks = ["first", "last"]
    results = [t for t in fake_results(spec, tasks) if t.outcome == "complete"]
    md = tables.markdown(tables.build(spec, results, tasks, {}))
    assert "paired over" not in md and "one seed in common" not in md  # every seed of both: nothing to say

    lost = lambda label, seeds: [TrialResult(t.trial_id, t.label, t.seed, "failed", {}, {}, [], "lost")
                                 if t.label == label and t.seed in seeds else t for t in results]
    md = tables.markdown(tables.build(spec, lost("mtl", {2}), tasks, {}))
    assert ("hyperprompt-global vs mtl: paired over the seeds both finished (0, 1), while the means above are "
            "over each method's own (hyperprompt-global: 3, mtl: 2)") in md
    assert "one seed in common" not in md
    table = tables.build(spec, lost("mtl", {1, 2}), tasks, {})
    (suite,) = [p for p in table.paired if p.metric == "suite"]
    assert suite.result.seeds == [0] and not suite.result.diff.defined
    assert "hyperprompt-global vs mtl: one seed in common, so the difference has no interval" in tables.markdown(table)
    md = tables.markdown(tables.build(spec, lost("mtl", {0, 1, 2}), tasks, {}))
    assert "hyperprompt-global vs mtl: no seed both finished; no paired difference" not in md  # mtl has no seed
    # a method no seed finished gets no bar in the chart (a 0 would read as a measured score), and says so
    import matplotlib.axes
    drawn = {}
    real_bar = matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "bar", lambda ax, x, h, *a, label, **k: (
        drawn.__setitem__(label, list(h)), real_bar(ax, x, h, *a, label=label, **k))[1])
    tables.bar_chart(tables.build(spec, lost("mtl", {0, 1, 2}), tasks, {}), tmp_path / "scores.png")
    assert drawn == {"mtl (no finished seed)": [], "hyperprompt-global": [64.0, 65.0, 64.0]}
    disjoint = [t for t in lost("mtl", {0, 1}) if t.label == "mtl" or t.seed != 2]  # mtl: seed 2 only; hp: 0, 1
    md = tables.markdown(tables.build(spec, disjoint, tasks, {}))
    assert "hyperprompt-global vs mtl: no seed both finished; no paired difference" in md


# ---- the command line: mistakes before Ray starts -------------------------------------------------------------------
def compare_cmd(tmp_path, *args):
    return [sys.executable, "-m", "hpsearch.compare", "--storage-path", str(tmp_path / "runs"), "--tracking-uri",
            f"sqlite:///{tmp_path}/mlflow.db", *args]


@pytest.mark.parametrize("case, message", [
    ("unknown method", "methods.hyperprompt-global.method: 'hyperprompt_v2' is not a method"),
    ("seeds 0 in the spec", "seeds: 0; expected an integer from 1 to 1000"),
    ("--seeds 0", "--seeds: 0; expected an integer from 1 to 1000"),
    ("no such study", "--from-study nope: no study 'nope' in"),
    ("deleted experiment", "MLflow experiment hpsearch/gone is deleted in sqlite:///"),
    ("from-study not a name", "--from-study '../x': expected a plain name"),
    ("spec name not a name", "spec.yaml: name: 'a b': expected a plain name"),
])
def test_command_line_mistakes_are_one_line_before_ray_starts(tmp_path, case, message):
    text, args = TINY, []
    if case == "deleted experiment":  # in the MLflow UI's trash: it would take no runs (MLflow's error after Ray)
        from mlflow import MlflowClient
        client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
        client.delete_experiment(client.create_experiment("hpsearch/gone"))
        args = ["--name", "gone"]
    elif case == "unknown method":
        text = TINY.replace("{method: hyperprompt,", "{method: hyperprompt_v2,")
    elif case == "seeds 0 in the spec":
        text = TINY.replace("seeds: 2", "seeds: 0")
    elif case == "--seeds 0":
        args = ["--seeds", "0"]
    elif case == "from-study not a name":
        args = ["--from-study", "../x"]
    elif case == "spec name not a name":
        text = TINY.replace("name: tiny", "name: a b")
    else:
        args = ["--from-study", "nope"]
    spec = write(tmp_path, text)
    out = subprocess.run(compare_cmd(tmp_path, "--spec", str(spec), *args), cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "ray" not in out.stdout.lower()
    assert (case == "deleted experiment") == (tmp_path / "mlflow.db").exists()  # nothing started
    assert not (tmp_path / "runs").exists()


def test_comparisons_started_together_take_a_name_each(tmp_path):
    """Nothing marked a comparison's name taken until it saved its state, after its MLflow run: two started
    together took one folder, one overwriting the other's state and report (found by an independent review). The
    checks now end by claiming the folder: without --name the second takes the next free name, with it, one line."""
    from hpsearch.compare.cli import parse_args, prepare

    spec = write(tmp_path, TINY)
    base = ["--spec", str(spec), "--storage-path", str(tmp_path / "runs"), "--tracking-uri",
            f"sqlite:///{tmp_path}/mlflow.db"]
    first, second = prepare(parse_args(base))[0], prepare(parse_args(base))[0]
    assert (first.name, second.name) == ("tiny", "tiny-2") and first.dir.is_dir() and second.dir.is_dir()
    prepare(parse_args([*base, "--name", "mine"]))
    with pytest.raises(ConfigError, match="--name mine: a study or comparison of that name already exists"):
        prepare(parse_args([*base, "--name", "mine"]))


def test_a_comparison_loads_its_suite_once_before_it_starts(tmp_path, monkeypatch):
    """The checks before a comparison starts load the suite once: its tasks and every method's check of its data and
    target lengths (each method's own backbone and max_new_tokens) used to load it once more."""
    import hpsearch.config
    import hpsearch.data
    from hpsearch.compare.cli import parse_args, prepare

    loads, load, checks, check = [], hpsearch.data.load_suite, [], hpsearch.config.check_run_data
    monkeypatch.setattr(hpsearch.data, "load_suite", lambda cfg: loads.append(cfg.source) or load(cfg))
    monkeypatch.setattr(hpsearch.config, "check_run_data",
                        lambda cfg, *a, **k: checks.append(cfg.train.max_new_tokens) or check(cfg, *a, **k))
    spec = write(tmp_path, TINY.replace("model.bottleneck: 8}", "model.bottleneck: 8, train.max_new_tokens: 6}"))
    prepare(parse_args(["--spec", str(spec), "--storage-path", str(tmp_path / "runs"),
                        "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"]))
    assert loads == ["synthetic"]
    assert sorted(checks) == [6, 8]  # each method's target lengths checked, with the one suite


# ---- end to end ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tiny_comparison_end_to_end_tracks_parent_children_table_and_plots(tmp_path):
    from mlflow import MlflowClient

    from hpsearch.tracking import experiment_name

    spec = write(tmp_path, TINY)
    out = subprocess.run(compare_cmd(tmp_path, "--spec", str(spec)), cwd=tmp_path, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "4 trials, 2 at a time" in out.stdout and "complete: best_score" in out.stdout
    for text in ("| method | first | last | count | contains | lacks | suite |", "| mtl |", "| hyperprompt-global |",
                 "Paired difference in suite test score", f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlflow.db"):
        assert text in out.stdout, text

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name(experiment_name("tiny"))
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("hpsearch.role") == "comparison"]
    children = [r for r in runs if r.data.tags.get("hpsearch.role") == "trial"]
    assert len(parents) == 1 and len(children) == 4 and len(runs) == 5
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.metrics["trials_complete"] == 4
    assert parent.data.tags["hpsearch.command"].startswith("python -m hpsearch.compare --storage-path")
    report = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert {"report/comparison.md", "report/comparison.csv", "report/paired.csv", "report/per_seed.csv"} <= report
    plots = {a.path for a in client.list_artifacts(parent.info.run_id, "report/plots")}
    assert {"report/plots/scores.png", "report/plots/attention.png"} <= plots
    assert "spec.yaml" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    md = Path(client.download_artifacts(parent.info.run_id, "report/comparison.md", str(tmp_path))).read_text()
    assert md.strip().splitlines()[6] in out.stdout  # the printed table is the logged one

    assert {(c.data.tags["hpsearch.label"], c.data.tags["hpsearch.seed"]) for c in children} == \
        {("mtl", "0"), ("mtl", "1"), ("hyperprompt-global", "0"), ("hyperprompt-global", "1")}
    for child in children:
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.info.status == "FINISHED" and child.data.tags["hpsearch.outcome"] == "complete"
        assert child.data.params["train.seed"] == child.data.tags["hpsearch.seed"] == child.data.params["data.seed"]
        for key in ("test_score", "best_score", "step_time", "gen_ms_per_row", "attn/encoder/0/token_entropy"):
            assert key in child.data.metrics, key
        hp = child.data.tags["hpsearch.label"] == "hyperprompt-global"
        assert ("attn/encoder/0/prompt_mass" in child.data.metrics) and \
            (child.data.metrics["attn/encoder/0/prompt_mass"] > 0) == hp


def test_a_labels_parameter_is_an_mlflow_name_and_a_refused_parameter_ends_the_run(tmp_path):
    """A label may hold '+', which MLflow refuses in a parameter's name: the comparison's parent run logged
    `method.hp+g` and crashed after creating the run, which stayed RUNNING. Its parameter is `method.hp_g`; a
    parameter MLflow still refuses ends the run FAILED."""
    from types import SimpleNamespace

    from mlflow import MlflowClient

    from hpsearch.compare.cli import _params
    from hpsearch.tracking import StudyRun

    spec = load_spec(write(tmp_path, TINY.replace("  hyperprompt-global:", "  hp+g:")))
    params = _params(SimpleNamespace(spec=spec, name="tiny"), SimpleNamespace(from_study=None))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    make = lambda p: StudyRun.create(uri, "tiny", space_path=str(spec.path), space_text=spec.text,
                                     command="python -m hpsearch.compare", params=p)
    run = MlflowClient(uri).get_run(make(params).run_id)
    assert "model.variant=global" in run.data.params["method.hp_g"] and run.info.status == "RUNNING"
    with pytest.raises(Exception, match="Invalid value"):
        make({"method.hp+g": "x"})
    runs = MlflowClient(uri).search_runs([run.info.experiment_id], order_by=["start_time DESC"])
    assert [r.info.status for r in runs] == ["FAILED", "RUNNING"]
