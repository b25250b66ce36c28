"""Multi-task data: GLUE / SuperGLUE / SciTail and a synthetic suite as text-to-text tasks for T5.

    suite = load_suite(cfg)                                   # validated, split protocol applied
    tokenizer = get_tokenizer(backbone, cfg, suite, vocab_size)
    sampler = MultiTaskSampler(suite.sizes(), batch_size, cfg.temperature, cfg.batching, cfg.seed,
                               rank, world_size)
    batch = next(sampler)                                     # [(task index, row index), ...]
    examples = [suite.split(suite.tasks[t], "train")[r] for t, r in batch]
    tensors = encode_batch(examples, [t for t, _ in batch], tokenizer, cfg)
    ...
    scores = score_task(task, decode(tokenizer, generated_ids), suite.split(task, "validation"))
    overall = suite_score({task: scores["score"], ...})
"""
from __future__ import annotations

from hpsearch.lazy import lazy_names

# where each public name lives: imported on first use (PEP 562), so reading and validating a config does not import
# the tokenizer, scikit-learn or torch
_WHERE = {
    "DataConfig": "config", "score_task": "metrics", "suite_score": "metrics", "MultiTaskSampler": "sampling",
    "task_probabilities": "sampling", "Example": "spec", "TaskSpec": "spec", "SPLITS": "suite", "Suite": "suite",
    "load_suite": "suite", "GLUE_SUITE": "tasks", "TASKS": "tasks", "get_task": "tasks", "decode": "tokenizer",
    "encode_batch": "tokenizer", "get_tokenizer": "tokenizer", "is_offline_shape": "tokenizer",
}

__all__ = sorted(_WHERE)


__getattr__, __dir__ = lazy_names(__name__, _WHERE)
