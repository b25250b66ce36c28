"""A suite tokenized once: token ids per task and split, and batches collated from them.

Training and evaluation used to tokenize every batch's texts again at every step and every evaluation; here each
(task, split) is tokenized once on first use (the same truncation as `encode_batch`, so the tensors are identical)
and a batch is padding of stored ids.

    tokens = TokenizedSuite(suite, tokenizer, cfg.data)
    batch = tokens.batch([(task_index, row_index), ...], "train")    # == encode_batch(the same rows)
"""
from __future__ import annotations

from collections.abc import Sequence

from hpsearch.data.config import DataConfig


class TokenizedSuite:
    def __init__(self, suite, tokenizer, cfg: DataConfig):
        self.suite, self.tokenizer, self.cfg = suite, tokenizer, cfg
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._ids: dict[tuple[str, str], tuple[list[list[int]], list[list[int]]]] = {}

    def ids(self, task: str, split: str) -> tuple[list[list[int]], list[list[int]]]:
        """(source ids, target ids) of every row of the split, in row order (eos included, truncated)."""
        key = (task, split)
        if key not in self._ids:
            rows = self.suite.split(task, split)
            encode = lambda texts, n: self.tokenizer(texts, max_length=n, truncation=True)["input_ids"] if texts \
                else []
            self._ids[key] = (encode([r.source for r in rows], self.cfg.max_source_length),
                              encode([r.target for r in rows], self.cfg.max_target_length))
        return self._ids[key]

    def batch(self, picks: Sequence[tuple[int, int]], split: str) -> dict:
        """The tensors `encode_batch` makes for these (task index, row index) picks."""
        sources, targets = [], []
        for t, i in picks:
            src, tgt = self.ids(self.suite.tasks[t], split)
            sources.append(src[i])
            targets.append(tgt[i])
        return collate(sources, targets, [t for t, _ in picks], self.pad)


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
