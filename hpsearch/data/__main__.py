"""`python -m hpsearch.data [--config FILE] [--json] [KEY=VALUE ...]`: describe a suite.

Per task and split (after the split protocol): the row count, the protocol and one example's
source/target. `--json` prints {"tasks": {TASK: {"splits": {...}, "protocol": ..., "example": {...}}}}.
"""
from __future__ import annotations

import json

from hpsearch.cli import Parser, run_main
from hpsearch.data.suite import Suite, load_suite


def main(argv: list[str]) -> int:
    parser = Parser(prog="python -m hpsearch.data", description=(
        "Describe a suite: per task and split the row count after the split protocol, the protocol used and "
        "one example's source/target."))
    parser.add_argument("--config", help="run config YAML (sections model, data, train; data is used)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, e.g. data.source=hub, data.source=PATH, data.tasks=rte,cb")
    args = parser.parse_intermixed_args(argv)
    from hpsearch.config import load_config  # the run config shared by all commands (imports the model code)

    suite = load_suite(load_config(args.config, args.overrides).data)
    print(json.dumps(suite.describe(), ensure_ascii=False) if args.json else format_suite(suite))
    return 0


def format_suite(suite: Suite) -> str:
    info = suite.describe()["tasks"]
    width = max(len(t) for t in info)
    lines = [f"source: {suite.source} ({len(info)} tasks; split protocol of HyperFormer, "
             "Karimi Mahabadi et al. 2021)",
             f"{'task':<{width}}  {'train':>7} {'validation':>10} {'test':>7}  protocol"]
    for task, d in info.items():
        s = d["splits"]
        counts = f"{s['train']:>7} {s['validation']:>10} {s['test']:>7}"
        lines.append(f"{task:<{width}}  {counts}  {d['protocol']}")
    lines.append("examples:")
    for task, d in info.items():
        source = d["example"]["source"]
        source = source if len(source) <= 100 else source[:97] + "..."
        lines.append(f"  {task:<{width}}  {source!r} -> {d['example']['target']!r}")
    notes = [f"  {task}: {note}" for task, d in info.items() for note in d["notes"]]
    return "\n".join(lines + (["notes:", *notes] if notes else []))


if __name__ == "__main__":
    run_main(main)
