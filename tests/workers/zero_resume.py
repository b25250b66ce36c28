"""Run under torchrun (2 ranks, gloo, DS_ACCELERATOR=cpu): a checkpoint of every ZeRO stage resumes exactly.

For each (stage, precision): an engine of the recipe's DeepSpeed config trains 2 steps, saves its checkpoint as the
loop does (`save_checkpoint`, tag `state`), trains 2 more; a fresh engine passes the resume check
(`checkpoints.check_files`), loads the checkpoint weights-only (`checkpoints.load`) and trains the same 2 steps.
bf16 (what GPU workers train in; DeepSpeed runs it on CPU too) swaps in DeepSpeed's 16-bit optimizers, whose state
holds other types than fp32's. Reports, per case: the error the check or the load gave (None), the largest
difference between the two engines' final weights, and how far training moved them.

Writes a JSON report per rank to argv[1]; tests/test_train.py asserts on it.
"""
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from rows import rank_batch  # noqa: E402

from hpsearch.config import load_config  # noqa: E402
from hpsearch.errors import UserError  # noqa: E402
from hpsearch.model import build_model  # noqa: E402
from hpsearch.train import checkpoints, deepspeed_config, optimizer_and_schedule  # noqa: E402
from hpsearch.train.ops import load_ops  # noqa: E402

CASES = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (1, "bf16"), (2, "bf16")]  # stage 3 (fp32): the runs in
# test_train.py

dist.init_process_group("gloo")
load_ops()
deepspeed.init_distributed("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


def engine(stage: int, precision: str):
    cfg = load_config(None, ["train.lr=1e-2", "train.warmup_steps=0", "train.max_steps=10",
                             "train.micro_batch_size=2", f"train.zero_stage={stage}"])
    torch.manual_seed(0)
    model = build_model("t5-tiny", "hyperprompt", ["a", "b"])
    optimizer, scheduler = optimizer_and_schedule(model, cfg)
    config = deepspeed_config(cfg, world, stage, hidden=model.config.d_model)
    config["bf16"] = {"enabled": precision == "bf16"}
    e, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return e


def train(e, steps) -> None:
    for step in steps:
        batch = rank_batch(step, rank)  # each rank its own rows; the same dropout in both engines
        e.train()
        e.backward(e(**batch).loss.float())
        e.step()


def weights(e) -> dict:
    with deepspeed.zero.GatheredParameters(list(e.module.parameters()), enabled=e.zero_optimization_stage() == 3):
        return {n: p.detach().float().clone() for n, p in e.module.named_parameters()}


report = {}
for stage, precision in CASES:
    folder = [tempfile.mkdtemp(prefix="zero-resume-")] if rank == 0 else [None]
    dist.broadcast_object_list(folder)
    first = engine(stage, precision)
    start = weights(first)
    train(first, range(2))
    torch.manual_seed(1000 + rank)  # each rank its own random stream, as the loop seeds them
    first.save_checkpoint(folder[0], tag="state", client_state={"step": 2, "rng": checkpoints.rng_state()})
    drawn = torch.rand(4).tolist()  # what each rank draws next (its dropout masks)
    train(first, range(2, 4))
    second, error = engine(stage, precision), None
    try:
        checkpoints.check_files(folder[0])
        client = checkpoints.load(second, folder[0], "state")
        assert client["step"] == 2
        torch.manual_seed(7)  # a fresh process's stream, which the resume must replace
        checkpoints.set_rng_state(client["rng"], rank)
        redrawn = torch.rand(4).tolist()
    except UserError as e:
        error = str(e)
    case = f"stage{stage}-{precision}"
    if error is None:
        train(second, range(2, 4))
        a, b = weights(first), weights(second)
        report[case] = {"error": None, "max_diff": max((a[n] - b[n]).abs().max().item() for n in a),
                        "moved": max((a[n] - start[n]).abs().max().item() for n in a), "drawn": drawn,
                        "redrawn": redrawn}
    else:
        report[case] = {"error": error}
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder[0], ignore_errors=True)
    del first, second
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(report))
dist.destroy_process_group()
