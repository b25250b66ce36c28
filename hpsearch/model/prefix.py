"""Prefix tuning (Li & Liang, ACL 2021), multi-task: per task and layer, l key/value prefixes in every attention.

As Li & Liang's encoder-decoder code (and MAM's, jxhe/unify-parameter-efficient-tuning), three kinds of attention
get prefixes, each from its own reparameterisation: the encoder's self-attentions, the decoder's self-attentions and
the decoder's cross-attentions (group g, M_g attentions, in layer order). Attention m of group g attends for task
tau over [P_k^{tau,m}; K] and [P_v^{tau,m}; V], with one embedding row per task and prefix position i < l and one
MLP per group shared by all tasks:

    [P_k^{tau,0} | P_v^{tau,0} | ... | P_v^{tau,M_g-1}][i] = W2_g tanh(W1_g E_g[tau*l + i] + c1_g) + c2_g

E_g: Embedding(T*l, d), W1_g: d -> h (`prefix_hidden`), W2_g: h -> M_g*2*d_i (d_i = heads * d_kv; each d_i slice
laid out [heads, d_kv] as T5's keys and values). The MLPs only ease training: `freeze_task_params()` (the base
class's precomputation) keeps the computed prefixes, [T, heads, l, d_kv] per attention, so inference skips them.

The prefixes enter through HyperPrompt's attention hook (attention.py): prefix columns get zero relative-position
bias and are never masked; a cross-attention's prefixes go in front of the encoder's keys and values at every call
(also each decoding step: the cache holds the encoder's). l = `prompt_length` (default 16); h = `prefix_hidden`
(default 64, a t5-tiny-sized MLP; Li & Liang used 512). Init as Li & Liang's code: E ~ N(0, 1), the MLP
nn.Linear's default.

Extra parameters (T tasks, l prefix length, d model width, h MLP hidden, M = L_enc + 2*L_dec prefixed attentions,
d_i = heads * d_kv; three groups):
    3*T*l*d + 3*(d + 1)*h + (h + 1)*2*M*d_i

The embeddings and the MLPs run on every call for the tasks the batch holds (`generate_task_tensors`; all tasks
once when frozen for inference): every ZeRO-3 rank calls the same modules, with other rows, and nothing reads a
parameter outside its module's forward.
"""
from __future__ import annotations

import torch
from torch import nn

from hpsearch.model.attention import CROSS, self_attention_modules
from hpsearch.model.base import Formula, MultiTaskT5, TaskContext

PREFIX_FORMULA = "3*T*l*d + 3*(d + 1)*h + (h + 1)*2*M*d_i"
GROUPS = ("encoder", "decoder", CROSS)  # self-attentions of each stack, then the decoder's cross-attentions


class PrefixT5(MultiTaskT5):
    """Multi-task T5 whose self-attentions get per-task key/value prefixes from a reparameterisation MLP."""

    def __init__(self, t5, tasks, cfg):
        super().__init__(t5, tasks, cfg)
        c = t5.config
        self.n_heads, self.d_kv = c.num_heads, c.d_kv
        self.groups = {side: [key for key in self_attention_modules(t5) if key[0] == side] for side in GROUPS[:2]}
        self.groups[CROSS] = [(CROSS, i) for i in range(len(t5.decoder.block))]
        self.layer_keys = [key for keys in self.groups.values() for key in keys]  # every prefixed attention
        self.prefix_length = self.length_of(cfg)
        self.prefix_embeddings = nn.ModuleDict()
        self.prefix_mlps = nn.ModuleDict()
        for group, keys in self.groups.items():
            self.prefix_embeddings[group] = nn.Embedding(len(self.tasks) * self.prefix_length, c.d_model)
            nn.init.normal_(self.prefix_embeddings[group].weight, std=1.0)
            self.prefix_mlps[group] = nn.Sequential(nn.Linear(c.d_model, cfg.prefix_hidden), nn.Tanh(),
                                                    nn.Linear(cfg.prefix_hidden, len(keys) * 2 * c.num_heads * c.d_kv))

    @staticmethod
    def length_of(cfg) -> int:
        """l, the prefix length per task and layer."""
        return cfg.prompt_length

    def generate_task_tensors(self, device=None, tasks=None) -> dict:
        """{(side, layer): (keys, values)}, each [T, heads, l, d_kv], for `tasks` (None: every task)."""
        device = device if device is not None else next(self.t5.parameters()).device
        ids = tasks.to(device) if tasks is not None else torch.arange(len(self.tasks), device=device)
        n_tasks, l = ids.numel(), self.prefix_length
        index = (ids[:, None] * l + torch.arange(l, device=device)).flatten()
        table = {}
        for group, keys in self.groups.items():
            rows = self.prefix_embeddings[group](index)                                        # [T*l, d]
            out = self.prefix_mlps[group](rows).view(n_tasks, l, len(keys), 2, self.n_heads, self.d_kv)
            # unbind, not a slice per layer: a slice's backward would allocate a zeroed gradient of all of `out`
            per_layer = out.permute(2, 3, 0, 4, 1, 5).unbind(0)                        # M_g x [2, T, heads, l, d_kv]
            table.update({key: tuple(kv.unbind(0)) for key, kv in zip(keys, per_layer)})
        return table

    def attention_prompts(self, ctx: TaskContext) -> dict:
        """Each row's prefixes: {(side, layer): (keys, values)}, each [batch | 1, heads, l, d_kv]."""
        return {key: ctx.rows(key) for key in self.layer_keys}

    def prefix_formula(self) -> Formula:
        c, T, l, h, M = self.t5.config, len(self.tasks), self.prefix_length, self.cfg.prefix_hidden, \
            len(self.layer_keys)
        d, di, G = c.d_model, c.num_heads * c.d_kv, len(self.groups)
        return Formula(PREFIX_FORMULA, dict(T=T, l=l, d=d, h=h, M=M, d_i=di),
                       G * T * l * d + G * (d + 1) * h + (h + 1) * 2 * M * di)

    def parameter_formula(self) -> Formula:
        return self.prefix_formula()
