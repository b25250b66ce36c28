"""MAM adapter (He, Zhou, Ma, Berg-Kirkpatrick, Neubig, ICLR 2022, "Mix-And-Match"), multi-task.

Prefix tuning on every attention, the decoder's cross-attentions too (prefix.py's prefixes and its three
reparameterisation MLPs, l = `mam_prefix_length`, the paper's 30) plus, in every block of both stacks, a scaled
parallel adapter per task beside the feed-forward:

    h' = h + dropout(FFN(LN h)) + s * (U_tau ReLU(D_tau LN h + c_tau) + u_tau)    D: d -> b, U: b -> d, s = `mam_scale`

(b = `bottleneck`; the paper: s = 4, b = 512 on XSum / MT, GLUE runs l = 16, b = 16, s = 2). The branch enters
through the base class's `residual_branch` hook on the feed-forward sublayer: after T5's dropout, beside the
residual, as upstream adds it after the FFN's dropout (through T5's dropout, training dropped and rescaled the
branch with the FFN's output). Adapter init as the
paper's code ("lora" init): D kaiming-uniform (a = sqrt 5), U and the biases zero, so a new adapter adds nothing.

Extra parameters (the prefix's, with l = mam_prefix_length, plus T * B adapters, B = L_enc + L_dec blocks):
    3*T*l*d + 3*(d + 1)*h + (h + 1)*2*M*d_i + T*B*(2*d*b + b + d),  M = L_enc + 2*L_dec

ZeRO-3: the prefix generators run on every call, for the batch's tasks (prefix.py); each feed-forward's adapter
is one module holding all tasks' weights, called on every forward, indexing its parameters inside its own forward.
"""
from __future__ import annotations

import torch
from torch import nn

from hpsearch.model.adapter import row_bottleneck
from hpsearch.model.attention import self_attention_modules
from hpsearch.model.base import Formula, Site, TaskContext
from hpsearch.model.prefix import PREFIX_FORMULA, PrefixT5


class ParallelAdapter(nn.Module):
    """One feed-forward's parallel adapters, one per task: x -> s * (U_tau ReLU(D_tau x + c_tau) + u_tau)."""

    def __init__(self, num_tasks: int, d_model: int, bottleneck: int, scale: float):
        super().__init__()
        self.scale = scale
        self.down_weight = nn.Parameter(torch.empty(num_tasks, bottleneck, d_model))
        self.down_bias = nn.Parameter(torch.zeros(num_tasks, bottleneck))
        self.up_weight = nn.Parameter(torch.zeros(num_tasks, d_model, bottleneck))
        self.up_bias = nn.Parameter(torch.zeros(num_tasks, d_model))
        nn.init.uniform_(self.down_weight, -d_model ** -0.5, d_model ** -0.5)  # kaiming_uniform_(a=sqrt(5))

    def forward(self, x: torch.Tensor, ctx: TaskContext) -> torch.Tensor:
        weights = (ctx.select(w, x.shape[0]).to(x.dtype) for w in (self.down_weight, self.down_bias,
                                                                   self.up_weight, self.up_bias))
        return row_bottleneck(x, *weights, scale=self.scale)


class MAMT5(PrefixT5):
    """Multi-task T5 with per-task prefixes on self-attention and scaled parallel adapters beside the FFNs."""

    def __init__(self, t5, tasks, cfg):
        super().__init__(t5, tasks, cfg)
        self.blocks = list(self_attention_modules(t5))  # (side, layer) of every block: one FFN each
        self.adapters = nn.ModuleDict({
            f"{side}_{i}": ParallelAdapter(len(self.tasks), t5.config.d_model, cfg.bottleneck, cfg.mam_scale)
            for side, i in self.blocks})

    @staticmethod
    def length_of(cfg) -> int:
        return cfg.mam_prefix_length

    def hooks_site(self, site: Site) -> bool:
        return site[2] == "ffn_residual"  # a parallel adapter beside each feed-forward sublayer, nothing elsewhere

    def residual_branch(self, ctx: TaskContext, site: Site, x: torch.Tensor) -> torch.Tensor | None:
        side, layer, kind = site
        if kind != "ffn_residual":
            return None
        return self.adapters[f"{side}_{layer}"](x, ctx)

    def parameter_formula(self) -> Formula:
        prefix = self.prefix_formula()
        T, B, d, b = len(self.tasks), len(self.blocks), self.t5.config.d_model, self.cfg.bottleneck
        return Formula(f"{PREFIX_FORMULA} + T*B*(2*d*b + b + d)", {**prefix.terms, "b": b, "B": B},
                       prefix.total + T * B * (2 * d * b + b + d))
