"""The command line of `python -m hpsearch.bench` (see the package docstring)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

from hpsearch.bench import GROUPS
from hpsearch.bench import __doc__ as DOC
from hpsearch.bench.timing import Figure
from hpsearch.cli import run_main
from hpsearch.errors import UserError

SPEC_REPS = 7  # repetitions the figures are specified with (min and median of at least 7)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (run_main), instead of argparse's usage block
        raise UserError(message)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = _Parser(prog="python -m hpsearch.bench", description=DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="t5-small", help="a named T5 shape (default: t5-small)")
    p.add_argument("--tasks", type=int, default=8, help="number of tasks (default: 8)")
    p.add_argument("--reps", type=int, default=SPEC_REPS, help="timed repetitions after one warm-up (default: 7; "
                   "fewer is a smoke run, said in the header and the JSON)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's current number)")
    p.add_argument("--batch", default="32x64+8", metavar="ROWSxSOURCE+TARGET",
                   help="the timed batch of groups step to deepspeed: rows x (input + target tokens) (32x64+8)")
    p.add_argument("--methods", nargs="+", metavar="ROW",
                   help="groups step, generate, flops: only these method rows (with MTL and stock T5), e.g. "
                        "hyperprompt-global lora (default: every method; all of them at t5-base take ~45 GB); "
                        "group deepspeed times the recipe's default model whatever this says")
    p.add_argument("--batching", choices=("task", "mixed"), default="task",
                   help="task ids of the batch: one task (the recipe's default) or all tasks mixed")
    p.add_argument("--host-allocator", choices=("reuse", "system"), default="reuse",
                   help="malloc in this process (groups step to deepspeed): reuse freed memory, as CPU training "
                        "does (train.host_allocator=auto), or glibc's defaults, for contrast")
    p.add_argument("--checkpoint-shape", default="t5-base",
                   help="the shape of group checkpoint's run (default: t5-base, as the issue measures it)")
    p.add_argument("--memory-shape", default="t5-large", help="the shape of group memory (default: t5-large)")
    p.add_argument("--memory-world", type=int, default=2, help="the ranks of group memory, one process each (2)")
    p.add_argument("--only", nargs="+", choices=GROUPS, metavar="GROUP", help=f"run only these: {', '.join(GROUPS)}")
    p.add_argument("--skip", nargs="+", choices=GROUPS, metavar="GROUP", default=[], help="run all but these")
    p.add_argument("--json", action="store_true", help="also print one JSON object on the last line")
    args = p.parse_args(argv)
    for name in ("tasks", "reps", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name}: {value} is out of range; expected an integer >= 1")
    from hpsearch.bench.rows import BatchShape, method_rows

    rows = [row for row, _, _ in method_rows()]
    for row in args.methods or []:
        if row not in rows:
            raise UserError(f"--methods: {row!r} is not a method row; known: {', '.join(rows)}")
    if args.methods:
        args.methods = list(dict.fromkeys(args.methods))  # each once, in the order given

    try:
        args.batch = BatchShape.parse(args.batch)
    except ValueError as e:
        raise UserError(f"--batch: {e}") from None
    args.groups = [g for g in (args.only or GROUPS) if g not in args.skip]
    if not args.groups:
        raise UserError("--only/--skip: no group left to run")
    if args.methods and not {"step", "generate", "flops"} & set(args.groups):
        raise UserError(f"--methods: selects rows of groups step, generate and flops; none of them runs here "
                        f"({' '.join(args.groups)})")
    if not 2 <= args.memory_world <= 16:
        raise UserError(f"--memory-world: {args.memory_world} is out of range; expected 2 to 16 ranks")
    from hpsearch.model.backbones import NAMED_SHAPES

    for name in ("shape", "checkpoint_shape", "memory_shape"):
        if getattr(args, name) not in NAMED_SHAPES:
            raise UserError(f"--{name.replace('_', '-')}: {getattr(args, name)!r} is not a named shape; known: "
                            f"{', '.join(NAMED_SHAPES)}")
    return args


def log(message: str) -> None:
    print(f"[hpsearch.bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _format(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return {"ratio": f"{value:.3f}x", "fraction": f"{100 * value:.1f} %", "s": f"{value:.1f} s",
            "x weights": f"{value:.2f}x W"}.get(unit, f"{value:.3g}")


def table(figures: list[Figure], errors: dict[str, str]) -> str:
    lines = [f"{'figure':<42} {'value':>10}  {'goal':>11}  {'meets':<5}  what"]
    for f in figures:
        goal = "-" if f.goal is None else ("<= " if f.better == "lower" else ">= ") + _format(f.goal, f.unit)
        meets = {True: "yes", False: "NO", None: "-"}[f.meets_goal]
        lines.append(f"{f.name:<42} {_format(f.value, f.unit):>10}  {goal:>11}  {meets:<5}  {f.what}")
    lines += [f"{'not measured: ' + name:<42} {message}" for name, message in errors.items()]
    return "\n".join(lines)


def _give_back(log) -> None:
    """Return the memory this process's malloc keeps from the in-process groups' models (`--host-allocator reuse`
    keeps freed memory: 11.0-11.2 GiB resident at t5-small with every method) to the OS, and say how much."""
    import gc

    import psutil

    from hpsearch.train import hostmem

    gc.collect()
    before = psutil.Process().memory_info().rss
    gave = hostmem.give_back()
    after = psutil.Process().memory_info().rss
    log(f"{'gave the freed memory back to the OS' if gave else 'no freed memory given back (not glibc, or none)'}: "
        f"resident {before / 2**30:.2f} -> {after / 2**30:.2f} GiB")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    groups = args.groups
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import psutil
    import torch

    from hpsearch.bench import memory, models, study, trial, zero
    from hpsearch.train import hostmem

    # a size this machine can never hold is bad input, said before any group runs (the estimates build the model on
    # the meta device: torch, so they are not checked with the arguments)
    total = psutil.virtual_memory().total
    why = models.too_big(args.shape, set(groups), args.methods, total, "this machine has")
    if why:
        raise UserError(f"--shape: {why}")
    if "memory" in groups:
        why = memory.too_big(args.memory_shape, args.memory_world, total, "this machine has")
        if why:
            raise UserError(f"--memory-shape: {why}")
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    allocator = hostmem.apply(args.host_allocator, use_gpu=False)  # what a CPU worker does (train.host_allocator)
    load_before = os.getloadavg()
    header = (f"hpsearch.bench: shape {args.shape}, {args.tasks} tasks, batch {args.batch} tokens, "
              f"{args.batching} batching, reps {args.reps} (+1 warm-up"
              f"{'; fewer than the 7 the goals are specified with: a smoke run' if args.reps < SPEC_REPS else ''}"
              "), groups "
              f"{' '.join(groups)}\nmachine: {os.cpu_count()}-core CPU ({_cpu_name()}), torch {torch.__version__}, "
              f"{threads} torch threads, host allocator {allocator}, load (1/5/15 min) before "
              f"{' '.join(f'{x:.2f}' for x in load_before)}")
    print(header, flush=True)
    figures, errors = [], {}
    started = time.perf_counter()
    if {"step", "generate", "flops"} & set(groups):
        f, e = models.run(args.shape, args.tasks, set(groups), args.reps, args.batching, log, args.batch,
                          args.methods)
        figures, errors = figures + f, {**errors, **e}
    if "deepspeed" in groups:
        f, e = zero.run(args.shape, args.tasks, args.reps, args.batching, log, args.batch)
        figures, errors = figures + f, {**errors, **e}
    if {"step", "generate", "flops", "deepspeed"} & set(groups):
        _give_back(log)  # the groups above are done with their models; the subprocess groups' ranks need memory
    if "checkpoint" in groups:
        f, e = trial.run_checkpoint(args.checkpoint_shape, log)
        figures, errors = figures + f, {**errors, **e}
    if "trial" in groups:
        f, e = trial.run_trial(args.shape, log)
        figures, errors = figures + f, {**errors, **e}
    if "study" in groups:
        f, e = study.run_study(args.shape, log)
        figures, errors = figures + f, {**errors, **e}
    if "memory" in groups:
        f, e = memory.run(args.memory_shape, log, args.memory_world)
        figures, errors = figures + f, {**errors, **e}
    load_after = os.getloadavg()
    print(table(figures, errors))
    print(f"load (1/5/15 min) after {' '.join(f'{x:.2f}' for x in load_after)}; "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    if args.json:
        print(json.dumps({
            "shape": args.shape, "checkpoint_shape": args.checkpoint_shape, "memory_shape": args.memory_shape,
            "tasks": args.tasks, "reps": args.reps, "warmup_rounds": 1, "groups": groups,
            "reps_as_specified": args.reps >= SPEC_REPS,  # the issue's >= 7: fewer is a smoke run, no measurement
            "methods": args.methods,  # the method rows groups step, generate and flops timed; null: every one
            "batch": {"rows": args.batch.rows, "source_tokens": args.batch.source,
                      "target_tokens": args.batch.target, "batching": args.batching},
            "threads": threads, "host_allocator": allocator, "cpu_count": os.cpu_count(), "cpu": _cpu_name(),
            "torch": torch.__version__,
            "load_before": list(load_before), "load_after": list(load_after),
            "figures": {f.name: f.to_json() for f in figures}, "errors": errors}))
    return 0


if __name__ == "__main__":
    run_main(main)
