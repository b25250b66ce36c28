"""Run under torchrun (1 or 2 ranks, gloo, DS_ACCELERATOR=cpu): the recipe at ZeRO stage 0.

- Its backward (`gradient_sync` around `engine.backward`) against DeepSpeed's own (every backward reduces), from the
  same weights, on batches that differ by rank, three steps each (dropout on, seeded alike, weight decay on), with
  a parameter (`probe`) that only the first step's loss uses, so it has no gradient afterwards. Reports, per rank:
  how many times each engine reduced its gradients, the largest difference between their weights, how far the
  weights and the probe moved after the first step, and a hash of the recipe's weights (every rank must end with
  the same ones).
- `gather_on_rank0` of the model's state (what the export writes): on rank 0, how many of its tensors are the
  model's own (not copies) and whether they equal the weights; on the other ranks, whether every value is None.

Writes a JSON report per rank to argv[1]; tests/test_train.py asserts on it.
"""
import hashlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from rows import rank_batch  # noqa: E402

from hpsearch.config import load_config  # noqa: E402
from hpsearch.model import build_model  # noqa: E402
from hpsearch.train import deepspeed_config, optimizer_and_schedule  # noqa: E402
from hpsearch.train.bestweights import gather_on_rank0  # noqa: E402
from hpsearch.train.loop import gradient_sync  # noqa: E402
from hpsearch.train.ops import load_ops  # noqa: E402

dist.init_process_group("gloo")
load_ops()
deepspeed.init_distributed("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
cfg = load_config(None, ["train.lr=1e-2", "train.warmup_steps=0", "train.max_steps=10", "train.micro_batch_size=2",
                         "train.zero_stage=0", "train.weight_decay=0.1"])


def engine():
    """A stage-0 engine of the recipe's config, and the list its gradient reductions are counted in."""
    torch.manual_seed(0)
    model = build_model("t5-tiny", "hyperprompt", ["a", "b"])
    model.register_parameter("probe", torch.nn.Parameter(torch.ones(4)))
    optimizer, scheduler = optimizer_and_schedule(model, cfg)
    e, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                 config=deepspeed_config(cfg, world, 0, hidden=model.config.d_model))
    calls, reduce = [], e.allreduce_gradients

    def counted(*args, **kwargs):
        calls.append(1)
        return reduce(*args, **kwargs)
    e.allreduce_gradients = counted
    return e, calls


def train(e, recipe: bool) -> dict:
    probes = []
    for step in range(3):
        batch = rank_batch(step, rank)  # each rank its own rows; the same dropout in both engines
        e.train()
        loss = e(**batch).loss
        if step == 0:
            loss = loss + e.module.probe.square().sum()  # its only gradient
        if recipe:
            with gradient_sync(e):
                e.backward(loss)
        else:
            e.backward(loss)
        e.step()
        probes.append(e.module.probe.detach().clone())
    return {n: p.detach().clone() for n, p in e.module.named_parameters()}, probes


ours, our_calls = engine()
start = {n: p.detach().clone() for n, p in ours.module.named_parameters()}
theirs, their_calls = engine()
(mine, probes), (reference, _) = train(ours, True), train(theirs, False)
flat = torch.cat([mine[n].flatten() for n in sorted(mine)])
report = {"world": world, "recipe_reductions": len(our_calls), "deepspeed_reductions": len(their_calls),
          "max_diff": max((mine[n] - reference[n]).abs().max().item() for n in mine),
          "moved": max((mine[n] - start[n]).abs().max().item() for n in mine),
          "probe_moved_later": (probes[-1] - probes[0]).abs().max().item(),  # momentum and decay, no gradient
          "weights_sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest()}
own = ours.module.state_dict(keep_vars=True)
state = gather_on_rank0(own.items(), rank)
report["export_tensors"] = len(state)
if rank == 0:
    report["export_own"] = sum(state[n].data_ptr() == t.data_ptr() for n, t in own.items())
    report["export_equal"] = all(torch.equal(state[n], t.detach()) for n, t in own.items())
else:
    report["export_none"] = all(v is None for v in state.values())
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(report))
dist.destroy_process_group()
