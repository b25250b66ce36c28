"""Run under torchrun (2 ranks, gloo, DS_ACCELERATOR=cpu): the recipe's optimizer (`optimizer_and_schedule`) inside a
DeepSpeed engine at ZeRO stages 0, 2 and 3, with `train.embedding_lr_scale` 1 and 20. After one step, AdamW's first
update is lr x g / (|g| + eps), i.e. +-lr on every element with a gradient: the largest change of the token-embedding
table must be lr x scale and that of every other weight lr. Then `train.optimizer=adafactor` at stage 0 (the only
stage it accepts): DeepSpeed must hand torch's Adafactor the model's own weights, whole, and its first update must
be the one tests/adafactor_ref.py re-computes from the averaged gradients.

Writes a JSON report per rank to argv[1]; tests/test_train.py asserts on it.
"""
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hpsearch.config import load_config  # noqa: E402
from hpsearch.model import build_model  # noqa: E402
from hpsearch.train import deepspeed_config, optimizer_and_schedule  # noqa: E402
from hpsearch.train.ops import load_ops  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from adafactor_ref import adafactor_first_update  # noqa: E402

dist.init_process_group("gloo")
load_ops()
deepspeed.init_distributed("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


def weights(model) -> dict:
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


report = {}
for stage in (0, 2, 3):
    for scale in (1.0, 20.0):
        cfg = load_config(None, ["train.lr=1e-3", "train.warmup_steps=1", "train.max_steps=10",
                                 "train.micro_batch_size=2", f"train.zero_stage={stage}",
                                 f"train.embedding_lr_scale={scale}"])
        torch.manual_seed(0)
        model = build_model("t5-tiny", "mtl", ["a", "b"])
        optimizer, scheduler = optimizer_and_schedule(model, cfg)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                          config=deepspeed_config(cfg, world, stage, hidden=model.config.d_model))
        before = weights(model)
        g = torch.Generator().manual_seed(rank)
        batch = dict(input_ids=torch.randint(3, 200, (2, 9), generator=g),
                     labels=torch.randint(3, 200, (2, 4), generator=g), task_ids=torch.tensor([0, 1]))
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        rates = engine.get_lr()  # the rates this first update uses, the loop's logged one first
        engine.backward(engine(**batch).loss)
        engine.step()
        after = weights(model)
        table = "t5.shared.weight"
        moved = {n: (after[n] - before[n]).abs().max().item() for n in before}
        report[f"{stage}/{scale:g}"] = {
            "table": moved[table], "others": [v for n, v in moved.items() if n != table],
            "rates": rates,
            "tied": model.t5.lm_head.weight is model.t5.shared.weight}
        del engine, optimizer, model

cfg = load_config(None, ["train.optimizer=adafactor", "train.lr=1e-2", "train.warmup_steps=1", "train.max_steps=10",
                         "train.micro_batch_size=2", "train.zero_stage=0", "train.grad_clip=0"])
torch.manual_seed(0)
model = build_model("t5-tiny", "mtl", ["a", "b"])
optimizer, scheduler = optimizer_and_schedule(model, cfg)
engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                  config=deepspeed_config(cfg, world, 0, hidden=model.config.d_model))
own = {id(p) for p in model.parameters()}
handed = [p for group in engine.optimizer.param_groups for p in group["params"]]
g = torch.Generator().manual_seed(rank)
batch = dict(input_ids=torch.randint(3, 200, (2, 9), generator=g),
             labels=torch.randint(3, 200, (2, 4), generator=g), task_ids=torch.tensor([0, 1]))
batch["attention_mask"] = torch.ones_like(batch["input_ids"])
(lr,) = engine.get_lr()
before = {n: p.detach().clone() for n, p in model.named_parameters()}
engine.backward(engine(**batch).loss)
grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
engine.step()
errors = {}
for n, p in model.named_parameters():
    if n in grads:
        want = adafactor_first_update(before[n], grads[n], lr)
        errors[n] = ((p.detach() - before[n] - want).abs().max() / want.abs().max().clamp(min=1e-12)).item()
report["adafactor"] = {"optimizer": type(engine.optimizer).__name__, "lr": lr,
                       "own_weights": len(handed) == len(own) and all(id(p) in own for p in handed),
                       "errors": errors, "trained": len(grads), "params": len(own)}

with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
