"""PHA, Prototype-based HyperAdapter (Zhao, Chen, Zhang, Wang, Liu, EMNLP 2023), multi-task.

As its public code lays it out (Bumble666/PHA, built on HyperDecoders; its GLUE config: `encoder_adapter: manual`,
`decoder_adapter: pro-hyper`), with p = `pha_dim`, r = `pha_retriever_hidden`, h = `pha_hidden`, b = `bottleneck`:

    encoder       h' = h + dropout(FFN(LN h)) + U_m ReLU(D_m LN h + c_m) + u_m   one adapter per block, shared by
                                               every task (the encoder's output, and so z, knows no task label);
                                               Xavier-uniform with gain 1e-4, biases 0, as upstream's
    z_i   = G(mean_n enc_i,n)                  instance-dense retriever G: Linear(d, r) -> ReLU -> Linear(r, p), on
                                               the mean of row i's encoder output over its real tokens
    k_tau                                      learned task prototypes [T, p]
    I     = LayerNorm(W2 ReLU(W1 [k_tau; e_m] + c1) + c2)    hypernetwork 2p -> h -> p; e_m a decoder block's
                                               embedding [M, p]
    D, c, U, u = heads(I)                      decoder block m's parallel feed-forward adapter for task tau
                                               (d -> b -> d; heads initialised "hyperfan-in": the adapters start
                                               near zero)
    decoder       h' = h + dropout(FFN(LN h)) + U ReLU(D LN h + c) + u           (upstream's T5LayerFFWithAdapter:
                                               after T5's dropout, beside the residual)
    L     = L_LM + lambda (L_IR + L_Pro)       lambda = `pha_loss_weight` (0.1), in training
    L_IR  = mean_i -1/|P_i| sum_{j in P_i} log( e^{s_ij / t} / sum_{a != i} e^{s_ia / t} )
                                               P_i the other rows of row i's task; over the rows that have one and
                                               a row of another task
    L_Pro = mean_i -log( e^{s(z_i, k_i) / t} / sum_{tau != task i} e^{s(z_i, k_tau) / t} )
                                               (upstream's: its own prototype is left out of the denominator; 0
                                               with one task)
            s: cosine similarity, t = `pha_temperature` (0.1)

The decoder's adapters of a row are generated from its task's prototype, so a trained model serves each task with
static weights (`freeze_task_params()`; inference does not run the hypernetwork, and cached decoding equals
uncached). The retriever shapes the prototype space through the two contrastive losses during training and
chooses the nearest prototype for a new task's instances (`nearest_task`, few-shot transfer: one encoder pass,
the encoder being the same for every task). The auxiliary losses enter through the base class's
`auxiliary_losses` hook and are logged as the metrics `ir_loss` and `proto_loss`. L_IR needs batches that mix
tasks (`data.batching=mixed`, as PHA trains): in one-task batches every other row is a positive and L_IR is 0,
leaving L_Pro alone to shape the retriever.

Extra parameters (T tasks, E encoder blocks, M decoder blocks):
    T*p + M*p + (d*r + r + r*p + p) + (2*p*h + h + h*p + p) + 2*p + (p + 1)*(2*d*b + b + d) + E*(2*d*b + b + d)
(prototypes, block embeddings, retriever, hypernetwork, its LayerNorm, the four heads, the encoder's adapters).

ZeRO-3: the hypernetwork runs on every call for every decoder block and the batch's tasks (only the rows differ
between ranks), each encoder adapter in its own module's forward, and the retriever on every forward with labels
(every training step on every rank).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpsearch.model.adapter import normal_linear, row_bottleneck
from hpsearch.model.base import Formula, MultiTaskT5, Site, TaskContext

FORMULA = ("T*p + M*p + (d*r + r + r*p + p) + (2*p*h + h + h*p + p) + 2*p + (p + 1)*(2*d*b + b + d)"
           " + E*(2*d*b + b + d)")


def masked_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each row's real tokens: hidden [B, n, d], mask [B, n] -> [B, d]."""
    m = mask.to(hidden.dtype)[..., None]
    count = mask.sum(1, keepdim=True).clamp_min(1)  # an integer count: bf16 is exact only up to 256 tokens
    return ((hidden * m).sum(1).float() / count).to(hidden.dtype)


def instance_loss(z: torch.Tensor, task_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Supervised contrastive loss among the rows (SupCon, as upstream's `_ins_ins_loss`): for each row with a
    same-task partner and a row of another task, the mean over its positives of -log(e^{s_ij / t} /
    sum_{a != i} e^{s_ia / t}), cosine similarity; the mean over those rows (0 when there is none: a one-task
    batch)."""
    z = F.normalize(z, dim=-1)
    sim = (z @ z.T) / temperature
    eye = torch.eye(len(z), dtype=torch.bool, device=z.device)
    same = task_ids[:, None] == task_ids[None, :]
    positive = same & ~eye
    count = positive.sum(1)
    # the rows with a same-task partner and a row of another task; the mean is over them. Upstream's batches mix
    # tasks, so every row has others; a one-task batch (data.batching=task) would pull every z of the batch
    # together (its SupCon term is log(n - 1) at best) and now counts for nothing
    anchors = (count > 0) & (~same).any(1)
    # without a branch on the device's values (no host synchronisation): a row with no partner is all zeros, so its
    # log-sum is finite (an all -inf row would give NaN gradients) and it counts 0
    others = sim.masked_fill(eye, float("-inf")).masked_fill(~anchors[:, None], 0.0)
    log_all = torch.logsumexp(others, dim=1)
    mean_positive = sim.masked_fill(~positive, 0.0).sum(1) / count.clamp_min(1)
    # summed and counted in fp32: bf16 holds whole numbers exactly only up to 256
    total = ((log_all - mean_positive).float() * anchors).sum()
    return (total / anchors.sum().clamp_min(1)).to(sim.dtype)


def prototype_loss(z: torch.Tensor, prototypes: torch.Tensor, task_ids: torch.Tensor,
                   temperature: float) -> torch.Tensor:
    """Each row against the task prototypes (upstream's `_pro_ins_loss`): -log(e^{s(z, k_own) / t} / sum over the
    other prototypes of e^{s(z, k) / t}), cosine similarity, its own prototype left out of the denominator; the
    mean over the rows. 0 with one task (no other prototype)."""
    if prototypes.dim() == 2 and prototypes.shape[0] < 2:  # (a partitioned ZeRO-3 read, shape [0], fails below)
        return (z * 0).sum()
    logits = F.normalize(z, dim=-1) @ F.normalize(prototypes, dim=-1).T / temperature
    own = F.one_hot(task_ids, prototypes.shape[0]).bool()
    log_others = torch.logsumexp(logits.masked_fill(own, float("-inf")), dim=1)
    return (log_others - logits.gather(1, task_ids[:, None])[:, 0]).float().mean().to(logits.dtype)


def hyperfan_in(layer: nn.Linear, fan_in: int) -> nn.Linear:
    """Upstream's hyperfan-in initialisation of a hypernetwork head: weights U(+-1e-3 sqrt(3 / fan_in)), bias 0,
    so the generated adapter starts near zero (fan_in: the hypernetwork's width times the generated layer's input
    width for a weight head, the hypernetwork's width for a bias head)."""
    bound = 1e-3 * (3 / fan_in) ** 0.5
    nn.init.uniform_(layer.weight, -bound, bound)
    nn.init.zeros_(layer.bias)
    return layer


class SharedAdapter(nn.Module):
    """One parallel feed-forward adapter for every row (d -> b -> d): upstream's `manual` adapter (HyperDecoders'
    AdapterLayer), weights Xavier-uniform with gain 1e-4, biases 0, so it starts at about zero."""

    def __init__(self, d_model: int, bottleneck: int):
        super().__init__()
        self.down_weight = nn.Parameter(nn.init.xavier_uniform_(torch.empty(bottleneck, d_model), gain=1e-4)[None])
        self.down_bias = nn.Parameter(torch.zeros(1, bottleneck))
        self.up_weight = nn.Parameter(nn.init.xavier_uniform_(torch.empty(d_model, bottleneck), gain=1e-4)[None])
        self.up_bias = nn.Parameter(torch.zeros(1, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_bottleneck(x, *(w.to(x.dtype) for w in (self.down_weight, self.down_bias, self.up_weight,
                                                           self.up_bias)))


class PHAT5(MultiTaskT5):
    """Multi-task T5 with parallel FFN adapters generated from learned task prototypes, plus a retriever."""

    def __init__(self, t5, tasks, cfg):
        super().__init__(t5, tasks, cfg)
        d, p, b = t5.config.d_model, cfg.pha_dim, cfg.bottleneck
        self.encoder_adapters = nn.ModuleList(SharedAdapter(d, b) for _ in t5.encoder.block)  # no task input
        self.blocks = [("decoder", i) for i in range(len(t5.decoder.block))]  # the generated adapters' blocks
        self.prototypes = nn.Embedding(len(self.tasks), p)          # N(0, 1), as HyperFormer's embeddings
        self.block_embeddings = nn.Embedding(len(self.blocks), p)
        self.retriever = nn.Sequential(normal_linear(d, cfg.pha_retriever_hidden, d ** -0.5), nn.ReLU(),
                                       normal_linear(cfg.pha_retriever_hidden, p, cfg.pha_retriever_hidden ** -0.5))
        self.hypernet = nn.Sequential(normal_linear(2 * p, cfg.pha_hidden, (2 * p) ** -0.5), nn.ReLU(),
                                      normal_linear(cfg.pha_hidden, p, cfg.pha_hidden ** -0.5), nn.LayerNorm(p))
        self.down_weight, self.down_bias = hyperfan_in(nn.Linear(p, b * d), p * d), hyperfan_in(nn.Linear(p, b), p)
        self.up_weight, self.up_bias = hyperfan_in(nn.Linear(p, d * b), p * b), hyperfan_in(nn.Linear(p, d), p)

    def generate_task_tensors(self, device=None, tasks=None) -> dict:
        """{("decoder", layer): (D [T, b, d], c [T, b], U [T, d, b], u [T, d])} for `tasks` (None: every task)
        and every decoder block.

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
        if side == "encoder":
            return self.encoder_adapters[layer](x)
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
        """PHA's retrieval for a new task: the task whose prototype is nearest (cosine) to the rows' z, from one
        encoder pass (the encoder's adapters are the same for every task)."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        ctx = self.task_context(torch.zeros(ids.shape[0], dtype=torch.long))  # on the CPU: checked there, no sync
        with self._using(ctx):
            hidden = self.t5.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        return self.nearest_prototype(hidden, mask)

    @torch.no_grad()
    def nearest_prototype(self, encoder_hidden: torch.Tensor, mask: torch.Tensor) -> int:
        """The task whose prototype is nearest (cosine) to the mean of these instances' retrieved z."""
        z = F.normalize(self.retrieve(encoder_hidden, mask), dim=-1).mean(0)
        return int((F.normalize(self.all_prototypes(z.device), dim=-1) @ z).argmax())

    def parameter_formula(self) -> Formula:
        cfg, d = self.cfg, self.t5.config.d_model
        T, M, p, r, h, b = len(self.tasks), len(self.blocks), cfg.pha_dim, cfg.pha_retriever_hidden, \
            cfg.pha_hidden, cfg.bottleneck
        E = len(self.encoder_adapters)
        total = T * p + M * p + (d * r + r + r * p + p) + (2 * p * h + h + h * p + p) + 2 * p \
            + (p + 1) * (2 * d * b + b + d) + E * (2 * d * b + b + d)
        return Formula(FORMULA, {"T": T, "M": M, "E": E, "p": p, "r": r, "h": h, "d": d, "b": b}, total)
