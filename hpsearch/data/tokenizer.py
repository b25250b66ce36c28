"""Tokenizers without downloads, and examples -> tensors for T5.

A backbone that is a local checkpoint or a hub name uses that checkpoint's own tokenizer. The offline
shapes (`t5-tiny`, `t5-small`, ..., `t5-v1_1-*`: random weights built from a config) get a byte-level BPE
tokenizer trained with `tokenizers` on the suite's training texts: any string encodes (bytes are the base
alphabet, so nothing is ever <unk>), decoding is exact, and the trainer is deterministic, so the same texts
and size give the same ids in every process. It is cached on disk under a hash of its inputs. Ids follow
T5: <pad>=0, </s>=1 (appended to every sequence), <unk>=2.
"""
from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from hpsearch.data._util import cache_path, one_line, temporary_beside
from hpsearch.data.config import DataConfig
from hpsearch.data.spec import Example
from hpsearch.errors import ConfigError, DataError

SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2 as in T5
_OFFLINE_SHAPE = re.compile(r"t5-(tiny|mini|small|base|large|3b|11b)|t5-v1_1-[a-z0-9]+")
_VERSION = "bpe-bytelevel-v1"  # change when the training recipe changes, so old caches are not reused


def is_offline_shape(backbone: str) -> bool:
    return _OFFLINE_SHAPE.fullmatch(backbone) is not None


def get_tokenizer(backbone: str, cfg: DataConfig, suite, vocab_size: int):
    """The checkpoint's own tokenizer, or for an offline shape the trained BPE one (ids < vocab_size)."""
    if not is_offline_shape(backbone):
        return _checkpoint_tokenizer(backbone, vocab_size)
    return _wrap(offline_tokenizer(cfg, suite, vocab_size))


def offline_tokenizer(cfg: DataConfig, suite, vocab_size: int):
    """An offline shape's trained BPE (cached) as a `tokenizers.Tokenizer`: without transformers, so a driver that
    checks a run before anything starts does not import it."""
    size = min(cfg.vocab_size, vocab_size)
    if size < 3 + 256:
        raise ConfigError(f"model vocab_size {vocab_size} is too small for the byte-level tokenizer; "
                          "expected >= 259")
    return _bpe(list(_corpus(suite)), size, cache_path(cfg.cache_dir, "tokenizers"))


def check_targets_early(backbone: str, model_vocab: int | None, cfg: DataConfig, suite, max_new_tokens: int) -> None:
    """`check_targets_fit` in a driver, before any worker starts, for an offline shape (`model_vocab`: its
    vocabulary; the BPE is trained here, or read from the cache the workers then read) and for a local checkpoint
    whose tokenizer `tokenizers` reads as the workers' transformers does (`plain_checkpoint_tokenizer`: the one
    `python -m hpsearch.pretrain` writes). Other checkpoints' tokenizers (T5's SentencePiece, which transformers
    converts and adjusts; a hub id, which downloads) are left to the workers."""
    if model_vocab is not None and is_offline_shape(backbone):
        tokenizer = offline_tokenizer(cfg, suite, model_vocab)
    else:
        tokenizer = plain_checkpoint_tokenizer(backbone)
    if tokenizer is not None:
        check_targets_fit(tokenizer, suite.tasks, cfg.max_target_length, max_new_tokens)


# the classes transformers loads a tokenizer.json as it is (5.x saves its fast tokenizers as TokenizersBackend)
PLAIN_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def plain_checkpoint_tokenizer(backbone: str):
    """A local checkpoint's tokenizer as a `tokenizers.Tokenizer` (no transformers), when transformers would load it
    unchanged: its tokenizer.json, with a plain class in tokenizer_config.json (`PLAIN_TOKENIZER_CLASSES`; a model's
    own class, T5's say, may adjust the pre-tokenizer on loading). None otherwise, or when the files do not read."""
    import json

    import tokenizers

    folder = Path(str(backbone)).expanduser()
    try:
        settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        if not isinstance(settings, dict) or settings.get("tokenizer_class") not in PLAIN_TOKENIZER_CLASSES:
            return None
        return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception:  # no such files, not JSON, not a tokenizer: the workers' loading says what is wrong
        return None


def longest_target(tokenizer, tasks: Sequence[str]) -> tuple[int, str | None, str | None]:
    """(tokens, task, target word) of the longest target of `tasks` in this tokenizer (end token not counted)."""
    from hpsearch.data.tasks import get_task

    longest, task, text = 0, None, None
    for name in tasks:
        for target in get_task(name).targets():
            n = _count(tokenizer, target)
            if n > longest:
                longest, task, text = n, name, target
    return longest, task, text


def check_targets_fit(tokenizer, tasks: Sequence[str], max_target_length: int, max_new_tokens: int) -> None:
    """Every target of every task fits what training keeps (`data.max_target_length`, its end token included) and
    what evaluation generates (`train.max_new_tokens`), in this tokenizer's tokens: else a cut label word would
    never parse (a perfect model scored 44.9 on RTE with 'not_entailment' in 9 tokens of a 300-token vocabulary) and
    a cut number would train on another value ('3' for '3.8'). A ConfigError naming the field and what would fit."""
    longest, task, text = longest_target(tokenizer, tasks)
    if longest + 1 > max_target_length:
        raise ConfigError(f"data.max_target_length: {max_target_length} cuts {task}'s target {text!r} ({longest} "
                          f"tokens with this tokenizer, and its end token); expected at least {longest + 1}")
    if longest > max_new_tokens:
        raise ConfigError(f"train.max_new_tokens: {max_new_tokens} cannot generate {task}'s target {text!r} "
                          f"({longest} tokens with this tokenizer); expected at least {longest}")


def _checkpoint_tokenizer(backbone: str, vocab_size: int):
    from transformers import AutoTokenizer

    from hpsearch.model.backbones import missing_tokenizer

    why = missing_tokenizer(backbone)
    if why:
        raise ConfigError(why)
    try:
        tokenizer = AutoTokenizer.from_pretrained(backbone)
    except Exception as e:
        raise DataError(f"could not load the tokenizer of backbone '{backbone}' (a local checkpoint or hub "
                        f"name; offline shapes are t5-tiny, t5-small, ...): {one_line(e)}") from e
    if len(tokenizer) > vocab_size:
        raise ConfigError(f"the tokenizer of '{backbone}' has {len(tokenizer)} tokens, more than the model's "
                          f"vocab_size {vocab_size}")
    return tokenizer


def _corpus(suite) -> Iterator[str]:
    """Training texts: every source and target of the train splits, in task order."""
    for task in suite.tasks:
        for example in suite.split(task, "train"):
            yield example.source
            yield example.target


def _count(tokenizer, text: str) -> int:
    """Tokens of `text` without the end token, in a transformers tokenizer or a `tokenizers.Tokenizer`."""
    import tokenizers

    if isinstance(tokenizer, tokenizers.Tokenizer):  # tokenizers' own (no transformers wrapper)
        return len(tokenizer.encode(text, add_special_tokens=False).ids)
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def train_tokenizer(texts: Sequence[str], vocab_size: int, cache_dir: Path):
    """Train (or load from `cache_dir`) a byte-level BPE tokenizer; written atomically, safe to race."""
    return _wrap(_bpe(texts, vocab_size, cache_dir))


def _wrap(tokenizer):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>")


def _bpe(texts: Sequence[str], vocab_size: int, cache_dir: Path):
    import tokenizers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    # the library's version too: another version may train other merges from the same texts, and nodes with caches
    # of their own must tokenize alike
    digest = hashlib.sha256(f"{_VERSION}\n{tokenizers.__version__}\n{vocab_size}\n".encode())
    for text in texts:
        digest.update(text.encode("utf-8") + b"\0")
    path = cache_dir / f"{_VERSION}-{vocab_size}-{digest.hexdigest()[:20]}.json"
    tokenizer = None
    if path.is_file():
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception:  # empty or damaged (a node that crashed after the rename): trained again, replaced
            tokenizer = None
    if tokenizer is None:
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                      special_tokens=list(SPECIAL_TOKENS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tokenizer.train_from_iterator(texts, trainer)
        tokenizer.post_processor = processors.TemplateProcessing(
            single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
        try:  # a cache that cannot be written (a read-only folder): this process keeps what it trained
            cache_dir.mkdir(parents=True, exist_ok=True)
            temporary = temporary_beside(path)
            tokenizer.save(str(temporary))
            os.replace(temporary, path)
        except OSError:
            pass
    return tokenizer


def encode_batch(examples: Sequence[Example], task_ids: Sequence[int], tokenizer, cfg: DataConfig) -> dict:
    """Tensors for T5's forward: input_ids, attention_mask, labels (-100 at padding, eos last),
    decoder_attention_mask and task_ids; padded to the longest sequence of the batch."""
    import torch

    if len(task_ids) != len(examples):
        raise ValueError(f"{len(task_ids)} task ids for {len(examples)} examples")
    sources = tokenizer([e.source for e in examples], max_length=cfg.max_source_length, truncation=True,
                        padding="longest", return_tensors="pt")
    targets = tokenizer([e.target for e in examples], max_length=cfg.max_target_length, truncation=True,
                        padding="longest", return_tensors="pt")
    return {
        "input_ids": sources["input_ids"],
        "attention_mask": sources["attention_mask"],
        "labels": targets["input_ids"].masked_fill(targets["attention_mask"] == 0, -100),
        "decoder_attention_mask": targets["attention_mask"],
        "task_ids": torch.as_tensor(list(task_ids), dtype=torch.long),
    }


def decode(tokenizer, ids) -> list[str]:
    """Generated ids -> target strings for `score_task` (special tokens dropped, whitespace stripped)."""
    return [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]
