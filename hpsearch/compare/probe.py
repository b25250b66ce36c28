"""After training, in the trial: the exported model's generation time and attention statistics.

The trial loads its own export (`build_model(<output_dir>/model)`: the best-validation weights the run delivers)
and takes the first `rows_per_task` validation rows of every task (the same rows in every trial: the split depends
on data.data_seed only). On them it measures

- generation time: greedy decoding with frozen task parameters (as the recipe's evaluation does), exactly
  `train.max_new_tokens` new tokens per row so every method decodes the same length; one untimed pass, then
  `reps` timed passes, each task's batch counting its fastest pass (a pass another process disturbed does not
  count); on one CPU thread, so the figure compares the
  methods' own cost (not the machine's parallelism) and trials running side by side disturb each other least;
- attention statistics (`model.attention_stats`, the paper's Fig. 3): per side and layer, the attention mass on
  the prompt positions and the entropy of the attention over real tokens, teacher-forced on the same rows and
  averaged over rows.

Returns flat metrics: `gen_ms_per_row`, `gen_rows`, `gen_new_tokens`, `backbone_params` (the T5's own
parameters), `attn/<side>/<layer>/prompt_mass`, `attn/<side>/<layer>/token_entropy`.
"""
from __future__ import annotations

import gc
import math
import time
from pathlib import Path

from hpsearch.config import RunConfig


def validation_batches(cfg: RunConfig, rows_per_task: int, vocab_size: int) -> list[dict]:
    """One encoded batch per task: its first `rows_per_task` validation rows (test rows if it has none)."""
    from hpsearch.data import encode_batch, get_tokenizer, load_suite

    suite = load_suite(cfg.data)
    tokenizer = get_tokenizer(cfg.model.backbone, cfg.data, suite, vocab_size)
    batches = []
    for task_id, task in enumerate(suite.tasks):
        rows = (suite.split(task, "validation") or suite.split(task, "test"))[:rows_per_task]
        if rows:
            batches.append(encode_batch(rows, [task_id] * len(rows), tokenizer, cfg.data))
    return batches


def probe(cfg: RunConfig, rows_per_task: int = 16, reps: int = 3) -> dict[str, float]:
    import torch

    from hpsearch.model import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(str(Path(cfg.train.output_dir) / "model"))
        model.eval()
        model.freeze_prompts()  # inference pays no generator cost (the recipe's evaluation does the same)
        batches = validation_batches(cfg, rows_per_task, model.t5.config.vocab_size)
        rows = sum(b["input_ids"].shape[0] for b in batches)
        new_tokens = cfg.train.max_new_tokens

        def generate(b):
            model.generate(b["input_ids"], b["attention_mask"], task_ids=b["task_ids"], do_sample=False,
                           num_beams=1, max_new_tokens=new_tokens, min_new_tokens=new_tokens)

        for b in batches:  # warm-up
            generate(b)
        fastest = [math.inf] * len(batches)
        for _ in range(reps):
            for i, b in enumerate(batches):
                gc.collect()
                start = time.perf_counter()
                generate(b)
                fastest[i] = min(fastest[i], time.perf_counter() - start)
        out = {"gen_ms_per_row": 1000 * sum(fastest) / rows, "gen_rows": float(rows),
               "gen_new_tokens": float(new_tokens),
               "backbone_params": float(sum(p.numel() for p in model.t5.parameters()))}
        out.update(attention(model, batches))
        return out
    finally:
        torch.set_num_threads(threads)


def attention(model, batches: list[dict]) -> dict[str, float]:
    """`attention_stats` per batch, averaged over batches weighted by their rows: flat `attn/...` metrics."""
    sums: dict[str, float] = {}
    total = 0
    for batch in batches:
        n = batch["input_ids"].shape[0]
        stats = model.attention_stats(batch)
        for side, layers in stats.items():
            for layer in layers:
                for key in ("prompt_mass", "token_entropy"):
                    name = f"attn/{side}/{layer['layer']}/{key}"
                    sums[name] = sums.get(name, 0.0) + n * float(layer[key])
        total += n
    return {k: v / total for k, v in sums.items()} if total else {}
