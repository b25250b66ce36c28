"""A pretraining config: the run config's model / data / train sections (the same recipe) and a `corpus` section.

    cfg, corpus = load_pretrain_config("pretrain.yaml", ["train.max_steps=100", "corpus.path=texts/"])

Defaults (`DEFAULTS`): the `t5-mini` shape, plain T5 (model.method=mtl), one Ray Train worker with ZeRO stage 0
(a 13 M-parameter model fits: sharding it would only add traffic), the GLUE training inputs of ../shared/data/glue
as the corpus, and a budget that takes about an hour on 2 CPU cores (measured, with evaluations). The token
embeddings learn at 20 x the rate of the rest (`train.embedding_lr_scale`): T5 starts them at std 1, and at the
layers' rate they barely moved (held-out loss after 2,500 steps with span targets: 3.89 with the scale, 4.28
without; README).
The inputs are T5's span corruption; the targets are the whole original piece (`corpus.targets=full`), because with
T5's short targets (`spans`) the decoder of this small model learned them without reading the encoder, and the
backbone fine-tuned no better than random weights (README).
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from pathlib import Path

from hpsearch.config import (
    SECTIONS,
    RunConfig,
    apply_mapping,
    coerce,
    parse_override,
    read_yaml,
    set_field,
)
from hpsearch.errors import ConfigError

DEFAULTS = {
    "model": {"backbone": "t5-mini", "method": "mtl", "dropout": 0.0},
    "data": {"source": "../shared/data/glue", "task_prefix": True},
    "train": {"num_workers": 1, "cpus_per_worker": 2.0, "zero_stage": 0, "micro_batch_size": 32,
              "max_steps": 1500, "lr": 5.0e-4, "embedding_lr_scale": 20.0, "warmup_steps": 150,
              "weight_decay": 0.0, "eval_every": 250,
              "log_every": 50, "eval_batch_size": 64, "output_dir": "runs/pretrain"},
}


@dataclass
class CorpusConfig:
    path: str | None = None         # a folder of .txt / .jsonl text; None: the training inputs of the suite data.*
    text_field: str = "text"        # the field of a .jsonl row that holds its text
    noise_density: float = 0.15     # share of tokens dropped into spans (T5: 0.15)
    mean_span_length: float = 3.0   # mean length of a dropped span (T5: 3)
    targets: str = "full"           # full: the whole original piece; spans: each sentinel and the tokens it hid (T5)
    max_length: int = 128           # tokens of a piece before corruption, eos included
    heldout_chunks: int = 64        # pieces of whole held-out texts, never trained on: the held-out loss and accuracy
    sentinels: int = 100            # <extra_id_0> ... added to the tokenizer

    def validate(self) -> None:
        if not 0 < self.noise_density < 1:
            raise ConfigError(f"corpus.noise_density: {self.noise_density!r}; expected 0 < density < 1")
        if self.targets not in ("spans", "full"):
            raise ConfigError(f"corpus.targets: {self.targets!r} is not one of spans, full")
        if not 1 <= self.mean_span_length < math.inf:  # nan and inf too
            raise ConfigError(f"corpus.mean_span_length: {self.mean_span_length!r}; expected a finite number >= 1")
        if self.max_length < 8:
            raise ConfigError(f"corpus.max_length: {self.max_length!r}; expected an integer >= 8")
        if self.heldout_chunks < 1:
            raise ConfigError(f"corpus.heldout_chunks: {self.heldout_chunks!r}; expected an integer >= 1")
        spans = round(round((self.max_length - 1) * self.noise_density) / self.mean_span_length)
        if self.sentinels < max(spans, 1):
            raise ConfigError(f"corpus.sentinels: {self.sentinels} < the {spans} spans a piece of "
                              f"{self.max_length} tokens gets; expected at least {spans}")
        if self.path is not None and not Path(self.path).expanduser().is_dir():
            raise ConfigError(f"corpus.path: {self.path}: no such directory; expected a folder of .txt or .jsonl "
                              "text (or leave it out to read the suite's training inputs)")


def _set_corpus(corpus: CorpusConfig, name: str, value, where: str) -> None:
    hints = typing.get_type_hints(CorpusConfig)
    names = [f.name for f in dataclasses.fields(CorpusConfig)]
    if name not in names:
        raise ConfigError(f"{where}: unknown field 'corpus.{name}'; corpus fields: {', '.join(names)}")
    setattr(corpus, name, coerce(value, hints[name], f"{where}: corpus.{name}"))


def load_pretrain_config(path: str | Path | None = None, overrides: typing.Iterable[str] = ()
                         ) -> tuple[RunConfig, CorpusConfig]:
    """Defaults <- YAML file <- overrides, validated; a mistake is one line naming the file and line or override."""
    cfg = RunConfig()
    apply_mapping(cfg, DEFAULTS, "<pretrain defaults>")  # validated with the file and overrides, below
    corpus = CorpusConfig()
    if path is not None:
        data, lines = read_yaml(path)
        where = lambda key: f"{path}:{lines[key]}" if key in lines else str(path)
        for section in data:
            if section not in (*SECTIONS, "corpus"):
                raise ConfigError(f"{where(section)}: unknown section {section!r}; expected "
                                  f"{', '.join((*SECTIONS, 'corpus'))}")
        values = data.pop("corpus", None) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{where('corpus')}: section 'corpus' must be a mapping of field: value")
        for name, value in values.items():
            _set_corpus(corpus, name, value, where(f"corpus.{name}"))
        apply_mapping(cfg, data, str(path), lines)
    for text in overrides:
        key, value = parse_override(text)
        if key.startswith("corpus."):
            _set_corpus(corpus, key.removeprefix("corpus."), value, f"override {text!r}")
        else:
            set_field(cfg, key, value, f"override {text!r}")
    corpus.validate()
    if corpus.path is not None:  # the suite is not read: its folder need not exist (the default's is the repo's)
        cfg.model.validate(), cfg.train.validate(), cfg.data.validate(read=False)
    else:
        cfg.validate()
    if cfg.model.method != "mtl":
        raise ConfigError(f"model.method: {cfg.model.method!r}; pretraining trains the plain backbone (mtl)")
    return cfg, corpus
