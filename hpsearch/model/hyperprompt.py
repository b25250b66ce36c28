"""HyperPrompt (He et al., ICML 2022): hypernetwork-generated key/value prompts for T5 self-attention.

For task tau and prompted block m:  P_k = U_k(ReLU(D_k(P_tau))),  P_v = U_v(ReLU(D_v(P_tau))),
with P_tau in R^{l x d} the task's global prompt (one for both sides when their lengths are equal, else one per
prompted side), D: d -> b, U: b -> d_i
(d_i = heads * d_kv, equal to d except in t5-3b / t5-11b).

- share:  one pair of local hypernetworks (h_k, h_v) per block, shared by all tasks.
- sep:    one pair per block *and task*.
          (Share and Sep keep every block's pair of one side in stacked tensors, computed in two batched products.)
- global: k_tau (t') and z_m (t') -> projection net (2t' -> e -> t) -> I_tau^m (t) -> global hypernetworks
          H_k, H_v (linear in I) emit the D and U matrices of the local hypernetworks.

Extra parameters (T tasks, M prompted blocks, l = the global prompts' length: one set P_tau shared by both sides
when both are prompted with the same length, else the summed length of each side's set; beta = 1 with
`hypernet_bias`, else 0; with beta = 0 and d_i = d these are the paper's counts):
    share:   d*l*T + M * (2*b*(d + d_i) + 2*beta*(b + d_i))
    sep:     d*l*T + M*T * (2*b*(d + d_i) + 2*beta*(b + d_i))
    global:  d*l*T + (2*t + 2*beta) * o + T*t' + M*t' + (2t' + beta)*e + (e + beta)*t,
             o = b*(d + d_i) + beta*(b + d_i)   (one generated local net: D, U and their biases)

Prompts are computed on every call for the tasks the batch holds (`generate_task_tensors`; all tasks once when
frozen for inference), then indexed by the batch's task ids: every data-parallel rank calls the same modules in
the same order, only with other rows (ZeRO-3 gathers parameters collectively per module call), and a batch may
mix tasks. Nothing here reads a parameter outside its own module's forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpsearch.model.attention import SIDES
from hpsearch.model.base import Formula, MultiTaskT5, TaskContext, count_trainable


class LocalHypernets(nn.Module):
    """h_k and h_v of every prompted block of one side, up(ReLU(down(P))), d -> b -> d_inner, stacked: weights
    [2 (keys, values), blocks, copies, d_in, d_out], so one side's generators are two batched products, not four
    small ones per block. copies=1 shares each block's pair across tasks (HyperPrompt-Share), copies=T gives every
    task its own (Sep)."""

    def __init__(self, blocks: int, copies: int, d_model: int, bottleneck: int, d_inner: int, bias: bool):
        super().__init__()
        self.down = nn.Parameter(torch.empty(2, blocks, copies, d_model, bottleneck))
        self.up = nn.Parameter(torch.empty(2, blocks, copies, bottleneck, d_inner))
        self.down_bias = nn.Parameter(torch.zeros(2, blocks, copies, 1, bottleneck)) if bias else None
        self.up_bias = nn.Parameter(torch.zeros(2, blocks, copies, 1, d_inner)) if bias else None
        for w in (self.down, self.up):  # nn.Linear's default range
            nn.init.uniform_(w, -w.shape[-2] ** -0.5, w.shape[-2] ** -0.5)

    def forward(self, prompts: torch.Tensor, tasks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prompts [T, l, d] of `tasks` (their indices) -> (keys, values), each [blocks, T, l, d_inner]."""
        pick = (lambda w: w) if self.down.shape[2] == 1 else (lambda w: w.index_select(2, tasks))  # Sep: theirs
        h = torch.matmul(prompts, pick(self.down))             # [2, blocks, T, l, b] (one copy broadcasts to T)
        if self.down_bias is not None:
            h = h + pick(self.down_bias)
        y = torch.matmul(F.relu(h), pick(self.up))             # [2, blocks, T, l, d_inner]
        if self.up_bias is not None:
            y = y + pick(self.up_bias)
        keys, values = y.unbind(0)  # backward stacks the two gradients (y[0], y[1]: a zero-filled y for each)
        return keys, values


class GlobalHypernets(nn.Module):
    """HyperPrompt-Global: layer-aware task embeddings I_tau^m drive H_k, H_v, which emit D and U per block."""

    def __init__(self, num_tasks: int, num_layers: int, d_model: int, d_inner: int, cfg, bias: bool):
        super().__init__()
        b, t1, t, e = cfg.bottleneck, cfg.task_embedding_dim, cfg.layer_task_dim, cfg.projection_hidden
        self.shape = (d_model, b, d_inner)
        self.bias = bias
        out = d_model * b + b * d_inner + ((b + d_inner) if bias else 0)
        self.task_embeddings = nn.Embedding(num_tasks, t1)
        self.layer_embeddings = nn.Embedding(num_layers, t1)
        self.projection = nn.Sequential(nn.Linear(2 * t1, e, bias=bias), nn.ReLU(), nn.Linear(e, t, bias=bias))
        self.hyper_k = nn.Linear(t, out, bias=bias)
        self.hyper_v = nn.Linear(t, out, bias=bias)
        for emb in (self.task_embeddings, self.layer_embeddings):
            nn.init.normal_(emb.weight, std=t1 ** -0.5)

    def _local(self, weights: torch.Tensor, prompts: torch.Tensor) -> torch.Tensor:
        """Apply the generated local nets of n blocks at once: weights [n, T, out], prompts [T, l, d] ->
        [n, T, l, d_inner]. One batched product per matrix (no per-block slice of the generated weights: the
        backward of such a slice allocates a zeroed gradient of the whole [M, T, out] tensor for each block)."""
        d, b, di = self.shape
        n, T = weights.shape[:2]
        parts = torch.split(weights, [d * b, b * di] + ([b, di] if self.bias else []), dim=-1)
        h = torch.matmul(prompts.unsqueeze(0), parts[0].view(n, T, d, b))          # [n, T, l, b]
        if self.bias:
            h = h + parts[2].unsqueeze(2)
        y = torch.matmul(F.relu(h), parts[1].view(n, T, b, di))                   # [n, T, l, d_i]
        return y + parts[3].unsqueeze(2) if self.bias else y

    def forward(self, side_prompts: list[tuple[torch.Tensor, int]], task_ids: torch.Tensor
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """side_prompts: (global prompts [T, l, d] of the tasks `task_ids`, number of prompted blocks they feed) per
        prompted side, in layer-embedding order; returns (keys, values) [T, l, d_inner] per prompted block, in that
        order."""
        num_tasks = task_ids.numel()
        counts = [n for _, n in side_prompts]
        num_layers, device = sum(counts), side_prompts[0][0].device
        tasks = self.task_embeddings(task_ids)                                         # [T, t']
        layers = self.layer_embeddings(torch.arange(num_layers, device=device))       # [M, t']
        pairs = torch.cat([tasks[None].expand(num_layers, -1, -1),
                           layers[:, None].expand(-1, num_tasks, -1)], dim=-1)      # [M, T, 2t']
        task_layer = self.projection(pairs)                                          # I: [M, T, t]
        wk, wv = self.hyper_k(task_layer), self.hyper_v(task_layer)                  # [M, T, out]
        out = []
        for (prompts, _), k, v in zip(side_prompts, wk.split(counts), wv.split(counts)):
            out += zip(self._local(k, prompts).unbind(0), self._local(v, prompts).unbind(0))
        return out


SHARED = "shared"


def prompt_sets(cfg) -> dict[str, str]:
    """{prompted side: the name of its global prompt set}: `shared` for both sides when both are prompted with
    the same length (one P_tau per task, as the paper counts d*l*T), else the side itself."""
    sides = cfg.prompted_sides()
    same = len(sides) == 2 and len({cfg.side_prompt_length(s) for s in sides}) == 1
    return {side: SHARED if same else side for side in sides}


class HyperPromptT5(MultiTaskT5):
    """Multi-task T5 whose prompted self-attention layers get per-task hyper-prompts."""

    def __init__(self, t5, tasks, cfg):
        super().__init__(t5, tasks, cfg)
        c = t5.config
        d, self.n_heads, self.d_kv, self.d_model = c.d_model, c.num_heads, c.d_kv, c.d_model
        d_inner = c.num_heads * c.d_kv
        n_tasks = len(self.tasks)
        self.layer_keys = [(side, i) for side in SIDES if side in cfg.prompted_sides()
                           for i in range(len(getattr(t5, side).block))]
        # Global prompts P_tau: an embedding row per task (never read as .weight), one set for both sides when they
        # have the same length (the paper's d*l*T), else one per prompted side
        self.prompt_sets = prompt_sets(cfg)
        lengths = {name: cfg.side_prompt_length(side) for side, name in self.prompt_sets.items()}  # each set once
        self.global_prompts = nn.ModuleDict({name: nn.Embedding(n_tasks, n * d) for name, n in lengths.items()})
        for emb in self.global_prompts.values():
            nn.init.normal_(emb.weight, std=1.0)  # T5 embeddings' scale: the prompts live where hidden states do
        if not self.layer_keys:  # every placed side has prompt length 0: nothing to generate (MTL's model)
            pass
        elif cfg.variant == "global":
            self.global_hypernets = GlobalHypernets(n_tasks, len(self.layer_keys), d, d_inner, cfg,
                                                    cfg.hypernet_bias)
        else:
            copies = 1 if cfg.variant == "share" else n_tasks
            self.local_hypernets = nn.ModuleDict({  # per prompted side, every block's generators stacked
                side: LocalHypernets(sum(s == side for s, _ in self.layer_keys), copies, d, cfg.bottleneck, d_inner,
                                     cfg.hypernet_bias) for side in cfg.prompted_sides()})

    def generate_task_tensors(self, device=None, tasks=None) -> dict[tuple[str, int], tuple[torch.Tensor, ...]]:
        """Run the generators for `tasks` (None: every task): {(side, layer): (keys, values)}, each
        [T, heads, l, d_kv]."""
        if not self.layer_keys:
            return {}
        device = device if device is not None else next(self.t5.parameters()).device
        ids = tasks.to(device) if tasks is not None else torch.arange(len(self.tasks), device=device)
        n_tasks = ids.numel()
        sets = {name: emb(ids) for name, emb in self.global_prompts.items()}
        side_prompts = {side: sets[name].view(n_tasks, self.cfg.side_prompt_length(side), self.d_model)
                        for side, name in self.prompt_sets.items()}
        if self.cfg.variant == "global":  # layer_keys: every block of one side, then of the next
            pairs = self.global_hypernets([(p, sum(s == side for s, _ in self.layer_keys))
                                           for side, p in side_prompts.items()], ids)
        else:
            pairs = []
            for side, p in side_prompts.items():
                keys, values = self.local_hypernets[side](p, ids)
                pairs += zip(keys.unbind(0), values.unbind(0))
        return {key: tuple(self._heads(x) for x in pair) for key, pair in zip(self.layer_keys, pairs)}

    def attention_prompts(self, ctx: TaskContext) -> dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]:
        """Each row's prompts: {(side, layer): (keys, values)}, each [batch | 1, heads, l, d_kv]."""
        return {key: ctx.rows(key) for key in ctx.table}

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[T, l, heads * d_kv] -> [T, heads, l, d_kv], the layout of T5's keys and values."""
        return x.view(x.shape[0], x.shape[1], self.n_heads, self.d_kv).transpose(1, 2)

    def extra_parameters(self) -> dict[str, int]:
        parts = {"global_prompts": self.global_prompts}
        if not self.layer_keys:
            pass
        elif self.cfg.variant == "global":
            g = self.global_hypernets
            parts.update(task_embeddings=g.task_embeddings, layer_embeddings=g.layer_embeddings,
                         projection=g.projection, global_hypernets=nn.ModuleList([g.hyper_k, g.hyper_v]))
        else:
            parts["local_hypernets"] = self.local_hypernets
        counts = {name: count_trainable(module) for name, module in parts.items()}
        counts["total"] = sum(counts.values())
        return counts

    def parameter_formula(self) -> Formula:
        c, cfg = self.t5.config, self.cfg
        d, di, b, T, beta = c.d_model, c.num_heads * c.d_kv, cfg.bottleneck, len(self.tasks), int(cfg.hypernet_bias)
        l = sum({name: cfg.side_prompt_length(side) for side, name in self.prompt_sets.items()}.values())
        M = len(self.layer_keys)
        terms = dict(d=d, d_i=di, l=l, T=T, M=M, b=b, beta=beta)
        if not M:
            return Formula("0 (no prompted side: every placed side has prompt length 0)", terms, 0)
        local = 2 * b * (d + di) + 2 * beta * (b + di)
        if cfg.variant != "global":
            copies = 1 if cfg.variant == "share" else T
            text = "d*l*T + M * (2*b*(d + d_i) + 2*beta*(b + d_i))" if copies == 1 else \
                "d*l*T + M*T * (2*b*(d + d_i) + 2*beta*(b + d_i))"
            return Formula(text, terms, d * l * T + M * copies * local)
        t1, t, e = cfg.task_embedding_dim, cfg.layer_task_dim, cfg.projection_hidden
        o = b * (d + di) + beta * (b + di)
        terms.update({"t'": t1, "t": t, "e": e, "o": o})
        text = ("d*l*T + (2*t + 2*beta)*o + T*t' + M*t' + (2t' + beta)*e + (e + beta)*t,"
                "  o = b*(d + d_i) + beta*(b + d_i)")
        return Formula(text, terms, d * l * T + (2 * t + 2 * beta) * o + T * t1 + M * t1 + (2 * t1 + beta) * e
                       + (e + beta) * t)
