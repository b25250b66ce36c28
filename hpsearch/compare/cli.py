"""`python -m hpsearch.compare`: methods x seeds on one Ray Tune grid, the paper's table with intervals, in MLflow.

    python -m hpsearch.compare [--spec FILE] [--seeds N] [--from-study NAME] [--tracking-uri URI]
                               [--storage-path PATH] [--name NAME] [key=value ...]

With no arguments it runs `search_spaces/compare-synthetic.yaml`. Overrides set the shared run config
(`train.lr=1e-3`), one method's (`methods.mtl.train.lr=3e-3`) or the spec's budget/resources/stats/probe
(`budget.max_steps=100`). Everything is validated before Ray starts; a mistake is one line and exit code 2.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

from hpsearch.cli import Parser, redacted
from hpsearch.errors import ConfigError

DEFAULT_SPEC = Path(__file__).resolve().parents[2] / "search_spaces" / "compare-synthetic.yaml"
INTERRUPTED = 130


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Parser(prog="python -m hpsearch.compare", description=__doc__.splitlines()[0])
    p.add_argument("--spec", help=f"comparison spec YAML (default: {DEFAULT_SPEC.parent.name}/{DEFAULT_SPEC.name})")
    p.add_argument("--seeds", type=int, help="number of seeds (0 .. N-1); the spec's `seeds`")
    p.add_argument("--from-study", metavar="NAME", help="each method's best configuration from this finished study "
                   "in the storage path")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: sqlite:///mlflow.db here)")
    p.add_argument("--storage-path", default="runs/tune",
                   help="where studies and comparisons keep their state (default: runs/tune)")
    p.add_argument("--name", help="comparison name (default: the spec's `name`, numbered when taken); also the "
                   "MLflow experiment")
    p.add_argument("overrides", nargs="*", help="key=value: model.*/data.*/train.*, methods.<label>.<field>, "
                   "budget.*/resources.*/stats.*/probe.*, seeds")
    return p.parse_intermixed_args(argv)  # overrides before or after the options


def prepare(args: argparse.Namespace):
    """Everything a comparison needs, validated, before Ray or MLflow start:
    (comparison, state to save, backbone size per configuration, the suite's tasks, notes)."""
    from hpsearch.compare.fromstudy import apply_best
    from hpsearch.compare.spec import MAX_SEEDS, load_spec
    from hpsearch.config import TARGET_FIELDS, absolute_paths, check_run_data
    from hpsearch.tracking import DEFAULT_TRACKING_URI, check_experiment_active, resolve_tracking_uri
    from hpsearch.tune.prepare import check_backbone, check_fits, claim, next_free_study, study_folder
    from hpsearch.tune.storage import open_storage

    if args.seeds is not None and not 1 <= args.seeds <= MAX_SEEDS:
        raise ConfigError(f"--seeds: {args.seeds}; expected an integer from 1 to {MAX_SEEDS} (3 or more for an "
                          "interval)")
    overrides = list(args.overrides) + ([f"seeds={args.seeds}"] if args.seeds is not None else [])
    spec_path = Path(args.spec) if args.spec else DEFAULT_SPEC
    spec = load_spec(spec_path, overrides)
    storage = open_storage(args.storage_path)
    notes = apply_best(spec, storage, args.from_study) if args.from_study else []
    uri = resolve_tracking_uri(args.tracking_uri or DEFAULT_TRACKING_URI)
    name = args.name or next_free_study(storage, spec.name)
    where = study_folder(storage, name, "--name" if args.name else f"{spec_path}: name:")
    if storage.exists(name):
        raise ConfigError(f"--name {name}: a study or comparison of that name already exists in {where}; choose "
                          "another --name")
    for cfg in [spec.config, *(m.config for m in spec.methods)]:
        absolute_paths(cfg)
    tasks, suite = _tasks(spec.config)
    checked = set()
    for entry in spec.entries():
        check_backbone(entry.config)
        data = repr((entry.config.data, *(entry.config.flat()[f] for f in TARGET_FIELDS)))
        if data not in checked:  # each method's data and target lengths (local data; the hub is left to the trials)
            check_run_data(entry.config, hub=False, suite=suite if entry.config.data == spec.config.data else None)
            checked.add(data)
    if not os.environ.get("RAY_ADDRESS"):  # a private local Ray: this machine is the whole cluster
        check_fits(spec)
    else:  # a cluster to join: it must answer
        from hpsearch.train.launch import check_ray_address
        check_ray_address()
    check_experiment_active(uri, name)  # deleted in the MLflow UI: it would take no runs
    # the checks above need no torch; building each configuration on the meta device (which also checks that it
    # builds) imports torch and the model library (~5 s); then the storage folder is made (the last check)
    sizes = {entry.label: backbone_size(entry.config, tasks) for entry in spec.entries()}
    storage.check_writable()
    # last: the name is this comparison's from now on (two started together took one name)
    name, where = claim(storage, name, where, args.name is None, spec.name, set(), then="choose another --name")
    state = {"name": name, "spec_path": str(spec_path), "spec_text": spec.text, "overrides": overrides,
             "from_study": args.from_study, "tracking_uri": uri}
    from hpsearch.compare.run import Comparison  # Ray Tune: after the checks, so a mistake is said at once
    return Comparison(name, where, spec, storage=storage), state, sizes, tasks, notes


def _tasks(cfg) -> tuple[list[str], object]:
    """The suite's tasks, and the suite when its data is local (it must load here, before any trial; the hub's
    is left to the trials: None)."""
    if cfg.data.source == "hub":
        from hpsearch.data.sources import resolve_tasks
        return list(resolve_tasks(cfg.data)), None
    from hpsearch.data import load_suite
    suite = load_suite(cfg.data)
    return suite.tasks, suite


def backbone_size(cfg, tasks: list[str]) -> float:
    """The backbone's parameters, on PyTorch's meta device (no weights); also checks the method builds with this
    config. NaN for a hub backbone (no download here: the trials' probes count it)."""
    import math

    import torch

    from hpsearch.data import is_offline_shape
    from hpsearch.model import build_from_config

    if not (is_offline_shape(cfg.model.backbone) or Path(cfg.model.backbone).is_dir()):
        return math.nan
    with torch.device("meta"):
        model = build_from_config(cfg.model, tasks)
    return float(sum(p.numel() for p in model.t5.parameters()))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    comparison, state, sizes, tasks, notes = prepare(args)
    command = shlex.join(["python", "-m", "hpsearch.compare", *argv])

    import ray

    from hpsearch.compare.run import ComparisonRuns, make_tuner
    from hpsearch.tracking import ROLE_TAG, StudyRun
    from hpsearch.train import init_ray, shutdown_ray
    from hpsearch.tune.cluster import at_a_time, concurrency, uses_ray_train

    spec = comparison.spec
    try:
        parent = StudyRun.create(state["tracking_uri"], comparison.name, space_path=spec.path, space_text=spec.text,
                                 command=command, params=_params(comparison, args), description=spec.description)
    except BaseException:  # the comparison never started: the name prepare claimed is free again
        comparison.storage.release(comparison.name)
        raise
    try:
        for key, value in {ROLE_TAG: "comparison", "mlflow.source.name": "python -m hpsearch.compare"}.items():
            parent.client.set_tag(parent.run_id, key, value)
        state.update(parent_run_id=parent.run_id, command=command)
        comparison.save_state(state)
        for note in notes:
            print(f"[hpsearch.compare] {note}", flush=True)
        # workers' output: Ray's session logs; the console: trial events
        init_ray(spec.config, log_to_driver=False, dashboard=uses_ray_train(spec))
        limit, now = concurrency(spec, ray.cluster_resources(), grows=bool(os.environ.get("RAY_ADDRESS")))
        n = len(spec.entries()) * len(spec.seeds)
        print(f"[hpsearch.compare] comparison '{comparison.name}': {len(spec.entries())} configurations x "
              f"{len(spec.seeds)} seeds = {n} trials, {at_a_time(limit, now)}, state in {comparison.dir}, MLflow "
              f"{redacted(parent.tracking_uri)} (run {parent.run_id})", flush=True)
        callbacks = [ComparisonRuns(parent.tracking_uri, parent.experiment_id, parent.run_id, comparison)]
        tuner = make_tuner(comparison, callbacks, limit, now)
        code = _run(comparison, parent, tuner, sizes, tasks, notes)
    except KeyboardInterrupt:  # a second Ctrl-C: the runs are not left RUNNING
        parent.finish("KILLED")
        raise
    except BaseException as e:  # the driver crashed
        from hpsearch.tracking import outage
        down = outage(e, "comparison", "a comparison does not resume: run it again (a new --name) once the server "
                                       "answers")
        if down:
            raise down from None
        parent.finish("FAILED")
        raise
    shutdown_ray()  # now, not in Ray's exit handler, which first waits 0.5 s for workers' output (in Ray's logs)
    return code


def _run(comparison, parent, tuner, sizes, tasks, notes) -> int:
    from hpsearch.compare.run import unfinished
    from hpsearch.tune.study import fit

    started = time.time()
    result_grid = fit(tuner)
    elapsed = time.time() - started
    left = unfinished(comparison)
    if left:
        parent.finish("KILLED")
        print(f"[hpsearch.compare] interrupted with {left} trial(s) to go; a comparison does not resume: run it "
              "again (a new --name)", file=sys.stderr)
        return INTERRUPTED
    return _report(comparison, parent, result_grid, elapsed, sizes, tasks, notes)


def _report(comparison, parent, result_grid, elapsed, sizes, tasks, notes) -> int:
    from hpsearch.compare import plots
    from hpsearch.compare import table as tables
    from hpsearch.compare.run import collect
    from hpsearch.tracking import ui_command

    trials = collect(comparison, result_grid)
    table = tables.build(comparison.spec, trials, tasks, sizes, notes)
    report_dir = comparison.dir / "report"
    shutil.rmtree(report_dir, ignore_errors=True)
    plot_dir = report_dir / "plots"
    tables.bar_chart(table, plot_dir / "scores.png")
    for draw, file in ((plots.attention_plot, "attention.png"), (plots.sweep_plot, "sweep.png")):
        try:
            draw(table, plot_dir / file)
        except Exception as e:  # a plot that cannot be drawn must not lose the table
            table.notes.append(f"plot {file}: not drawn ({type(e).__name__}: {e})")
    text = tables.markdown(table)
    ui = (f"MLflow: {redacted(parent.tracking_uri)}, comparison run {parent.run_id}; open the UI: "
          f"{ui_command(parent.tracking_uri)}")
    summary = (f"{text}\n{len(trials)} trials in {elapsed / 60:.1f} min; report in {report_dir}\n"
               f"Plots: {', '.join(str(p) for p in sorted(plot_dir.glob('*.png')))}\n{ui}\n")
    files = {"comparison.md": text, "comparison.csv": tables.comparison_frame(table).to_csv(index=False),
             "paired.csv": tables.paired_frame(table).to_csv(index=False),
             "per_seed.csv": tables.per_seed_frame(table).to_csv(index=False), "summary.txt": summary}
    for file, content in files.items():
        (report_dir / file).write_text(content)
    print(summary, flush=True)
    complete = sum(t.outcome == "complete" for t in trials)
    parent.log_report(tables.summary(table), {"hpsearch.trials_complete": str(complete)}, files, plot_dir)
    comparison.storage.push(comparison.name, "report")
    parent.finish("FAILED" if not complete else "FINISHED", over=True)
    return 1 if not complete else 0


def _params(comparison, args) -> dict:
    """The parent run's parameters: a method's under `method.<label>` in MLflow's characters (a label's `+`
    is not one; labels that would give one name are refused with the spec)."""
    from hpsearch.compare.spec import metric_name

    spec = comparison.spec
    t = spec.config.train
    return {"spec": Path(spec.path).name, "comparison": comparison.name,
            "methods": ",".join(m.label for m in spec.methods), "seeds": ",".join(map(str, spec.seeds)),
            "references": ",".join(spec.references), "max_steps": t.max_steps, "eval_every": t.eval_every,
            "workers": t.num_workers, "interval": spec.stats.interval, "confidence": spec.stats.confidence,
            "backbone": spec.config.model.backbone, "from_study": args.from_study or "",
            "sweep": f"{spec.sweep.method}:{spec.sweep.field}={spec.sweep.values}" if spec.sweep else "",
            **{f"method.{metric_name(m.label)}": ",".join(f"{k}={v}" for k, v in m.fields.items())
               for m in spec.methods}}
