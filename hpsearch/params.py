"""`python -m hpsearch.params`: the parameters a method adds to its backbone, per component, for any config.

    python -m hpsearch.params model.backbone=t5-base model.variant=global --num-tasks 8 [--json]
    python -m hpsearch.params model.method=hyperformer model.backbone=t5-base --num-tasks 8
    python -m hpsearch.params model.method=lora model.lora_rank=8 model.backbone=t5-base --num-tasks 8

Prints the method's closed formula with the value of each of its terms, and the count of the real modules
(the two are equal: the tests check it for every method).

Built on PyTorch's meta device from the config alone: nothing is downloaded or allocated, so `t5-11b` works.
"""
from __future__ import annotations

import json

from hpsearch.cli import Parser, run_main
from hpsearch.config import load_config
from hpsearch.errors import ConfigError

MAX_TASKS = 100_000  # a task embedding table per task: beyond this the meta build itself takes minutes


def count(cfg, num_tasks: int) -> dict:
    import torch  # here, not above: the command's checks say a mistake before torch loads (~5 s)

    from hpsearch.model import build_from_config
    with torch.device("meta"):
        model = build_from_config(cfg.model, [f"task{i}" for i in range(num_tasks)])
    extra = model.extra_parameters()
    formula = model.parameter_formula()
    backbone = sum(p.numel() for p in model.t5.parameters())
    return {"backbone": cfg.model.backbone, "method": cfg.model.method, "num_tasks": num_tasks,
            "backbone_params": backbone, "extra_params": extra["total"],
            "extra_percent": 100.0 * extra["total"] / backbone,
            "extra_breakdown": {k: v for k, v in extra.items() if k != "total"},
            "formula": formula.text, "formula_terms": formula.terms, "formula_total": formula.total}


def describe(m) -> str:
    """One line naming the method and its main settings."""
    if m.method == "hyperprompt":
        return f"hyperprompt-{m.variant} ({m.placement})"
    if m.method == "prompt_tuning":
        return f"prompt_tuning (l={m.prompt_length}, init={m.prompt_init})"
    if m.method == "adapter":
        return (f"adapter (b={m.bottleneck}, sites={m.adapter_sites}, {m.adapter_insertion}, "
                f"s={m.adapter_scale:g})")
    if m.method == "hyperformer":
        return f"hyperformer++ (reduction factor {m.reduction_factor})"
    if m.method == "prefix":
        return f"prefix (l={m.prompt_length}, h={m.prefix_hidden})"
    if m.method == "lora":
        return f"lora (r={m.lora_rank}, alpha={m.lora_alpha:g}, q and v)"
    if m.method == "mam":
        return f"mam (prefix l={m.mam_prefix_length}, h={m.prefix_hidden}; adapter b={m.bottleneck}, s={m.mam_scale:g})"
    if m.method == "pha":
        return (f"pha (prototypes p={m.pha_dim}, retriever r={m.pha_retriever_hidden}, hypernetwork h={m.pha_hidden}; "
                f"adapter b={m.bottleneck}; lambda={m.pha_loss_weight:g}, temperature={m.pha_temperature:g})")
    return m.method


def main(argv: list[str]) -> int:
    parser = Parser(prog="python -m hpsearch.params", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="a run config YAML (sections model/data/train)")
    parser.add_argument("--num-tasks", type=int, help="number of tasks T (default: the run's tasks, as "
                        "data.source resolves data.tasks)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. model.variant=sep")
    args = parser.parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides)
    if args.num_tasks is not None:
        num_tasks = args.num_tasks
    else:  # the default task list stands for the source's own suite (13 tasks in a GLUE folder, 8 on the hub)
        from hpsearch.data.sources import resolve_tasks
        num_tasks = len(resolve_tasks(cfg.data))
    if not 1 <= num_tasks <= MAX_TASKS:
        raise ConfigError(f"--num-tasks: {num_tasks}; expected an integer in [1, {MAX_TASKS}]")
    from hpsearch.model import check_local_backbone
    check_local_backbone(cfg.model.backbone, tokenizer=False)
    report = count(cfg, num_tasks)
    if args.json:
        print(json.dumps(report))
        return 0
    m = cfg.model
    print(f"{m.backbone} + {describe(m)}, T={num_tasks} tasks")
    print(f"  backbone parameters: {report['backbone_params']:>14,}")
    for name, n in report["extra_breakdown"].items():
        print(f"  + {name:<24} {n:>12,}")
    print(f"  extra parameters:    {report['extra_params']:>14,}  ({report['extra_percent']:.3f}% of the backbone)")
    print(f"  formula: {report['formula']}")
    if report["formula_terms"]:
        print("    with " + ", ".join(f"{k}={v:,}" for k, v in report["formula_terms"].items()))
    print(f"    = {report['formula_total']:,}")
    return 0


if __name__ == "__main__":
    run_main(main)
