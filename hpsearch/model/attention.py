"""The attention hook: key/value prompts inside T5 attention (transformers 5.x `AttentionInterface`).

Every T5 attention module of a wrapped model calls `prompted_attention`. A self-attention module that carries
prompts (`module.hp_prompt = (keys, values)`, each [batch | 1, heads, l, d_kv]) attends over [prompts; tokens]:

    softmax(Q [P_k; K]^T + [0 | position_bias] + [0 | mask]) [P_v; V]        (T5: no 1/sqrt(d) scaling)

Prompt columns get zero relative-position bias and are never masked; padding and the causal mask still apply
to the real tokens. The KV cache is updated before this function runs. In a forward without a cache the prompts
are concatenated in front of the keys and values here. Generation gets a cache (`prompt_cache`) whose prompted
decoder layers hold their prompts in front of the cached tokens from the first step on, so a decoding step
appends its token once instead of copying the prompts and every cached token again; the cache counts tokens only,
so generation's positions, masks and T5's relative-position bias stay the tokens'. A cross-attention with prompts
(prefix tuning's) gets them in front of the encoder's keys and values at every call, decoding steps too (its cache
holds the encoder's). Modules without prompts compute plain T5 attention, so an unprompted model equals stock T5.

A mask function is registered under the same name: without it transformers hands a custom attention
function no padding mask at all. It is transformers' eager mask, except that on an accelerator the mask is always
built: transformers skips it when no token is padded, which it finds out by reading the mask on the host
(`padding_mask.all()`), a device synchronisation in every forward (the encoder's mask and the cross-attention's).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache, DynamicLayer, EncoderDecoderCache
from transformers.masking_utils import AttentionMaskInterface, eager_mask

ATTN_NAME = "hyperprompt"
SIDES = ("encoder", "decoder")
CROSS = "cross"  # prompts keyed (CROSS, layer) go to the decoder's cross-attentions (prefix tuning)


def _additive_mask(module, mask, q_len: int, k_len: int, dtype, device) -> torch.Tensor:
    """The mask as an additive float tensor [batch|1, 1, q_len, k_len]; builds the causal mask when absent."""
    neg = torch.finfo(dtype).min
    if mask is None:
        if getattr(module, "is_causal", False):  # decoder self-attention: queries are the last q_len keys
            allowed = torch.arange(k_len, device=device)[None, :] <= torch.arange(q_len, device=device)[:, None] \
                + (k_len - q_len)
            return torch.where(allowed, 0.0, neg).to(dtype)[None, None]
        return torch.zeros(1, 1, 1, k_len, dtype=dtype, device=device)
    if mask.dtype == torch.bool:
        return torch.where(mask, 0.0, neg).to(dtype)
    return mask[..., :k_len].to(dtype)


def expand_rows(t: torch.Tensor, batch: int) -> torch.Tensor:
    """Per-example tensors (prompts, task ids) follow beam search, which repeats each example (repeat_interleave);
    one row shared by the whole batch (a one-task batch's prompts) is a view, not copies."""
    if t.shape[0] == batch:
        return t
    if t.shape[0] == 1:
        return t.expand(batch, *t.shape[1:])
    if not t.shape[0] or batch % t.shape[0]:
        raise RuntimeError(f"per-example batch {t.shape[0]} does not divide the running batch {batch}")
    return t.repeat_interleave(batch // t.shape[0], dim=0)


def _bias(module, attention_mask, position_bias, q_len: int, k_len: int, n_prompt: int, batch: int, dtype, device):
    """[0 | position_bias] + [0 | mask], expanded to the batch."""
    bias = _additive_mask(module, attention_mask, q_len, k_len, dtype, device)
    if position_bias is not None:
        bias = bias + position_bias[..., -q_len:, :k_len]
    if n_prompt:
        bias = F.pad(bias, (n_prompt, 0), value=0.0)  # prompt columns: no position bias, never masked
    return bias.expand(batch, -1, q_len, -1)


def _stack_bias(module, attention_mask, position_bias, q_len, k_len, n_prompt, batch, dtype, device):
    """The bias, built once per stack and call: every layer of a stack gets the same mask and position-bias tensors
    (T5 computes the bias in its first layer and hands it on), so a layer reuses the bias the previous one built
    when the inputs are the very same objects (held by the cache, so their identity cannot be reused)."""
    cache = getattr(module, "hp_bias_cache", None)
    if cache is None:
        return _bias(module, attention_mask, position_bias, q_len, k_len, n_prompt, batch, dtype, device)
    slot = module.hp_bias_slot
    inputs = (attention_mask, position_bias, q_len, k_len, n_prompt, batch, dtype,
              bool(getattr(module, "is_causal", False)))
    hit = cache.get(slot)
    if hit is not None and len(hit[0]) == len(inputs) and all(
            a is b if isinstance(a, torch.Tensor) or a is None else a == b for a, b in zip(hit[0], inputs)):
        return hit[1]
    bias = _bias(module, attention_mask, position_bias, q_len, k_len, n_prompt, batch, dtype, device)
    cache[slot] = (inputs, bias)  # one slot per stack: cached decoding's new tensors each step replace it
    return bias


def prompted_attention(module, query, key, value, attention_mask, scaling=1.0, dropout=0.0,
                       position_bias=None, **kwargs):
    batch, _, q_len, _ = query.shape
    k_len = key.shape[2]
    prompt = getattr(module, "hp_prompt", None)
    n_prompt = getattr(module, "hp_prompts_in_cache", 0)  # set by this call's cache update (PromptCacheLayer)
    if n_prompt:
        module.hp_prompts_in_cache = 0
        k_len -= n_prompt  # the keys already start with the prompts
    elif prompt is not None and prompt[0].shape[2] > 0:
        pk, pv = (expand_rows(p.to(key.dtype), batch) for p in prompt)
        n_prompt = pk.shape[2]
        key = torch.cat([pk, key], dim=2)
        value = torch.cat([pv, value], dim=2)
    bias = _stack_bias(module, attention_mask, position_bias, q_len, k_len, n_prompt, batch, query.dtype,
                       query.device)
    recorder = getattr(module, "hp_recorder", None)
    if recorder is not None:  # attention statistics: explicit probabilities (eager path)
        probs = torch.softmax(query @ key.transpose(-1, -2) * scaling + bias, dim=-1)
        recorder(probs, n_prompt, bias)
        out = probs @ value
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias,
                                             dropout_p=dropout if module.training else 0.0, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


class PromptCacheLayer(DynamicLayer):
    """A prompted decoder self-attention's KV cache: the layer's prompts ([batch | 1, heads, l, d_kv], following
    beam search's rows) go in front at the first update, then each step appends its tokens. `get_seq_length` (and
    so generation's cache positions, the causal mask and T5's relative positions) counts the tokens only; each
    update tells its module that the keys it returns start with the l prompt columns."""

    def __init__(self, module, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.module, self.prompt, self.n_prompt = module, (keys, values), keys.shape[2]

    def update(self, key_states, value_states, *args, **kwargs):
        if self.get_seq_length() == 0:
            self.lazy_initialization(key_states, value_states)
            pk, pv = (expand_rows(p.to(key_states.dtype), key_states.shape[0]) for p in self.prompt)
            self.keys, self.values = torch.cat([pk, key_states], dim=2), torch.cat([pv, value_states], dim=2)
        else:
            self.keys = torch.cat([self.keys, key_states], dim=2)
            self.values = torch.cat([self.values, value_states], dim=2)
        self.module.hp_prompts_in_cache = self.n_prompt
        return self.keys, self.values

    def get_seq_length(self) -> int:
        if not self.is_initialized or self.keys.numel() == 0:
            return 0
        return self.keys.shape[2] - self.n_prompt

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0 and -tokens_to_remove >= self.get_seq_length():
            self.reset()  # every token: the next update puts the prompts in front again
        else:
            super().crop(tokens_to_remove)


def prompt_cache(t5) -> EncoderDecoderCache | None:
    """A generation cache whose prompted decoder self-attentions (their attached `hp_prompt`) hold the prompts
    (`PromptCacheLayer`); None when no decoder self-attention has prompts."""
    modules = [block.layer[0].SelfAttention for block in t5.decoder.block]
    prompts = [getattr(m, "hp_prompt", None) for m in modules]
    if not any(p is not None and p[0].shape[2] > 0 for p in prompts):
        return None
    self_attention = DynamicCache()
    self_attention.layers = [PromptCacheLayer(m, *p) if p is not None and p[0].shape[2] > 0 else DynamicLayer()
                             for m, p in zip(modules, prompts)]
    return EncoderDecoderCache(self_attention, DynamicCache())


def prompted_mask(*args, attention_mask=None, allow_is_bidirectional_skip: bool = False, **kwargs):
    """transformers' eager mask; its skip of an all-unpadded bidirectional mask only where testing for it needs no
    device synchronisation (CPU tensors). Otherwise the mask is built: the same additive bias, all zeros."""
    skip = allow_is_bidirectional_skip and (attention_mask is None or attention_mask.device.type == "cpu")
    return eager_mask(*args, attention_mask=attention_mask, allow_is_bidirectional_skip=skip, **kwargs)


AttentionInterface.register(ATTN_NAME, prompted_attention)
AttentionMaskInterface.register(ATTN_NAME, prompted_mask)


def self_attention_modules(t5) -> dict[tuple[str, int], torch.nn.Module]:
    """{(side, layer): T5Attention} for every self-attention of the encoder and decoder stacks."""
    return {(side, i): block.layer[0].SelfAttention
            for side in SIDES for i, block in enumerate(getattr(t5, side).block)}


def use_prompted_attention(t5) -> None:
    t5.set_attn_implementation(ATTN_NAME)


@contextmanager
def attach(t5, prompts: dict | None = None, recorders: dict | None = None):
    """Attach per-layer prompts (and statistic recorders) to the self-attention modules for one call: prompts keyed
    (side, layer), and (CROSS, layer) for a decoder layer's cross-attention."""
    modules = self_attention_modules(t5)
    cross = [block.layer[1].EncDecAttention for block in t5.decoder.block]
    cache: dict = {}  # the attention bias of each stack, shared by its layers for this call (see _stack_bias)
    try:
        for key, module in modules.items():
            module.hp_prompt = (prompts or {}).get(key)
            module.hp_recorder = (recorders or {}).get(key)
            module.hp_bias_cache, module.hp_bias_slot = cache, key[0]
        for i, module in enumerate(cross):
            module.hp_prompt = (prompts or {}).get((CROSS, i))
            module.hp_bias_cache, module.hp_bias_slot = cache, CROSS
        yield
    finally:
        for module in (*modules.values(), *cross):
            module.hp_prompt = None
            module.hp_recorder = None
            module.hp_bias_cache = None
            module.hp_prompts_in_cache = 0
