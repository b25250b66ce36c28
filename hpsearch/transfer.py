"""`python -m hpsearch.transfer`: few-shot transfer of a trained multi-task model to a new task.

    python -m hpsearch.transfer --from runs/train --task scitail --shots 4 [--seeds 3] [--data ../shared/data/glue]
                                [--steps 50] [--lr 3e-3] [--eval-rows 200] [--out DIR] [--json]

`--from`: a run's output folder (`train.output_dir` of `python -m hpsearch.train`, or a study trial's), holding
`config.yaml` and the full export `model/`. The new task joins the model as one more task of the same method, and
its task parameters start two ways, each tuned on the same k training rows (drawn per seed, `--shots`):

    nearest   a copy of the nearest existing task's parameters (`model.nearest_task`): PHA's retrieval (the task
              whose prototype is nearest to the rows' retrieved instance embeddings); for the methods without a
              retriever (HyperPrompt, HyperFormer++, adapters, prompt tuning, prefix, LoRA, MAM) the existing task
              under which the model's loss on the k rows is lowest, whose task embedding or rows are then copied
    scratch   the parameters the method gives a new task (a from-scratch task embedding)

Tuning trains the method's own parameters with the backbone frozen (AdamW, no weight decay, so the other tasks'
rows do not move), `--steps` full-batch steps on the k rows. The test split of the new task (its first
`--eval-rows` rows, the same for every seed) is scored after tuning; a task without a training split here (SciTail
in ../shared/data/glue is its labelled test split only) draws its shots from the test rows after the scored ones
that share no input text (a premise, a hypothesis) with a scored row. The new task's targets are encoded whole,
also when the source run's `data.max_target_length` is shorter than its label words in the source's tokenizer.
The result: per seed and init, the test score; per init, the mean with a 95 % t interval over seeds; and the paired
difference nearest - scratch. Written as
`transfer.json` and `transfer.md` in `--out` (default `runs/transfer/<task>-<k>shot`) and printed.

Plain PyTorch in this process: k <= a few dozen rows need neither Ray nor DeepSpeed. Per-task parameters are found
by their shapes: a tensor whose first dimension is T * r in the trained model and (T + 1) * r in the grown one holds
r rows per task, task-major (every method of the library lays its task tables out so).
"""
from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path

import torch

from hpsearch.cli import Parser, run_main, unwritable
from hpsearch.errors import ConfigError, UserError

INITS = ("nearest", "scratch")


def find_run(path: str) -> tuple[Path, Path]:
    """(run folder with config.yaml, its model/ export) from a run folder or its model/ folder."""
    from hpsearch.model.export import is_export

    p = Path(path).expanduser()
    for run, model in ((p, p / "model"), (p.parent, p)):
        if (run / "config.yaml").is_file() and is_export(model):
            return run, model
    raise ConfigError(f"--from: {path} is not a run's output folder (expected config.yaml and a model/ export "
                      "inside, as `python -m hpsearch.train` writes to train.output_dir)")


def disjoint_from(pool: list, scored: list, fields) -> list:
    """The examples of `pool` that share no input text with an example of `scored`. SciTail pairs each hypothesis
    with many premises (171 hypotheses in its 2,126 test rows, spread through the file), and rows of one hypothesis
    mostly share a label: a shot sharing one with a scored row would carry that row's label."""
    seen = {part for example in scored for part in input_texts(example.source, fields)}
    return [example for example in pool if not seen & input_texts(example.source, fields)]


def input_texts(source: str, fields) -> set[tuple[str, str]]:
    """(field, text) of each input field of a source text `<task> <field>: <text> <field>: <text> ...`
    (TaskSpec.source_text), read from the end."""
    out = set()
    for field in reversed(fields[1:]):
        source, _, text = source.rpartition(f" {field}: ")
        out.add((field, text))
    out.add((fields[0], source.partition(f"{fields[0]}: ")[2]))
    return out


def grow(trained, grown, source: int | None) -> None:
    """Copy `trained`'s weights into `grown` (one more task); the new task's rows become a copy of task `source`'s,
    or stay as `grown` initialised them (None)."""
    T = len(trained.tasks)
    new_state = grown.state_dict()
    with torch.no_grad():
        for name, value in trained.state_dict().items():
            target = new_state[name]
            if target.shape == value.shape:
                target.copy_(value)
                continue
            axes = [a for a in range(value.dim()) if value.shape[a] != target.shape[a]] \
                if value.dim() == target.dim() else []
            a = axes[0] if len(axes) == 1 else None  # the task axis (0 for tables; 2 for stacked Sep generators)
            r = value.shape[a] // T if a is not None else 0
            if not (r and value.shape[a] == T * r and target.shape[a] == (T + 1) * r):
                raise ValueError(f"{name}: {tuple(value.shape)} -> {tuple(target.shape)} is not a per-task table")
            target.narrow(a, 0, T * r).copy_(value)
            if source is not None:
                target.narrow(a, T * r, r).copy_(value.narrow(a, source * r, r))


def evaluate(model, examples, task_id: int, tokenizer, data_cfg, task: str, batch_size: int = 32) -> float:
    from hpsearch.data import decode, encode_batch, score_task

    model.eval()
    model.freeze_task_params()
    predictions = []
    with torch.no_grad():
        for i in range(0, len(examples), batch_size):
            chunk = examples[i:i + batch_size]
            batch = encode_batch(chunk, [task_id] * len(chunk), tokenizer, data_cfg)
            ids = model.generate(batch["input_ids"], batch["attention_mask"], task_ids=batch["task_ids"],
                                 max_new_tokens=data_cfg.max_target_length, do_sample=False, num_beams=1)
            predictions += decode(tokenizer, ids)
    return score_task(task, predictions, examples)["score"]


def tune(model, batch: dict, steps: int, lr: float) -> list[float]:
    model.t5.requires_grad_(False)
    params = [p for n, p in model.named_parameters() if not n.startswith("t5.")]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    model.train()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def run(args) -> dict:
    from hpsearch.compare.stats import paired, t_interval
    from hpsearch.config import load_config
    from hpsearch.data import encode_batch, get_task, get_tokenizer, load_suite
    from hpsearch.data.tokenizer import longest_target
    from hpsearch.model import build_from_config, build_model

    run_dir, model_dir = find_run(args.source)
    cfg = load_config(run_dir / "config.yaml")
    trained = build_model(str(model_dir)).eval()
    if trained.cfg.method == "mtl":
        raise ConfigError(f"--from: {model_dir} is plain multi-task T5 (method mtl): it has no task parameters to "
                          "start a new task from")
    task = get_task(args.task).name
    if task in trained.tasks:
        raise ConfigError(f"--task: {task} is already one of the model's tasks ({', '.join(trained.tasks)})")
    folder = args.data or (cfg.data.source if cfg.data.source not in ("synthetic", "hub") else None)
    if folder is None or not (Path(folder).expanduser() / task).is_dir():
        raise ConfigError(f"--data: {folder or 'the run used ' + cfg.data.source + ' data'} has no {task}/ folder; "
                          f"give the folder holding <task>/<split>.jsonl, e.g. --data ../shared/data/glue")
    target_cfg = copy.deepcopy(cfg.data)
    target_cfg.source, target_cfg.tasks = str(Path(folder).expanduser()), [task]
    target_cfg.max_train_rows = target_cfg.max_eval_rows = None
    target = load_suite(target_cfg)
    all_test = target.split(task, "test")
    test_rows, pool, shots_from = all_test[:args.eval_rows], target.split(task, "train"), "train"
    if len(pool) < args.shots:  # e.g. SciTail here: a labelled test split only
        pool = disjoint_from(all_test[args.eval_rows:], test_rows, get_task(task).fields)
        shots_from = (f"test rows after the first {len(test_rows)} (no train split) sharing no premise, hypothesis "
                      f"or other input text with a scored row: {len(pool)} of {len(all_test) - len(test_rows)}")
    if len(pool) < args.shots or not test_rows:
        raise ConfigError(f"--shots: {task} has {len(pool)} rows to draw {args.shots} shots from and "
                          f"{len(test_rows)} test rows to score here; lower --shots or --eval-rows")
    # the source run's tokenizer (an offline shape's BPE is trained on the source suite's training texts)
    tokenizer = get_tokenizer(cfg.model.backbone, cfg.data, load_suite(cfg.data), trained.t5.config.vocab_size)
    longest, _, word = longest_target(tokenizer, [task])
    if longest + 1 > target_cfg.max_target_length:  # the new task's target words, whole (else never parsed)
        print(f"[hpsearch.transfer] {task}'s target {word!r} is {longest} tokens in the source run's tokenizer: "
              f"its targets are {longest + 1} long here (the source run's data.max_target_length is "
              f"{target_cfg.max_target_length})", flush=True)
        target_cfg.max_target_length = longest + 1
    new_id = len(trained.tasks)
    results: dict[str, dict[int, float]] = {init: {} for init in INITS}
    chosen: dict[int, str] = {}
    for seed in range(args.seeds):
        shots = random.Random(seed).sample(pool, args.shots)
        batch = encode_batch(shots, [new_id] * len(shots), tokenizer, target_cfg)
        near = trained.nearest_task({k: v for k, v in batch.items() if k != "task_ids"})
        chosen[seed] = trained.tasks[near]
        for init in INITS:
            torch.manual_seed(seed)
            grown = build_from_config(trained.cfg, [*trained.tasks, task], backbone=trained.t5.config)
            grow(trained, grown, near if init == "nearest" else None)
            losses = tune(grown, batch, args.steps, args.lr)
            results[init][seed] = evaluate(grown, test_rows, new_id, tokenizer, target_cfg, task)
            print(f"[hpsearch.transfer] seed {seed} {init:<8} (from {chosen[seed] if init == 'nearest' else 'scratch'})"
                  f": loss {losses[0]:.3f} -> {losses[-1]:.3f}, test score {results[init][seed]:.1f}", flush=True)
    summary = {init: t_interval(list(results[init].values())) for init in INITS}
    diff = paired(results["nearest"], results["scratch"])
    return {"from": str(model_dir.resolve()), "method": trained.cfg.method, "source_tasks": trained.tasks,
            "task": task, "shots": args.shots, "seeds": args.seeds, "steps": args.steps, "lr": args.lr,
            "test_rows": len(test_rows), "shots_from": shots_from,
            "nearest_task": {str(s): t for s, t in chosen.items()},
            "scores": {init: {str(s): v for s, v in results[init].items()} for init in INITS},
            "mean": {init: summary[init].mean for init in INITS},
            "interval": {init: [summary[init].low, summary[init].high] for init in INITS},
            "nearest_minus_scratch": {"mean": diff.diff.mean, "interval": [diff.diff.low, diff.diff.high],
                                      "wins": diff.wins, "losses": diff.losses},
            "table": table(summary, diff)}


def table(summary, diff) -> str:
    lines = ["| init | test score (mean ± 95 % t interval) | seeds |", "|---|---|---|"]
    lines += [f"| {init} | {summary[init].text()} | {summary[init].n} |" for init in INITS]
    lines.append(f"| nearest - scratch (paired) | {diff.diff.text()} | wins {diff.wins}, losses {diff.losses} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = Parser(prog="python -m hpsearch.transfer", description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", required=True, help="a run's output folder (config.yaml, model/)")
    parser.add_argument("--task", required=True, help="the new task, e.g. scitail")
    parser.add_argument("--shots", type=int, default=16, help="k training rows (e.g. 4, 16, 32)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds (each draws its own k rows)")
    parser.add_argument("--data", help="folder holding <task>/<split>.jsonl (default: the run's data folder)")
    parser.add_argument("--steps", type=int, default=50, help="tuning steps on the k rows")
    parser.add_argument("--lr", type=float, default=3e-3, help="tuning learning rate")
    parser.add_argument("--eval-rows", type=int, default=200, help="test rows scored (the first N)")
    parser.add_argument("--out", help="output folder (default runs/transfer/<task>-<k>shot)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line at the end")
    args = parser.parse_args(argv)
    for name, value, low in (("--shots", args.shots, 1), ("--seeds", args.seeds, 1), ("--steps", args.steps, 1),
                             ("--eval-rows", args.eval_rows, 1)):
        if value < low:
            raise ConfigError(f"{name}: {value}; expected an integer >= {low}")
    if not (0 < args.lr < 1 and math.isfinite(args.lr)):
        raise ConfigError(f"--lr: {args.lr}; expected 0 < lr < 1")
    out = Path(args.out or f"runs/transfer/{args.task}-{args.shots}shot")
    why = unwritable(out)
    if why:  # before the run, not after it
        raise ConfigError(f"--out {out}: {why}; expected a folder this user can create or write")
    result = run(args)  # every input checked before anything is written
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out: cannot create {out}: {e.strerror}") from None
    (out / "transfer.json").write_text(json.dumps(result, indent=2))
    (out / "transfer.md").write_text(f"# {result['method']}: few-shot transfer to {result['task']}, "
                                     f"{result['shots']} shots, {result['seeds']} seeds\n\n{result['table']}\n")
    print(result["table"])
    print(f"[hpsearch.transfer] wrote {out / 'transfer.json'} and {out / 'transfer.md'}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    run_main(main)
