"""PHA, Prototype-based HyperAdapter (Zhao, Chen, Zhang, Wang, Liu, EMNLP 2023), multi-task.

As its public code lays it out (Bumble666/PHA, built on HyperDecoders), with p = `pha_dim`, r =
`pha_retriever_hidden`, h = `pha_hidden`, b = `bottleneck`:

    z_i   = G(mean_n enc_i,n)                  instance-dense retriever G: Linear(d, r) -> ReLU -> Linear(r, p), on
                                               the mean of row i's encoder output over its real tokens
    k_tau                                      learned task prototypes [T, p]
    I     = LayerNorm(W2 ReLU(W1 [k_tau; e_m] + c1) + c2)    hypernetwork 2p -> h -> p; e_m a block embedding [M, p]
    D, c, U, u = heads(I)                      block m's parallel feed-forward adapter for task tau (d -> b -> d)
    h'    = h + dropout(FFN(LN h)) + U ReLU(D LN h + c) + u  in every block of both stacks (upstream's
                                               T5LayerFFWithAdapter: after T5's dropout, beside the residual)
    L     = L_LM + lambda (L_IR + L_Pro)       lambda = `pha_loss_weight` (0.1)
    L_IR  = mean_i -log( sum_{j != i, task j = task i} e^{s_ij / t} / sum_{j != i} e^{s_ij / t} )
                                               over the rows that have a same-task partner in the batch
    L_Pro = mean_i -log softmax_tau( s(z_i, k_tau) / t )[task i]
            s: cosine similarity, t = `pha_temperature` (0.1)

The adapters of a row are generated from its task's prototype, so a trained model serves each task with static
weights (`freeze_task_params()`; inference does not run the hypernetwork, and cached decoding equals uncached).
The retriever shapes the prototype space through the two contrastive losses during training and chooses the
nearest prototype for a new task's instances (`nearest_prototype`, few-shot transfer). The auxiliary losses enter
through the base class's `auxiliary_losses` hook and are logged as the metrics `ir_loss` and `proto_loss`.
L_IR needs batches that mix tasks (`data.batching=mixed`, as PHA trains): in one-task batches every other row is a
positive and L_IR is 0, leaving L_Pro alone to shape the retriever.

Extra parameters (T tasks, M = L_enc + L_dec blocks):
    T*p + M*p + (d*r + r + r*p + p) + (2*p*h + h + h*p + p) + 2*p + (p + 1)*(2*d*b + b + d)
(prototypes, block embeddings, retriever, hypernetwork, its LayerNorm, the four heads).

ZeRO-3: the hypernetwork runs on every call for every block and the batch's tasks (only the rows differ between
ranks), and the retriever on every forward with labels (every training step on every rank).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpsearch.model.adapter import normal_linear, row_bottleneck
from hpsearch.model.attention import SIDES
from hpsearch.model.base import Formula, MultiTaskT5, Site, TaskContext

FORMULA = "T*p + M*p + (d*r + r + r*p + p) + (2*p*h + h + h*p + p) + 2*p + (p + 1)*(2*d*b + b + d)"


def masked_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each row's real tokens: hidden [B, n, d], mask [B, n] -> [B, d]."""
    m = mask.to(hidden.dtype)[..., None]
    count = mask.sum(1, keepdim=True).clamp_min(1)  # an integer count: bf16 is exact only up to 256 tokens
    return ((hidden * m).sum(1).float() / count).to(hidden.dtype)


def instance_loss(z: torch.Tensor, task_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Supervised InfoNCE among the rows (positives: the other rows of the same task), cosine similarity."""
    z = F.normalize(z, dim=-1)
    sim = (z @ z.T) / temperature
    eye = torch.eye(len(z), dtype=torch.bool, device=z.device)
    sim = sim.masked_fill(eye, float("-inf"))
    positive = (task_ids[:, None] == task_ids[None, :]) & ~eye
    anchors = positive.any(1)  # the rows with a same-task partner; the mean is over them (0 when there is none)
    # without a branch on the device's values (no host synchronisation): a row with no partner is all zeros and all
    # "positive", so its two log-sums are equal and finite (an all -inf row would give NaN gradients) and count 0
    lone = ~anchors[:, None]
    sim = sim.masked_fill(lone, 0.0)
    log_all = torch.logsumexp(sim, dim=1)
    log_pos = torch.logsumexp(sim.masked_fill(~(positive | lone), float("-inf")), dim=1)
    # summed and counted in fp32: bf16 holds whole numbers exactly only up to 256
    total = ((log_all - log_pos).float() * anchors).sum()
    return (total / anchors.sum().clamp_min(1)).to(sim.dtype)


def prototype_loss(z: torch.Tensor, prototypes: torch.Tensor, task_ids: torch.Tensor,
                   temperature: float) -> torch.Tensor:
    """InfoNCE of each row against every task prototype; the positive is its own task's (cosine similarity)."""
    logits = F.normalize(z, dim=-1) @ F.normalize(prototypes, dim=-1).T / temperature
    return F.cross_entropy(logits, task_ids)


class PHAT5(MultiTaskT5):
    """Multi-task T5 with parallel FFN adapters generated from learned task prototypes, plus a retriever."""

    def __init__(self, t5, tasks, cfg):
        super().__init__(t5, tasks, cfg)
        d, p, b = t5.config.d_model, cfg.pha_dim, cfg.bottleneck
        self.blocks = [(side, i) for side in SIDES for i in range(len(getattr(t5, side).block))]
        self.prototypes = nn.Embedding(len(self.tasks), p)          # N(0, 1), as HyperFormer's embeddings
        self.block_embeddings = nn.Embedding(len(self.blocks), p)
        self.retriever = nn.Sequential(normal_linear(d, cfg.pha_retriever_hidden, d ** -0.5), nn.ReLU(),
                                       normal_linear(cfg.pha_retriever_hidden, p, cfg.pha_retriever_hidden ** -0.5))
        self.hypernet = nn.Sequential(normal_linear(2 * p, cfg.pha_hidden, (2 * p) ** -0.5), nn.ReLU(),
                                      normal_linear(cfg.pha_hidden, p, cfg.pha_hidden ** -0.5), nn.LayerNorm(p))
        self.down_weight, self.down_bias = normal_linear(p, b * d), normal_linear(p, b)
        self.up_weight, self.up_bias = normal_linear(p, d * b), normal_linear(p, d)

    def generate_task_tensors(self, device=None, tasks=None) -> dict:
        """{(side, layer): (D [T, b, d], c [T, b], U [T, d, b], u [T, d])} for `tasks` (None: every task) and
        every block.

        The hypernetwork and each of the four heads run once on all (task, block) pairs of those tasks; the blocks'
        tables are then unbound from the heads' outputs (whose backward stacks the blocks' gradients: no block's
        slice zero-fills a whole output)."""
        ids = self._arange(len(self.tasks), device) if tasks is None else tasks
        prototypes, blocks = self.prototypes(ids), self.block_embeddings(self._arange(len(self.blocks), device))
        (T, p), M = prototypes.shape, blocks.shape[0]
        emb = self.hypernet(torch.cat([prototypes[:, None].expand(T, M, p), blocks[None].expand(T, M, p)], -1))
        d, b = self.t5.config.d_model, self.cfg.bottleneck                                   # emb: [T, M, p]
        heads = (self.down_weight, self.down_bias, self.up_weight, self.up_bias)
        down_w, down_b, up_w, up_b = (head(emb).unbind(1) for head in heads)                 # M of [T, ...]
        return {key: (dw.view(T, b, d), db, uw.view(T, d, b), ub)
                for key, dw, db, uw, ub in zip(self.blocks, down_w, down_b, up_w, up_b)}

    def _arange(self, n: int, device=None) -> torch.Tensor:
        return torch.arange(n, device=device if device is not None else next(self.t5.parameters()).device)

    def all_prototypes(self, device=None) -> torch.Tensor:
        """k [T, p], through the embedding's own forward (ZeRO-3 gathers it there; its .weight is partitioned)."""
        return self.prototypes(self._arange(len(self.tasks), device))

    def hooks_site(self, site: Site) -> bool:
        return site[2] == "ffn_residual"  # a parallel adapter beside each feed-forward sublayer, nothing elsewhere

    def residual_branch(self, ctx: TaskContext, site: Site, x: torch.Tensor) -> torch.Tensor | None:
        side, layer, kind = site
        if kind != "ffn_residual":
            return None
        down_w, down_b, up_w, up_b = (w.to(x.dtype) for w in ctx.rows((side, layer), x.shape[0]))
        return row_bottleneck(x, down_w, down_b, up_w, up_b)

    def retrieve(self, encoder_hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """z [B, p]: the retriever on the mean-pooled encoder output."""
        return self.retriever(masked_mean(encoder_hidden, mask))

    def auxiliary_losses(self, ctx: TaskContext, encoder_hidden: torch.Tensor, mask: torch.Tensor):
        z = self.retrieve(encoder_hidden, mask)
        ids = ctx.ids(z.shape[0]).to(z.device)
        t = self.cfg.pha_temperature
        ir, pro = instance_loss(z, ids, t), prototype_loss(z, self.all_prototypes(z.device), ids, t)
        return self.cfg.pha_loss_weight * (ir + pro), {"ir_loss": ir, "proto_loss": pro}

    @torch.no_grad()
    def nearest_task(self, batch: dict) -> int:
        """PHA's retrieval for a new task: the task whose prototype is nearest (cosine) to the rows' z, each
        candidate's z computed as in training, by the encoder under that task's adapters."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        prototypes = F.normalize(self.all_prototypes(ids.device), dim=-1)
        sims = []
        for task in range(len(self.tasks)):
            ctx = self.task_context(torch.full((ids.shape[0],), task, dtype=torch.long, device=ids.device))
            with self._using(ctx):
                hidden = self.t5.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
            sims.append(float((F.normalize(self.retrieve(hidden, mask), dim=-1) @ prototypes[task]).mean()))
        return max(range(len(sims)), key=sims.__getitem__)

    @torch.no_grad()
    def nearest_prototype(self, encoder_hidden: torch.Tensor, mask: torch.Tensor) -> int:
        """The task whose prototype is nearest (cosine) to the mean of these instances' retrieved z."""
        z = F.normalize(self.retrieve(encoder_hidden, mask), dim=-1).mean(0)
        return int((F.normalize(self.all_prototypes(z.device), dim=-1) @ z).argmax())

    def parameter_formula(self) -> Formula:
        cfg, d = self.cfg, self.t5.config.d_model
        T, M, p, r, h, b = len(self.tasks), len(self.blocks), cfg.pha_dim, cfg.pha_retriever_hidden, \
            cfg.pha_hidden, cfg.bottleneck
        total = T * p + M * p + (d * r + r + r * p + p) + (2 * p * h + h + h * p + p) + 2 * p \
            + (p + 1) * (2 * d * b + b + d)
        return Formula(FORMULA, {"T": T, "M": M, "p": p, "r": r, "h": h, "d": d, "b": b}, total)
