"""Span corruption as the training loop's objective (`hpsearch.train.objective` describes the interface).

Each rank reads the corpus, trains (or loads from the cache) the same byte-level BPE tokenizer with `corpus.sentinels`
sentinel tokens added, and cuts the token stream into pieces (`corpus.Chunks`). A training batch is a sampled set of
pieces, each corrupted with a noise mask drawn from a generator seeded by (data.seed, the sampler's step, rank,
slot), so a resume draws the same masks. Validation is the held-out pieces with fixed masks: teacher-forced loss
and token accuracy of the targets (`score` = the accuracy in %, higher is better). The export is a plain
`T5ForConditionalGeneration` checkpoint with its tokenizer, which `model.backbone=<dir>` loads.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from hpsearch.pretrain.config import CorpusConfig
from hpsearch.pretrain.corpus import Chunks, describe_corpus, read_corpus
from hpsearch.pretrain.spans import corrupt, noise_mask
from hpsearch.train.build import build_whole

CORPUS_TASK = "corpus"  # the one "task" of the plain T5 being pretrained
BACKBONE_DIR = "backbone"


def sentinel_tokens(n: int) -> list[str]:
    return [f"<extra_id_{i}>" for i in range(n)]


def corpus_tokenizer(texts: list[str], vocab_size: int, corpus: CorpusConfig, cache_dir: str | None):
    """The byte-level BPE tokenizer trained on the corpus (vocab_size - sentinels entries) plus the sentinels."""
    from hpsearch.data.tokenizer import train_tokenizer

    size = vocab_size - corpus.sentinels
    if size < 3 + 256:
        raise ValueError(f"vocab_size {vocab_size} leaves {size} entries beside {corpus.sentinels} sentinels; the "
                         "byte-level tokenizer needs >= 259")
    tokenizer = train_tokenizer(texts, size, Path(cache_dir or "~/.cache/hpsearch").expanduser() / "tokenizers")
    tokenizer.add_special_tokens({"additional_special_tokens": sentinel_tokens(corpus.sentinels)})
    return tokenizer


class SpanCorruption:
    def __init__(self, cfg, rank: int, world: int, options: dict, build=build_whole):
        from hpsearch.data import MultiTaskSampler
        from hpsearch.model import build_from_config, build_skeleton

        self.cfg, self.rank, self.world = cfg, rank, world
        self.corpus = corpus = CorpusConfig(**options["corpus"])
        texts = read_corpus(corpus, cfg.data)

        def make():
            torch.manual_seed(cfg.train.seed)
            return build_from_config(cfg.model, [CORPUS_TASK])  # the same initial weights wherever it runs
        self.model = build(make, lambda: build_skeleton(cfg.model, [CORPUS_TASK]))
        self.tokenizer = corpus_tokenizer(texts, self.model.t5.config.vocab_size, corpus, cfg.data.cache_dir)
        self.sentinels = self.tokenizer.convert_tokens_to_ids(sentinel_tokens(corpus.sentinels))
        self.eos, self.pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        self.chunks = Chunks(texts, self.tokenizer, corpus.max_length - 1, corpus.heldout_chunks, cfg.data.seed)
        self.sampler = MultiTaskSampler([len(self.chunks.train)], cfg.train.micro_batch_size, 1.0, "task",
                                        cfg.data.seed, rank, world)
        heldout_rng = lambda k: np.random.default_rng([cfg.data.seed, 2, k])
        self.heldout = [self._example(ids, heldout_rng(k)) for k, ids in enumerate(self.chunks.heldout)]

    def _example(self, ids: list[int], rng: np.random.Generator) -> tuple[list[int], list[int]]:
        mask = noise_mask(len(ids), self.corpus.noise_density, self.corpus.mean_span_length, rng)
        return corrupt(ids, mask, self.sentinels, self.eos, full=self.corpus.targets == "full")

    def start(self, engine, device) -> None:
        self.engine, self.device = engine, device

    def batch(self) -> dict:
        from hpsearch.data.tokens import collate

        step = self.sampler.state_dict()["step"]
        picks = next(self.sampler)
        pairs = [self._example(self.chunks.train[i], np.random.default_rng([self.cfg.data.seed, 1, step, self.rank,
                                                                             slot]))
                 for slot, (_, i) in enumerate(picks)]
        return collate([p[0] for p in pairs], [p[1] for p in pairs], [0] * len(pairs), self.pad)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Teacher-forced loss and token accuracy on the held-out pieces, sharded over the ranks (every rank runs the
        same number of forward passes: ZeRO-3 gathers parameters collectively)."""
        from hpsearch.data.tokens import collate

        model = self.engine.module
        model.eval()
        bs = self.cfg.train.eval_batch_size
        mine = list(range(self.rank, len(self.heldout), self.world))
        sums = torch.zeros(3, dtype=torch.float64)  # loss, correct tokens, tokens
        for b in range(math.ceil(math.ceil(len(self.heldout) / self.world) / bs)):
            rows = mine[b * bs:(b + 1) * bs]
            picked = [self.heldout[k] for k in rows] or [self.heldout[0]]  # a dummy row keeps ranks in lockstep
            batch = {k: v.to(self.device) for k, v in collate([p[0] for p in picked], [p[1] for p in picked],
                                                               [0] * len(picked), self.pad).items()}
            logits = model(**batch).logits.float()
            labels = batch["labels"]
            counted = labels != -100
            if not rows:
                continue
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                     reduction="sum")
            sums += torch.stack([loss, ((logits.argmax(-1) == labels) & counted).sum(), counted.sum()]).double().cpu()
        if torch.distributed.is_initialized():
            sums = sums.to(self.device)
            torch.distributed.all_reduce(sums)
        loss, correct, tokens = sums.tolist()
        model.train()
        accuracy = 100.0 * correct / max(tokens, 1.0)
        return {"heldout_loss": loss / max(tokens, 1.0), "heldout_accuracy": accuracy, "score": accuracy}

    def finish(self, engine, best: dict) -> dict:
        """The loaded weights as a plain T5 checkpoint with the tokenizer: <train.output_dir>/backbone."""
        from hpsearch.model.backbones import new_t5
        from hpsearch.train.objective import gathered_state

        target = Path(self.cfg.train.output_dir) / BACKBONE_DIR

        def export(state):
            t5 = new_t5(self.model.t5.config, init=False)
            t5.load_state_dict({k.removeprefix("t5."): v for k, v in state.items() if k.startswith("t5.")})
            partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            shutil.rmtree(partial, ignore_errors=True)
            t5.save_pretrained(partial)
            self.tokenizer.save_pretrained(partial)
            (partial / "pretrain.json").write_text(json.dumps({
                "corpus": describe_corpus(self.corpus, self.cfg.data),
                "corpus_tokens": self.chunks.tokens, "step": best["step"], "heldout_accuracy": best["score"],
                "noise_density": self.corpus.noise_density, "mean_span_length": self.corpus.mean_span_length,
                "targets": self.corpus.targets,
                "data_seed": self.cfg.data.data_seed,
                "data_source": None if self.corpus.path else self.cfg.data.source}, indent=1) + "\n")
            shutil.rmtree(target, ignore_errors=True)
            os.replace(partial, target)

        gathered_state(engine, self.rank, export)
        return {"backbone": str(target.resolve())}
