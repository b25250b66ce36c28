"""`python -m hpsearch.params`: the parameters a method adds to its backbone, per component, for any config.

    python -m hpsearch.params model.backbone=t5-base model.variant=global --num-tasks 8 [--json]

Built on PyTorch's meta device from the config alone: nothing is downloaded or allocated, so `t5-11b` works.
"""
from __future__ import annotations

import argparse
import json

import torch

from hpsearch.cli import run_main
from hpsearch.config import load_config
from hpsearch.errors import ConfigError
from hpsearch.model import build_from_config


def count(cfg, num_tasks: int) -> dict:
    with torch.device("meta"):
        model = build_from_config(cfg.model, [f"task{i}" for i in range(num_tasks)])
    extra = model.extra_parameters()
    backbone = sum(p.numel() for p in model.t5.parameters())
    return {"backbone": cfg.model.backbone, "method": cfg.model.method, "num_tasks": num_tasks,
            "backbone_params": backbone, "extra_params": extra["total"],
            "extra_percent": 100.0 * extra["total"] / backbone,
            "extra_breakdown": {k: v for k, v in extra.items() if k != "total"}}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpsearch.params", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="a run config YAML (sections model/data/train)")
    parser.add_argument("--num-tasks", type=int, help="number of tasks T (default: len(data.tasks))")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. model.variant=sep")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    num_tasks = args.num_tasks if args.num_tasks is not None else len(cfg.data.tasks)
    if num_tasks < 1:
        raise ConfigError(f"--num-tasks: {num_tasks}; expected an integer >= 1")
    report = count(cfg, num_tasks)
    if args.json:
        print(json.dumps(report))
        return 0
    m = cfg.model
    what = m.method if m.method == "mtl" else f"hyperprompt-{m.variant} ({m.placement})"
    print(f"{m.backbone} + {what}, T={num_tasks} tasks")
    print(f"  backbone parameters: {report['backbone_params']:>14,}")
    for name, n in report["extra_breakdown"].items():
        print(f"  + {name:<24} {n:>12,}")
    print(f"  extra parameters:    {report['extra_params']:>14,}  ({report['extra_percent']:.3f}% of the backbone)")
    return 0


if __name__ == "__main__":
    run_main(main)
