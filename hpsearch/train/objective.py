"""What a run trains on, apart from the loop: the model, the batches, the validation score and the export.

The loop (`loop.py`) owns DeepSpeed, steps, checkpoints, resume and reports; an objective owns the data. The
recipe's own objective is `FineTuning` (the suite's tasks); `hpsearch.pretrain` passes its span-corruption objective
by name (`loop_config["objective"] = "module:Class"`), so pretraining runs the same loop. An objective has:

    objective = Objective(cfg, rank, world, options, build=builder)   # .model, .sampler: the model comes from
                                                          # build(make, skeleton) (build.py: whole, or ZeRO-3's)
    objective.start(engine, device)                       # after DeepSpeed wraps the model
    objective.batch()                                     # this rank's next training batch (CPU tensors; the
                                                          # loop moves all but `task_ids` to the device: the
                                                          # model takes them on the CPU, see MultiTaskT5), with
                                                          # LABEL_TOKENS if it knows every rank's batches (the
                                                          # loss is then a mean over the whole step's tokens)
    objective.evaluate()                                  # validation metrics with "score" (higher is better)
    objective.finish(engine, best)                        # export the (best) weights, score the test split
"""
from __future__ import annotations

import importlib
from pathlib import Path

import torch

from hpsearch.config import dump_yaml
from hpsearch.model import build_from_config, build_skeleton, save_export, save_task_params
from hpsearch.train.build import build_whole

LABEL_TOKENS = "label_tokens"  # a batch's key: (this rank's target tokens, every rank's in every micro-step of
#                                the step), plain ints

# The model library is imported here, with the loop, not first inside a run: imported for the first time from
# within a training call, it left that run's DeepSpeed engine alive after the run returned, past a full
# collection (tests/test_train.py, RELEASED; the holder is not a Python object gc can see)


def load_objective(name: str | None):
    """The objective class `module:Class` names; FineTuning when None."""
    if not name:
        return FineTuning
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def gathered_state(engine, rank: int, use) -> None:
    """Call `use(state)` on rank 0 with the full state dict on the CPU; every rank must call this. Under ZeRO-3 the
    parameters are gathered one at a time, so rank 0 alone builds the full CPU copy and no other rank ever holds
    more than one whole parameter beyond its shard (a t5-3b export does not put the model on every rank)."""
    from hpsearch.train.bestweights import gather_on_rank0

    state = gather_on_rank0(engine.module.state_dict(keep_vars=True).items(), rank)
    if rank == 0:
        use(state)


class FineTuning:
    """The suite's tasks: temperature-sampled multi-task batches, generation scored on validation and test, and
    the export (model/, task_params/, config.yaml)."""

    def __init__(self, cfg, rank: int, world: int, options: dict | None = None, build=build_whole):
        from hpsearch.data import MultiTaskSampler, get_task, get_tokenizer, load_suite
        from hpsearch.data.tokenizer import check_targets_fit

        self.cfg, self.rank, self.world = cfg, rank, world
        self.suite = suite = load_suite(cfg.data)
        skeleton = lambda: build_skeleton(cfg.model, suite.tasks)
        with torch.device("meta"):
            vocab_size = skeleton().t5.config.vocab_size
        self.tokenizer = get_tokenizer(cfg.model.backbone, cfg.data, suite, vocab_size)
        check_targets_fit(self.tokenizer, suite.tasks, cfg.data.max_target_length, cfg.train.max_new_tokens)
        labels = [[self.tokenizer(word, add_special_tokens=False).input_ids for word in (spec.labels or ())]
                  for spec in (get_task(t) for t in suite.tasks)]

        def make():
            torch.manual_seed(cfg.train.seed)
            model = build_from_config(cfg.model, suite.tasks)  # the same initial weights wherever it runs
            model.init_task_params(labels)  # e.g. prompt tuning's prompts from the labels' embeddings
            return model
        self.model = build(make, skeleton)
        self.sampler = MultiTaskSampler(suite.sizes("train"), cfg.train.micro_batch_size, cfg.data.temperature,
                                        cfg.data.batching, cfg.data.seed, rank, world)
        self._step_batches: list = []  # the rest of the current step's micro-batches (batch())

    def start(self, engine, device) -> None:
        from hpsearch.data.tokens import TokenizedSuite
        from hpsearch.train.evaluate import Evaluator

        self.tokens = TokenizedSuite(self.suite, self.tokenizer, self.cfg.data)  # every row tokenized once
        for task in self.suite.tasks:  # the training rows now: the prefetch thread then only reads stored ids, and
            self.tokens.ids(task, "train")  # the tokenizer (not thread-safe) stays with evaluation on this thread
        self.evaluator = Evaluator(engine, self.suite, self.tokens, self.cfg, self.rank, self.world, device)

    def batch(self) -> dict:
        """This rank's next micro-batch, and LABEL_TOKENS: (its target tokens, every rank's in all train.grad_accum
        micro-batches of its step). The sampler draws every rank's picks, and a step's micro-batches are drawn
        together at its first, so the loss is a mean over the whole step's tokens without a collective or a tensor
        read. The sampler's state between steps is unchanged: a step's first call draws the step."""
        if not self._step_batches:
            drawn = []
            for _ in range(self.cfg.train.grad_accum):
                picks = next(self.sampler)
                drawn.append((picks, self.tokens.label_tokens(self.sampler.last_all_ranks, "train")))
            everyone = sum(n for _, n in drawn)
            self._step_batches = [(picks, everyone) for picks, _ in reversed(drawn)]
        picks, everyone = self._step_batches.pop()
        batch = self.tokens.batch(picks, "train")
        batch[LABEL_TOKENS] = (self.tokens.label_tokens(picks, "train"), everyone)
        return batch

    def evaluate(self) -> dict:
        return self.evaluator.evaluate("validation")

    def finish(self, engine, best: dict) -> dict:
        """Export the loaded weights and score them on the test split."""

        out_dir = Path(self.cfg.train.output_dir)

        def export(state):
            save_export(engine.module, out_dir / "model", state)
            save_task_params(engine.module, out_dir / "task_params", state)
            (out_dir / "config.yaml").write_text(dump_yaml(self.cfg))

        gathered_state(engine, self.rank, export)
        test = self.evaluator.evaluate("test", prefix="test")
        return {"test_score": test.pop("test_score"), **test}
