"""HyperPrompt T5 against independent computations: stock T5 with the same weights, hand-written attention."""
from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors import safe_open
from t5_testing import logits, overfit, stock_copy, tiny_config

from hpsearch.errors import ConfigError
from hpsearch.model import build_model

VARIANTS = ("share", "sep", "global")
PLACEMENTS = ("encoder", "decoder", "both")
TASKS = ["a", "b", "c"]


def hp(variant="global", placement="both", l_enc=3, l_dec=2, seed=0, config=None, **kw):
    torch.manual_seed(seed)
    return build_model(config or tiny_config(), "hyperprompt", TASKS, variant=variant, placement=placement,
                       prompt_length_encoder=l_enc, prompt_length_decoder=l_dec, bottleneck=4,
                       task_embedding_dim=5, layer_task_dim=6, projection_hidden=7, **kw).eval()


# ---- equality with stock T5 -------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["mtl", "hyperprompt"])
def test_unprompted_equals_stock_t5(method, batch):
    torch.manual_seed(0)
    extra = {} if method == "mtl" else dict(prompt_length_encoder=0, prompt_length_decoder=0, placement="both")
    model = build_model(tiny_config(), method, TASKS, **extra).eval()
    stock = stock_copy(model)
    with torch.no_grad():
        ref = stock(**{k: v for k, v in batch.items() if k != "task_ids"})
    out = model(**batch)
    assert (out.logits - ref.logits).abs().max() <= 1e-5
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-5


def test_placement_decoder_leaves_encoder_as_stock(batch):
    model = hp(placement="decoder")
    stock = stock_copy(model)
    with torch.no_grad():
        ours = model.t5.encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        ref = stock.encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        # the same encoder, now inside a full prompted forward (hooks see what the decoder's forward runs)
        seen = {}
        h = model.t5.encoder.register_forward_hook(lambda m, a, o: seen.update(enc=o.last_hidden_state))
        model(**batch)
        h.remove()
    assert {side for side, _ in model.hyper_prompts(batch["task_ids"])} == {"decoder"}
    assert (seen["enc"] - ref.last_hidden_state).abs().max() <= 1e-5
    assert (ours.last_hidden_state - ref.last_hidden_state).abs().max() <= 1e-5
    # ...while the decoder does change
    assert (logits(model, batch) - stock(**{k: v for k, v in batch.items() if k != "task_ids"}).logits
            ).abs().max() > 1e-3


def test_placement_encoder_leaves_decoder_unprompted(batch):
    model = hp(placement="encoder")
    stock = stock_copy(model)
    assert {side for side, _ in model.hyper_prompts(batch["task_ids"])} == {"encoder"}
    with torch.no_grad():
        enc = model(**batch, output_hidden_states=True).encoder_last_hidden_state
        stock_enc = stock.encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        assert (enc - stock_enc.last_hidden_state).abs().max() > 1e-3  # the encoder is prompted
        # given the same (prompted) encoder states, our decoder equals stock T5's decoder
        from transformers.modeling_outputs import BaseModelOutput
        ours = model(**batch, encoder_outputs=BaseModelOutput(last_hidden_state=enc)).logits
        ref = stock(attention_mask=batch["attention_mask"], labels=batch["labels"],
                    encoder_outputs=BaseModelOutput(last_hidden_state=enc)).logits
    assert (ours - ref).abs().max() <= 1e-5


# ---- one layer against hand-written attention --------------------------------------------------------------
def hand_attention(module, rel_module, hidden, pk, pv, key_mask, causal):
    """softmax(Q [P_k; K]^T + [0 | bias] + [0 | mask]) [P_v; V] then the output projection, written out."""
    b, n, _ = hidden.shape
    heads, dkv = module.n_heads, module.key_value_proj_dim
    split = lambda x: x.view(b, n, heads, dkv).transpose(1, 2)
    q, k, v = split(hidden @ module.q.weight.T), split(hidden @ module.k.weight.T), split(hidden @ module.v.weight.T)
    k, v = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
    bias = rel_module.compute_bias(n, n, device=hidden.device)                    # [1, H, n, n]
    allowed = key_mask[:, None, None, :].bool().expand(b, 1, n, n)
    if causal:
        allowed = allowed & torch.ones(n, n, dtype=torch.bool).tril()
    bias = bias + torch.where(allowed, 0.0, torch.finfo(hidden.dtype).min)
    l = pk.shape[2]
    scores = q @ k.transpose(-1, -2) + torch.cat([torch.zeros(b, heads, n, l), bias], -1)
    probs = torch.softmax(scores, -1)
    out = (probs @ v).transpose(1, 2).reshape(b, n, heads * dkv) @ module.o.weight.T
    return out, probs


@pytest.mark.parametrize("side,layer", [("encoder", 0), ("encoder", 1), ("decoder", 0), ("decoder", 1)])
def test_layer_equals_hand_written_attention(side, layer, batch):
    model = hp(variant="sep")
    stack = getattr(model.t5, side)
    module = stack.block[layer].layer[0].SelfAttention
    captured = {}
    handle = module.register_forward_hook(
        lambda m, args, kwargs, out: captured.update(h=args[0] if args else kwargs["hidden_states"], out=out[0]),
        with_kwargs=True)
    with torch.no_grad():
        model(**batch)
    handle.remove()
    pk, pv = model.hyper_prompts(batch["task_ids"])[(side, layer)]
    if side == "encoder":
        key_mask = batch["attention_mask"]
    else:  # decoder self-attention: no padding mask given, so all decoder positions are keys (causal only)
        key_mask = torch.ones(captured["h"].shape[:2], dtype=torch.long)
    with torch.no_grad():
        ref, _ = hand_attention(module, stack.block[0].layer[0].SelfAttention, captured["h"], pk, pv, key_mask,
                                causal=side == "decoder")
    real = key_mask.bool() if side == "encoder" else torch.ones_like(key_mask).bool()
    assert (captured["out"][real] - ref[real]).abs().max() <= 1e-5
    assert pk.shape == (4, 4, 3 if side == "encoder" else 2, 8)


def test_attention_stats_match_hand_computation(batch):
    model = hp(variant="share")
    stats = model.attention_stats(batch)
    module = model.t5.encoder.block[1].layer[0].SelfAttention
    captured = {}
    handle = module.register_forward_hook(
        lambda m, args, kwargs, out: captured.update(h=args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True)
    with torch.no_grad():
        model(**batch)
    handle.remove()
    pk, pv = model.hyper_prompts(batch["task_ids"])[("encoder", 1)]
    with torch.no_grad():
        _, probs = hand_attention(module, model.t5.encoder.block[0].layer[0].SelfAttention, captured["h"], pk, pv,
                                  batch["attention_mask"], causal=False)
    q = batch["attention_mask"].bool()
    mass = probs[..., :3].sum(-1).mean(1)[q].mean()                      # heads, then real queries
    real = probs[..., 3:] / probs[..., 3:].sum(-1, keepdim=True)
    ent = -(real * torch.log(real.clamp_min(1e-30))).sum(-1).mean(1)[q].mean()
    got = stats["encoder"][1]
    assert got["layer"] == 1
    assert got["prompt_mass"] == pytest.approx(mass.item(), abs=1e-5)
    assert got["token_entropy"] == pytest.approx(ent.item(), abs=1e-5)
    assert len(stats["decoder"]) == 2 and 0 < stats["decoder"][0]["prompt_mass"] < 1
    mtl = build_model(tiny_config(), "mtl", TASKS).eval()
    assert all(s["prompt_mass"] == 0 for s in mtl.attention_stats(batch)["encoder"])


def test_hyper_prompts_are_what_attention_receives(batch):
    model = hp(variant="global")
    expected = model.hyper_prompts(batch["task_ids"])
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, key=key: seen.update({key: m.hp_prompt}))
             for key, m in model_self_attention(model).items()]
    with torch.no_grad():
        model(**batch)
    for h in hooks:
        h.remove()
    assert set(seen) == set(expected) == {(s, i) for s in ("encoder", "decoder") for i in range(2)}
    for key, (k, v) in expected.items():
        assert k.shape == (4, 4, 3 if key[0] == "encoder" else 2, 8)
        assert torch.equal(seen[key][0], k) and torch.equal(seen[key][1], v)


def model_self_attention(model):
    from hpsearch.model.attention import self_attention_modules
    return self_attention_modules(model.t5)


# ---- task conditioning ------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_tasks_condition_and_mixed_batches(variant, batch):
    model = hp(variant=variant)
    same = {**batch, "task_ids": torch.zeros(4, dtype=torch.long)}
    other = {**batch, "task_ids": torch.ones(4, dtype=torch.long)}
    assert (logits(model, same) - logits(model, other)).abs().max() > 1e-3
    mixed = logits(model, batch)
    for row, task in enumerate(batch["task_ids"].tolist()):
        single = {**batch, "task_ids": torch.full((4,), task)}
        assert (logits(model, single)[row] - mixed[row]).abs().max() <= 1e-5


# ---- generation ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant,placement", [("global", "both"), ("share", "decoder"), ("sep", "encoder")])
def test_cached_generate_equals_uncached(variant, placement, batch):
    model = hp(variant=variant, placement=placement, seed=3, config=tiny_config(d_model=64, d_kv=16))
    overfit(model, batch)  # an untrained model decodes one token over and over: make decoding non-trivial
    args = dict(max_new_tokens=6, do_sample=False, num_beams=1, output_scores=True, return_dict_in_generate=True,
                eos_token_id=None, min_new_tokens=6)
    with torch.no_grad():
        cached = model.generate(batch["input_ids"], batch["attention_mask"], task_ids=batch["task_ids"],
                                use_cache=True, **args)
        uncached = model.generate(batch["input_ids"], batch["attention_mask"], task_ids=batch["task_ids"],
                                  use_cache=False, **args)
        assert torch.equal(cached.sequences, uncached.sequences)
        assert len(set(cached.sequences[:, 1:].flatten().tolist())) > 2  # a real decode, not one token repeated
        # every step's scores equal a full teacher-forced forward over the decoded prefix
        full = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     decoder_input_ids=cached.sequences[:, :-1], task_ids=batch["task_ids"]).logits
    steps = torch.stack(cached.scores, 1)
    assert (steps - full).abs().max() <= 1e-4
    # the decoder's prompts sit in the cache, in front of the tokens, instead of being copied in at every step
    from hpsearch.model.attention import PromptCacheLayer

    layers = cached.past_key_values.self_attention_cache.layers
    prompted = placement in ("both", "decoder")
    assert all(isinstance(layer, PromptCacheLayer) == prompted for layer in layers)
    model.freeze_task_params()
    for i, layer in enumerate(layers if prompted else []):
        with model._using(model.task_context(batch["task_ids"], batch["task_ids"].shape[0])):
            pk, pv = model.t5.decoder.block[i].layer[0].SelfAttention.hp_prompt
        l = pk.shape[2]
        assert layer.get_seq_length() == cached.sequences.shape[1] - 1 == layer.keys.shape[2] - l
        assert torch.allclose(layer.keys[:, :, :l], pk.expand(layer.keys.shape[0], -1, -1, -1), atol=1e-6)
        assert torch.allclose(layer.values[:, :, :l], pv.expand(layer.values.shape[0], -1, -1, -1), atol=1e-6)


def test_generate_takes_the_callers_cache_choice(batch):
    """The prompt-holding cache stands in for the default cache only: caching switched off in the model's generation
    config (a cache handed in would then be fed the whole prefix each step) and another cache implementation asked
    for both decode as uncached generation does, and leave no prompt cache behind."""
    from transformers import GenerationConfig

    from hpsearch.model.attention import PromptCacheLayer

    model = hp(variant="global", placement="both", seed=3, config=tiny_config(d_model=64, d_kv=16))
    overfit(model, batch)
    args = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=1, eos_token_id=None,
                return_dict_in_generate=True)
    ids, mask, tasks = batch["input_ids"], batch["attention_mask"], batch["task_ids"]
    with torch.no_grad():
        expected = model.generate(ids, mask, task_ids=tasks, use_cache=False, **args).sequences
        assert len(set(expected[:, 1:].flatten().tolist())) > 2  # a real decode, not one token repeated
        off = GenerationConfig(**{**model.t5.generation_config.to_dict(), "use_cache": False})
        out = model.generate(ids, mask, task_ids=tasks, generation_config=off, **args)
        assert torch.equal(out.sequences, expected) and out.past_key_values is None
        default = model.t5.generation_config.use_cache
        model.t5.generation_config.use_cache = False
        try:
            out = model.generate(ids, mask, task_ids=tasks, **args)
        finally:
            model.t5.generation_config.use_cache = default
        assert torch.equal(out.sequences, expected) and out.past_key_values is None
        out = model.generate(ids, mask, task_ids=tasks, cache_implementation="static", **args)
        assert torch.equal(out.sequences, expected)
        assert not any(isinstance(layer, PromptCacheLayer) for layer in out.past_key_values.self_attention_cache.layers)
        # a partial generation config takes what it leaves unset from the model's, as transformers does
        for name, value in (("use_cache", False), ("cache_implementation", "static")):
            default = getattr(model.t5.generation_config, name)
            setattr(model.t5.generation_config, name, value)
            try:
                out = model.generate(ids, mask, task_ids=tasks, generation_config=GenerationConfig(max_new_tokens=6),
                                     **args)
            finally:
                setattr(model.t5.generation_config, name, default)
            assert torch.equal(out.sequences, expected), name
            layers = out.past_key_values.self_attention_cache.layers if out.past_key_values is not None else []
            assert not any(isinstance(layer, PromptCacheLayer) for layer in layers), name



def test_beam_search_with_mixed_tasks_equals_per_task(batch):
    model = hp(config=tiny_config(d_model=64, d_kv=16))
    overfit(model, batch)
    args = dict(max_new_tokens=5, num_beams=3, num_return_sequences=2, eos_token_id=None, min_new_tokens=5)
    with torch.no_grad():
        mixed = model.generate(batch["input_ids"], batch["attention_mask"], task_ids=batch["task_ids"], **args)
        assert mixed.shape[0] == 8
        for row, task in enumerate(batch["task_ids"].tolist()):
            single = model.generate(batch["input_ids"], batch["attention_mask"], task_ids=torch.full((4,), task),
                                    **args)
            assert torch.equal(single[2 * row: 2 * row + 2], mixed[2 * row: 2 * row + 2])
        uncached = model.generate(batch["input_ids"], batch["attention_mask"], task_ids=batch["task_ids"],
                                  use_cache=False, **args)
    assert torch.equal(uncached, mixed)


@pytest.mark.parametrize("variant", VARIANTS)
def test_frozen_prompts_equal_dynamic_and_skip_generators(variant, batch, monkeypatch):
    model = hp(variant=variant)
    dynamic = logits(model, batch)
    with torch.no_grad():
        gen_dyn = model.generate(batch["input_ids"], batch["attention_mask"], task_ids=batch["task_ids"],
                                 max_new_tokens=4)
    model.freeze_prompts()
    monkeypatch.setattr(model, "generate_task_tensors", lambda *a: (_ for _ in ()).throw(AssertionError("called")))
    assert torch.equal(logits(model, batch), dynamic)
    with torch.no_grad():
        assert torch.equal(model.generate(batch["input_ids"], batch["attention_mask"],
                                          task_ids=batch["task_ids"], max_new_tokens=4), gen_dyn)
    monkeypatch.undo()
    model.train()
    assert not model.prompts_frozen


# ---- gradients ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant,bias", list(itertools.product(VARIANTS, [False, True])))
def test_gradients_reach_every_generator_parameter(variant, bias, batch):
    model = hp(variant=variant, hypernet_bias=bias).train()
    model(**batch).loss.backward()
    generator = {n: p for n, p in model.named_parameters() if not n.startswith("t5.")}
    assert generator
    for name, p in generator.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert model.t5.shared.weight.grad is not None


def test_sep_hypernetworks_get_gradient_only_from_their_tasks_rows(batch):
    model = hp(variant="sep").train()
    model(**{**batch, "task_ids": torch.tensor([0, 2, 2, 0])}).loss.backward()
    grad = model.local_hypernets["encoder"].down.grad[0, 0]             # keys of block 0: [tasks, d, b]
    assert grad[0].abs().sum() > 0 and grad[2].abs().sum() > 0
    assert grad[1].abs().sum() == 0                                     # task 1 is absent from the batch
    assert model.global_prompts["encoder"].weight.grad[1].abs().sum() == 0


def test_train_task_params_only_freezes_backbone(batch):
    model = hp(variant="share", train_task_params_only=True).train()
    model(**batch).loss.backward()
    assert all(p.grad is None for p in model.t5.parameters())
    assert all(p.grad is not None for n, p in model.named_parameters() if not n.startswith("t5."))


# ---- parameter counts --------------------------------------------------------------------------------------------
def formula(variant, d, b, l, T, M, t1, t, e, d_inner=None):
    """The paper's counts; with d_inner = heads * d_kv != d_model (t5-3b, t5-11b) the up-projections are
    b x d_inner, so 4*b*d becomes 2*b*(d + d_inner). Equal to the paper's formula when d_inner == d."""
    hyper = 2 * b * (d + (d_inner or d))
    prompts = d * l * T
    if variant == "share":
        return prompts + hyper * M
    if variant == "sep":
        return prompts + hyper * M * T
    return prompts + hyper * t + T * t1 + M * t1 + (2 * t1 + t) * e


@pytest.mark.parametrize("variant,placement", list(itertools.product(VARIANTS, PLACEMENTS)))
@pytest.mark.parametrize("shape", [dict(d_model=32, num_heads=4, d_kv=8, num_layers=2, num_decoder_layers=2),
                                   dict(d_model=48, num_heads=6, d_kv=8, num_layers=3, num_decoder_layers=1),
                                   dict(d_model=24, num_heads=4, d_kv=12, num_layers=2, num_decoder_layers=2)])
def test_extra_parameters_match_paper_formula(variant, placement, shape):
    tasks = ["t0", "t1", "t2", "t3", "t4"]
    le, ld, b, t1, t, e = 7, 3, 5, 4, 6, 9
    model = build_model(tiny_config(**shape), "hyperprompt", tasks, variant=variant, placement=placement,
                        prompt_length_encoder=le, prompt_length_decoder=ld, bottleneck=b, task_embedding_dim=t1,
                        layer_task_dim=t, projection_hidden=e)
    d, T = shape["d_model"], len(tasks)
    enc, dec = placement in ("encoder", "both"), placement in ("decoder", "both")
    l = le * enc + ld * dec
    M = shape["num_layers"] * enc + shape["num_decoder_layers"] * dec
    counts = model.extra_parameters()
    d_inner = shape["num_heads"] * shape["d_kv"]
    assert counts["total"] == formula(variant, shape["d_model"], b, l, len(tasks), M, t1, t, e, d_inner)
    if d_inner == shape["d_model"]:  # the paper's own formula, written out
        paper = {"share": d * l * T + 4 * b * d * M, "sep": d * l * T + 4 * b * d * M * T,
                 "global": d * l * T + 4 * b * d * t + T * t1 + M * t1 + (2 * t1 + t) * e}[variant]
        assert counts["total"] == paper
    assert counts["total"] == sum(v for k, v in counts.items() if k != "total")
    backbone = sum(p.numel() for p in model.t5.parameters())
    assert sum(p.numel() for p in model.parameters()) == backbone + counts["total"]


def test_extra_parameters_with_bias_count_the_real_modules():
    model = hp(variant="share", hypernet_bias=True)
    without = hp(variant="share", hypernet_bias=False)
    # 4 layers x (down_k, down_v: b=4 each; up_k, up_v: d_inner=32 each)
    assert model.extra_parameters()["total"] - without.extra_parameters()["total"] == 4 * (2 * 4 + 2 * 32)
    assert build_model(tiny_config(), "mtl", TASKS).extra_parameters() == {"total": 0}


# ---- construction and errors ----------------------------------------------------------------------------------------
def test_named_shapes_build_offline_with_published_sizes():
    from hpsearch.model import backbone_config
    base = backbone_config("t5-base")
    assert (base.d_model, base.d_ff, base.num_layers, base.num_heads, base.vocab_size) == (768, 3072, 12, 12, 32128)
    v11 = backbone_config("t5-v1_1-base")
    assert v11.is_gated_act and v11.d_ff == 2048
    model = build_model("t5-tiny", "hyperprompt", TASKS)
    assert model.t5.config.d_model == 64


@pytest.mark.parametrize("ff,tied", [("relu", True), ("gated-gelu", False)])  # T5 and T5 v1.1
def test_a_new_backbone_has_the_stock_constructors_initial_weights_in_distribution(ff, tied):
    """`new_t5` skips torch's default initialisation (T5's own overwrites it): every weight must still be drawn as
    the stock `T5ForConditionalGeneration(config)` draws it (same mean and spread per tensor, constant ones equal),
    nothing left uninitialised, the embeddings tied as the stock model's, and a seed gives the same weights again."""
    from transformers import T5Config, T5ForConditionalGeneration

    from hpsearch.model.backbones import new_t5

    config = T5Config(d_model=128, d_ff=512, num_layers=2, num_heads=4, d_kv=32, vocab_size=3000,
                      feed_forward_proj=ff, tie_word_embeddings=tied)
    torch.manual_seed(0)
    stock = T5ForConditionalGeneration(config)
    torch.manual_seed(1)
    ours = new_t5(config)
    torch.manual_seed(1)
    again = new_t5(config)
    for model in (stock, ours):  # transformers 5 ties T5's output layer whatever the config says
        assert model.lm_head.weight is model.shared.weight and model.encoder.embed_tokens.weight is model.shared.weight
    stock_params = dict(stock.named_parameters())
    assert [n for n, _ in ours.named_parameters()] == list(stock_params)
    for (name, w), w_again in zip(ours.named_parameters(), again.parameters()):
        ref, n = stock_params[name].detach(), w.numel()
        assert torch.equal(w, w_again), name
        assert torch.isfinite(w).all(), name
        if ref.std() == 0:  # layer norms: ones
            assert torch.equal(w, ref), name
            continue
        sigma = ref.std().item()  # a sample's std and mean vary by sigma/sqrt(2n) and sigma/sqrt(n)
        assert abs(w.std().item() / sigma - 1) < 6 / (2 * n) ** 0.5, name
        assert abs(w.mean().item() - ref.mean().item()) < 6 * sigma / n ** 0.5, name


def test_a_process_that_keeps_backbones_copies_the_same_one_and_draws_the_same_after(monkeypatch):
    """`keep_random_backbones` (a study's reused actors and ranks): the next backbone of the same config from the
    same seed is a copy of the kept initial weights, T5's initialisation not run again, and leaves the RNG where
    building it would have; the kept copy is the initial weights, not the trained model's; another seed or config
    is built and kept instead; the meta device and a backbone too large for this rank's share of the host's free
    memory keep nothing."""
    import psutil
    from transformers import PreTrainedModel

    from hpsearch.model import backbones

    inits = []
    real_init = PreTrainedModel.init_weights
    monkeypatch.setattr(PreTrainedModel, "init_weights", lambda self: (inits.append(1), real_init(self))[1])

    def build(seed, backbone="t5-tiny"):
        torch.manual_seed(seed)
        model = backbones.load_backbone(backbone)
        return model, torch.rand(5)  # the next draws

    def same(a, b):
        return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))

    fresh, fresh_next = build(7)  # not kept: T5's initialisation
    assert inits == [1] and backbones._kept is None
    backbones.keep_random_backbones()
    try:
        first, first_next = build(7)
        with torch.no_grad():
            first.shared.weight.add_(1.0)  # a trial trains its model in place
        copies = backbones.copies
        second, second_next = build(7)
        assert backbones.copies == copies + 1 and len(inits) == 2  # a copy: no initialisation
        assert same(second, fresh) and torch.equal(second_next, fresh_next) and torch.equal(first_next, fresh_next)
        tied = second.shared.weight
        assert second.lm_head.weight is tied and second.encoder.embed_tokens.weight is tied
        with torch.no_grad():
            second.shared.weight.add_(1.0)
        assert same(build(7)[0], fresh)  # the copy shares nothing with what is kept
        other, _ = build(8)  # another seed: initialised, and kept in place of the first
        assert len(inits) == 3 and not same(other, fresh) and same(build(8)[0], other) and len(inits) == 3
        with torch.device("meta"):
            backbones.load_backbone("t5-tiny")  # a structure only: neither copied nor kept
        assert same(build(8)[0], other) and len(inits) == 4
        assert not same(build(8, "t5-mini")[0], other) and len(inits) == 5  # another config
        monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": 100_000_000})())
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "10")  # a tenth of 100 MB shared by 10 ranks: t5-tiny's 2 MB is more
        build(7)
        assert backbones._kept is None and len(inits) == 6
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        build(7)
        assert backbones._kept is not None and same(build(7)[0], fresh) and len(inits) == 7
    finally:
        backbones.keep_random_backbones(False)


@pytest.mark.parametrize("bad,match", [
    (dict(variant="shared"), "model.variant"),
    (dict(placement="middle"), "model.placement"),
    (dict(prompt_length_encoder=-1), "model.prompt_length_encoder"),
    (dict(bottleneck=0), "model.bottleneck"),
    (dict(prompt_lenght=3), "model.prompt_lenght: unknown field"),
])
def test_bad_hparams_are_config_errors(bad, match):
    with pytest.raises(ConfigError, match=match):
        build_model(tiny_config(), "hyperprompt", TASKS, **bad)


@pytest.mark.parametrize("task_ids", [[0, 1, 2, 3], [2], [0, 2], [[0, 1, 2, 0]]])
def test_bad_task_ids_are_an_error(batch, task_ids):
    model = hp()
    with pytest.raises(ValueError, match="task_ids"):
        model(**{**batch, "task_ids": torch.tensor(task_ids)})
    with pytest.raises(ValueError, match="task_ids"):
        model.generate(batch["input_ids"], batch["attention_mask"], task_ids=torch.tensor(task_ids))


def test_task_param_export_is_not_a_loadable_model(tmp_path):
    from hpsearch.model import save_task_params
    save_task_params(hp(), tmp_path)
    with pytest.raises(ConfigError, match="task-parameter export"):
        build_model(str(tmp_path))


def test_full_export_round_trip(tmp_path, batch):
    from safetensors.torch import load_file

    from hpsearch.model import save_export, save_task_params
    model = hp(variant="global", hypernet_bias=True)
    save_export(model, tmp_path / "full")
    again = build_model(str(tmp_path / "full")).eval()
    assert again.cfg == model.cfg and again.tasks == model.tasks
    assert torch.equal(logits(again, batch), logits(model, batch))
    save_task_params(model, tmp_path / "task")
    saved = load_file(str(tmp_path / "task" / "task_params.safetensors"))
    assert sum(t.numel() for t in saved.values()) == model.extra_parameters()["total"]
    assert not any(k.startswith("t5.") for k in saved)


TIED = {"t5.encoder.embed_tokens.weight", "t5.decoder.embed_tokens.weight", "t5.lm_head.weight"}


def test_full_export_writes_tied_weights_once(tmp_path, batch):
    """T5's token embeddings are one tensor under four names (transformers ties `lm_head` to `shared` for every
    T5, v1.1 too): written once, under the first, with the others named in the file's metadata; loading puts them
    back."""
    from hpsearch.model import save_export
    model = hp()
    save_export(model, tmp_path / "full")
    with safe_open(str(tmp_path / "full" / "model.safetensors"), "pt") as f:
        names, aliases = set(f.keys()), json.loads(f.metadata()["hpsearch_tied"])
        stored = sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in names)
    assert aliases == {name: "t5.shared.weight" for name in TIED}
    assert names == set(model.state_dict()) - TIED
    unique = {p.data_ptr(): p.numel() for p in [*model.parameters(), *model.buffers()]}
    assert stored == sum(unique.values())  # each tensor's numbers once
    again = build_model(str(tmp_path / "full")).eval()
    assert torch.equal(again.t5.lm_head.weight, model.t5.lm_head.weight)
    assert again.t5.lm_head.weight is again.t5.shared.weight
    assert torch.equal(logits(again, batch), logits(model, batch))


def test_export_of_parameters_in_one_flat_buffer(tmp_path, batch):
    """DeepSpeed's ZeRO-1/2 make every parameter a view of one flat buffer: none of them is taken for a tied
    weight (each is written), and the export loads back to the same model."""
    from hpsearch.model import save_export
    model = hp()
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    save_export(model, tmp_path / "full")
    with safe_open(str(tmp_path / "full" / "model.safetensors"), "pt") as f:
        assert set(json.loads(f.metadata()["hpsearch_tied"])) == TIED
        assert set(f.keys()) == set(model.state_dict()) - TIED
    again = build_model(str(tmp_path / "full")).eval()
    assert torch.equal(logits(again, batch), logits(model, batch))


# ---- the generators against the paper's equations, from the raw parameters ------------------------------------------
def hand_hyper_prompts(model):
    """P_k = U_k(ReLU(D_k P_tau)), P_v = U_v(ReLU(D_v P_tau)) per prompted block, written from the paper.

    share: one (D, U) pair per block; sep: one per block and task; global: I = W2 ReLU(W1 [k_tau; z_m]) and
    (D, U) = H I, H's output read as [D (d x b) | U (b x d_i) | D's bias (b) | U's bias (d_i)].
    Returns {(side, layer): (keys, values)}, each [T, heads, l, d_kv].
    """
    cfg, c = model.cfg, model.t5.config
    d, heads, dkv, b, bias = c.d_model, c.num_heads, c.d_kv, cfg.bottleneck, cfg.hypernet_bias
    di = heads * dkv
    lengths = {"encoder": cfg.prompt_length_encoder, "decoder": cfg.prompt_length_decoder}
    sides = {"encoder": ("encoder",), "decoder": ("decoder",), "both": ("encoder", "decoder")}[cfg.placement]
    # the paper's P_tau: one per task, one set per prompted side only when the two sides' lengths differ
    one_set = len(sides) == 2 and lengths["encoder"] == lengths["decoder"]
    assert set(model.global_prompts) == ({"shared"} if one_set else set(sides))
    blocks = [(s, i) for s in ("encoder", "decoder") if s in sides for i in range(len(getattr(model.t5, s).block))]
    relu = torch.relu
    out = {}
    for m, (side, i) in enumerate(blocks):
        keys, values = [], []
        for task in range(len(model.tasks)):
            P = model.global_prompts["shared" if one_set else side].weight[task].view(lengths[side], d)
            if cfg.variant == "global":
                g = model.global_hypernets
                x = torch.cat([g.task_embeddings.weight[task], g.layer_embeddings.weight[m]])
                w1, w2 = g.projection[0], g.projection[2]
                I = w2.weight @ relu(w1.weight @ x + (w1.bias if bias else 0)) + (w2.bias if bias else 0)
                nets = []
                for H in (g.hyper_k, g.hyper_v):
                    w = H.weight @ I + (H.bias if bias else 0)
                    D, U = w[:d * b].view(d, b), w[d * b: d * b + b * di].view(b, di)
                    cD = w[d * b + b * di: d * b + b * di + b] if bias else 0
                    cU = w[d * b + b * di + b:] if bias else 0
                    nets.append((D, cD, U, cU))
            else:
                h = model.local_hypernets[side]  # weights [keys/values, block, copy, d_in, d_out]
                j = 0 if cfg.variant == "share" else task
                nets = [(h.down[kv, i, j], h.down_bias[kv, i, j, 0] if bias else 0, h.up[kv, i, j],
                         h.up_bias[kv, i, j, 0] if bias else 0) for kv in (0, 1)]
            k, v = (relu(P @ D + cD) @ U + cU for D, cD, U, cU in nets)
            keys.append(k.view(-1, heads, dkv).transpose(0, 1))
            values.append(v.view(-1, heads, dkv).transpose(0, 1))
        out[(side, i)] = (torch.stack(keys), torch.stack(values))
    return out


@pytest.mark.parametrize("variant,bias,placement,l_dec", [(v, b, "both", 2) for v in VARIANTS for b in (False, True)]
                         + [("global", False, "decoder", 2), ("sep", True, "encoder", 2)]
                         + [(v, False, "both", 3) for v in VARIANTS])  # equal lengths: one P_tau for both sides
def test_generated_prompts_equal_the_papers_equations(variant, bias, placement, l_dec, batch):
    model = hp(variant=variant, placement=placement, hypernet_bias=bias, l_dec=l_dec)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # biases start at zero: move every generator parameter so each one counts
        for name, p in model.named_parameters():
            if not name.startswith("t5."):
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
        expected = hand_hyper_prompts(model)
        table = model.generate_task_tensors()
        rows = model.hyper_prompts(batch["task_ids"])
    assert set(table) == set(expected) == set(rows)
    for key, (k, v) in expected.items():
        assert (table[key][0] - k).abs().max() <= 1e-5, key
        assert (table[key][1] - v).abs().max() <= 1e-5, key
        assert (rows[key][0] - k[batch["task_ids"]]).abs().max() <= 1e-5
        assert (k - v).abs().max() > 1e-3  # keys and values come from different networks


def test_global_prompts_are_counted_once_and_an_unprompted_side_has_no_generators():
    d, T = tiny_config().d_model, len(TASKS)
    for variant in VARIANTS:
        same = hp(variant=variant, placement="both", l_enc=3, l_dec=3)
        assert same.extra_parameters()["global_prompts"] == d * 3 * T  # the paper's d*l*T, not d*(l + l)*T
        # a placed side of length 0 has no prompts: no generators (they would never train yet count)
        half = hp(variant=variant, placement="both", l_enc=3, l_dec=0)
        alone = hp(variant=variant, placement="encoder", l_enc=3, l_dec=0)
        assert half.cfg.prompted_sides() == ("encoder",)
        assert {n: p.shape for n, p in half.named_parameters() if not n.startswith("t5.")} == \
            {n: p.shape for n, p in alone.named_parameters() if not n.startswith("t5.")}
        assert half.extra_parameters() == alone.extra_parameters()
        assert half.parameter_formula().total == half.extra_parameters()["total"]
        none = hp(variant=variant, placement="both", l_enc=0, l_dec=0)
        assert none.extra_parameters()["total"] == 0 == none.parameter_formula().total
    with pytest.raises(ConfigError, match="model.train_task_params_only: every placed side's prompt length is 0"):
        hp(placement="both", l_enc=0, l_dec=0, train_task_params_only=True)


def test_the_attention_bias_is_built_once_per_stack_and_call(batch, monkeypatch):
    """T5 hands every layer of a stack the same mask and position bias: the first prompted layer builds
    [0 | position_bias] + [0 | mask] and the others reuse it (the outputs are covered by the stock-T5 and
    cached-generation tests)."""
    from hpsearch.model import attention

    built = []
    real = attention._bias
    monkeypatch.setattr(attention, "_bias", lambda module, *a: built.append(module.is_decoder) or real(module, *a))
    model = hp(variant="global").eval()
    layers = model.t5.config.num_layers
    assert layers > 1
    with torch.no_grad():
        model(**batch)
    assert sorted(built) == [False, True, True]  # once per stack (encoder, decoder, cross-attention), not per layer
    built.clear()
    with torch.no_grad():
        model.generate(batch["input_ids"], batch["attention_mask"], task_ids=batch["task_ids"], max_new_tokens=3)
    assert built.count(False) == 1 and built.count(True) <= 2 * 3  # the encoder once; decoder and cross once a step

