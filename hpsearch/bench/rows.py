"""What groups step to deepspeed time: the batch's shape and the method rows. Light (no torch), so the command line
checks `--batch` and `--methods` before anything heavy is imported."""
from __future__ import annotations

import re
from dataclasses import dataclass

# HyperPrompt as the issue states it: both sides, l = 16 / 6, b = 32 (the rest: ModelConfig's defaults)
HYPERPROMPT = dict(placement="both", prompt_length_encoder=16, prompt_length_decoder=6, bottleneck=32)


@dataclass(frozen=True)
class BatchShape:
    """The timed batch: `rows` x (`source` input + `target` label) tokens (`--batch ROWSxSOURCE+TARGET`)."""
    rows: int = 32
    source: int = 64
    target: int = 8

    @classmethod
    def parse(cls, text: str) -> BatchShape:
        match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*\+\s*(\d+)\s*", text)
        if not match or min(int(g) for g in match.groups()) < 1:
            raise ValueError(f"{text!r} is not ROWSxSOURCE+TARGET with positive integers, e.g. 32x64+8")
        return cls(*(int(g) for g in match.groups()))

    def __str__(self) -> str:
        return f"{self.rows} x ({self.source} + {self.target})"


BATCH = BatchShape()  # the issue's: 32 x (64 + 8) tokens


def method_rows() -> list[tuple[str, str, dict]]:
    """(row, method, hparams): every method of the registry with its defaults; HyperPrompt once per variant."""
    from hpsearch.model.config import METHODS, VARIANTS  # the registry's methods (METHOD_CLASSES), without torch

    variants = sorted(VARIANTS, key=lambda v: v != "global")  # the paper's own variant first
    rows = []
    for method in METHODS:
        if method == "hyperprompt":
            rows += [(f"hyperprompt-{v}", method, {**HYPERPROMPT, "variant": v}) for v in variants]
        else:
            rows.append((method, method, {}))
    return rows
