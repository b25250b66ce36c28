"""T5's span corruption (Raffel et al. 2020, §3.1.4): drop 15 % of the tokens in spans of mean length 3, replace
each dropped span in the input by one sentinel, and make the target the sentinels followed by the tokens they hid.

    mask = noise_mask(length=10, noise_density=0.15, mean_span_length=3.0, rng=np.random.default_rng(0))
    inputs, targets = corrupt([5, 6, 7, 8], [False, True, True, False], sentinels=[99, 98], eos=1)
    # inputs [5, 99, 8, 1], targets [99, 6, 7, 1]; with full=True the targets are [5, 6, 7, 8, 1]

The mask follows the T5 code's `random_spans_noise_mask`: round(length x density) noise tokens (at least 1, at most
length - 1) in round(noise / mean length) spans (at least 1); the noise and the kept tokens are each split into that
many non-empty runs at random, and the sequence alternates kept, noise, kept, noise, ... so it starts with kept
tokens. The end-of-sequence token is appended after corruption, to inputs and targets alike: no span covers it.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def span_counts(length: int, noise_density: float, mean_span_length: float) -> tuple[int, int]:
    """(noise tokens, noise spans) for a sequence of `length` tokens; (0, 0) when it is too short to corrupt."""
    if length < 2:
        return 0, 0
    noise = min(max(int(round(length * noise_density)), 1), length - 1)
    spans = max(int(round(noise / mean_span_length)), 1)
    return noise, min(spans, noise, length - noise)


def _segments(items: int, segments: int, rng: np.random.Generator) -> np.ndarray:
    """A random split of `items` into `segments` non-empty runs: their lengths, in order."""
    cuts = np.sort(rng.choice(np.arange(1, items), size=segments - 1, replace=False)) if segments > 1 else \
        np.array([], dtype=int)
    return np.diff(np.concatenate([[0], cuts, [items]])).astype(int)


def noise_mask(length: int, noise_density: float, mean_span_length: float, rng: np.random.Generator) -> np.ndarray:
    """A boolean mask over `length` tokens, True where a token is dropped into a span."""
    noise, spans = span_counts(length, noise_density, mean_span_length)
    mask = np.zeros(length, dtype=bool)
    if spans == 0:
        return mask
    noise_runs = _segments(noise, spans, rng)
    kept_runs = _segments(length - noise, spans, rng)
    position = 0
    for kept, dropped in zip(kept_runs, noise_runs):
        position += kept
        mask[position:position + dropped] = True
        position += dropped
    return mask


def corrupt(ids: Sequence[int], mask: Sequence[bool], sentinels: Sequence[int], eos: int, full: bool = False
            ) -> tuple[list[int], list[int]]:
    """(inputs, targets): each run of masked tokens becomes the next sentinel in the inputs; the targets are each
    sentinel followed by the tokens it replaced, or with `full` the whole original sequence (BART's text infilling,
    the T5 paper's "reconstruct the original" targets: the decoder copies what it sees and fills in the spans).
    Both end with `eos`."""
    if len(ids) != len(mask):
        raise ValueError(f"{len(ids)} tokens but a mask of {len(mask)}")
    inputs: list[int] = []
    targets: list[int] = []
    span = -1
    for k, (token, dropped) in enumerate(zip(ids, mask)):
        if not dropped:
            inputs.append(int(token))
            continue
        if k == 0 or not mask[k - 1]:  # a span starts
            span += 1
            if span >= len(sentinels):
                raise ValueError(f"more noise spans than the {len(sentinels)} sentinel tokens")
            inputs.append(int(sentinels[span]))
            targets.append(int(sentinels[span]))
        targets.append(int(token))
    if full:
        targets = [int(t) for t in ids]
    return inputs + [eos], targets + [eos]
