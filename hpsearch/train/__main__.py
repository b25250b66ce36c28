"""`python -m hpsearch.train`: train one configuration (see hpsearch/train/__init__.py)."""
from __future__ import annotations

import json
import sys

from hpsearch.cli import Parser, run_main
from hpsearch.config import absolute_paths, check_run_data, load_config
from hpsearch.errors import UserError
from hpsearch.train import __doc__ as DOC
from hpsearch.train.launch import TrainingFailed, check_fits_locally, check_output_dir, run_with_ray
from hpsearch.train.startup import process_start

# torch, the loop and the model library are imported where they are used: the driver of a Ray run only checks the
# config and the data (a mistake is one line within a second) and starts Ray; the workers import the rest.


def main(argv: list[str]) -> int:
    parser = Parser(prog="python -m hpsearch.train", description=DOC.splitlines()[0])
    parser.add_argument("--config", help="run config YAML (sections model, data, train)")
    parser.add_argument("--local", action="store_true", help="run the loop in this process, without Ray")
    parser.add_argument("--resume-from", help="a checkpoint directory to resume from")
    parser.add_argument("overrides", nargs="*", help="dotted key=value, e.g. model.variant=global")
    args = parser.parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides)
    absolute_paths(cfg)  # workers run elsewhere: train.output_dir and data paths are this directory's
    check_run_data(cfg)  # data mistakes fail here, before any worker starts
    from hpsearch.model import check_backbone_width, check_local_backbone
    from hpsearch.pretrain.corpus import check_backbone_corpus
    check_local_backbone(cfg.model.backbone)
    check_backbone_width(cfg.model)
    check_backbone_corpus(cfg.model.backbone, cfg.data)
    one_rank = args.local and cfg.train.num_workers != 1
    if one_rank:  # what the run is (a resume is checked against it); said once the checks passed
        cfg.train.num_workers = 1
    if args.resume_from:
        from hpsearch.train import checkpoints
        # before anything starts, unpickling none
        checkpoints.check_resume_dir(args.resume_from, cfg.to_dict(), local=args.local)
    check_output_dir(cfg)
    if one_rank:
        print("[hpsearch.train] --local runs one rank (train.num_workers ignored)", file=sys.stderr)
    if args.local:
        import torch
        if cfg.train.use_gpu and not torch.cuda.is_available():
            raise UserError("train.use_gpu=true but this machine has no CUDA device; use train.use_gpu=false")
        from hpsearch.train.loop import NonFiniteLoss, train_loop
        from hpsearch.train.sessions import LocalSession
        try:
            metrics = train_loop({"run": cfg.to_dict(), "startup": {"process": process_start()}},
                                 LocalSession(cfg, args.resume_from))
        except NonFiniteLoss as e:
            raise TrainingFailed(str(e)) from None
    else:
        check_fits_locally(cfg)  # before Ray starts: workers this machine can never hold would be waited for
        metrics = run_with_ray(cfg, args.resume_from)
    tasks = {k.split("/")[1]: v for k, v in metrics.items() if k.startswith("task/") and k.endswith("/score")}
    keys = ("step", "loss", "score", "best_score", "best_step", "test_score", "majority_score", "chance_score",
            "test_majority_score", "test_chance_score", "output_dir", "extra_params")
    summary = {**{k: metrics.get(k) for k in keys}, "tasks": tasks}
    for t in tasks:  # the yardstick beside each score, on stderr: the last stdout line is the JSON
        print(f"[hpsearch.train] {t}: validation {_pct(metrics, 'task', t)} | test {_pct(metrics, 'test', t)}",
              file=sys.stderr)
    if _finite(metrics.get("test_score")) and _finite(metrics.get("test_majority_score")) and \
            metrics["test_score"] <= metrics["test_majority_score"]:
        print(f"[hpsearch.train] warning: test score {metrics['test_score']:.1f} does not beat always predicting "
              f"the majority class ({metrics['test_majority_score']:.1f})", file=sys.stderr)
    print(json.dumps(summary))
    return 0


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and v == v and abs(v) != float("inf")


def _pct(metrics: dict, tag: str, task: str) -> str:
    score, majority, rows = (metrics.get(f"{tag}/{task}/{k}") for k in ("score", "majority", "rows"))
    if score is None:
        return "-"
    return f"{score:.1f} (majority {majority:.1f}, {int(rows)} rows)" if majority is not None else f"{score:.1f}"


if __name__ == "__main__":
    run_main(main)
