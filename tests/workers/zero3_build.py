"""Run under torchrun (2 ranks, gloo, DS_ACCELERATOR=cpu): every method's model built the way the recipe builds it
under ZeRO-3 (`hpsearch.train.build.ModelBuilder`: rank 0 builds it whole, every rank builds its structure under
`deepspeed.zero.Init` and receives rank 0's values one parameter at a time), against the same model built whole.

Writes a JSON report per rank to argv[1]; tests/test_zero3.py asserts on it.
"""
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hpsearch.model import build_from_config, build_skeleton, model_config  # noqa: E402
from hpsearch.train.build import ModelBuilder, fill_from_rank0  # noqa: E402
from hpsearch.train.ops import load_ops  # noqa: E402
from hpsearch.train.startup import freeze_imports  # noqa: E402

freeze_imports()  # as the recipe does: DeepSpeed's full collections (its ZeRO-3 set-up) skip the imports

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_methods import SETUPS  # noqa: E402

dist.init_process_group("gloo")
load_ops()
deepspeed.init_distributed("gloo")
rank = dist.get_rank()
TASKS = ["a", "b", "c"]
DS = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
LABELS = [[[5, 6], [7]], [[8], [9, 10, 11]], [[12]]]  # label token ids per task: prompt tuning starts from them


def build(name, stage):
    method, hparams = SETUPS[name]
    cfg = model_config("t5-tiny", method, **hparams)
    made = []

    def make():
        made.append(rank)
        torch.manual_seed(0)
        model = build_from_config(cfg, TASKS)
        model.init_task_params(LABELS)
        return model
    builder = ModelBuilder(lambda n: stage, lambda s, hidden: {**DS, "zero_optimization": {"stage": s}}, rank)
    model = builder(make, lambda: build_skeleton(cfg, TASKS))
    return model, make, made, builder


report = {}
for name in SETUPS:
    model, make, made, builder = build(name, 3)
    whole = make()  # every rank: the model as a whole build makes it
    names = [n for n, _ in model.named_parameters()]
    partitioned = all(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters())
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        gathered = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = dict(whole.named_parameters())
    report[name] = {
        "made_on": made[:-1],  # the ranks whose build made the whole model (the last call is ours, above)
        "stage": builder.stage,
        "partitioned": partitioned,
        "names_equal": names == list(expected),
        "equal": {n: torch.equal(gathered[n], expected[n].detach()) for n in names},
        "requires_grad_equal": all(p.requires_grad == expected[n].requires_grad for n, p in model.named_parameters()),
        "buffers_equal": all(torch.equal(b, dict(whole.named_buffers())[n]) for n, b in model.named_buffers()),
        "tied": model.t5.lm_head.weight is model.t5.shared.weight,
    }
    stage0, _, made0, builder0 = build(name, 0)
    report[name]["stage0_made_on"] = made0
    report[name]["stage0_whole"] = not any(hasattr(p, "ds_id") for p in stage0.parameters())
    report[name]["stage0_equal"] = all(torch.equal(p, expected[n]) for n, p in stage0.named_parameters())


class WithBuffer(torch.nn.Module):  # no method has a buffer: this checks that buffers reach every rank too
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.register_buffer("scale", torch.randn(3))


torch.manual_seed(1)
expected = WithBuffer()  # rank 0's values on every rank
for precision, ds in (("fp32", DS), ("bf16", {**DS, "bf16": {"enabled": True}})):  # zero.Init casts to bf16
    torch.manual_seed(100 + rank)  # each rank's skeleton starts from other values
    source = WithBuffer() if rank == 0 else None
    if rank == 0:
        source.load_state_dict(expected.state_dict())
    with deepspeed.zero.Init(config_dict_or_path=ds):
        target = WithBuffer()
    fill_from_rank0(target, source, rank)
    with deepspeed.zero.GatheredParameters(list(target.parameters())):
        report[f"buffer_module_{precision}"] = {
            "buffer": torch.equal(target.scale, expected.scale.to(target.scale.dtype)),
            "params": all(torch.equal(p, q.to(p.dtype)) for p, q in zip(target.parameters(), expected.parameters()))}

with open(os.path.join(sys.argv[1], f"build{rank}.json"), "w") as f:
    json.dump(report, f)

dist.barrier()
dist.destroy_process_group()  # without it gloo's threads can abort the interpreter's exit ("terminate called ...")
# and even with it they did once (CI, rank 1, after its report was written): nothing is left to do, so no teardown
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
