"""Validation and test scoring: greedy generation on every task's split, rows sharded over the ranks."""
from __future__ import annotations

import contextlib
import math

import torch


class Evaluator:
    """Generate on every task's split, parse, score. Rows are sharded over ranks; every rank runs the same
    number of generate calls. Under ZeRO-3, which gathers parameters collectively in every forward, the ranks also
    decode in lockstep (`synced_gpus`: a flag all-reduced and read on the host at every decoding step); the other
    stages keep whole parameters on every rank, so each rank decodes on its own. One gather of the predictions per
    evaluation, and the batches go to a GPU from pinned memory without waiting."""

    def __init__(self, engine, suite, tokens, cfg, rank, world, device):
        self.engine, self.suite, self.tokens, self.tok, self.cfg = engine, suite, tokens, tokens.tokenizer, cfg
        self.rank, self.world, self.device = rank, world, device
        self._yardsticks: dict[str, dict] = {}

    def yardsticks(self, split: str, prefix: str) -> dict[str, float]:
        """Majority-class and chance scores on the split, and its row counts (computed once per split)."""
        from hpsearch.data.baselines import baselines, flat_metrics
        if split not in self._yardsticks:
            self._yardsticks[split] = flat_metrics(baselines(self.suite, split), f"{prefix}_" if prefix else "")
        return self._yardsticks[split]

    @torch.no_grad()
    def evaluate(self, split: str, prefix: str = "") -> dict:
        from hpsearch.data import decode, score_task, suite_score

        model = self.engine.module
        model.eval()
        model.freeze_prompts()  # inference pays no hypernetwork cost
        bs = self.cfg.train.eval_batch_size
        lockstep = self.world > 1 and self.engine.zero_optimization_partition_weights()  # ZeRO-3's gathers
        pin = self.device.type == "cuda"
        autocast = getattr(self.engine, "torch_autocast_enabled", lambda: False)()  # the dtype training computes in
        precision = torch.autocast(self.device.type, dtype=self.engine.torch_autocast_dtype()) if autocast else \
            contextlib.nullcontext()
        to_device = lambda t: t.pin_memory().to(self.device, non_blocking=True) if pin else t.to(self.device)
        metrics, scores, predictions = {}, {}, {}
        for task_id, task in enumerate(self.suite.tasks):
            rows = self.suite.split(task, split)
            if not rows:
                continue
            sources = self.tokens.ids(task, split)[0]
            # this rank's rows, shortest first: batches of similar lengths carry little padding
            mine = sorted(range(self.rank, len(rows), self.world), key=lambda i: len(sources[i]))
            n_batches = math.ceil(math.ceil(len(rows) / self.world) / bs)
            preds: dict[int, str] = {}
            for b in range(n_batches):
                idx = mine[b * bs:(b + 1) * bs]
                picks = [(task_id, i) for i in idx] or [(task_id, 0)]  # a dummy row keeps ranks in lockstep
                batch = self.tokens.batch(picks, split)
                with precision:
                    out = model.generate(to_device(batch["input_ids"]), to_device(batch["attention_mask"]),
                                         task_ids=batch["task_ids"],  # the model moves them (checked on the CPU)
                                         max_new_tokens=self.cfg.train.max_new_tokens, do_sample=False,
                                         num_beams=1, synced_gpus=lockstep)
                preds.update(zip(idx, decode(self.tok, out)))
            predictions[task] = preds
        if self.world > 1:  # every task's predictions in one gather
            gathered: list = [None] * self.world
            torch.distributed.all_gather_object(gathered, predictions)
            predictions = {task: {k: v for part in gathered for k, v in part[task].items()} for task in predictions}
        for task, preds in predictions.items():
            rows = self.suite.split(task, split)
            result = score_task(task, [preds[i] for i in range(len(rows))], rows)
            scores[task] = result["score"]
            tag = prefix or "task"
            metrics.update({f"{tag}/{task}/{name}": value for name, value in result.items()})
        model.train()
        metrics[f"{prefix}_score" if prefix else "score"] = suite_score(scores) if scores else float("nan")
        metrics.update(self.yardsticks(split, prefix))
        return metrics

