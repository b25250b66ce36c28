"""Every method of the model library against one contract, and each baseline against an independent computation.

Contract (all methods): mixed-task batches equal the rows run task by task; cached == uncached decoding (greedy and
beam search); gradients reach every method parameter; train_task_params_only freezes the backbone; the closed
formula (written here, independently) equals the real modules' count; export round-trip; frozen task parameters
equal dynamic ones and skip the generators.
Baselines: prompt tuning == stock T5 fed [prompt; embed(ids)]; adapter and HyperFormer++ blocks == hand-written
blocks; HyperFormer++'s generated weights == a re-computation from the raw parameters; LoRA == stock T5 with q, v
merged by hand; prefix == the attention hook fed the MLP's prefixes computed by hand; MAM's feed-forward sublayer ==
the hand-written scaled parallel adapter; PHA's feed-forward == a parallel adapter whose weights are re-computed from
the raw prototypes, block embeddings, hypernetwork and heads, its loss == LM + lambda (L_IR + L_Pro) written out
term by term, and its retriever picks the nearest prototype.
"""
from __future__ import annotations

import collections
import math

import pytest
import torch
from t5_testing import logits, overfit, stock_copy, tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

from hpsearch.errors import ConfigError
from hpsearch.model import base, build_model, save_export, save_task_params
from hpsearch.model.config import COMMON_FIELDS, METHOD_FIELDS, METHODS, ModelConfig

TASKS = ["a", "b", "c"]
HP = dict(placement="both", prompt_length_encoder=3, prompt_length_decoder=2, bottleneck=4, task_embedding_dim=5,
          layer_task_dim=6, projection_hidden=7)
HF = dict(reduction_factor=8, hyperformer_task_dim=5, hyperformer_projected_dim=6, hyperformer_hidden_dim=7)
SETUPS = {
    "mtl": ("mtl", {}),
    "hyperprompt-share": ("hyperprompt", dict(variant="share", **HP)),
    "hyperprompt-sep": ("hyperprompt", dict(variant="sep", **HP)),
    "hyperprompt-global": ("hyperprompt", dict(variant="global", hypernet_bias=True, **HP)),
    "prompt_tuning": ("prompt_tuning", dict(prompt_length=3)),
    "adapter": ("adapter", dict(bottleneck=4)),
    "adapter-ffn": ("adapter", dict(bottleneck=4, adapter_sites="ffn")),
    "adapter-attention": ("adapter", dict(bottleneck=4, adapter_sites="attention")),
    "adapter-parallel": ("adapter", dict(bottleneck=4, adapter_insertion="parallel", adapter_scale=2.5)),
    "hyperformer": ("hyperformer", HF),
    "prefix": ("prefix", dict(prompt_length=3, prefix_hidden=5)),
    "lora": ("lora", dict(lora_rank=2, lora_alpha=3.0)),
    "mam": ("mam", dict(mam_prefix_length=2, prefix_hidden=5, bottleneck=4, mam_scale=2.5)),
    "pha": ("pha", dict(bottleneck=4, pha_dim=5, pha_retriever_hidden=6, pha_hidden=7)),
}
WITH_TASK_PARAMS = [name for name in SETUPS if name != "mtl"]
GENERATED = ["hyperprompt-share", "hyperprompt-sep", "hyperprompt-global", "hyperformer", "prefix", "mam", "pha"]
PROMPTED = ["hyperprompt-share", "hyperprompt-sep", "hyperprompt-global", "prefix", "mam"]  # key/value prompts


def make(name, seed=0, config=None, **kw):
    method, hparams = SETUPS[name]
    torch.manual_seed(seed)
    return build_model(config or tiny_config(), method, TASKS, **{**hparams, **kw}).eval()


def method_params(model) -> dict:
    return {n: p for n, p in model.named_parameters() if not n.startswith("t5.")}


def perturb(model, std=0.3, seed=5):
    """Move every method parameter away from its near-identity init, so each one matters in the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in method_params(model).values():
            p.add_(torch.randn(p.shape, generator=g) * std)
    return model


# ---- the contract, for every method -------------------------------------------------------------------------
@pytest.mark.parametrize("name", SETUPS)
def test_mixed_batch_equals_rows_run_task_by_task(name, batch):
    model = perturb(make(name))
    mixed = logits(model, batch)
    for row, task in enumerate(batch["task_ids"].tolist()):
        single = {**batch, "task_ids": torch.full((4,), task)}
        assert (logits(model, single)[row] - mixed[row]).abs().max() <= 1e-5
    if name != "mtl":  # and the task does condition the output
        other = {**batch, "task_ids": (batch["task_ids"] + 1) % 3}
        assert (logits(model, other) - mixed).abs().max() > 1e-3


@pytest.mark.parametrize("name", SETUPS)
def test_generators_run_for_the_batchs_tasks_only_and_give_the_all_task_values(name, batch, monkeypatch):
    """A batch of tasks c and a (no b): the generators are asked for [a, c] only, and the outputs and every
    gradient equal those of the all-task path (every task's table, indexed by the task ids themselves)."""
    from hpsearch.model.base import TaskContext

    model = perturb(make(name))  # eval: no dropout; not frozen, so the generators run on every call
    two = {**batch, "task_ids": torch.tensor([2, 0, 2, 0])}
    asked, generate = [], model.generate_task_tensors
    monkeypatch.setattr(model, "generate_task_tensors",
                        lambda device=None, tasks=None: asked.append(tasks) or generate(device, tasks))
    out = model(**two)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in method_params(model).items() if p.grad is not None}
    assert [t.tolist() for t in asked] == [[0, 2]]
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(model, "task_context",
                        lambda task_ids, batch_size=None: TaskContext(task_ids, generate(task_ids.device)))
    every = model(**two)
    every.loss.backward()
    assert (out.logits - every.logits).abs().max() <= 1e-5
    for n, p in method_params(model).items():
        mine, theirs = grads.get(n, torch.zeros_like(p)), p.grad if p.grad is not None else torch.zeros_like(p)
        assert torch.allclose(mine, theirs, atol=1e-6), n



class _Ops(TorchDispatchMode):
    """The ATen operations run inside it, by name."""

    def __init__(self):
        super().__init__()
        self.names = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[str(func)] += 1
        return func(*args, **(kwargs or {}))


def partitioned_as_zero3(model):
    """ZeRO-3's rule, by hooks: every parameter is empty (shape [0], as a partitioned one) except while a module
    that owns it runs its forward. A read anywhere else (a `.weight` taken outside its module) fails."""
    owners = {m: [p for p in m._parameters.values() if p is not None] for m in model.modules()}
    owners = {m: params for m, params in owners.items() if params}
    whole, depth = {id(p): p.data for p in model.parameters()}, {}
    for p in model.parameters():
        p.data = torch.empty(0, dtype=p.dtype)

    def gather(module, args):
        for p in owners[module]:
            depth[id(p)] = depth.get(id(p), 0) + 1
            p.data = whole[id(p)]

    def release(module, args, out):
        for p in owners[module]:
            depth[id(p)] -= 1
            if not depth[id(p)]:
                p.data = torch.empty(0, dtype=p.dtype)
    for module in owners:
        module.register_forward_pre_hook(gather)
        module.register_forward_hook(release)
    return model


@pytest.mark.parametrize("name", SETUPS)
def test_every_parameter_is_read_inside_its_own_modules_forward(name, batch):
    """ZeRO-3 gathers a parameter only around its module's forward: a method reading one elsewhere reads a [0]
    tensor on a real cluster (or, where DeepSpeed happened to keep it gathered, passes there and fails later). A
    training forward with its auxiliary losses and a cached generation, with every parameter partitioned outside
    its module's forward, give what the whole model gives (a PHA reading `prototypes.weight` directly passed every
    other test)."""
    model = perturb(make(name)).train()
    with torch.no_grad():
        want = model(**batch)
        want_ids = model.eval().generate(batch["input_ids"], batch["attention_mask"], task_ids=batch["task_ids"],
                                         max_new_tokens=3, do_sample=False)
        partitioned_as_zero3(model.train())
        got = model(**batch)
        torch.testing.assert_close(got.loss, want.loss)
        got_ids = model.eval().generate(batch["input_ids"], batch["attention_mask"], task_ids=batch["task_ids"],
                                        max_new_tokens=3, do_sample=False)
    assert torch.equal(got_ids, want_ids)


@pytest.mark.parametrize("name", GENERATED)
def test_generators_are_a_few_batched_products_whatever_the_depth(name):
    """The generators' structure, which no value test sees: every block's tensors come out of the same batched
    products (as many at depth 2 as at 4, not a few small ones per block), and the backward never zero-fills a
    whole generated tensor to hand one block's slice its gradient (select or slice backward: what made
    HyperPrompt-Global slow; Share/Sep and PHA had it too)."""
    products = ("aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten.baddbmm.default")
    counts = []
    for layers in (2, 4):
        model = make(name, config=tiny_config(num_layers=layers, num_decoder_layers=layers)).train()
        with _Ops() as forward:
            table = model.task_context(torch.tensor([2, 0, 2, 0])).table
        tensors = [t for v in table.values() for t in (v if isinstance(v, tuple) else (v,))]
        blocks = layers if name == "pha" else 2 * layers  # PHA generates the decoder's adapters only
        assert len(table) >= blocks and all(t.requires_grad for t in tensors)  # a table per block, generated
        with _Ops() as backward:
            sum(t.sum() for t in tensors).backward()
        counts.append({op: forward.names[op] for op in products if forward.names[op]})
        zero_filled = {op for op in backward.names if "select_backward" in op or "slice_backward" in op}
        assert not zero_filled, zero_filled
    assert counts[0] == counts[1] and counts[0], counts

@pytest.mark.parametrize("frozen", [False, True], ids=["dynamic", "frozen"])
@pytest.mark.parametrize("name", WITH_TASK_PARAMS)
def test_a_one_task_batch_applies_its_task_row_once_and_equals_the_per_row_path(name, frozen, batch, monkeypatch):
    """A one-task batch (the recipe's default) takes its task's row of each per-task tensor once (`shared`), not a
    copy per row; its logits, generations and every method parameter's gradient equal the per-row path's."""
    model = perturb(make(name))
    if frozen:
        model.freeze_task_params()
    one = {**batch, "task_ids": torch.full((4,), 2)}
    assert model.task_context(one["task_ids"], 4).shared == 2
    assert model.task_context(batch["task_ids"], 4).shared is None  # the fixture mixes tasks
    out = model(**one)
    generated = model.generate(one["input_ids"], one["attention_mask"], task_ids=one["task_ids"], max_new_tokens=4)
    if not frozen:
        out.loss.backward()
    grads = {n: p.grad.clone() for n, p in method_params(model).items() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    context = model.task_context

    def per_row(task_ids, batch_size=None):
        ctx = context(task_ids, batch_size)
        ctx.shared = ctx._shared_row = None
        return ctx
    monkeypatch.setattr(model, "task_context", per_row)
    rows = model(**one)
    assert torch.equal(model.generate(one["input_ids"], one["attention_mask"], task_ids=one["task_ids"],
                                      max_new_tokens=4), generated)
    assert (out.logits - rows.logits).abs().max() <= 1e-5
    if frozen:
        return
    rows.loss.backward()
    assert grads and set(grads) == {n for n, p in method_params(model).items() if p.grad is not None}
    for n, p in method_params(model).items():
        if n in grads:
            assert torch.allclose(grads[n], p.grad, atol=1e-6), n


@pytest.mark.parametrize("name", SETUPS)
def test_generation_cached_equals_uncached_and_beams_follow_tasks(name, batch):
    model = make(name, seed=3, config=tiny_config(d_model=64, d_kv=16))
    overfit(model, batch)  # an untrained model decodes one token over and over: make decoding non-trivial
    ids, am, tids = batch["input_ids"], batch["attention_mask"], batch["task_ids"]
    greedy = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=1, eos_token_id=None,
                  output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        cached = model.generate(ids, am, task_ids=tids, use_cache=True, **greedy)
        uncached = model.generate(ids, am, task_ids=tids, use_cache=False, **greedy)
        assert torch.equal(cached.sequences, uncached.sequences)
        assert len(set(cached.sequences[:, 1:].flatten().tolist())) > 2  # a real decode
        full = model(input_ids=ids, attention_mask=am, decoder_input_ids=cached.sequences[:, :-1],
                     task_ids=tids).logits
        assert (torch.stack(cached.scores, 1) - full).abs().max() <= 1e-4
        # beam search repeats every row: per-row task data must follow
        beams = dict(max_new_tokens=5, min_new_tokens=5, num_beams=3, num_return_sequences=2, eos_token_id=None)
        mixed = model.generate(ids, am, task_ids=tids, **beams)
        assert torch.equal(model.generate(ids, am, task_ids=tids, use_cache=False, **beams), mixed)
        for row, task in enumerate(tids.tolist()):
            single = model.generate(ids, am, task_ids=torch.full((4,), task), **beams)
            assert torch.equal(single[2 * row: 2 * row + 2], mixed[2 * row: 2 * row + 2])


@pytest.mark.parametrize("name", SETUPS)
def test_gradients_reach_every_method_parameter(name, batch):
    model = perturb(make(name)).train()  # LoRA's B and MAM's U start at zero: A's and D's gradients would be zero
    model(**batch).loss.backward()
    params = method_params(model)
    assert bool(params) == (name != "mtl")
    for n, p in params.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, n
    assert model.t5.shared.weight.grad is not None


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("name", SETUPS)
def test_a_train_step_never_reads_a_device_value_on_the_host(name, batch, padded):
    """Forward (with every auxiliary loss) and backward on the meta device, where every read of a tensor's values
    on the host raises (`.item()`, `bool()` in an `if`, a boolean-mask index, `.tolist()`): on a GPU each would be a
    device synchronisation in every micro-step. Task ids stay on the CPU, where the model checks them by design.
    Before: PHA's instance loss branched on `anchors.any()` and indexed with the anchors; transformers' mask skip
    read `padding_mask.all()` (twice a forward, every method)."""
    model = make(name).train().to("meta")
    on_meta = {k: v if k == "task_ids" else v.to("meta") for k, v in batch.items()}
    if not padded:  # the case transformers' mask skip was for
        on_meta["attention_mask"] = torch.ones(batch["attention_mask"].shape, dtype=torch.long, device="meta")
    out = model(**on_meta)
    assert out.loss.device.type == "meta" and out.loss.shape == ()
    out.loss.backward()
    assert all(p.grad is not None for p in method_params(model).values())
    if name == "pha":  # its auxiliary losses are in the loss that was backpropagated
        assert set(out.aux_losses) == {"ir_loss", "proto_loss"}


@pytest.mark.parametrize("name", WITH_TASK_PARAMS)
def test_train_task_params_only_freezes_the_backbone(name, batch):
    model = make(name, train_task_params_only=True).train()
    model(**batch).loss.backward()
    assert all(p.grad is None for p in model.t5.parameters())
    assert all(p.grad is not None for p in method_params(model).values())
    assert model.extra_parameters()["total"] == sum(p.numel() for p in method_params(model).values())


def test_mtl_refuses_train_task_params_only():
    with pytest.raises(ConfigError, match="model.train_task_params_only"):
        make("mtl", train_task_params_only=True)


def expected_extra(name, shape, T) -> int:
    """Each method's parameter count, written from its definition (module by module), not from the library."""
    method, kw = SETUPS[name]
    d, Le, Ld = shape["d_model"], shape["num_layers"], shape["num_decoder_layers"]
    di = shape["num_heads"] * shape["d_kv"]
    if method == "mtl":
        return 0
    if method == "prompt_tuning":
        return T * kw["prompt_length"] * d                                     # one l x d prompt per task
    if method == "adapter":
        b = kw["bottleneck"]
        sites = (Le + Ld) * (2 if kw.get("adapter_sites", "both") == "both" else 1)
        return T * sites * ((d * b + b) + (b * d + d))                         # D, c, U, u per task and site
    if method in ("prefix", "mam"):
        l, h = kw.get("prompt_length", kw.get("mam_prefix_length")), kw["prefix_hidden"]
        # E, W1 and c1, W2 and c2 for each kind of attention: encoder self (Le), decoder self (Ld), cross (Ld)
        prefix = sum(T * l * d + (d * h + h) + (h * M * 2 * di + M * 2 * di) for M in (Le, Ld, Ld))
        if method == "prefix":
            return prefix
        b = kw["bottleneck"]
        return prefix + T * (Le + Ld) * ((d * b + b) + (b * d + d))           # one D, c, U, u per task and FFN
    if method == "pha":  # the decoder's adapters generated, the encoder's one per block for every task
        b, p, r, h, M = kw["bottleneck"], kw["pha_dim"], kw["pha_retriever_hidden"], kw["pha_hidden"], Ld
        return (T * p + M * p                                                  # prototypes, decoder block embeddings
                + (d * r + r) + (r * p + p)                                    # retriever d -> r -> p
                + (2 * p * h + h) + (h * p + p) + 2 * p                        # hypernetwork 2p -> h -> p, LN
                + (p * b * d + b * d) + (p * b + b) + (p * d * b + d * b) + (p * d + d)  # heads D, c, U, u
                + Le * (b * d + b + d * b + d))                                # the encoder's shared adapters
    if method == "lora":
        r = kw["lora_rank"]
        return T * (Le + Ld) * 2 * (r * d + di * r)                            # A [r, d], B [d_i, r] for q and v
    if method == "hyperformer":
        t, h, p, b = kw["hyperformer_task_dim"], kw["hyperformer_hidden_dim"], kw["hyperformer_projected_dim"], \
            d // kw["reduction_factor"]
        per_stack = lambda L: (L * t + 2 * t + (3 * t * h + h) + (h * p + p) + 2 * p    # embeddings, projector, LN
                               + (p + 1) * b * d + (p + 1) * b + (p + 1) * d * b + (p + 1) * d + 2 * (p + 1) * d)
        return T * t + per_stack(Le) + per_stack(Ld)
    b, l, M, beta = kw["bottleneck"], kw["prompt_length_encoder"] + kw["prompt_length_decoder"], Le + Ld, \
        int(kw.get("hypernet_bias", False))
    local = 2 * (d * b + beta * b) + 2 * (b * di + beta * di)                  # D_k, D_v, U_k, U_v of one block
    if kw["variant"] == "share":
        return d * l * T + M * local
    if kw["variant"] == "sep":
        return d * l * T + M * T * local
    t1, t, e = kw["task_embedding_dim"], kw["layer_task_dim"], kw["projection_hidden"]
    out = d * b + b * di + beta * (b + di)
    return d * l * T + T * t1 + M * t1 + (2 * t1 * e + beta * e) + (e * t + beta * t) + 2 * (t * out + beta * out)


@pytest.mark.parametrize("name", SETUPS)
@pytest.mark.parametrize("shape", [dict(d_model=32, num_heads=4, d_kv=8, num_layers=2, num_decoder_layers=2),
                                   dict(d_model=48, num_heads=6, d_kv=8, num_layers=3, num_decoder_layers=1),
                                   dict(d_model=24, num_heads=4, d_kv=12, num_layers=2, num_decoder_layers=2)])
@pytest.mark.parametrize("n_tasks", [1, 5])
def test_formula_equals_extra_parameters(name, shape, n_tasks):
    method, kw = SETUPS[name]
    model = build_model(tiny_config(**shape), method, [f"t{i}" for i in range(n_tasks)], **kw)
    counts = model.extra_parameters()
    assert counts["total"] == expected_extra(name, shape, n_tasks)
    assert model.parameter_formula().total == counts["total"]  # the docstring's formula, as the library codes it
    assert counts["total"] == sum(v for k, v in counts.items() if k != "total")
    backbone = sum(p.numel() for p in model.t5.parameters())
    assert sum(p.numel() for p in model.parameters()) == backbone + counts["total"]


def test_an_export_of_the_older_prefix_layout_is_one_line_saying_so(tmp_path):
    """Exports written before 2026-11-27 (one prefix MLP, `prefix_mlp.*`) do not fit today's prefix model: the error
    says which version wrote them instead of listing parameter names only."""
    from safetensors.torch import load_file, save_file

    from hpsearch.errors import ConfigError
    save_export(make("prefix"), tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    old = {(k.replace("prefix_mlps.encoder.", "prefix_mlp.").replace("prefix_embeddings.encoder.", "prefix_embeddings.")
            if "encoder" in k else k): v for k, v in weights.items()
           if not k.startswith(("prefix_mlps.decoder", "prefix_mlps.cross", "prefix_embeddings.decoder",
                                "prefix_embeddings.cross"))}
    save_file(old, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"export does not match the model .*it was written by hpsearch before "
                                          r"2026-11-27 \(prefix tuning and MAM then had one prefix MLP"):
        build_model(str(tmp_path))


@pytest.mark.parametrize("name", SETUPS)
def test_full_export_round_trip(name, batch, tmp_path):
    from safetensors.torch import load_file
    model = perturb(make(name))
    save_export(model, tmp_path / "full")
    again = build_model(str(tmp_path / "full")).eval()
    assert type(again) is type(model) and again.cfg == model.cfg and again.tasks == model.tasks
    assert torch.equal(logits(again, batch), logits(model, batch))
    save_task_params(model, tmp_path / "task")
    saved = load_file(str(tmp_path / "task" / "task_params.safetensors"))
    assert sum(t.numel() for t in saved.values()) == model.extra_parameters()["total"]
    assert not any(k.startswith("t5.") for k in saved)


@pytest.mark.parametrize("name", SETUPS)
def test_frozen_task_params_equal_dynamic_and_skip_generators(name, batch, monkeypatch):
    model = perturb(make(name))
    dynamic = logits(model, batch)
    with torch.no_grad():
        gen = model.generate(batch["input_ids"], batch["attention_mask"], task_ids=batch["task_ids"],
                             max_new_tokens=4)
    model.freeze_task_params()
    assert model.task_params_frozen and model.prompts_frozen  # the old name still answers
    monkeypatch.setattr(model, "generate_task_tensors", lambda *a: (_ for _ in ()).throw(AssertionError("called")))
    assert torch.equal(logits(model, batch), dynamic)
    with torch.no_grad():
        assert torch.equal(model.generate(batch["input_ids"], batch["attention_mask"], task_ids=batch["task_ids"],
                                          max_new_tokens=4), gen)
    monkeypatch.undo()
    model.train()
    assert not model.task_params_frozen
    model.freeze_prompts()  # train.py's name for the same thing
    assert model.task_params_frozen


@pytest.mark.parametrize("name", WITH_TASK_PARAMS)
def test_method_modules_run_for_all_tasks_whatever_the_batch(name, batch):
    """ZeRO-3: the same module calls on every rank, whatever tasks its batch holds."""
    model = make(name)
    calls = []
    hooks = [m.register_forward_hook(lambda m, a, o, n=n: calls.append(n))
             for n, m in model.named_modules() if n and not n.startswith("t5")]
    logits(model, {**batch, "task_ids": torch.zeros(4, dtype=torch.long)})
    first, calls[:] = list(calls), []
    logits(model, {**batch, "task_ids": torch.tensor([2, 1, 2, 1])})
    for h in hooks:
        h.remove()
    assert first and calls == first


@pytest.mark.parametrize("name", SETUPS)
def test_attention_stats_run_for_every_method(name, batch):
    stats = perturb(make(name)).attention_stats(batch)
    assert [len(stats[side]) for side in ("encoder", "decoder")] == [2, 2]
    for side in ("encoder", "decoder"):
        for s in stats[side]:
            assert s["token_entropy"] > 0
            assert (s["prompt_mass"] > 0) == (name in PROMPTED)  # hyper-prompts and prefixes are prompts


@pytest.mark.parametrize("name", SETUPS)
def test_the_backbone_is_hooked_only_where_the_method_has_work(name, batch, monkeypatch):
    """A backbone module with a forward hook leaves torch's fast call path, so the base class hooks only the sites
    `hooks_site` names. Every site it leaves out must be one where the method's hooks do nothing: the model built
    with every site hooked gives the same logits (method parameters perturbed, so each one matters)."""
    def hooked_sites(model):
        return {m.hp_site for m in model.t5.modules() if m._forward_hooks}

    model = perturb(make(name))
    sites = {**base.sublayer_modules(model.t5), **base.projection_modules(model.t5), **base.residual_modules(model.t5)}
    hooked = hooked_sites(model)
    assert hooked == {site for site in sites if model.hooks_site(site)}
    expected = {"mtl": set(), "prompt_tuning": set(), "prefix": set(), "lora": {"q", "v"}, "mam": {"ffn_residual"},
                "pha": {"ffn_residual"}, "adapter-ffn": {"ffn"}, "adapter-attention": {"attention"},
                "adapter-parallel": {"attention_residual", "ffn_residual"}}
    kinds = {site[2] for site in hooked}
    assert kinds == expected.get(name, set() if name.startswith("hyperprompt") else {"attention", "ffn"}), kinds
    monkeypatch.setattr(type(model), "hooks_site", lambda self, site: True)
    forced = perturb(make(name))
    assert hooked_sites(forced) == set(sites)
    assert torch.equal(logits(model, batch), logits(forced, batch))


@pytest.mark.parametrize("name", WITH_TASK_PARAMS)
def test_task_ids_are_required(name, batch):
    model = make(name)
    with pytest.raises(ValueError, match="task_ids"):
        model(**{**batch, "task_ids": None})


# ---- prompt tuning --------------------------------------------------------------------------------------------
def test_prompt_tuning_equals_stock_t5_with_prompt_embeddings(batch):
    model = perturb(make("prompt_tuning"))
    stock = stock_copy(model)
    l, d = 3, 32
    prompts = model.prompts.weight.detach().view(3, l, d)[batch["task_ids"]]          # [batch, l, d]
    embeds = torch.cat([prompts, stock.shared(batch["input_ids"])], dim=1)
    mask = torch.cat([torch.ones(4, l, dtype=torch.long), batch["attention_mask"]], dim=1)
    with torch.no_grad():
        ref = stock(inputs_embeds=embeds, attention_mask=mask, labels=batch["labels"])
        out = model(**batch)
        assert (out.logits - ref.logits).abs().max() <= 1e-5
        assert abs(out.loss.item() - ref.loss.item()) <= 1e-5
        ours = model.generate(batch["input_ids"], batch["attention_mask"], task_ids=batch["task_ids"],
                              max_new_tokens=5, num_beams=2)
        assert torch.equal(ours, stock.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=5,
                                                num_beams=2))
    # prompts are what make the difference: without them the model is stock T5
    with torch.no_grad():
        plain = stock(**{k: v for k, v in batch.items() if k != "task_ids"}).logits
    assert (plain - out.logits).abs().max() > 1e-3


def test_prompt_tuning_inits():
    model = make("prompt_tuning", prompt_length=4, prompt_init="random")
    w = model.prompts.weight
    assert w.min() >= -0.5 and w.max() <= 0.5 and w.std() > 0.2
    emb = make("prompt_tuning").t5.shared.weight.detach()
    for init in ("vocab", "labels"):  # labels without label ids: vocab
        model = make("prompt_tuning", prompt_length=4, prompt_init=init)
        rows = model.prompts.weight.detach().view(-1, 32)
        pool = emb[3:]
        assert all((pool - r).abs().max(1).values.min() == 0 for r in rows)  # each row is a vocabulary embedding
    model = make("prompt_tuning", prompt_length=4, prompt_init="labels")
    model.init_prompts([[5, [6, 7]], [8], [9, 10, 11, 12, 13]])
    p = model.prompts.weight.detach().view(3, 4, 32)
    assert torch.equal(p[0, 0], emb[5]) and torch.allclose(p[0, 1], (emb[6] + emb[7]) / 2)
    assert torch.equal(p[1, 0], emb[8]) and torch.equal(p[2], emb[9:13])  # labels first, at most l of them
    assert (emb[3:] - p[1, 1]).abs().max(1).values.min() == 0  # then sampled vocabulary
    with pytest.raises(ValueError, match="token_ids_per_task"):
        model.init_prompts([[5]])


# ---- adapter and HyperFormer++: blocks by hand ---------------------------------------------------------------
def hand_self_attention(attn, rel, h, key_mask, causal):
    b, n, _ = h.shape
    heads, dkv = attn.n_heads, attn.key_value_proj_dim
    split = lambda x: x.view(b, n, heads, dkv).transpose(1, 2)
    q, k, v = (split(h @ lin.weight.T) for lin in (attn.q, attn.k, attn.v))
    allowed = key_mask[:, None, None, :].bool().expand(b, 1, n, n)
    if causal:
        allowed = allowed & torch.ones(n, n, dtype=torch.bool).tril()
    scores = q @ k.transpose(-1, -2) + rel.compute_bias(n, n) + torch.where(allowed, 0.0, torch.finfo(h.dtype).min)
    return (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, n, heads * dkv) @ attn.o.weight.T


def adapter_by_hand(model, side, layer, kind, y, task_ids, x):
    """y + s (U(ReLU(D v + c)) + u) with the raw parameters of each row's task; v = y (sequential) or the
    sublayer's input x (parallel)."""
    a = model.adapters[f"{side}_{layer}_{kind}"]
    s, v = model.cfg.adapter_scale, (x if model.cfg.adapter_insertion == "parallel" else y)
    out = []
    for row, task in enumerate(task_ids.tolist()):
        h = torch.relu(v[row] @ a.down_weight[task].T + a.down_bias[task])
        out.append(y[row] + s * (h @ a.up_weight[task].T + a.up_bias[task]))
    return torch.stack(out)


BLOCK_TYPE = {"ffn": 0, "attention": 1}  # HyperFormer's code: 0 = feed-forward, 1 = self-attention


def hyperformer_weights_by_hand(model, side, layer, kind, task):
    """embeddings -> projector (Linear, ReLU, Linear) -> LayerNorm -> generators, from the raw parameters."""
    c = model.controllers[side]
    x = torch.cat([model.task_embeddings.weight[task], c.layer_embeddings.weight[layer],
                   c.type_embeddings.weight[BLOCK_TYPE[kind]]])
    w1, w2 = c.projector[0], c.projector[2]
    z = w2.weight @ torch.relu(w1.weight @ x + w1.bias) + w2.bias
    e = (z - z.mean()) / torch.sqrt(z.var(unbiased=False) + 1e-6) * c.norm.weight + c.norm.bias
    gen = lambda lin: lin.weight @ e + lin.bias
    d = model.t5.config.d_model
    b = d // model.cfg.reduction_factor
    return dict(D=gen(c.down_weight).view(b, d), c=gen(c.down_bias), U=gen(c.up_weight).view(d, b),
                u=gen(c.up_bias), gamma=gen(c.ln_weight), beta=gen(c.ln_bias))


def hyperformer_by_hand(model, side, layer, kind, y, task_ids):
    """y + LN_{gamma, beta}(U ReLU(D y + c) + u) with weights re-computed from the raw parameters."""
    out = []
    for row, task in enumerate(task_ids.tolist()):
        w = hyperformer_weights_by_hand(model, side, layer, kind, task)
        z = torch.relu(y[row] @ w["D"].T + w["c"]) @ w["U"].T + w["u"]
        z = (z - z.mean(-1, keepdim=True)) / torch.sqrt(z.var(-1, unbiased=False, keepdim=True) + 1e-5)
        out.append(y[row] + z * w["gamma"] + w["beta"])
    return torch.stack(out)


def capture(module, store, key):
    """Record a module's first input and first output."""
    def hook(m, args, kwargs, out):
        store[key] = (args[0] if args else kwargs["hidden_states"], out[0] if isinstance(out, tuple) else out)
    return module.register_forward_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("name", ["adapter", "adapter-ffn", "adapter-attention", "adapter-parallel", "hyperformer"])
@pytest.mark.parametrize("side,layer", [("encoder", 1), ("decoder", 1)])
def test_block_equals_hand_written_adapters(name, side, layer, batch):
    model = perturb(make(name))
    stock = stock_copy(model)
    stack, ref_stack = getattr(model.t5, side), getattr(stock, side)
    block, ref = stack.block[layer], ref_stack.block[layer]
    seen = {}
    hooks = [capture(block, seen, "block"), capture(block.layer[1], seen, "second")]
    with torch.no_grad():
        model(**batch)
    for h in hooks:
        h.remove()
    sites = {"adapter": ("attention", "ffn"), "adapter-ffn": ("ffn",), "adapter-attention": ("attention",),
             "adapter-parallel": ("attention", "ffn"), "hyperformer": ("attention", "ffn")}[name]
    tids = batch["task_ids"]

    def adapt(kind, y, x):
        if kind not in sites:
            return y
        if name == "hyperformer":
            return hyperformer_by_hand(model, side, layer, kind, y, tids)
        return adapter_by_hand(model, side, layer, kind, y, tids, x)

    h = seen["block"][0]
    key_mask = batch["attention_mask"] if side == "encoder" else torch.ones(h.shape[:2], dtype=torch.long)
    rel = ref_stack.block[0].layer[0].SelfAttention
    with torch.no_grad():
        sa = ref.layer[0]
        attn = hand_self_attention(sa.SelfAttention, rel, sa.layer_norm(h), key_mask, causal=side == "decoder")
        h1 = h + adapt("attention", attn, sa.layer_norm(h))
        # the decoder's cross-attention is not adapted: take its output from the run, after checking its input
        if side == "decoder":
            assert (seen["second"][0] - h1).abs().max() <= 1e-4
            h1 = seen["second"][1]
        ff = ref.layer[-1]
        y = ff.DenseReluDense(ff.layer_norm(h1))
        out = h1 + adapt("ffn", y, ff.layer_norm(h1))
        plain = h1 + y
    real = key_mask.bool()
    assert (seen["block"][1][real] - out[real]).abs().max() <= 1e-4
    if "ffn" in sites:  # the adapters do change the block
        assert (seen["block"][1][real] - plain[real]).abs().max() > 1e-2


@pytest.mark.parametrize("side", ["encoder", "decoder"])
def test_hyperformer_weights_equal_recomputation_from_raw_parameters(side):
    model = perturb(make("hyperformer"))
    table = model.generate_task_tensors()
    for layer in range(2):
        for kind in ("attention", "ffn"):
            D, c, U, u, gamma, beta = table[(side, layer, kind)]
            for task in range(3):
                ref = hyperformer_weights_by_hand(model, side, layer, kind, task)
                for got, want in ((D, "D"), (c, "c"), (U, "U"), (u, "u"), (gamma, "gamma"), (beta, "beta")):
                    assert (got[task] - ref[want]).abs().max() <= 1e-5, (layer, kind, want)
    # layers, block types and tasks all make a difference
    assert (table[(side, 0, "ffn")][0] - table[(side, 1, "ffn")][0]).abs().max() > 1e-3
    assert (table[(side, 0, "ffn")][0] - table[(side, 0, "attention")][0]).abs().max() > 1e-3
    assert (table[(side, 0, "ffn")][0][0] - table[(side, 0, "ffn")][0][1]).abs().max() > 1e-3


def test_hyperformer_defaults_follow_the_released_config():
    cfg = ModelConfig(method="hyperformer")
    assert (cfg.reduction_factor, cfg.hyperformer_task_dim, cfg.hyperformer_projected_dim,
            cfg.hyperformer_hidden_dim) == (32, 64, 64, 128)
    with torch.device("meta"):  # no memory: shapes only
        meta = build_model("t5-base", "hyperformer", ["rte", "mrpc"])
    assert meta.bottleneck == 24  # T5-Base: 768 // 32, as the paper reports


def test_hyperformer_reduction_factor_must_leave_a_bottleneck():
    with pytest.raises(ConfigError, match=r"model.reduction_factor: 64 leaves no bottleneck \(d_model 32 // 64 = 0\)"):
        make("hyperformer", reduction_factor=64)  # d_model 32: a T5Config, so no backbone name to give


# ---- LoRA, prefix, MAM: against independent computations ------------------------------------------------------
def plain(batch):
    return {k: v for k, v in batch.items() if k != "task_ids"}


def test_lora_equals_stock_t5_with_q_and_v_merged_by_hand(batch, tmp_path):
    r, alpha = SETUPS["lora"][1]["lora_rank"], SETUPS["lora"][1]["lora_alpha"]
    fresh = make("lora")  # B = 0: the backbone itself
    assert (logits(fresh, batch) - stock_copy(fresh)(**plain(batch)).logits).abs().max() <= 1e-5
    model = perturb(make("lora"))
    for task in range(3):
        stock = stock_copy(model)
        with torch.no_grad():
            for side in ("encoder", "decoder"):
                for i, block in enumerate(getattr(stock, side).block):
                    for proj in ("q", "v"):
                        lora = model.lora[f"{side}_{i}_{proj}"]
                        getattr(block.layer[0].SelfAttention, proj).weight += (alpha / r) * lora.B[task] @ lora.A[task]
            ref = stock(**plain(batch)).logits
            one = {**batch, "task_ids": torch.full((4,), task)}
            assert (logits(model, one) - ref).abs().max() <= 1e-5
            merged = model.merge(TASKS[task])  # the single-task export
            assert type(merged) is type(stock) and (merged(**plain(batch)).logits - ref).abs().max() <= 1e-5
            assert (ref - logits(fresh, one)).abs().max() > 1e-3  # the update matters
    merged.save_pretrained(tmp_path / "c")
    again = build_model(str(tmp_path / "c"), "mtl", ["c"]).eval()
    assert (logits(again, {**batch, "task_ids": torch.zeros(4, dtype=torch.long)}) - ref).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="merge: task 'd'"):
        model.merge("d")


def prefixes_by_hand(model, l):
    """Li & Liang's MLPs on the raw weights, one per kind of attention (encoder self, decoder self, decoder cross);
    attention m of a kind takes its MLP's output columns [2m d_i, (2m + 2) d_i) as its keys and values."""
    heads, dkv = model.t5.config.num_heads, model.t5.config.d_kv
    di = heads * dkv
    split = lambda x: x.reshape(l, heads, dkv).transpose(0, 1)                          # [heads, l, d_kv]
    n_enc, n_dec = len(model.t5.encoder.block), len(model.t5.decoder.block)
    prefixes = {}
    for kind, n in (("encoder", n_enc), ("decoder", n_dec), ("cross", n_dec)):
        E, (W1, _, W2) = model.prefix_embeddings[kind].weight, model.prefix_mlps[kind]
        out = torch.tanh(E @ W1.weight.T + W1.bias) @ W2.weight.T + W2.bias             # [T*l, n*2*d_i]
        prefixes.update({(kind, m): [(split(out[t * l:(t + 1) * l, 2 * m * di:(2 * m + 1) * di]),
                                      split(out[t * l:(t + 1) * l, (2 * m + 1) * di:(2 * m + 2) * di]))
                                     for t in range(3)] for m in range(n)})
    return prefixes


def test_cross_attention_prefixes_equal_a_hand_written_cross_attention(batch):
    """A decoder cross-attention attends over [P_k; W_k enc] and [P_v; W_v enc], prefix columns never masked
    (T5: no scaling, no position bias across): written out from the module's weights and the MLP's prefixes."""
    model = perturb(make("prefix"))
    module = model.t5.decoder.block[1].layer[1].EncDecAttention
    seen = {}
    hook = module.register_forward_hook(lambda m, args, kwargs, out: seen.update(
        x=args[0] if args else kwargs["hidden_states"], enc=kwargs["key_value_states"], out=out[0]), with_kwargs=True)
    with torch.no_grad():
        model(**batch)
    hook.remove()
    heads, dkv = model.t5.config.num_heads, model.t5.config.d_kv
    with torch.no_grad():
        by_hand = prefixes_by_hand(model, l=3)[("cross", 1)]
        x, enc, mask = seen["x"], seen["enc"], batch["attention_mask"]
        split = lambda t: t.view(t.shape[0], -1, heads, dkv).transpose(1, 2)              # [b, heads, n, d_kv]
        q, k, v = split(module.q(x)), split(module.k(enc)), split(module.v(enc))
        pk = torch.stack([by_hand[t][0] for t in batch["task_ids"].tolist()])           # [b, heads, l, d_kv]
        pv = torch.stack([by_hand[t][1] for t in batch["task_ids"].tolist()])
        scores = q @ torch.cat([pk, k], 2).transpose(-1, -2)                            # [b, heads, q, l + n]
        allowed = torch.cat([torch.ones(mask.shape[0], 3, dtype=torch.bool), mask.bool()], 1)[:, None, None]
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
        want = module.o((probs @ torch.cat([pv, v], 2)).transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))
    assert (seen["out"] - want).abs().max() <= 1e-5
    assert (want - module.o((torch.softmax((q @ k.transpose(-1, -2)).masked_fill(~allowed[..., 3:], float("-inf")),
                                           -1) @ v).transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))
            ).abs().max() > 1e-3  # the prefixes matter


def test_prefix_equals_the_attention_hook_fed_the_mlp_output_by_hand(batch):
    from hpsearch.model.attention import attach, use_prompted_attention
    model = perturb(make("prefix"))
    stock = stock_copy(model)
    use_prompted_attention(stock)
    with torch.no_grad():
        by_hand = prefixes_by_hand(model, l=3)
        rows = batch["task_ids"].tolist()
        prompts = {key: tuple(torch.stack([per_task[t][kv] for t in rows]) for kv in (0, 1))
                   for key, per_task in by_hand.items()}
        with attach(stock, prompts):
            ref = stock(**plain(batch)).logits
        without = stock(**plain(batch)).logits
    assert (logits(model, batch) - ref).abs().max() <= 1e-5
    assert (ref - without).abs().max() > 1e-3  # the prefixes matter
    model.freeze_task_params()  # the MLP replaced by its output: the same logits
    assert (logits(model, batch) - ref).abs().max() <= 1e-5
    mam = perturb(make("mam"))  # MAM's prefixes: the same pieces, with its own length
    table, by_hand = mam.generate_task_tensors(), prefixes_by_hand(mam, l=SETUPS["mam"][1]["mam_prefix_length"])
    for key, per_task in by_hand.items():
        for t, (pk, pv) in enumerate(per_task):
            assert (table[key][0][t] - pk).abs().max() <= 1e-6 and (table[key][1][t] - pv).abs().max() <= 1e-6


def feed_forward_in_out(model, side, layer, batch):
    """(the feed-forward sublayer, its input hidden states h, its output) in one forward of `model`."""
    ff = getattr(model.t5, side).block[layer].layer[-1]
    seen = {}
    hook = capture(ff, seen, "ffn")
    with torch.no_grad():
        model(**batch)
    hook.remove()
    return (ff, *seen["ffn"])


@pytest.mark.parametrize("side", ["encoder", "decoder"])
def test_mam_feed_forward_equals_hand_written_scaled_parallel_adapter(side, batch):
    model = perturb(make("mam"))
    s = SETUPS["mam"][1]["mam_scale"]
    ff, h, got = feed_forward_in_out(model, side, 1, batch)
    a = model.adapters[f"{side}_1"]
    with torch.no_grad():
        x = ff.layer_norm(h)
        out = []
        for row, t in enumerate(batch["task_ids"].tolist()):
            branch = torch.relu(x[row] @ a.down_weight[t].T + a.down_bias[t]) @ a.up_weight[t].T + a.up_bias[t]
            out.append(h[row] + ff.DenseReluDense(x[row]) + s * branch)   # residual + FFN(LN h) + s * adapter
        want = torch.stack(out)
    assert (got - want).abs().max() <= 1e-5
    assert (got - h - ff.DenseReluDense(x)).abs().max() > 1e-2  # the adapter matters


def parallel_branch_by_hand(name, model, side, layer, x, task_ids):
    """The branch a parallel-adapter method adds beside the feed-forward sublayer, from the raw parameters."""
    out = []
    for row, t in enumerate(task_ids.tolist()):
        if name == "pha":
            D, c, U, u = pha_weights_by_hand(model, t, side, layer)
            s = 1.0
        else:
            a = model.adapters[f"{side}_{layer}" if name == "mam" else f"{side}_{layer}_ffn"]
            D, c, U, u = a.down_weight[t], a.down_bias[t], a.up_weight[t], a.up_bias[t]
            s = SETUPS[name][1]["mam_scale" if name == "mam" else "adapter_scale"]
        out.append(s * (torch.relu(x[row] @ D.T + c) @ U.T + u))
    return torch.stack(out)


@pytest.mark.parametrize("name", ["mam", "pha", "adapter-parallel"])
def test_parallel_adapters_are_added_after_t5s_dropout(name, batch):
    """MAM (methods.md), PHA and the unified view's parallel adapter, as their code adds them: h + dropout(FFN(LN h))
    + branch(LN h). In training, with the FFN's output zeroed (so its dropout adds nothing), every entry of the
    branch arrives whole: none dropped, none rescaled by 1 / (1 - p)."""
    model = perturb(make(name, config=tiny_config(dropout_rate=0.5)))
    ff = model.t5.encoder.block[1].layer[-1]
    with torch.no_grad():
        ff.DenseReluDense.wo.weight.zero_()
    model.train()
    ff_, h, got = feed_forward_in_out(model, "encoder", 1, batch)
    with torch.no_grad():
        branch = parallel_branch_by_hand(name, model, "encoder", 1, ff.layer_norm(h), batch["task_ids"])
    assert branch.abs().max() > 1e-2  # the branch matters
    torch.testing.assert_close(got, h + branch, rtol=1e-5, atol=1e-5)


# ---- PHA -----------------------------------------------------------------------------------------------------
def pha_weights_by_hand(model, task: int, side: str, layer: int):
    """D, c, U, u of one (task, block) from the raw parameters: in the decoder, [k; e] -> W1, ReLU, W2, LayerNorm
    -> heads; in the encoder, the block's own adapter, the same for every task (upstream's `manual` adapter)."""
    if side == "encoder":
        a = model.encoder_adapters[layer]
        return a.down_weight[0], a.down_bias[0], a.up_weight[0], a.up_bias[0]
    k, e = model.prototypes.weight[task], model.block_embeddings.weight[layer]
    (w1, _, w2, ln) = model.hypernet
    i = torch.relu(torch.cat([k, e]) @ w1.weight.T + w1.bias) @ w2.weight.T + w2.bias
    i = (i - i.mean()) / torch.sqrt(i.var(unbiased=False) + ln.eps) * ln.weight + ln.bias
    d, b = model.t5.config.d_model, model.cfg.bottleneck
    head = lambda lin: i @ lin.weight.T + lin.bias
    return (head(model.down_weight).view(b, d), head(model.down_bias), head(model.up_weight).view(d, b),
            head(model.up_bias))


@pytest.mark.parametrize("side,layer", [("encoder", 1), ("decoder", 0)])
def test_pha_feed_forward_equals_parallel_adapter_recomputed_from_raw_parameters(side, layer, batch):
    model = perturb(make("pha"))
    ff, h, got = feed_forward_in_out(model, side, layer, batch)
    with torch.no_grad():
        x = ff.layer_norm(h)
        out = []
        for row, t in enumerate(batch["task_ids"].tolist()):
            D, c, U, u = pha_weights_by_hand(model, t, side, layer)
            out.append(h[row] + ff.DenseReluDense(x[row]) + torch.relu(x[row] @ D.T + c) @ U.T + u)
        want = torch.stack(out)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - h - ff.DenseReluDense(x)).abs().max() > 1e-2  # the adapter matters


def test_pha_training_loss_is_lm_plus_weighted_contrastive_terms_written_out(batch):
    model = perturb(make("pha", pha_temperature=0.5, pha_loss_weight=0.3))
    ids = batch["task_ids"]
    with torch.no_grad():
        out = model(**batch)
        lm = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        enc, am = out.encoder_last_hidden_state, batch["attention_mask"]
        pooled = torch.stack([enc[i, am[i].bool()].mean(0) for i in range(len(ids))])  # real tokens only
        lin1, _, lin2 = model.retriever
        z = torch.relu(pooled @ lin1.weight.T + lin1.bias) @ lin2.weight.T + lin2.bias
        cos = lambda a, b: float(a @ b / (a.norm() * b.norm()))
        t, n = 0.5, len(ids)
        ir, anchors = 0.0, 0
        for i in range(n):  # SupCon (upstream's _ins_ins_loss): the mean over the other rows of the same task
            pos = [j for j in range(n) if j != i and ids[j] == ids[i]]
            if not pos:
                continue
            anchors += 1
            den = sum(math.exp(cos(z[i], z[j]) / t) for j in range(n) if j != i)
            ir += sum(-math.log(math.exp(cos(z[i], z[j]) / t) / den) for j in pos) / len(pos)
        ir /= anchors
        protos = model.prototypes.weight  # its own prototype against the others (upstream's _pro_ins_loss)
        pro = sum(-math.log(math.exp(cos(z[i], protos[ids[i]]) / t)
                            / sum(math.exp(cos(z[i], protos[k]) / t) for k in range(len(TASKS)) if k != ids[i]))
                  for i in range(n)) / n
    assert anchors == 2  # rows 0 and 3 share task 0; tasks 1 and 2 have one row each
    assert abs(out.aux_losses["ir_loss"].item() - ir) <= 1e-5
    assert abs(out.aux_losses["proto_loss"].item() - pro) <= 1e-5
    assert abs(out.loss.item() - lm.item()) <= 1e-5  # in eval, the loss is T5's own: the terms train
    with torch.no_grad():
        trained = model.train()(**batch)
    assert abs(trained.lm_loss.item() - lm.item()) <= 1e-5  # (no dropout in this config)
    assert abs(trained.loss.item() - (lm.item() + 0.3 * (ir + pro))) <= 1e-5



def test_pha_conditions_the_decoder_only_and_its_generated_adapters_start_near_zero(batch):
    """As PHA's code lays it out (its GLUE config: encoder adapter `manual`, decoder adapter `pro-hyper`): the
    encoder's adapters are the same for every task, so its output (and the retriever's z) carries no task label the
    contrastive losses could read; only the decoder's adapters come from the prototypes, through heads initialised
    hyperfan-in (upstream's `hyperfanin_init_weight` / `_bias`: U(+-1e-3 sqrt(3 / fan_in)), bias 0), so they start
    near zero (N(0, 0.01^2) heads made them 60-80 % of their input at t5-small). With one task there is no other
    prototype: the prototype loss is 0, with finite gradients."""
    model = perturb(make("pha"))
    with torch.no_grad():
        one = model(**batch).encoder_last_hidden_state
        other = model(**{**batch, "task_ids": (batch["task_ids"] + 1) % len(TASKS)}).encoder_last_hidden_state
    torch.testing.assert_close(one, other)
    assert all(side == "decoder" for side, _ in model.blocks) and len(model.encoder_adapters) == 2
    fresh = make("pha", config=tiny_config(d_model=64), bottleneck=16, pha_dim=8)
    p, d, b = 8, 64, 16
    for head, fan_in in ((fresh.down_weight, p * d), (fresh.up_weight, p * b), (fresh.down_bias, p),
                         (fresh.up_bias, p)):
        bound = 1e-3 * math.sqrt(3 / fan_in)
        assert head.weight.abs().max() <= bound and head.weight.abs().max() > bound / 2 and not head.bias.any()
    from hpsearch.model.pha import prototype_loss
    z = torch.randn(4, 5, requires_grad=True)
    loss = prototype_loss(z, torch.randn(1, 5), torch.zeros(4, dtype=torch.long), 0.1)
    loss.backward()
    assert loss.item() == 0 and torch.isfinite(z.grad).all()


def test_pha_instance_loss_is_the_supervised_contrastive_mean_over_each_rows_positives():
    """Upstream's `_ins_ins_loss`, written out, on rows with two and three positives (with one positive each, the
    mean over positives equals the log of their summed probability, the multi-positive InfoNCE it replaced); rows
    without a partner or without a row of another task (a one-task batch) count for nothing."""
    from hpsearch.model.pha import instance_loss

    torch.manual_seed(3)
    z, ids, t = torch.randn(7, 4), torch.tensor([0, 0, 0, 1, 1, 2, 0]), 0.5
    cos = lambda a, b: float(a @ b / (a.norm() * b.norm()))
    terms = []
    for i in range(7):
        pos = [j for j in range(7) if j != i and ids[j] == ids[i]]
        if pos:
            den = sum(math.exp(cos(z[i], z[a]) / t) for a in range(7) if a != i)
            terms.append(sum(-math.log(math.exp(cos(z[i], z[j]) / t) / den) for j in pos) / len(pos))
    assert abs(instance_loss(z, ids, t).item() - sum(terms) / len(terms)) <= 1e-5
    one_task = z.clone().requires_grad_()
    loss = instance_loss(one_task, torch.zeros(7, dtype=torch.long), t)
    loss.backward()
    assert loss.item() == 0 and not one_task.grad.any()


def test_an_export_of_the_earlier_pha_layout_is_one_line_saying_so(tmp_path):
    """PHA's exports from before its encoder's adapters were shared (block embeddings for every block of both
    stacks) do not fit: torch raised a size mismatch as a traceback; the error says which version wrote them."""
    from safetensors.torch import load_file, save_file

    from hpsearch.errors import ConfigError
    save_export(make("pha"), tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    old = {k: v for k, v in weights.items() if not k.startswith("encoder_adapters.")}
    old["block_embeddings.weight"] = torch.cat([weights["block_embeddings.weight"]] * 2)  # [L_enc + L_dec, p]
    save_file(old, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"export does not match the model .*another shape \['block_embeddings"
                                          r".weight'\]\); it was written by an earlier hpsearch \(PHA then "
                                          r"generated the encoder's adapters from the task too\).*git checkout "
                                          r"8667c60"):
        build_model(str(tmp_path))


def test_pha_means_count_their_rows_and_tokens_exactly_in_bf16():
    """bf16 holds whole numbers exactly only up to 256: the contrastive loss's mean over its anchor rows and the
    retriever's mean over a row's tokens count them exactly (514 anchors counted in bf16 read 512)."""
    from hpsearch.model.pha import instance_loss, masked_mean

    # 257 tasks of 2 rows and 43 of one row: every anchor's term is the same, log(556 / 1) (identical z: every
    # similarity equal), so the mean is that term, whatever the count, once the count is right
    ids = torch.cat([torch.arange(257).repeat_interleave(2), torch.arange(257, 300)])
    z = torch.ones(len(ids), 4, dtype=torch.bfloat16)
    loss = instance_loss(z, ids, temperature=0.5)
    assert loss.dtype == torch.bfloat16
    assert abs(loss.item() - math.log(556)) < 0.015, loss.item()  # 6.3125; a bf16 step above with the count 512
    hidden = torch.ones(1, 301, 2, dtype=torch.bfloat16) * 3
    mask = torch.ones(1, 301, dtype=torch.long)
    assert masked_mean(hidden, mask).tolist() == [[3.0, 3.0]]  # the bf16 sum 904 / 301; / 300 gave 3.015625

def test_pha_retriever_picks_the_nearest_prototype():
    from hpsearch.model.pha import instance_loss
    model = make("pha")
    d = model.t5.config.d_model
    with torch.no_grad():  # a retriever that passes the first p features through; prototypes on the axes
        lin1, _, lin2 = model.retriever
        p = lin2.out_features
        lin1.weight.zero_(), lin1.bias.zero_(), lin2.weight.zero_(), lin2.bias.zero_()
        lin1.weight[:p, :p] = torch.eye(p)
        lin2.weight[:, :p] = torch.eye(p)
        model.prototypes.weight.copy_(torch.eye(p)[:len(TASKS)] * 3.0)
    for task in range(len(TASKS)):
        hidden = torch.rand(6, 4, d) * 0.1  # small positive noise, plus a strong feature on the task's axis
        hidden[..., task] += 1.0
        mask = torch.ones(6, 4)
        mask[:, 3] = 0
        hidden[:, 3] = -50.0  # padding must not count in the mean
        assert model.nearest_prototype(hidden, mask) == task
    # cosine, not a dot product: a long prototype off the instances' direction does not win by its length
    with torch.no_grad():
        model.prototypes.weight.zero_()
        model.prototypes.weight[0, 0] = 1.0
        model.prototypes.weight[1, :2] = 10.0
    hidden = torch.zeros(6, 4, d)
    hidden[..., 0] = 1.0
    assert model.nearest_prototype(hidden, torch.ones(6, 4)) == 0
    # the contrastive loss is low when same-task instances agree and high when they disagree
    z = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    tids = torch.tensor([0, 0, 1, 1])
    assert instance_loss(z, tids, 0.1) < 0.01 < instance_loss(z, torch.tensor([0, 1, 0, 1]), 0.1)
    # rows without a same-task partner count for nothing, and their gradient has no NaN (an all -inf row's log-sum
    # would give one): every row alone gives 0 and zero gradients; with tasks [0, 1, 0, 2] the mean is over rows 0, 2
    z = z.clone().requires_grad_()
    lone = instance_loss(z, torch.tensor([0, 1, 2, 3]), 0.1)
    lone.backward()
    assert lone.item() == 0.0 and torch.equal(z.grad, torch.zeros_like(z))
    z.grad = None
    single = instance_loss(z[:1], torch.tensor([0]), 0.1)  # a one-row batch: its row's only similarity is masked
    single.backward()
    assert single.item() == 0.0 and torch.equal(z.grad, torch.zeros_like(z))
    z.grad = None
    two = instance_loss(z, torch.tensor([0, 1, 0, 2]), 0.1)  # only rows 0 and 2 are anchors
    two.backward()
    unit = torch.nn.functional.normalize(z.detach(), dim=-1)
    sim = unit @ unit.T / 0.1
    by_hand = sum(torch.logsumexp(torch.cat([sim[i, :i], sim[i, i + 1:]]), 0) - sim[i, j]
                  for i, j in ((0, 2), (2, 0))) / 2
    assert abs(two.item() - by_hand.item()) <= 1e-5 and torch.isfinite(z.grad).all() and z.grad[1].abs().sum() > 0


# ---- config: which fields a method uses ----------------------------------------------------------------------
def test_method_fields_cover_the_config():
    names = {f for f in ModelConfig.__dataclass_fields__}
    used = set(COMMON_FIELDS).union(*METHOD_FIELDS.values())
    assert used == names
    assert set(METHOD_FIELDS) == set(METHODS)
    from hpsearch.model import METHOD_CLASSES
    assert set(METHOD_CLASSES) == set(METHODS)


@pytest.mark.parametrize("kw,expected", [
    (dict(method="mtl"), set()),
    (dict(method="hyperprompt", variant="share", placement="encoder"),
     {"variant", "placement", "prompt_length_encoder", "bottleneck", "hypernet_bias", "train_task_params_only"}),
    (dict(method="hyperprompt", variant="global", placement="decoder"),
     {"variant", "placement", "prompt_length_decoder", "bottleneck", "hypernet_bias", "train_task_params_only",
      "task_embedding_dim", "layer_task_dim", "projection_hidden"}),
    (dict(method="prompt_tuning"), {"prompt_length", "prompt_init", "train_task_params_only"}),
    (dict(method="adapter"), {"bottleneck", "adapter_sites", "adapter_insertion", "adapter_scale",
                              "train_task_params_only"}),
    (dict(method="hyperformer"), {"reduction_factor", "hyperformer_task_dim", "hyperformer_projected_dim",
                                  "hyperformer_hidden_dim", "train_task_params_only"}),
    (dict(method="prefix"), {"prompt_length", "prefix_hidden", "train_task_params_only"}),
    (dict(method="lora"), {"lora_rank", "lora_alpha", "lora_dropout", "train_task_params_only"}),
    (dict(method="mam"), {"mam_prefix_length", "prefix_hidden", "bottleneck", "mam_scale", "train_task_params_only"}),
])
def test_active_fields(kw, expected):
    assert ModelConfig(**kw).active_fields() == expected | set(COMMON_FIELDS)


@pytest.mark.parametrize("bad,match", [
    (dict(method="prompt_tuning", prompt_init="text"), "model.prompt_init: 'text' is not one of random, vocab"),
    (dict(method="prompt_tuning", prompt_length=0), r"model.prompt_length: 0 is out of range"),
    (dict(method="adapter", adapter_sites="cross"), "model.adapter_sites: 'cross' is not one of ffn"),
    (dict(method="hyperformer", reduction_factor=0), "model.reduction_factor: 0 is out of range"),
    (dict(method="hyperformer", hyperformer_hidden_dim=-1), "model.hyperformer_hidden_dim"),
    (dict(method="ia3"), "model.method: 'ia3' is not one of mtl, hyperprompt, prompt_tuning, adapter, hyperformer, "
                         "prefix, lora, mam"),
    (dict(method="prefix", prefix_hidden=0), r"model.prefix_hidden: 0 is out of range; expected an integer in \[1"),
    (dict(method="prefix", prompt_length=5000), r"model.prompt_length: 5000 is out of range"),
    (dict(method="lora", lora_rank=0), r"model.lora_rank: 0 is out of range; expected an integer in \[1, 4096\]"),
    (dict(method="lora", lora_alpha=0), r"model.lora_alpha: 0 is out of range; expected a number with 0 < lora_alpha"),
    (dict(method="lora", lora_dropout=1.0), r"model.lora_dropout: 1.0 is out of range; expected a number with 0 <="),
    (dict(method="lora", lora_alpha="8"), r"model.lora_alpha: '8' is out of range"),
    (dict(method="mam", mam_scale=-1.0), r"model.mam_scale: -1.0 is out of range; expected a number with 0 < mam"),
    (dict(method="mam", mam_prefix_length=0), r"model.mam_prefix_length: 0 is out of range"),
])
def test_bad_method_fields_are_one_line_config_errors(bad, match):
    with pytest.raises(ConfigError, match=match) as e:
        build_model(tiny_config(), bad.pop("method"), TASKS, **bad)
    assert "\n" not in str(e.value)


def test_prompt_tuning_labels_init_through_the_generic_hook():
    """The trainer calls `init_task_params(label token ids)` on every model; prompt tuning with `labels` init then
    starts from the class labels' embeddings (a multi-token label: their mean), the vocabulary after them."""
    torch.manual_seed(0)
    model = build_model(tiny_config(), "prompt_tuning", ["a", "b"], prompt_length=3, prompt_init="labels")
    model.init_task_params([[[5], [7, 8]], [[9]]])
    prompts = model.prompts.weight.detach().view(2, 3, -1)
    embed = model.t5.encoder.embed_tokens.weight.detach()
    assert torch.allclose(prompts[0, 0], embed[5]) and torch.allclose(prompts[0, 1], (embed[7] + embed[8]) / 2)
    assert torch.allclose(prompts[1, 0], embed[9])
    vocab = build_model(tiny_config(), "prompt_tuning", ["a", "b"], prompt_length=3, prompt_init="vocab")
    before = vocab.prompts.weight.detach().clone()
    vocab.init_task_params([[[5]], [[9]]])  # other inits ignore label tokens
    assert torch.equal(vocab.prompts.weight.detach(), before)
    mtl = build_model(tiny_config(), "mtl", ["a", "b"])
    mtl.init_task_params([[[5]], [[9]]])  # a no-op for methods without such an init


def test_an_older_layout_is_blamed_only_when_the_model_lacks_todays_names():
    """A resume's or an export's mismatch names the version that wrote the weights only when they have the old
    names and the model misses today's instead: a HyperPrompt with unequal prompt lengths per side still keeps
    `global_prompts.encoder.*`, so its weights loaded into another placement or method are a config mismatch.
    The names come from torch's own load_state_dict error, as a checkpoint's load reports it."""
    from hpsearch.model.export import older_layout
    from hpsearch.train.checkpoints import state_dict_mismatch

    def mismatch(source, target):
        with pytest.raises(RuntimeError) as e:
            target.load_state_dict(source.state_dict())
        return state_dict_mismatch(str(e.value))

    unequal = make("hyperprompt-global")  # lengths 3 and 2: a prompt set per side
    assert any(k.startswith("global_prompts.encoder.") for k in unequal.state_dict())
    equal = make("hyperprompt-global", prompt_length_decoder=3)  # one shared set
    assert any(k.startswith("global_prompts.shared.") for k in equal.state_dict())
    missing, unexpected = mismatch(unequal, equal)
    assert any(k.startswith("global_prompts.shared.") for k in missing)
    assert any(k.startswith("global_prompts.encoder.") for k in unexpected)
    assert "written by hpsearch before 2026-11-27 (HyperPrompt then kept a prompt set" in older_layout(unexpected,
                                                                                                       missing)
    for other in (make("hyperprompt-global", placement="decoder"), make("lora"), make("mtl")):
        missing, unexpected = mismatch(unequal, other)
        assert unexpected and older_layout(unexpected, missing) is None


# ---- gaps a mutation run found (each test fails with its mutant) -----------------------------------------------
@pytest.mark.parametrize("name", ["hyperprompt-share", "hyperprompt-sep", "hyperprompt-global"])
def test_hyperprompts_cross_attention_is_stock(name, batch):
    """methods.md: HyperPrompt prompts the self-attentions only. Each decoder layer's cross-attention equals one
    written by hand from its q, k, v, o, the encoder's output and its padding mask: no prompt columns, no position
    bias (decoder prompts fed to cross-attention too changed the logits, and cached == uncached still held)."""
    model = perturb(make(name))
    seen = {}
    hooks = [capture(block.layer[1], seen, i) for i, block in enumerate(model.t5.decoder.block)]
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
    for h in hooks:
        h.remove()
    enc = out.encoder_last_hidden_state
    for i, block in enumerate(model.t5.decoder.block):
        h, got = seen[i]
        layer = block.layer[1]
        attn = layer.EncDecAttention
        b, n, _ = h.shape
        heads, dkv = attn.n_heads, attn.key_value_proj_dim
        split = lambda x, b=b, heads=heads, dkv=dkv: x.view(b, x.shape[1], heads, dkv).transpose(1, 2)
        with torch.no_grad():
            q, k, v = split(layer.layer_norm(h) @ attn.q.weight.T), split(enc @ attn.k.weight.T), \
                split(enc @ attn.v.weight.T)
            mask = torch.where(batch["attention_mask"][:, None, None, :].bool(), 0.0, torch.finfo(h.dtype).min)
            o = (torch.softmax(q @ k.transpose(-1, -2) + mask, -1) @ v).transpose(1, 2).reshape(b, n, heads * dkv)
            want = h + o @ attn.o.weight.T
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_new_adapters_and_lora_start_as_their_papers_do():
    """Unperturbed: LoRA's B and MAM's up-projection and biases are zero (a new module adds nothing) while LoRA's A
    and MAM's down-projection are Kaiming-uniform (else nothing could ever train: B's gradient is A x); the adapter's
    weights are N(0, 0.01^2) with zero biases (HyperFormer's code)."""
    from hpsearch.model.lora import TaskLoRA
    branches = [m for m in make("lora").modules() if isinstance(m, TaskLoRA)]
    assert len(branches) == 2 * 4  # q and v of the 4 self-attentions
    for branch in branches:
        assert torch.count_nonzero(branch.B) == 0
        bound = 1 / math.sqrt(branch.A.shape[-1])
        assert branch.A.abs().max() <= bound and branch.A.std() > 0.5 * bound / math.sqrt(3)
    mam = make("mam")
    for adapter in mam.adapters.values():
        assert torch.count_nonzero(adapter.up_weight) == 0 and torch.count_nonzero(adapter.up_bias) == 0
        assert torch.count_nonzero(adapter.down_bias) == 0
        bound = 1 / math.sqrt(adapter.down_weight.shape[-1])
        assert adapter.down_weight.abs().max() <= bound and adapter.down_weight.std() > 0.5 * bound / math.sqrt(3)
    adapter = make("adapter")
    for a in adapter.adapters.values():
        for w in (a.down_weight, a.up_weight):
            assert 0.005 < w.std() < 0.02, w.std()
        assert torch.count_nonzero(a.down_bias) == 0 and torch.count_nonzero(a.up_bias) == 0


def test_a_full_export_keeps_its_backbones_name(tmp_path):
    model = build_model("t5-tiny", "mtl", TASKS)
    save_export(model, tmp_path)
    assert build_model(str(tmp_path)).cfg.backbone == "t5-tiny"


def test_prompt_tuning_never_samples_pad_eos_or_unk():
    """The sampled-vocabulary init draws from ids after T5's pad (0), eos (1) and unk (2)."""
    model = make("prompt_tuning", config=tiny_config(vocab_size=8), prompt_length=200, prompt_init="vocab")
    emb = model.t5.get_input_embeddings().weight.detach()
    rows = model.prompts.weight.detach().view(-1, emb.shape[1])
    special = emb[:3]
    assert not any(torch.equal(r, e) for r in rows for e in special)
    assert all(any(torch.equal(r, e) for e in emb[3:]) for r in rows[:20])  # each a vocabulary embedding


@pytest.mark.parametrize("name", ["lora", "hyperprompt-global"])
def test_dropout_acts_in_training_only(name, batch):
    """LoRA's branch dropout (the backbone's own dropout 0: only the branch's can make a difference), and the
    dropout on the attention probabilities in the library's attention (one self-attention called alone, with its
    layer's prompts: T5Attention has no other dropout): in eval two calls are equal, in training two seeds differ."""
    if name == "lora":
        model = perturb(make("lora", lora_dropout=0.5))
        call = lambda: model(**batch).logits
    else:
        model = perturb(make(name, config=tiny_config(dropout_rate=0.5)))
        attn = model.t5.encoder.block[1].layer[0].SelfAttention
        h = torch.randn(4, 9, model.t5.config.d_model, generator=torch.Generator().manual_seed(3))

        def call():
            with model._using(model.task_context(batch["task_ids"])):
                assert attn.hp_prompt is not None
                return attn(h)[0]
    runs = []
    for mode, seed in (("eval", 0), ("eval", 1), ("train", 0), ("train", 1)):
        getattr(model, mode)()
        torch.manual_seed(seed)
        with torch.no_grad():
            runs.append(call())
    assert torch.equal(runs[0], runs[1])
    assert (runs[2] - runs[3]).abs().max() > 1e-4

