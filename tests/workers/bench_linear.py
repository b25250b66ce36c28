"""Run in a process of its own (DS_ACCELERATOR=cpu): the bench's `deepspeed` group at the tiny shape, recording which
`torch.nn.functional.linear` each timed entry runs with. ZeRO-3's engine replaces it process-wide; the plain torch
loop and the ZeRO-0 engine must still run torch's own.

Writes a JSON report to argv[1]: {entry: [names of the linear at each call]}, the one left behind ("after") and the
DeepSpeed engines still alive after a full collection ("engines_after"); tests/test_bench.py asserts on it.
"""
import gc
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402

from hpsearch.bench import zero  # noqa: E402
from hpsearch.bench.rows import BatchShape  # noqa: E402

native = torch.nn.functional.linear
seen: dict[str, list[str]] = {}


def name(linear) -> str:
    return "torch" if linear is native else f"{linear.__module__}.{linear.__name__}"


def recording(entry: str, step):
    def step_and_record():
        seen.setdefault(entry, []).append(name(torch.nn.functional.linear))
        step()
    return step_and_record


plain_step, engine_step = zero.plain_step, zero.engine_step
zero.plain_step = lambda *a: recording("torch", plain_step(*a))


def engine_step_recorded(model, cfg, batch):
    step, engine = engine_step(model, cfg, batch)
    return recording(f"zero{cfg.train.zero_stage}", step), engine


zero.engine_step = engine_step_recorded
figures, errors = zero.run("t5-tiny", 2, 2, "task", lambda *a: None, BatchShape(4, 8, 2))
assert not errors, errors
gc.collect()
alive = sum(type(o).__name__ == "DeepSpeedEngine" for o in gc.get_objects())
with open(sys.argv[1], "w") as f:
    json.dump({**seen, "after": name(torch.nn.functional.linear), "figures": [x.name for x in figures],
               "engines_after": alive}, f)
