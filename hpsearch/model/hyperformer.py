"""HyperFormer++ (Karimi Mahabadi et al., ACL 2021): one hypernetwork per stack generates every adapter.

As its public code does it (rabeehk/hyperformer, `AdapterLayersOneHyperNetController`, the released
`hyperformer++.json`): for task tau, block m of a stack and block type k (0 = feed-forward, 1 = self-attention)

    x     = [task_tau; layer_m; type_k]                        (three embeddings of size t; tasks shared by stacks)
    I     = LayerNorm(W2 ReLU(W1 x + c1) + c2)                  task projector 3t -> h -> p, then LayerNorm(p)
    D, c  = G_D I, g_D I      U, u = G_U I, g_U I               generators: D [b x d], c [b], U [d x b], u [d]
    gamma, beta = G_gamma I, G_beta I                           the conditional LayerNorm after the adapter [d]
    y'    = y + LN_{gamma,beta}(U ReLU(D y + c) + u)            on the self-attention and feed-forward outputs

with y the sublayer output before T5's dropout and residual. The generators (each a Linear with bias) are shared
by all layers and both block types of a stack; each stack (encoder, decoder) has its own controller (layer ids,
block types, projector, generators). b = d_model // reduction_factor (T5-Base with the released 32: b = 24).
Init as in the code: projector and generators N(0, 0.01^2) with zero biases, embeddings N(0, 1).
One departure: the released config's adapter non-linearity is gelu_new; here it is ReLU (the issue's form).

Extra parameters (T tasks, t task/layer/type embedding, h projector hidden, p projected, L_enc + L_dec blocks):
    T*t + (L_enc + L_dec)*t + 2 * (2*t + 3*t*h + h + h*p + 3*p + (p + 1)*(2*b*d + b + 3*d))
(per stack: block-type embeddings 2t, projector 3t*h + h + h*p + p, LayerNorm 2p, generators
(p + 1)*(b*d + b + d*b + d + d + d)).

All weights are generated for the batch's tasks, every layer and block type in one call per stack
(`generate_task_tensors`), so every rank calls the same modules whatever its batch holds (only the rows differ);
`freeze_task_params()` caches them for every task and inference skips the hypernetwork.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpsearch.model.adapter import normal_linear, row_bottleneck
from hpsearch.model.attention import SIDES
from hpsearch.model.base import Formula, MultiTaskT5, Site, TaskContext
from hpsearch.model.config import check_width

BLOCK_TYPES = ("ffn", "attention")  # the code's block-type ids: 0 = feed-forward, 1 = self-attention
LN_EPS = 1e-5                       # F.layer_norm's default, as the code's conditional LayerNorm


class HyperFormerController(nn.Module):
    """One stack's hypernetwork: (task, layer, block type) -> adapter D, c, U, u and LayerNorm gamma, beta."""

    def __init__(self, num_layers: int, d_model: int, bottleneck: int, t: int, hidden: int, projected: int):
        super().__init__()
        self.d, self.b = d_model, bottleneck
        self.layer_embeddings = nn.Embedding(num_layers, t)
        self.type_embeddings = nn.Embedding(len(BLOCK_TYPES), t)
        self.projector = nn.Sequential(normal_linear(3 * t, hidden), nn.ReLU(), normal_linear(hidden, projected))
        self.norm = nn.LayerNorm(projected, eps=1e-6)
        d, b = d_model, bottleneck
        self.down_weight, self.down_bias = normal_linear(projected, b * d), normal_linear(projected, b)
        self.up_weight, self.up_bias = normal_linear(projected, d * b), normal_linear(projected, d)
        self.ln_weight, self.ln_bias = normal_linear(projected, d), normal_linear(projected, d)

    def forward(self, tasks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """tasks [T, t] -> (D [T,L,2,b,d], c [T,L,2,b], U [T,L,2,d,b], u [T,L,2,d], gamma, beta [T,L,2,d])."""
        n_tasks, n_layers, t = tasks.shape[0], self.layer_embeddings.num_embeddings, tasks.shape[1]
        layers = self.layer_embeddings(torch.arange(n_layers, device=tasks.device))          # [L, t]
        types = self.type_embeddings(torch.arange(len(BLOCK_TYPES), device=tasks.device))    # [2, t]
        shape = (n_tasks, n_layers, len(BLOCK_TYPES), t)
        x = torch.cat([tasks[:, None, None].expand(shape), layers[None, :, None].expand(shape),
                       types[None, None].expand(shape)], dim=-1)                              # [T, L, 2, 3t]
        emb = self.norm(self.projector(x))                                                   # [T, L, 2, p]
        lead, d, b = emb.shape[:-1], self.d, self.b
        return (self.down_weight(emb).view(*lead, b, d), self.down_bias(emb),
                self.up_weight(emb).view(*lead, d, b), self.up_bias(emb),
                self.ln_weight(emb), self.ln_bias(emb))


class HyperFormerT5(MultiTaskT5):
    """Multi-task T5 whose adapters (and their LayerNorms) are generated per task by HyperFormer++."""

    def __init__(self, t5, tasks, cfg):
        super().__init__(t5, tasks, cfg)
        d = t5.config.d_model
        check_width(cfg, d)
        self.bottleneck = d // cfg.reduction_factor
        t = cfg.hyperformer_task_dim
        self.task_embeddings = nn.Embedding(len(self.tasks), t)
        self.controllers = nn.ModuleDict({
            side: HyperFormerController(len(getattr(t5, side).block), d, self.bottleneck, t,
                                        cfg.hyperformer_hidden_dim, cfg.hyperformer_projected_dim)
            for side in SIDES})

    def generate_task_tensors(self, device=None, tasks=None) -> dict[Site, tuple[torch.Tensor, ...]]:
        """{(side, layer, kind): (D, c, U, u, gamma, beta)}, each [T, ...], for `tasks` (None: every task), every
        layer and kind."""
        device = device if device is not None else next(self.t5.parameters()).device
        tasks = self.task_embeddings(tasks.to(device) if tasks is not None else
                                     torch.arange(len(self.tasks), device=device))
        table = {}
        for side, controller in self.controllers.items():
            weights = controller(tasks)  # each [T, L, 2, ...]
            # unbind, not a slice per (layer, kind): a slice's backward allocates a zeroed gradient of the whole
            # generated tensor for each of the 2L sites; unbind's backward stacks the sites' gradients once
            per_site = [w.transpose(0, 1).transpose(1, 2).flatten(0, 1).unbind(0) for w in weights]  # 2L x [T, ...]
            for layer in range(weights[0].shape[1]):
                for k, kind in enumerate(BLOCK_TYPES):
                    table[(side, layer, kind)] = tuple(w[layer * len(BLOCK_TYPES) + k] for w in per_site)
        return table

    def adapt_sublayer(self, ctx: TaskContext, site: Site, output: torch.Tensor) -> torch.Tensor:
        down_w, down_b, up_w, up_b, gamma, beta = (w.to(output.dtype) for w in ctx.rows(site, output.shape[0]))
        z = row_bottleneck(output, down_w, down_b, up_w, up_b)
        if gamma.shape[0] == 1:  # one task's (the shared row): layer norm's own affine, no second pass
            return output + F.layer_norm(z, z.shape[-1:], gamma[0], beta[0], eps=LN_EPS)
        return output + F.layer_norm(z, z.shape[-1:], eps=LN_EPS) * gamma[:, None] + beta[:, None]

    def parameter_formula(self) -> Formula:
        c, cfg = self.t5.config, self.cfg
        d, b, T = c.d_model, self.bottleneck, len(self.tasks)
        t, h, p = cfg.hyperformer_task_dim, cfg.hyperformer_hidden_dim, cfg.hyperformer_projected_dim
        layers = len(self.t5.encoder.block) + len(self.t5.decoder.block)
        text = "T*t + (L_enc + L_dec)*t + 2 * (2*t + 3*t*h + h + h*p + 3*p + (p + 1)*(2*b*d + b + 3*d))"
        total = T * t + layers * t + 2 * (2 * t + 3 * t * h + h + h * p + 3 * p + (p + 1) * (2 * b * d + b + 3 * d))
        return Formula(text, {"T": T, "t": t, "h": h, "p": p, "d": d, "b": b, "L_enc + L_dec": layers}, total)
