"""Prefix tuning (Li & Liang, ACL 2021), multi-task: per task and layer, l key/value prefixes in self-attention.

Every self-attention of both stacks (M = L_enc + L_dec of them, in the order encoder 0 .. L_enc-1, decoder
0 .. L_dec-1) attends for task tau over [P_k^{tau,m}; K] and [P_v^{tau,m}; V]. The prefixes come from Li & Liang's
reparameterisation, one embedding row per task and prefix position i < l, one MLP shared by all tasks:

    [P_k^{tau,0} | P_v^{tau,0} | ... | P_k^{tau,M-1} | P_v^{tau,M-1}][i] = W2 tanh(W1 E[tau*l + i] + c1) + c2

E: Embedding(T*l, d), W1: d -> h (`prefix_hidden`), W2: h -> M*2*d_i (d_i = heads * d_kv; each d_i slice laid
out [heads, d_kv] as T5's keys and values). The MLP only eases training: `freeze_task_params()` (the base
class's precomputation) keeps the computed prefixes, [T, heads, l, d_kv] per layer, so inference skips the MLP.

The prefixes enter through HyperPrompt's attention hook (attention.py): prefix columns get zero relative-position
bias and are never masked. Only self-attention is prefixed (Li & Liang's BART also prefixes cross-attention).
l = `prompt_length` (default 16); h = `prefix_hidden` (default 64, a t5-tiny-sized MLP; Li & Liang used 512).
Init as Li & Liang's code: E ~ N(0, 1), the MLP nn.Linear's default.

Extra parameters (T tasks, l prefix length, d model width, h MLP hidden, M self-attentions, d_i = heads * d_kv):
    T*l*d + (d + 1)*h + (h + 1)*2*M*d_i

The embedding and the MLP run on every call for the tasks the batch holds (`generate_task_tensors`; all tasks
once when frozen for inference): every ZeRO-3 rank calls the same modules, with other rows, and nothing reads a
parameter outside its module's forward.
"""
from __future__ import annotations

import torch
from torch import nn

from hpsearch.model.attention import self_attention_modules
from hpsearch.model.base import Formula, MultiTaskT5, TaskContext

PREFIX_FORMULA = "T*l*d + (d + 1)*h + (h + 1)*2*M*d_i"


class PrefixT5(MultiTaskT5):
    """Multi-task T5 whose self-attentions get per-task key/value prefixes from a reparameterisation MLP."""

    def __init__(self, t5, tasks, cfg):
        super().__init__(t5, tasks, cfg)
        c = t5.config
        self.n_heads, self.d_kv = c.num_heads, c.d_kv
        self.layer_keys = list(self_attention_modules(t5))
        self.prefix_length = self.length_of(cfg)
        self.prefix_embeddings = nn.Embedding(len(self.tasks) * self.prefix_length, c.d_model)
        nn.init.normal_(self.prefix_embeddings.weight, std=1.0)
        self.prefix_mlp = nn.Sequential(nn.Linear(c.d_model, cfg.prefix_hidden), nn.Tanh(),
                                        nn.Linear(cfg.prefix_hidden, len(self.layer_keys) * 2 * c.num_heads * c.d_kv))

    @staticmethod
    def length_of(cfg) -> int:
        """l, the prefix length per task and layer."""
        return cfg.prompt_length

    def generate_task_tensors(self, device=None, tasks=None) -> dict:
        """{(side, layer): (keys, values)}, each [T, heads, l, d_kv], for `tasks` (None: every task)."""
        device = device if device is not None else next(self.t5.parameters()).device
        ids = tasks.to(device) if tasks is not None else torch.arange(len(self.tasks), device=device)
        n_tasks, l = ids.numel(), self.prefix_length
        rows = self.prefix_embeddings((ids[:, None] * l + torch.arange(l, device=device)).flatten())  # [T*l, d]
        out = self.prefix_mlp(rows).view(n_tasks, l, len(self.layer_keys), 2, self.n_heads, self.d_kv)
        # unbind, not a slice per layer: a slice's backward would allocate a zeroed gradient of all of `out`
        per_layer = out.permute(2, 3, 0, 4, 1, 5).unbind(0)                               # M x [2, T, heads, l, d_kv]
        return {key: tuple(kv.unbind(0)) for key, kv in zip(self.layer_keys, per_layer)}

    def attention_prompts(self, ctx: TaskContext) -> dict:
        """Each row's prefixes: {(side, layer): (keys, values)}, each [batch | 1, heads, l, d_kv]."""
        return {key: ctx.rows(key) for key in self.layer_keys}

    def prefix_formula(self) -> Formula:
        c, T, l, h, M = self.t5.config, len(self.tasks), self.prefix_length, self.cfg.prefix_hidden, \
            len(self.layer_keys)
        d, di = c.d_model, c.num_heads * c.d_kv
        return Formula(PREFIX_FORMULA, dict(T=T, l=l, d=d, h=h, M=M, d_i=di),
                       T * l * d + (d + 1) * h + (h + 1) * 2 * M * di)

    def parameter_formula(self) -> Formula:
        return self.prefix_formula()
