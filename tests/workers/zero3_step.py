"""Run under torchrun (2 ranks, gloo, DS_ACCELERATOR=cpu): ZeRO-3 training steps for every method of the library
(the three HyperPrompt variants, MTL, prompt tuning, adapter, HyperFormer++, prefix tuning, LoRA, MAM): training
steps, synced generation with the task tensors generated and frozen (`freeze_task_params`, as evaluation does), and
LoRA's single-task merge under `GatheredParameters`, and the best weights written and read back
(`bestweights.save_best` / `load_best`, one parameter gathered at a time), also with every parameter persistent; and
after each method the DeepSpeed engines still alive once its engine is released (`build.release`) and collected.

Writes a JSON report per rank to argv[1]; tests/test_zero3.py asserts on it.
"""
import copy
import gc
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from pyarrow import fs  # noqa: E402
from safetensors import safe_open  # noqa: E402

from hpsearch.model import build_model  # noqa: E402
from hpsearch.train.bestweights import load_best, save_best  # noqa: E402
from hpsearch.train.build import release  # noqa: E402
from hpsearch.train.ops import load_ops  # noqa: E402
from hpsearch.train.startup import freeze_imports  # noqa: E402

freeze_imports()  # as the recipe does: DeepSpeed's full collections (its ZeRO-3 set-up, each load) skip the imports

dist.init_process_group("gloo")
load_ops()
deepspeed.init_distributed("gloo")
rank = dist.get_rank()
HP = dict(placement="both", prompt_length_encoder=4, prompt_length_decoder=2, bottleneck=8)
SETUPS = {
    "hyperprompt-share": ("hyperprompt", dict(variant="share", **HP)),
    "hyperprompt-sep": ("hyperprompt", dict(variant="sep", **HP)),
    "hyperprompt-global": ("hyperprompt", dict(variant="global", **HP)),
    "mtl": ("mtl", {}),
    "prompt_tuning": ("prompt_tuning", dict(prompt_length=4)),
    "adapter": ("adapter", dict(bottleneck=8)),
    "hyperformer": ("hyperformer", {}),  # the released config's sizes; t5-tiny: b = 64 // 32 = 2
    "prefix": ("prefix", dict(prompt_length=4, prefix_hidden=16)),
    "lora": ("lora", dict(lora_rank=4, lora_alpha=8.0)),
    "mam": ("mam", dict(mam_prefix_length=4, prefix_hidden=16, bottleneck=8, mam_scale=4.0)),
    "pha": ("pha", dict(bottleneck=8, pha_dim=8, pha_retriever_hidden=16, pha_hidden=16)),
}


def trained(model) -> dict:
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def best_round_trip(engine, model, batch, path) -> dict:
    """Save the best weights, train one more step (the weights move), load them back: the gathered weights must be
    the saved ones again; the file holds every trained parameter, whole."""
    save_best(engine, rank, fs.LocalFileSystem(), path)
    saved = trained(model)
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()
    moved = any(not torch.equal(v, saved[n]) for n, v in trained(model).items())
    with torch.no_grad():  # a forward last, as the loop's final evaluation: gathered copies are left whole
        engine(**batch)
    read = load_best(engine, rank, fs.LocalFileSystem(), path)
    restored = all(torch.equal(v, saved[n]) for n, v in trained(model).items())
    with safe_open(path, "pt") as f:
        whole = set(f.keys()) == set(saved) and all(list(f.get_slice(n).get_shape()) == list(saved[n].shape)
                                                    for n in saved)
    tensor_bytes = sum(v.numel() * v.element_size() for v in saved.values())
    return dict(moved=moved, restored=restored, whole=whole, read_share=read / tensor_bytes)


report = {}
for name, (method, hparams) in SETUPS.items():
    torch.manual_seed(0)
    model = build_model("t5-tiny", method, ["a", "b", "c"], **hparams)
    plain = copy.deepcopy(model)
    g = torch.Generator().manual_seed(rank)  # each rank its own data shard
    batch = dict(input_ids=torch.randint(3, 200, (2, 9), generator=g),
                 labels=torch.randint(3, 200, (2, 4), generator=g),
                 task_ids=torch.tensor([0, 2]) if rank == 0 else torch.tensor([1, 1]))
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    with torch.no_grad():
        plain_loss = plain(**batch).loss.item()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    local_shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if not n.startswith("t5.")}
    partitioned = all(tuple(p.shape) == (0,) for p in model.parameters())
    losses = []
    for _ in range(3):
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    # generation across ranks: different inputs (and output lengths) per rank, kept in step by synced_gpus;
    # each rank's result equals the unpartitioned model's (same updated weights, gathered below)
    model.eval()
    n_new = 3 + 4 * rank  # rank 1 decodes longer than rank 0: without synced_gpus the ranks would deadlock
    with torch.no_grad():
        generated = model.generate(batch["input_ids"], batch["attention_mask"], task_ids=batch["task_ids"],
                                   max_new_tokens=n_new, min_new_tokens=n_new, synced_gpus=True).tolist()
        model.freeze_task_params()  # every rank runs the generators once (gathering their partitions)
        frozen = model.generate(batch["input_ids"], batch["attention_mask"], task_ids=batch["task_ids"],
                                max_new_tokens=n_new, min_new_tokens=n_new, synced_gpus=True).tolist()
    model.train()
    merged = None
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        if hasattr(model, "merge"):  # LoRA's single-task export reads the gathered weights
            merged = {k: v.detach().clone() for k, v in model.merge(1).state_dict().items()}
        before = dict(plain.named_parameters())
        changed = {n: not torch.equal(p.detach(), before[n].detach())
                   for n, p in model.named_parameters() if not n.startswith("t5.")}
        backbone_changed = not torch.equal(model.t5.shared.weight.detach(), before["t5.shared.weight"].detach())
        plain.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
    plain.eval()
    with torch.no_grad():
        expected = plain.generate(batch["input_ids"], batch["attention_mask"], task_ids=batch["task_ids"],
                                  max_new_tokens=n_new, min_new_tokens=n_new).tolist()
        merge_equal = merged is None or all(torch.equal(v, merged[k]) for k, v in plain.merge(1).state_dict().items())
    best = best_round_trip(engine, model, batch, os.path.join(sys.argv[1], f"best-{name}.safetensors"))
    report[name] = dict(best=best, generated=generated, frozen=frozen, merge_equal=merge_equal,
                        merged=merged is not None, expected=expected, plain_loss=plain_loss, losses=losses,
                        local_shapes=local_shapes, partitioned=partitioned, changed=changed,
                        backbone_changed=backbone_changed, extra=model.extra_parameters(),
                        plain_extra=plain.extra_parameters())
    release(engine)  # as the recipe does when a run ends: then nothing keeps this method's engine alive
    del engine, opt, model, loss
    gc.collect()
    report[name]["engines_alive"] = sum(type(o).__name__ == "DeepSpeedEngine" for o in gc.get_objects())
# every parameter persistent (kept whole beside its partition, as DeepSpeed does below its threshold, 1e5 elements
# by default): the loaded weights must reach the whole copies too
torch.manual_seed(0)
model = build_model("t5-tiny", "hyperprompt", ["a", "b", "c"], **SETUPS["hyperprompt-global"][1])
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
          "zero_allow_untested_optimizer": True,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10**9}}
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  config=config)
best = best_round_trip(engine, model, batch, os.path.join(sys.argv[1], "best-persistent.safetensors"))
model.eval()
with torch.no_grad():  # the forward uses the whole copies: it must see the loaded weights
    after = engine(**batch).loss.item()
torch.manual_seed(0)  # the same frozen weights, if any
plain = build_model("t5-tiny", "hyperprompt", ["a", "b", "c"], **SETUPS["hyperprompt-global"][1])
with safe_open(os.path.join(sys.argv[1], "best-persistent.safetensors"), "pt") as f:
    plain.load_state_dict({n: f.get_tensor(n) for n in f.keys()}, strict=False)
plain.eval()
with torch.no_grad():
    expected = plain(**batch).loss.item()
report["persistent"] = dict(best=best, loss=after, expected_loss=expected)
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
