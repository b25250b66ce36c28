"""Groups `trial` and `checkpoint`: `python -m hpsearch.train` as a user runs it, in subprocesses.

trial: wall time of a trial at two step counts (one evaluation each, at the end), with Ray Train and with
    `--local`; the fixed cost is the intercept of wall time vs steps. One run per point (each takes a minute
    or more), after an untimed `--local` warm-up that fills the page cache and the tokenizer cache. Every step
    is logged, and the time its line appears splits a run into start-up, steps, and the end (parts); the run's own
    start-up line (hpsearch/train/startup.py) splits the start-up into its phases.
checkpoint: one `--local` run evaluating after each of 2 steps; bytes the process wrote (`wchar` of
    /proc/self/io, read at exit) minus its final outputs (export, metrics), per evaluation that writes resumable
    state (all but the last, which keeps the run's result only), over the bytes of the model's weights (each
    parameter once): the state (3x) and the best weights at each improvement (1x), each written once; plus what
    the best weights, checkpoints/ and the export keep on disk.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hpsearch.bench import children, memory
from hpsearch.bench.timing import Figure, error_line
from hpsearch.train import startup

TRIAL_STEPS = (2, 8)
FIXED_COST_GOAL = 6.0
# resumable state (fp32 weights + 2 AdamW moments = 3x) at each evaluation but the last (which keeps the run's
# result only) + a weights-only best when it improves (1x), each once; headers, manifests and DeepSpeed's small
# files within 1 % of the weights
STATE_X, SMALL_FILES_X, BEST_GOAL, COPIED_GOAL = 3.0, 0.01, 1.0, 0.0
SMALL_DATA = ["data.synthetic_train_rows=200", "data.synthetic_eval_rows=20"]
TIMEOUT_S = 3600
# the in-process groups' torch.distributed environment: not the subprocess's
_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
_STEP_LINE = re.compile(r"\[hpsearch\.train\] step \d+/\d+")

_IO_AT_EXIT = """
import atexit, json, os, runpy
def _dump():
    with open('/proc/self/io') as f:
        io = {k: int(v) for k, v in (line.split(': ') for line in f.read().splitlines())}
    with open(os.environ['HPSEARCH_BENCH_IO'], 'w') as f:
        json.dump(io, f)
atexit.register(_dump)
runpy.run_module('hpsearch.train', run_name='__main__', alter_sys=True)
"""


@dataclass
class Run:
    wall: float        # start to exit
    first_step: float  # start to the log line of step 1 (imports, Ray, workers, DeepSpeed, data, step 1)
    last_step: float   # start to the log line of the last step (then: evaluation, export, test, shutdown)
    startup: dict | None = None  # the run's start-up line: total and phases, seconds

    def to_json(self) -> dict:
        return {"wall_s": self.wall, "start_to_first_step_s": self.first_step,
                "last_step_to_exit_s": self.wall - self.last_step, "startup": self.startup}


def _train(args: list[str], cwd: Path, log, env: dict | None = None, script: str | None = None) -> Run:
    """Run hpsearch.train (every step logged) and time it from its output; a failure raises, with its reason."""
    env = {**{k: v for k, v in os.environ.items() if k not in _DIST_VARS}, "DS_ACCELERATOR": "cpu",
           "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    args = [*args, "train.log_every=1"]
    cmd = children.command(code=script, args=args) if script else \
        children.command(module="hpsearch.train", args=args)
    start = time.perf_counter()
    steps, tail, startup_line = [], [], None
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        watchdog = threading.Timer(TIMEOUT_S, proc.kill)
        watchdog.start()
        for line in proc.stdout:  # Ray forwards the workers' lines to the driver's output
            if _STEP_LINE.search(line):
                steps.append(time.perf_counter() - start)
            startup_line = startup_line or startup.parse(line)
            tail = [*tail[-20:], line.strip()]
        returncode = proc.wait()
        watchdog.cancel()
    wall = time.perf_counter() - start
    log(f"  {wall:.1f} s")
    if returncode != 0 or not steps:
        last = next((ln for ln in reversed(tail) if ln), "(no output)")
        raise RuntimeError(f"hpsearch.train {' '.join(args)} exited {returncode}: {last[:300]}")
    return Run(wall, steps[0], steps[-1], startup_line)


def _overrides(shape: str, out: Path, steps: int, eval_every: int) -> list[str]:
    return [f"model.backbone={shape}", f"train.max_steps={steps}", f"train.eval_every={eval_every}",
            f"train.output_dir={out}", *SMALL_DATA]


def _intercept(points: dict[int, float]) -> tuple[float, float]:
    (n1, t1), (n2, t2) = sorted(points.items())
    slope = (t2 - t1) / (n2 - n1)
    return t1 - slope * n1, slope


def run_trial(shape: str, log) -> tuple[list, dict]:
    runs: dict[str, dict[int, Run]] = {"ray": {}, "local": {}}
    with tempfile.TemporaryDirectory(prefix="hpsearch-bench-trial-") as tmp:
        tmp = Path(tmp)
        log("trial: untimed --local warm-up")
        try:
            _train(["--local", *_overrides(shape, tmp / "warm", 1, 1)], tmp, log)
            for steps in TRIAL_STEPS:
                for mode in ("ray", "local"):
                    log(f"trial: {mode} run, {steps} steps")
                    args = _overrides(shape, tmp / f"{mode}-{steps}", steps, steps)
                    runs[mode][steps] = _train(["--local", *args] if mode == "local" else args, tmp, log)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            return [], {"trial": str(e)[:400]}
    figures, errors = [], {}
    for mode, goal in (("ray", FIXED_COST_GOAL), ("local", None)):
        fixed, per_step = _intercept({n: r.wall for n, r in runs[mode].items()})
        if fixed < 0 or per_step <= 0:  # the runs' noise exceeds what they measure (a negative cost met the goal)
            walls = ", ".join(f"{r.wall:.1f} s" for r in runs[mode].values())
            errors[f"trial/{mode}"] = (f"not measured: wall times {walls} give a fixed cost of {fixed:.1f} s and "
                                       f"{per_step:.3f} s a step")
            continue
        what = ("fixed cost of a trial, `python -m hpsearch.train` (Ray Train): intercept of wall time vs steps"
                if mode == "ray" else "fixed cost of `python -m hpsearch.train --local` (no Ray; contrast)")
        figures.append(Figure(f"trial/{'fixed_cost' if mode == 'ray' else 'local_fixed_cost'}", fixed, goal,
                              "lower", "s", what, parts={"per_step_s": per_step,
                                                         "runs": {str(n): r.to_json() for n, r in runs[mode].items()}}))
    first = min(runs["ray"].values(), key=lambda r: r.first_step)
    figures.append(Figure("trial/start_to_first_step", first.first_step, None, "lower", "s",
                          "Ray trial: start to the end of step 1, the shorter of the two runs (contrast); parts: "
                          "its start-up phases", parts={"phases_s": first.startup,
                                                        "runs": {str(n): r.to_json() for n, r in runs["ray"].items()}}))
    return figures, errors


def _bytes(root: Path, where=lambda rel: True) -> int:
    """Bytes of the regular files under root (symlinks not followed) whose relative path passes `where`."""
    total = 0
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and where(path.relative_to(root)):
            total += path.stat().st_size
    return total


def _improvements(metrics_file: Path) -> tuple[int, int]:
    """(evaluations, times the best score improved) from the run's metrics.jsonl."""
    best, evaluations, improved = float("-inf"), 0, 0
    for line in metrics_file.read_text().splitlines():
        score = json.loads(line).get("score")
        evaluations += 1
        if score is not None and score > best:
            best, improved = score, improved + 1
    return evaluations, improved


def _tensor_bytes(path: Path) -> int:
    """The tensor data of a safetensors file: its size less the 8-byte length and the JSON header."""
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return path.stat().st_size - 8 - header


def run_checkpoint(shape: str, log) -> tuple[list, dict]:
    with tempfile.TemporaryDirectory(prefix="hpsearch-bench-ckpt-") as tmp:
        tmp = Path(tmp)
        out, io_file = tmp / "run", tmp / "io.json"
        overrides = _overrides(shape, out, 2, 1)
        log("checkpoint: --local run, 2 steps, an evaluation after each")
        try:
            _train(["--local", *overrides], tmp, log, env={"HPSEARCH_BENCH_IO": str(io_file)}, script=_IO_AT_EXIT)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            return [], {"checkpoint": str(e)[:400]}
        written = json.loads(io_file.read_text())["wchar"]
        evaluations, improved = _improvements(out / "metrics.jsonl")
        try:
            weights = memory.weights_bytes(overrides)
        except Exception as e:
            return [], {"checkpoint": f"cannot count the model's weights: {error_line(e)}"}
        export = sum(_tensor_bytes(f) for f in (out / "model").glob("*.safetensors"))  # tensor data, as best's
        finals = _bytes(out, lambda rel: rel.parts[0] not in ("checkpoints", "best"))  # export, metrics, config
        versions = sorted((out / "checkpoints" / "best").glob("*.safetensors"))  # the best weights kept
        best = max((_tensor_bytes(v) for v in versions), default=0)
        kept = sorted(p for p in (out / "checkpoints").glob("step_*") if p.is_dir())
        copied = _bytes(out / "checkpoints", lambda rel: rel.parts[0].startswith("step_") and "best" in rel.parts[1:])
        on_disk = _bytes(out / "checkpoints") if kept else 0
    # a run that wrote no best weights, kept no checkpoint or exported no model would meet every upper-bound goal
    # below with zeros: that is a broken run, not a figure
    missing = [what for what, bad in (("no best weights", not versions), ("no checkpoint kept", not kept),
                                      ("no exported model", not export), ("no evaluation", not evaluations),
                                      ("a best version that is not the weights", best < 0.9 * weights),
                                      ("an export that is not the weights", export < 0.9 * weights)) if bad]
    if missing:
        return [], {"checkpoint": f"not measured: the run left {', '.join(missing)} ({evaluations} evaluations, "
                                  f"{len(versions)} best versions, {len(kept)} checkpoints kept)"}
    # per evaluation that writes resumable state (every one but the last), so that a second copy of the state
    # shows (averaged with the last evaluation's result-only write, it looked like 3.5x against a goal of 4)
    state_evals = max(evaluations - 1, 1)
    per_eval = (written - finals) / state_evals
    common = {"weights_bytes": weights, "evaluations": evaluations, "best_improved": improved}
    figures = [
        Figure("checkpoint/written_per_eval", per_eval / weights, STATE_X + improved / state_evals + SMALL_FILES_X,
               "lower", "x weights", "bytes written per evaluation that writes resumable state (--local) ÷ the "
               "model's weight bytes; goal: the state (3x) once, and a weights-only best (1x) at each improvement",
               parts={**common, "bytes_written_total": written, "final_outputs_bytes": finals,
                      "state_evaluations": state_evals, "bytes_per_eval": per_eval}),
        Figure("checkpoint/best_size", best / weights, BEST_GOAL, "lower", "x weights",
               "a version of the best weights ÷ the model's weight bytes (goal: weights only)",
               parts={**common, "best_bytes": best, "best_versions_kept": len(versions)}),
        Figure("checkpoint/best_copied", copied / weights / max(len(kept), 1), COPIED_GOAL, "lower", "x weights",
               "best weights copied into each kept checkpoint ÷ weight bytes (goal: referenced, not copied)",
               parts={**common, "checkpoints_kept": len(kept), "copied_bytes": copied,
                      "checkpoints_bytes": on_disk}),
        Figure("checkpoint/export_size", export / weights, BEST_GOAL, "lower", "x weights",
               "exported model (model/*.safetensors) ÷ the model's weight bytes (goal: each tensor once)",
               parts={**common, "export_bytes": export}),
    ]
    return figures, {}
