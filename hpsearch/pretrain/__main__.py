"""`python -m hpsearch.pretrain` (see hpsearch/pretrain/__init__.py)."""
from __future__ import annotations

import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

from hpsearch.cli import Parser, run_main
from hpsearch.config import absolute_paths
from hpsearch.errors import UserError
from hpsearch.pretrain import __doc__ as DOC

OBJECTIVE = "hpsearch.pretrain.objective:SpanCorruption"


def _say(text: str) -> None:
    print(f"[hpsearch.pretrain] {text}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    parser = Parser(prog="python -m hpsearch.pretrain", description=DOC.splitlines()[0])
    parser.add_argument("--config", help="YAML with sections model, data, train, corpus")
    parser.add_argument("--local", action="store_true", help="run the loop in this process, without Ray")
    parser.add_argument("--resume-from", help="a checkpoint directory to resume from")
    parser.add_argument("--tracking-uri", default="sqlite:///mlflow.db", help="MLflow tracking URI")
    parser.add_argument("overrides", nargs="*", help="dotted key=value, e.g. train.max_steps=100")
    args = parser.parse_intermixed_args(argv)

    from hpsearch.pretrain.config import load_pretrain_config
    cfg, corpus = load_pretrain_config(args.config, args.overrides)
    absolute_paths(cfg)
    if corpus.path:
        corpus.path = str(Path(corpus.path).expanduser().resolve())
    from hpsearch.pretrain.corpus import LAYOUT
    options = {"corpus": dataclasses.asdict(corpus), "corpus_layout": {"version": LAYOUT}}  # resume checks both
    if args.local:  # one rank: what the run is (a resume is checked against it)
        cfg.train.num_workers = 1
    _check(cfg, corpus, args.resume_from, args.local)  # every mistake before Ray starts or MLflow gets a run

    from hpsearch.tracking import SingleRun, resolve_tracking_uri, ui_command
    uri = resolve_tracking_uri(args.tracking_uri)
    command = "python -m hpsearch.pretrain " + shlex.join(argv)
    params = {**cfg.flat(), **{f"corpus.{k}": v for k, v in options["corpus"].items()}}
    run = SingleRun(uri, "pretrain", Path(cfg.train.output_dir).name, params, command)
    status, started = "FAILED", time.time()
    try:
        metrics = _train(cfg, options, args, run)
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        try:  # the curve is a convenience: whatever goes wrong with it, the run's status is recorded
            curve = _plot(Path(cfg.train.output_dir), since=started)
            if curve is not None:
                run.log_artifact(curve)
        except Exception as e:
            _say(f"loss.png not made: {type(e).__name__}: {e}")
        run.finish(status)
    _say(f"backbone: {metrics['backbone']} (held-out target accuracy {metrics.get('best_score', float('nan')):.1f} % "
         f"at step {metrics.get('best_step')}); MLflow: {ui_command(uri)}")
    _say(f"fine-tune from it: python -m hpsearch.tune --space search_spaces/glue-local.yaml "
         f"model.backbone={metrics['backbone']}")
    keys = ("step", "loss", "heldout_loss", "heldout_accuracy", "best_step", "backbone", "output_dir")
    print(json.dumps({k: metrics.get(k) for k in keys}))
    return 0


def _check(cfg, corpus, resume_from, local: bool) -> None:
    """Config and corpus mistakes as one line: the corpus is read, tokenized (warming the tokenizer cache the
    workers then read) and cut into pieces here."""
    from hpsearch.model import check_local_backbone
    from hpsearch.model.backbones import backbone_config
    from hpsearch.pretrain.corpus import Chunks, read_corpus

    check_local_backbone(cfg.model.backbone, tokenizer=False)  # it trains its own
    texts = read_corpus(corpus, cfg.data)
    # the backbone's config and the tokenizer import transformers and torch (~2 s): after the corpus' own checks
    vocab = backbone_config(cfg.model.backbone, cfg.model.vocab_size).vocab_size
    from hpsearch.pretrain.objective import corpus_tokenizer
    try:
        tokenizer = corpus_tokenizer(texts, vocab, corpus, cfg.data.cache_dir)
    except ValueError as e:
        raise UserError(f"model.vocab_size: {e}") from None
    chunks = Chunks(texts, tokenizer, corpus.max_length - 1, corpus.heldout_chunks, cfg.data.seed)
    if resume_from:
        from hpsearch.train import checkpoints
        checkpoints.check_resume_dir(resume_from, {**cfg.to_dict(), "corpus": dataclasses.asdict(corpus)},
                                     local=local)
    from hpsearch.train.launch import check_fits_locally, check_output_dir
    check_output_dir(cfg)
    if not local:  # workers this machine can never hold would be waited for
        check_fits_locally(cfg)
    per_step = cfg.train.micro_batch_size * cfg.train.grad_accum * cfg.train.num_workers
    _say(f"corpus: {len(texts)} texts, {chunks.tokens} tokens, {len(chunks.train)} pieces of "
         f"{corpus.max_length - 1} tokens to train on, {len(chunks.heldout)} held out; {cfg.train.max_steps} steps "
         f"x {per_step} pieces = {cfg.train.max_steps * per_step / len(chunks.train):.2f} epochs")


def _train(cfg, options, args, run) -> dict:
    from hpsearch.train import run_with_ray, train_loop
    from hpsearch.train.launch import TrainingFailed
    from hpsearch.train.loop import NonFiniteLoss
    from hpsearch.train.sessions import LocalSession

    if not args.local:
        return run_with_ray(cfg, args.resume_from, objective=OBJECTIVE, options=options, callbacks=[run.callback()])
    session = LocalSession(cfg, args.resume_from)
    try:
        metrics = train_loop({"run": cfg.to_dict(), "objective": OBJECTIVE, "options": options}, session)
    except NonFiniteLoss as e:
        raise TrainingFailed(str(e)) from None
    from hpsearch.tracking import _log_batches, _metrics
    for report in session.history:
        _log_batches(run.client, run.run_id, metrics=_metrics(report, int(report.get("step", 0))))
    return metrics


def _plot(out_dir: Path, since: float = 0.0) -> Path | None:
    """loss.png: training loss and held-out loss per evaluation step, from the run's metrics.jsonl (None when this
    run, started at `since`, wrote none: a file left by an earlier run in the folder is not this run's curve). A
    line cut short by a kill is left out."""
    history = out_dir / "metrics.jsonl"
    if not history.is_file() or history.stat().st_mtime < since:
        return None
    rows = []
    for line in history.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and {"step", "loss", "heldout_loss"} <= set(row):
            rows.append(row)
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(steps, [r["loss"] for r in rows], marker="o", label="training loss (mean since last evaluation)")
    ax.plot(steps, [r["heldout_loss"] for r in rows], marker="s", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / target token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out_dir / "loss.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    run_main(main)
