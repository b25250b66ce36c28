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
from hpsearch.data.config import DataConfig
from hpsearch.data.metrics import score_task, suite_score
from hpsearch.data.sampling import MultiTaskSampler, task_probabilities
from hpsearch.data.spec import Example, TaskSpec
from hpsearch.data.suite import SPLITS, Suite, load_suite
from hpsearch.data.tasks import GLUE_SUITE, TASKS, get_task
from hpsearch.data.tokenizer import decode, encode_batch, get_tokenizer, is_offline_shape

__all__ = [
    "GLUE_SUITE", "SPLITS", "TASKS", "DataConfig", "Example", "MultiTaskSampler", "Suite", "TaskSpec",
    "decode", "encode_batch", "get_task", "get_tokenizer", "is_offline_shape", "load_suite", "score_task",
    "suite_score", "task_probabilities",
]
