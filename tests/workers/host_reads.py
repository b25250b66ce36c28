"""One `--local` run of the recipe (in this process, LocalSession) with every host read of a tensor's values and
every collective recorded, by the part of the loop it happened in.

Recorded: `Tensor.item`, `.tolist`, `bool()`, `int()`, `float()`, `.nonzero` (and `torch.nonzero`), the accelerator's
`synchronize`, and torch.distributed's collectives, in the main thread (the batch prefetcher's thread works on the
host by design). The phases: "step" from the loop taking a batch to its fold of the window (forward, backward,
optimizer step, the window's sums, every micro-step), "fold" inside `Window.fold`, "other" the rest (the model's
build, evaluation, checkpoints). The model checks its task ids on the CPU by design (`task_context`): those reads
are counted apart, as are the reads inside the model's forward in the "step" phase (tests/test_methods.py runs
every method's forward and backward on the meta device, where any such read raises). On this CPU none of these
is a synchronisation; on a GPU each read of a device tensor would be one.

argv: output JSON, then the run's overrides. Writes {"events": {phase: {what: count}}, "folds": n,
"task_context": n, "model": n, "metrics": {...}}.
"""
import collections
import json
import os
import sys
import threading
import traceback

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hpsearch.config import load_config  # noqa: E402
from hpsearch.train import loop  # noqa: E402
from hpsearch.train.prefetch import Prefetch  # noqa: E402
from hpsearch.train.sessions import LocalSession  # noqa: E402

out_file, overrides = sys.argv[1], sys.argv[2:]
main = threading.get_ident()
phase = ["other"]
events: dict = collections.defaultdict(collections.Counter)
counts = collections.Counter()


def record(what: str) -> None:
    if threading.get_ident() != main:
        return
    stack = traceback.extract_stack()[:-2]
    if any(f.name == "task_context" for f in stack):
        counts["task_context"] += 1
        return
    if phase[0] == "step" and any(f.name == "forward" and f.filename.endswith("hpsearch/model/base.py")
                                  for f in stack):
        counts["model"] += 1  # the model's own forward: tests/test_methods.py runs it on the meta device
        return
    # where: the innermost caller outside torch and DeepSpeed's communication wrappers, e.g. deepspeed's
    # clip_grad_norm_ or the loop's fold
    caller = next((f for f in reversed(stack) if not any(part in f.filename for part in (
        "/torch/", "deepspeed/comm/", "host_reads.py"))), stack[-1])
    events[phase[0]][f"{what} in {caller.filename.rsplit('site-packages/', 1)[-1]}:{caller.name}"] += 1


def spy(owner, name: str, what: str) -> None:
    original = getattr(owner, name)

    def spied(*args, **kwargs):
        record(what)
        return original(*args, **kwargs)
    setattr(owner, name, spied)


for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero"):
    spy(torch.Tensor, name, name)
spy(torch, "nonzero", "nonzero")
for name in ("all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
             "barrier"):
    spy(dist, name, f"collective {name}")

next_batch, fold = Prefetch.next, loop.Window.fold


def next_spied(self):
    phase[0] = "step"
    return next_batch(self)


def fold_spied(self, *args):
    counts["folds"] += 1
    phase[0] = "fold"
    try:
        return fold(self, *args)
    finally:
        phase[0] = "other"


Prefetch.next, loop.Window.fold = next_spied, fold_spied
if os.environ.get("HOST_READS_BF16"):  # the GPU workers' default precision, on this CPU (DeepSpeed's CPU accelerator
    from hpsearch.train import dsconfig  # runs it; the run config refuses bf16 without GPU workers)

    dsconfig.use_bf16 = lambda cfg: True
cfg = load_config(None, overrides)
from deepspeed.accelerator import get_accelerator  # noqa: E402  (after the loop set DS_ACCELERATOR)

spy(get_accelerator(), "synchronize", "synchronize")
metrics = loop.train_loop({"run": cfg.to_dict()}, LocalSession(cfg, None))
with open(out_file, "w") as f:
    json.dump({"events": {k: dict(v) for k, v in events.items()}, "folds": counts["folds"],
               "task_context": counts["task_context"], "model": counts["model"], "metrics": {"step": metrics["step"]}},
              f)
