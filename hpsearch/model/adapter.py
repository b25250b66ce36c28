"""Adapter: per-task bottleneck adapters (Houlsby et al. 2019) made multi-task as in HyperFormer's baseline.

In every block of both stacks, at the self-attention sublayer and/or the feed-forward sublayer
(`adapter_sites`: attention | ffn | both), with y = sublayer(LN h) the sublayer's output and x = LN h its input:

    sequential:  h' = h + dropout(y + s * (U_tau(ReLU(D_tau y + c_tau)) + u_tau))     D_tau: d -> b, U_tau: b -> d
    parallel:    h' = h + dropout(y) + s * (U_tau(ReLU(D_tau x + c_tau)) + u_tau)     per task tau

(`adapter_insertion`, default sequential: HyperFormer's placement, the adapter on the sublayer's output before
T5's dropout and residual; the issue's form: ReLU, no layer norm. The parallel form and the composition scale
s = `adapter_scale`, default 1, are the unified view's axes (He et al. 2022): parallel insertion and a scaled sum
did better there. Its parallel adapter is added beside the residual, after the sublayer's dropout, as in its code
and MAM's: the base class's `residual_branch` hook.) Weights start at N(0, 0.01^2) and biases at
zero as in HyperFormer's code, so a new adapter is close to the identity.

Extra parameters (T tasks, S adapted sublayers = (L_enc + L_dec) * (2 if both else 1), b = `bottleneck`):
    T * S * (2*d*b + b + d)

Each site is one module holding all tasks' weights ([T, ...]); it is called on every forward whatever tasks the
batch holds, and indexes its own parameters per row inside its own forward (ZeRO-3 safe; a one-task batch takes its
task's row once, `TaskContext.select`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpsearch.model.base import Formula, MultiTaskT5, Site, TaskContext, row_linear, sublayer_modules


def normal_linear(d_in: int, d_out: int, std: float = 1e-2) -> nn.Linear:
    """nn.Linear with weights N(0, std^2) and zero bias (HyperFormer's init of its hypernetworks)."""
    layer = nn.Linear(d_in, d_out)
    nn.init.normal_(layer.weight, std=std)
    nn.init.zeros_(layer.bias)
    return layer


def row_bottleneck(y: torch.Tensor, down_w, down_b, up_w, up_b, scale: float = 1.0) -> torch.Tensor:
    """s * (U(ReLU(D y + c)) + u) with one adapter per row: y [B, n, d], down_w [B, b, d], down_b [B, b],
    up_w [B, d, b], up_b [B, d] (weights laid out [out, in] as in nn.Linear), or one adapter for every row
    (leading dimension 1). The scale s multiplies U and u (d x (b + 1) numbers), not the output (every token's)."""
    if scale != 1:
        up_w, up_b = up_w * scale, up_b * scale
    return row_linear(F.relu(row_linear(y, down_w, down_b)), up_w, up_b)


class TaskAdapter(nn.Module):
    """The adapters of one sublayer, one per task: y -> s * (U_tau(ReLU(D_tau y + c_tau)) + u_tau) for each row's
    task tau."""

    def __init__(self, num_tasks: int, d_model: int, bottleneck: int, scale: float = 1.0, std: float = 1e-2):
        super().__init__()
        self.scale = scale
        self.down_weight = nn.Parameter(torch.randn(num_tasks, bottleneck, d_model) * std)
        self.down_bias = nn.Parameter(torch.zeros(num_tasks, bottleneck))
        self.up_weight = nn.Parameter(torch.randn(num_tasks, d_model, bottleneck) * std)
        self.up_bias = nn.Parameter(torch.zeros(num_tasks, d_model))

    def forward(self, x: torch.Tensor, ctx: TaskContext) -> torch.Tensor:
        """s * (U_tau(ReLU(D_tau x + c_tau)) + u_tau) for each row's task (the residual is the caller's)."""
        weights = (ctx.select(w, x.shape[0]).to(x.dtype) for w in (self.down_weight, self.down_bias,
                                                                   self.up_weight, self.up_bias))
        return row_bottleneck(x, *weights, scale=self.scale)


ADAPTED_KINDS = {"both": ("attention", "ffn"), "attention": ("attention",), "ffn": ("ffn",)}  # adapter_sites
RESIDUAL = "_residual"  # the base class's residual sites: "attention_residual", "ffn_residual"


def adapted_sites(t5, adapter_sites: str) -> list[Site]:
    return [site for site in sublayer_modules(t5) if site[2] in ADAPTED_KINDS[adapter_sites]]


def site_name(site: Site) -> str:
    return "_".join(map(str, site))


class AdapterT5(MultiTaskT5):
    """Multi-task T5 with per-task bottleneck adapters after its sublayers."""

    def __init__(self, t5, tasks, cfg):
        super().__init__(t5, tasks, cfg)
        self.sites = adapted_sites(t5, cfg.adapter_sites)
        self.adapters = nn.ModuleDict({site_name(s): TaskAdapter(len(self.tasks), t5.config.d_model, cfg.bottleneck,
                                                                         cfg.adapter_scale)
                                       for s in self.sites})

    def hooks_site(self, site: Site) -> bool:
        side, layer, kind = site
        if self.cfg.adapter_insertion == "parallel":  # the whole sublayer (its residual), not its inner module
            return kind.endswith(RESIDUAL) and kind.removesuffix(RESIDUAL) in ADAPTED_KINDS[self.cfg.adapter_sites]
        return kind in ADAPTED_KINDS[self.cfg.adapter_sites]

    def residual_branch(self, ctx: TaskContext, site: Site, x: torch.Tensor) -> torch.Tensor | None:
        side, layer, kind = site
        name = site_name((side, layer, kind.removesuffix(RESIDUAL)))
        if self.cfg.adapter_insertion != "parallel" or name not in self.adapters:
            return None
        return self.adapters[name](x, ctx)

    def adapt_sublayer(self, ctx: TaskContext, site: Site, output: torch.Tensor) -> torch.Tensor:
        name = site_name(site)
        if self.cfg.adapter_insertion != "sequential" or name not in self.adapters:
            return output
        return output + self.adapters[name](output, ctx)

    def parameter_formula(self) -> Formula:
        d, b, T, S = self.t5.config.d_model, self.cfg.bottleneck, len(self.tasks), len(self.sites)
        return Formula("T * S * (2*d*b + b + d)", dict(T=T, S=S, d=d, b=b), T * S * (2 * d * b + b + d))
