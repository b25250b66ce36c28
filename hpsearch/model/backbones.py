"""T5 backbones: named shapes built offline from their published configs, or checkpoints via `from_pretrained`.

A named shape (`t5-tiny`, `t5-base`, `t5-v1_1-large`, ...) gets random weights and needs nothing from outside.
Anything else is a local checkpoint directory or a hub id (e.g. `google-t5/t5-base`) for `from_pretrained`.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from hpsearch.errors import ConfigError

if TYPE_CHECKING:  # transformers (with torch: ~4 s) is imported where it is used, so checking a config is quick
    from transformers import T5Config, T5ForConditionalGeneration

_V1 = dict(feed_forward_proj="relu", vocab_size=32128)
_V11 = dict(feed_forward_proj="gated-gelu", vocab_size=32128, tie_word_embeddings=False)

# d_model, d_ff, layers (encoder = decoder), heads, d_kv: the values of the published configs.
NAMED_SHAPES: dict[str, dict] = {
    "t5-tiny": dict(d_model=64, d_ff=256, num_layers=2, num_heads=4, d_kv=16, feed_forward_proj="relu",
                    vocab_size=4096, dropout_rate=0.0),
    # not a published shape: 13.1 M parameters, small enough to pretrain on a CPU box (python -m hpsearch.pretrain)
    "t5-mini": dict(d_model=256, d_ff=1024, num_layers=6, num_heads=4, d_kv=64, feed_forward_proj="relu",
                    vocab_size=8192),
    "t5-small": dict(d_model=512, d_ff=2048, num_layers=6, num_heads=8, d_kv=64, **_V1),
    "t5-base": dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12, d_kv=64, **_V1),
    "t5-large": dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16, d_kv=64, **_V1),
    "t5-3b": dict(d_model=1024, d_ff=16384, num_layers=24, num_heads=32, d_kv=128, **_V1),
    "t5-11b": dict(d_model=1024, d_ff=65536, num_layers=24, num_heads=128, d_kv=128, **_V1),
    "t5-v1_1-small": dict(d_model=512, d_ff=1024, num_layers=8, num_heads=6, d_kv=64, **_V11),
    "t5-v1_1-base": dict(d_model=768, d_ff=2048, num_layers=12, num_heads=12, d_kv=64, **_V11),
    "t5-v1_1-large": dict(d_model=1024, d_ff=2816, num_layers=24, num_heads=16, d_kv=64, **_V11),
    "t5-v1_1-xl": dict(d_model=2048, d_ff=5120, num_layers=24, num_heads=32, d_kv=64, **_V11),
    "t5-v1_1-xxl": dict(d_model=4096, d_ff=10240, num_layers=24, num_heads=64, d_kv=64, **_V11),
}


def is_named_shape(backbone) -> bool:
    return isinstance(backbone, str) and backbone in NAMED_SHAPES


def named_vocab_size(backbone, vocab_size: int | None = None) -> int | None:
    """The vocabulary of a named shape (`model.vocab_size` if set, else the shape's), read without transformers;
    None for any other backbone."""
    if not is_named_shape(backbone):
        return None
    return vocab_size if vocab_size is not None else NAMED_SHAPES[backbone]["vocab_size"]


def backbone_width(backbone) -> int | None:
    """d_model of a named shape or of a local checkpoint (its config.json), read without torch or transformers;
    None for a hub id, an hpsearch export (built and checked when it was made) or a config that does not say."""
    if is_named_shape(backbone):
        return NAMED_SHAPES[backbone]["d_model"]
    try:
        width = json.loads((Path(str(backbone)).expanduser() / "config.json").read_text(encoding="utf-8"))["d_model"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return width if isinstance(width, int) and not isinstance(width, bool) and width > 0 else None


def check_backbone_width(cfg) -> None:
    """Before anything starts: what the method sizes from the backbone's width (`config.check_width`), when the
    width can be read here (`backbone_width`: not a hub id's, which needs the network)."""
    from hpsearch.model.config import check_width

    width = backbone_width(cfg.backbone)
    if width is not None:
        check_width(cfg, width)


def named_config(name: str, vocab_size: int | None = None, dropout: float | None = None) -> T5Config:
    if name not in NAMED_SHAPES:
        raise ConfigError(f"model.backbone: {name!r} is not a named shape; known: {', '.join(NAMED_SHAPES)}")
    from transformers import T5Config

    values = dict(NAMED_SHAPES[name])
    if vocab_size is not None:
        values["vocab_size"] = vocab_size
    if dropout is not None:
        values["dropout_rate"] = dropout
    return T5Config(**values, num_decoder_layers=values["num_layers"], decoder_start_token_id=0,
                    pad_token_id=0, eos_token_id=1)


@contextmanager
def _quiet_hub():
    """The hub client logs its failed requests itself; the one-line error below says it all."""
    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _looks_local(text: str) -> bool:
    """A path, not a hub id ("org/name"): starts with . / ~, has two or more separators, or starts in a folder
    that exists here."""
    parts = text.replace("\\", "/").split("/")
    return text.startswith((".", "/", "~")) or len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).is_dir())


def backbone_config(backbone, vocab_size: int | None = None, dropout: float | None = None) -> T5Config:
    """The T5Config of a backbone, without building weights (hub/local: reads the config file only)."""
    from transformers import T5Config

    if isinstance(backbone, T5Config):
        return backbone
    if is_named_shape(backbone):
        return named_config(backbone, vocab_size, dropout)
    _check_local(backbone)
    try:
        with _quiet_hub():
            config = T5Config.from_pretrained(backbone)
    except Exception as e:  # no internet, no such path: a user mistake, one line
        raise _unloadable(backbone, type(e).__name__) from None
    if dropout is not None:
        config.dropout_rate = dropout
    return config


def _unloadable(backbone, why: str) -> ConfigError:
    return ConfigError(f"model.backbone: cannot load a T5 config from {backbone!r} ({why}); expected a named shape "
                       f"({', '.join(NAMED_SHAPES)}), a local checkpoint directory or a reachable hub id")


def _check_local(backbone) -> None:
    """A local folder must hold a checkpoint (T5Config.from_pretrained would answer a default config for any
    folder); a local-looking path that does not exist is a mistake. Hub ids pass (only the network can tell)."""
    folder = Path(str(backbone)).expanduser()
    if folder.is_dir():
        weights = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json")
        if not (folder / "config.json").is_file() or not any((folder / w).is_file() for w in weights):
            raise ConfigError(f"model.backbone: {backbone} is not a checkpoint (expected config.json and "
                              "model.safetensors or pytorch_model.bin in it, an hpsearch export with "
                              "hpsearch_model.json, or a named shape)")
        try:
            config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (ValueError, OSError) as e:
            raise _unloadable(backbone, type(e).__name__) from None
        if not isinstance(config, dict):
            raise _unloadable(backbone, "config.json is not a JSON object")
    elif _looks_local(str(backbone)):
        raise ConfigError(f"model.backbone: {backbone}: no such directory; to make a pretrained backbone there, run "
                          "python -m hpsearch.pretrain (it writes <train.output_dir>/backbone, by default "
                          "runs/pretrain/backbone)")


# the files a checkpoint's tokenizer is read from (transformers' AutoTokenizer): the fast tokenizer's, T5's
# SentencePiece model, a BPE's or WordPiece's vocabulary
TOKENIZER_FILES = ("tokenizer.json", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "vocab.txt")


def missing_tokenizer(backbone) -> str | None:
    """Why a local checkpoint folder cannot give its tokenizer (it has none of `TOKENIZER_FILES`), else None.
    Without them transformers built T5's slow tokenizer around nothing, and every word became <unk>."""
    folder = Path(str(backbone)).expanduser()
    if not folder.is_dir() or any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    return (f"model.backbone: {backbone} has no tokenizer ({' or '.join(TOKENIZER_FILES[:2])}); expected the "
            "tokenizer files beside config.json, as python -m hpsearch.pretrain and save_pretrained write them")


def check_local_backbone(backbone: str, tokenizer: bool = True) -> None:
    """Before anything starts: a local backbone folder (not a hub id: that needs the network) must be a checkpoint
    or an hpsearch export, with its tokenizer when the run reads it (`tokenizer`: fine-tuning does, counting
    parameters and pretraining, which trains its own, do not); else a one-line ConfigError. Reads files only (no
    transformers, no torch)."""
    if (Path(str(backbone)).expanduser() / "hpsearch_model.json").is_file():
        return
    _check_local(backbone)
    why = missing_tokenizer(backbone) if tokenizer else None
    if why:
        raise ConfigError(why)


def new_t5(config: T5Config, init: bool = True) -> T5ForConditionalGeneration:
    """`T5ForConditionalGeneration(config)` without torch's default initialisation of each layer, which T5's own
    (`init_weights`: every weight, then the tied embeddings) overwrites anyway: 0.8 s instead of 1.2 s at t5-small
    here. The same distribution per weight as the stock constructor's (tested), though not the same draws for a
    seed. `init=False` skips T5's too (the weights are `torch.empty`'s until the caller loads every one of them)."""
    from transformers import T5ForConditionalGeneration
    from transformers.initialization import no_init_weights

    with no_init_weights():  # torch.nn.init's functions and PreTrainedModel.init_weights do nothing in here
        model = T5ForConditionalGeneration(config)
    if init:
        model.init_weights()
    else:
        model.tie_weights()
    return model


_keep = False  # keep_random_backbones(): this process builds a backbone for every trial
_kept: tuple | None = None  # (key, weights, RNG state after building them) of the last random backbone
_lock = threading.Lock()  # a reused actor's threads
KEEP_SHARE = 0.1  # a backbone is kept only while its weights take at most this share of the host's free memory
copies = 0  # backbones this process built as copies of a kept one


def keep_random_backbones(on: bool = True) -> None:
    """For a process that builds a backbone for every trial (a study's reused Tune actor, its kept ranks): keep a
    copy of the last random backbone's initial weights, and build the next one of the same config from the same
    RNG state (a trial seeds it with `train.seed`) as a copy of them, leaving the RNG where building it would have:
    the same weights and the same later draws. One backbone is kept, only for a build on the CPU, and only when
    its weights take at most `KEEP_SHARE` of the host's available memory shared by the ranks on this node
    (`LOCAL_WORLD_SIZE`, each of which keeps its own)."""
    global _keep, _kept
    _keep = on
    if not on:
        _kept = None


def _random_backbone(config: T5Config) -> T5ForConditionalGeneration:
    if not _keep:
        return new_t5(config)
    import hashlib

    import psutil
    import torch

    from hpsearch.model.base import values_absent

    global _kept, copies
    key = (config.to_json_string(), str(torch.get_default_dtype()),
           hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest())
    model = new_t5(config, init=False)  # the structure; its values next
    params = list(model.parameters())
    if values_absent(*params) or any(p.device.type != "cpu" for p in params):  # meta, zero.Init, a device: as ever
        model.init_weights()
        return model
    with _lock:
        kept = _kept
        if kept is not None and kept[0] == key:
            model.load_state_dict(kept[1])  # copied in: the kept weights stay as they were
            torch.set_rng_state(kept[2])
            copies += 1
            return model
        _kept = None  # one kept at a time
        model.init_weights()  # as new_t5(config)
        state = model.state_dict()
        unique = {t.data_ptr(): t for t in state.values()}  # tied weights: one copy, under each of their names
        size = sum(t.numel() * t.element_size() for t in unique.values())
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if size <= KEEP_SHARE * psutil.virtual_memory().available / ranks:
            clones = {ptr: t.detach().clone() for ptr, t in unique.items()}
            _kept = (key, {name: clones[t.data_ptr()] for name, t in state.items()}, torch.get_rng_state())
    return model


def load_backbone(backbone, vocab_size: int | None = None, dropout: float | None = None
                  ) -> T5ForConditionalGeneration:
    """A T5ForConditionalGeneration: random weights for a named shape or config, else `from_pretrained`."""
    from transformers import T5Config, T5ForConditionalGeneration

    if isinstance(backbone, T5Config) or is_named_shape(backbone):
        return _random_backbone(backbone_config(backbone, vocab_size, dropout))
    config = backbone_config(backbone, dropout=dropout)
    source = str(Path(backbone)) if Path(backbone).exists() else backbone
    return T5ForConditionalGeneration.from_pretrained(source, config=config)
