"""A suite tokenized once: token ids per task and split, and batches collated from them.

Training and evaluation used to tokenize every batch's texts again at every step and every evaluation; here each
(task, split) is tokenized once on first use (the same truncation as `encode_batch`, so the tensors are identical)
and a batch is padding of stored ids.

The ids are also cached on disk (`<data.cache_dir>/tokens/`, default ~/.cache/hpsearch), under a hash of the
tokenizer (its whole serialized form, class, truncation side and library versions), the maximum length and the
texts, so the next trial of a study, each rank of a run and the next run read them instead of tokenizing again
(RTE, MRPC, CoLA, SST-2 and CB: 81,000 training rows, 5.2 s to tokenize, 0.6 s to read, hashing included). A file
is numpy's (`allow_pickle=False`), written atomically; a damaged one is tokenized again, and a tokenizer that
cannot be serialized (not a fast one) is not cached. The folder is kept under `data.token_cache_mb` (default
2 GiB; 0: no disk cache): after each write the least recently used files beyond it are removed (a read marks a
file used), and so are temporary files a killed writer left (older than an hour).

    tokens = TokenizedSuite(suite, tokenizer, cfg.data)
    batch = tokens.batch([(task_index, row_index), ...], "train")    # == encode_batch(the same rows)
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

from hpsearch.data._util import cache_path, temporary_beside
from hpsearch.data.config import DataConfig

_VERSION = "token-ids-v1"  # change when what a file holds changes, so old caches are not read
STALE_TEMPORARY_S = 3600  # a writer's temporary file older than this was left by a killed process


class TokenizedSuite:
    def __init__(self, suite, tokenizer, cfg: DataConfig):
        self.suite, self.tokenizer, self.cfg = suite, tokenizer, cfg
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._ids: dict[tuple[str, str], tuple[list[list[int]], list[list[int]]]] = {}
        self.cache_dir = cache_path(cfg.cache_dir, "tokens")
        self._budget = int(cfg.token_cache_mb * 2**20)
        self._identity = identity(tokenizer) if self._budget > 0 else None

    def ids(self, task: str, split: str) -> tuple[list[list[int]], list[list[int]]]:
        """(source ids, target ids) of every row of the split, in row order (eos included, truncated)."""
        key = (task, split)
        if key not in self._ids:
            rows = self.suite.split(task, split)
            self._ids[key] = (self._encode([r.source for r in rows], self.cfg.max_source_length),
                              self._encode([r.target for r in rows], self.cfg.max_target_length))
        return self._ids[key]

    def _encode(self, texts: list[str], max_length: int) -> list[list[int]]:
        if not texts:
            return []
        encode = lambda: self.tokenizer(texts, max_length=max_length, truncation=True)["input_ids"]
        if self._identity is None:
            return encode()
        digest = hashlib.sha256(f"{_VERSION}\n{max_length}\n".encode() + self._identity)
        for text in texts:
            data = text.encode("utf-8")
            digest.update(len(data).to_bytes(8, "little") + data)  # length first: no two lists hash alike
        path = self.cache_dir / f"{digest.hexdigest()[:32]}.npz"
        cached = read_ids(path, len(texts))
        if cached is not None:
            return cached
        ids = encode()
        if write_ids(path, ids):
            prune(self.cache_dir, self._budget, keep=path)
        return ids

    def label_tokens(self, picks: Sequence[tuple[int, int]], split: str) -> int:
        """The target tokens (eos included, truncated) of these picks: what their loss averages over."""
        return sum(len(self.ids(self.suite.tasks[t], split)[1][i]) for t, i in picks)

    def batch(self, picks: Sequence[tuple[int, int]], split: str) -> dict:
        """The tensors `encode_batch` makes for these (task index, row index) picks."""
        sources, targets = [], []
        for t, i in picks:
            src, tgt = self.ids(self.suite.tasks[t], split)
            sources.append(src[i])
            targets.append(tgt[i])
        return collate(sources, targets, [t for t, _ in picks], self.pad)


def identity(tokenizer) -> bytes | None:
    """A hash of what decides a fast tokenizer's ids: its whole definition (vocabulary, merges, normalizer, pre- and
    post-processing, without the truncation and padding a call leaves set on it), its class and truncation side, and
    the versions of `tokenizers` and `transformers`; None for a tokenizer that cannot be serialized."""
    import tokenizers
    import transformers

    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        definition = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
    except Exception:  # not a fast tokenizer, or one with a custom Python component
        return None
    key = [definition, type(tokenizer).__name__, getattr(tokenizer, "truncation_side", None),
           tokenizers.__version__, transformers.__version__]
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).digest()


def read_ids(path: Path, rows: int) -> list[list[int]] | None:
    """The rows of ids stored at `path`, or None when there is no such file (or it is unreadable)."""
    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as f:
            flat, offsets = f["ids"], f["offsets"]
    except Exception:  # none there, or a damaged one (zipfile and numpy raise many kinds): tokenize again
        return None
    if len(offsets) != rows + 1:
        return None
    try:
        os.utime(path)  # used now: `prune` removes the least recently used first
    except OSError:
        pass
    values, bounds = flat.tolist(), offsets.tolist()
    return [values[a:b] for a, b in zip(bounds, bounds[1:])]


def write_ids(path: Path, ids: list[list[int]]) -> bool:
    """Store rows of ids at `path` (flat int32 ids and row offsets), atomically: safe when processes race. False
    when the folder cannot take it."""
    import numpy as np

    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(row) for row in ids])
    flat = np.fromiter((i for row in ids for i in row), dtype=np.int32, count=int(offsets[-1]))
    temporary = temporary_beside(path, ".npz")  # numpy appends .npz to a name without it
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(temporary, ids=flat, offsets=offsets)
        os.replace(temporary, path)
        return True
    except OSError:  # a read-only or full cache directory: tokenizing again next time is all it costs
        temporary.unlink(missing_ok=True)
        return False


def prune(folder: Path, max_bytes: int, keep: Path) -> None:
    """Remove the least recently used (oldest modification time) id files until the folder's files take at most
    `max_bytes`, never `keep` (the file just written), and writers' temporary files older than STALE_TEMPORARY_S.
    Processes pruning at once, or a reader losing a file it was about to open, only cost tokenizing again."""
    now, files = time.time(), []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        try:
            stat = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if entry.name.startswith(".") and ".tmp" in entry.name:
            if now - stat.st_mtime > STALE_TEMPORARY_S:
                Path(entry.path).unlink(missing_ok=True)
        elif entry.name.endswith(".npz") and entry.is_file(follow_symlinks=False):
            files.append((stat.st_mtime, stat.st_size, Path(entry.path)))
    total = sum(size for _, size, _ in files)
    for _, size, path in sorted(files, key=lambda f: f[0]):  # least recently used first
        if total <= max_bytes:
            break
        if path == keep:
            continue
        try:
            path.unlink()
        except FileNotFoundError:  # another process pruned it
            pass
        except OSError:
            continue
        total -= size

def collate(sources: Sequence[list[int]], targets: Sequence[list[int]], task_ids: Sequence[int], pad: int) -> dict:
    """Right-padded to the longest row: input_ids, attention_mask, labels (-100 at padding),
    decoder_attention_mask, task_ids."""
    import torch

    def padded(rows):
        n = max(len(r) for r in rows)
        ids = torch.full((len(rows), n), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), n), dtype=torch.long)
        for k, r in enumerate(rows):
            ids[k, :len(r)] = torch.as_tensor(r, dtype=torch.long)
            mask[k, :len(r)] = 1
        return ids, mask

    input_ids, attention_mask = padded(sources)
    labels, decoder_mask = padded(targets)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels.masked_fill(decoder_mask == 0,
                                                                                                  -100),
            "decoder_attention_mask": decoder_mask, "task_ids": torch.as_tensor(list(task_ids), dtype=torch.long)}
