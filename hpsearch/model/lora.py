"""LoRA (Hu et al., ICLR 2022), multi-task: per-task low-rank updates of every self-attention's q and v projections.

For a row of task tau, the query and value projections W (d -> d_i, d_i = heads * d_kv) of every self-attention
of both stacks become

    W x + (alpha / r) * B_tau A_tau dropout(x)            A_tau: d -> r, B_tau: r -> d_i (r = `lora_rank`)

A starts kaiming-uniform (a = sqrt 5, as nn.Linear and PEFT: U(-1/sqrt d, 1/sqrt d)), B at zero, so a new model
equals its backbone. Each row gathers its own task's A and B: a batch may mix tasks. Cross-attention's q and v
are left alone (PEFT's suffix match on "q", "v" would also hit them). The branch enters through the base class's
`parallel_branch` hook on the projections.

`merge(task)` is the single-task export: a stock T5ForConditionalGeneration whose q and v weights are
W + (alpha / r) B_tau A_tau (`merge(task).save_pretrained(dir)`; `build_model(dir, "mtl", ...)` loads it).

Extra parameters (T tasks, M = L_enc + L_dec self-attentions, two adapted projections each):
    T * M * 2 * r * (d + d_i)

Each adapted projection is one module holding all tasks' A and B ([T, ...]), called on every forward whatever the
batch holds, indexing its own parameters inside its own forward (ZeRO-3 safe). `merge` reads weights: under ZeRO-3
call it inside `deepspeed.zero.GatheredParameters(list(model.parameters()))` (as the trainer's export does), or
pass it the gathered `state`.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import T5ForConditionalGeneration

from hpsearch.model.attention import self_attention_modules
from hpsearch.model.backbones import new_t5
from hpsearch.model.base import Formula, MultiTaskT5, Site, TaskContext, row_linear

LORA_PROJECTIONS = ("q", "v")


class TaskLoRA(nn.Module):
    """One projection's LoRA branch for every task: x -> (alpha / r) B_tau A_tau dropout(x), tau each row's task."""

    def __init__(self, num_tasks: int, d_in: int, d_out: int, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.scaling = alpha / rank
        self.A = nn.Parameter(torch.empty(num_tasks, rank, d_in))  # [out, in] per task, as nn.Linear
        self.B = nn.Parameter(torch.zeros(num_tasks, d_out, rank))
        nn.init.uniform_(self.A, -d_in ** -0.5, d_in ** -0.5)  # kaiming_uniform_(a=sqrt(5)) of each [r, d_in]
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, ctx: TaskContext) -> torch.Tensor:
        h = row_linear(self.dropout(x), ctx.select(self.A, x.shape[0]).to(x.dtype))
        # the scaling multiplies B (d_out x r numbers), not the output (every token's)
        return row_linear(h, ctx.select(self.B, x.shape[0]).to(x.dtype) * self.scaling)


def site_name(site: Site) -> str:
    return "_".join(map(str, site))


class LoRAT5(MultiTaskT5):
    """Multi-task T5 with per-task LoRA on its self-attention q and v projections."""

    def __init__(self, t5, tasks, cfg):
        super().__init__(t5, tasks, cfg)
        c = t5.config
        self.sites = [(side, i, p) for side, i in self_attention_modules(t5) for p in LORA_PROJECTIONS]
        self.lora = nn.ModuleDict({
            site_name(s): TaskLoRA(len(self.tasks), c.d_model, c.num_heads * c.d_kv, cfg.lora_rank, cfg.lora_alpha,
                                   cfg.lora_dropout) for s in self.sites})

    def hooks_site(self, site: Site) -> bool:
        return site[2] in LORA_PROJECTIONS

    def parallel_branch(self, ctx: TaskContext, site: Site, x: torch.Tensor) -> torch.Tensor | None:
        name = site_name(site)
        if name not in self.lora:
            return None
        return self.lora[name](x, ctx)

    @torch.no_grad()
    def merge(self, task, state: dict | None = None) -> T5ForConditionalGeneration:
        """A stock single-task T5 (eval mode) with q, v = W + (alpha / r) B_tau A_tau for `task` (index or name).

        `state`: this model's state dict gathered from ZeRO-3 partitions (default: `self.state_dict()`)."""
        index = self.tasks.index(task) if task in self.tasks else task
        if not isinstance(index, int) or not 0 <= index < len(self.tasks):
            raise ValueError(f"merge: task {task!r} is not one of {self.tasks} (or an index below {len(self.tasks)})")
        state = self.state_dict() if state is None else state
        weights = {k[len("t5."):]: v.detach().clone() for k, v in state.items() if k.startswith("t5.")}
        for side, i, proj in self.sites:
            key, name = f"{side}.block.{i}.layer.0.SelfAttention.{proj}.weight", site_name((side, i, proj))
            w, a, b = weights[key], state[f"lora.{name}.A"], state[f"lora.{name}.B"]
            if 0 in (w.numel(), a.numel(), b.numel()):
                raise RuntimeError("merge: the parameters are partitioned (ZeRO-3); call it inside "
                                   "deepspeed.zero.GatheredParameters(list(model.parameters())) or pass state=")
            weights[key] = w + (self.lora[name].scaling * (b[index].double() @ a[index].double())).to(w.dtype)
        config = self.t5.config.__class__(**self.t5.config.to_dict())
        merged = new_t5(config, init=False)
        merged.load_state_dict(weights)  # every weight
        merged.set_attn_implementation("sdpa")
        ref = weights["shared.weight"]
        return merged.to(device=ref.device, dtype=ref.dtype).eval()

    def parameter_formula(self) -> Formula:
        c, cfg = self.t5.config, self.cfg
        d, di, r, T, M = c.d_model, c.num_heads * c.d_kv, cfg.lora_rank, len(self.tasks), len(self.sites) // 2
        return Formula("T * M * 2 * r * (d + d_i)", dict(T=T, M=M, r=r, d=d, d_i=di), T * M * 2 * r * (d + di))
