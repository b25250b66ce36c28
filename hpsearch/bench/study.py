"""Group `study`: what a trial costs inside a study (`python -m hpsearch.tune`, as a user runs it, in subprocesses).

In a study, Ray, the driver, the searcher and MLflow's parent run are up once; each trial then pays the hand-over
from the previous one, its model and data, DeepSpeed, its evaluations, export and test scoring, and the trial's
MLflow and Optuna bookkeeping. Two studies of the same space and budget, one trial and `TRIALS` trials (one at a
time), differ by `TRIALS - 1` trials: their wall-time difference, less those trials' training steps (each trial's
own `step_time` × steps, from its metrics.jsonl; `step_time` leaves out the first step's one-off work, which is
start-up and so stays in the fixed cost), divided by `TRIALS - 1`, is a trial's fixed cost. Measured for
one-worker trials that train in their own Tune actor (`resources.worker_group=auto`, the default for one worker),
two-worker trials on the ranks their Tune actor keeps (`pool`), and, for contrast, the same trials each launching
Ray Train's worker group (`always`). One run per point, after an untimed warm-up study that fills the tokenizer and
page caches.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from hpsearch.bench import children
from hpsearch.bench.timing import Figure
from hpsearch.bench.trial import _DIST_VARS, FIXED_COST_GOAL, SMALL_DATA, TIMEOUT_S

STEPS, TRIALS = 8, 3
# case: (figure name, workers, resources.worker_group, goal, what it measures)
CASES = {
    "auto": ("study/fixed_cost_in_actor", 1, "auto", FIXED_COST_GOAL,
             "fixed cost of a trial in a study, one worker training in the trial's own Tune actor"),
    "always": ("study/fixed_cost_worker_group", 1, "always", None,
               "the same, each trial launching Ray Train's worker group (contrast)"),
    "pool": ("study/fixed_cost_pool", 2, "pool", FIXED_COST_GOAL,
             "fixed cost of a two-worker trial in a study, on the ranks its Tune actor keeps"),
    "always-2": ("study/fixed_cost_worker_group_2", 2, "always", None,
                 "the same two-worker trials, each launching Ray Train's worker group (contrast)"),
}


def _study(shape: str, tmp: Path, name: str, trials: int, workers: int, worker_group: str,
           log) -> tuple[float, float]:
    """(wall seconds, seconds its trials spent in training steps) of one study; a failure raises with its reason."""
    env = {**{k: v for k, v in os.environ.items() if k not in _DIST_VARS}, "PYTHONWARNINGS": "ignore",
           "TOKENIZERS_PARALLELISM": "false"}
    storage = tmp / "runs"
    cmd = children.command(module="hpsearch.tune", args=["--name", name, "--num-samples", str(trials),
           "--storage-path", str(storage), "--tracking-uri", f"sqlite:///{tmp}/mlflow-{name}.db",
           "--optuna-storage", f"sqlite:///{tmp}/optuna-{name}.db", f"model.backbone={shape}",
           f"budget.max_steps={STEPS}", f"budget.eval_every={STEPS}", f"budget.grace_period={STEPS}",
           f"train.log_every={STEPS}", *SMALL_DATA, f"resources.workers={workers}", "resources.max_concurrent=1",
           f"resources.worker_group={worker_group}"])
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    wall = time.perf_counter() - start
    log(f"  {wall:.1f} s")
    if proc.returncode != 0:
        last = next((ln for ln in reversed(proc.stderr.splitlines()) if ln.strip()), "(no output)")
        raise RuntimeError(f"hpsearch.tune ({trials} trials, worker_group={worker_group}) exited "
                           f"{proc.returncode}: {last[:300]}")
    training, finished = 0.0, 0
    for metrics in (storage / name / "trials").glob("*/metrics.jsonl"):
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        training += sum(row["step_time"] * STEPS for row in rows[-1:])  # one evaluation, at the last step
        finished += bool(rows) and rows[-1].get("step") == STEPS
    if finished != trials:  # the study exits 0 unless every trial failed: fewer trials make a smaller difference
        raise RuntimeError(f"hpsearch.tune ({trials} trials, worker_group={worker_group}): {finished} of them "
                           f"trained their {STEPS} steps")
    return wall, training


def run_study(shape: str, log, groups=tuple(CASES), trials: int = TRIALS,
              warm_up: bool = True) -> tuple[list, dict]:
    """The group's figures, and its error if a study failed. `groups` (keys of CASES), `trials` and `warm_up` are
    for the smoke test: the benchmark measures every case, `TRIALS` trials, after a warm-up study."""
    figures = []
    with tempfile.TemporaryDirectory(prefix="hpsearch-bench-study-") as tmp:
        tmp = Path(tmp)
        try:
            if warm_up:
                log("study: untimed warm-up study, 1 trial")
                _study(shape, tmp, "warm", 1, 1, "auto", log)
            for group in groups:
                name, workers, worker_group, goal, what = CASES[group]
                points = {}
                for n in (1, trials):
                    log(f"study: {n} trial(s), resources.workers={workers}, resources.worker_group={worker_group}")
                    points[n] = _study(shape, tmp, f"{group}-{n}", n, workers, worker_group, log)
                (w1, s1), (wn, sn) = points[1], points[trials]
                fixed = ((wn - w1) - (sn - s1)) / (trials - 1)
                if fixed < 0:  # the studies' noise exceeds what they measure (a negative cost met the goal)
                    raise RuntimeError(f"{name}: not measured: wall times {w1:.1f} s and {wn:.1f} s, training "
                                       f"{s1:.1f} s and {sn:.1f} s give a fixed cost of {fixed:.1f} s")
                figures.append(Figure(name, fixed, goal, "lower", "s", what, parts={
                    "steps": STEPS, "trials": [1, trials], "workers": workers, "wall_s": [w1, wn],
                    "training_s": [s1, sn]}))
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            return figures, {"study": str(e)[:400]}
    return figures, {}
