"""The multi-task T5 wrapper every method shares: task ids in, Hugging Face seq2seq outputs out.

A method subclasses `MultiTaskT5` and fills in only the hooks it needs; this class never names a method.

    generate_task_tensors(device, tasks)   per-task tensors made by the method's generators (hypernetworks) for
                                    `tasks` (a sorted LongTensor of task indices; None: all), {key: tensor or
                                    tuple of tensors, each [len(tasks), ...]}. A training or uncached call asks
                                    only for the tasks its batch holds; `freeze_task_params()` caches them for all
                                    tasks so inference does not pay the generators.
    attention_prompts(ctx)          {(side, layer): (keys, values)} prepended inside self-attention, and
                                    {("cross", layer): ...} inside a decoder cross-attention (attention.py)
    prepare_encoder_inputs(ctx, x)  rewrite the encoder inputs {input_ids, attention_mask, inputs_embeds}
    parallel_branch(ctx, site, x)   a branch beside a module, fed the module's input x; its result is added to the
                                    module's output (None: no branch). Sites: the sublayers (below; x = T5's
                                    layer-normed hidden states) and the self-attention projections
                                    (side, layer, "q" | "k" | "v" | "o") (LoRA, parallel adapters)
    adapt_sublayer(ctx, site, y)    rewrite a sublayer's output y (before T5's dropout + residual; after the parallel
                                    branch); site = (side, layer, kind), kind "attention" (self-attention) or "ffn"
    residual_branch(ctx, site, x)   a branch beside a sublayer added after T5's dropout, beside the residual:
                                    h + dropout(sublayer(LN h)) + branch(LN h), fed x = LN h (MAM's scaled adapter);
                                    site = (side, layer, "attention_residual" | "ffn_residual")
    hooks_site(site)                whether the backbone module at a site may need parallel_branch or adapt_sublayer
                                    (by default: every site of the ones the method fills in)
    auxiliary_losses(ctx, enc, mask)   (term added to the loss in training, {name: value to log}) from the encoder
                                    output [batch, n, d] and its mask; runs on every forward with labels (PHA)
    nearest_task(batch)             the existing task a new task's rows are closest to (few-shot transfer starts
                                    the new task from it); by default the task under which their loss is lowest
    extra_parameters(), parameter_formula()   counts from the real modules, and the closed formula

`ctx` is the `TaskContext` of the current forward/generate call: the batch's task ids and the per-task tensors,
indexed per row on request (following beam search's repeat_interleave; a one-task batch gets its task's row once,
[1, ...], and `row_linear` applies it as one matrix product). Every hook runs on every call, for every
layer, whatever tasks the batch holds: data-parallel ranks call the same modules in the same order (ZeRO-3).
The backbone's modules are hooked (torch forward hooks) only at the sites `hooks_site` names: by default every
site of the hooks a method fills in (parallel_branch: sublayers and projections; adapt_sublayer: sublayers), which a
method narrows to the sites it uses; methods that fill in neither leave T5's modules on torch's fast call path.
Plain multi-task T5 (MTL) is this class as it is.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hpsearch.model.attention import (
    SIDES,
    attach,
    expand_rows,
    prompt_cache,
    self_attention_modules,
    use_prompted_attention,
)

Prompts = dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]
Site = tuple[str, int, str]
SUBLAYER_KINDS = ("attention", "ffn")
RESIDUAL_KINDS = ("attention_residual", "ffn_residual")
PROJECTIONS = ("q", "k", "v", "o")  # the linear maps of a T5 self-attention


@dataclass
class Formula:
    """A method's closed parameter formula: its text, the value of each symbol, and its value."""
    text: str
    terms: dict[str, int] = field(default_factory=dict)
    total: int = 0


class TaskContext:
    """One call's task information: validated `task_ids` [batch] (or None) and the per-task tensor table, whose
    row for each batch row is `table_ids` (the task id itself when the table holds every task, else its position
    among the tasks the table was generated for). `shared`: the task every batch row has, when they all have the
    same one (a one-task batch, the recipe's default), found on the CPU; then `select` and `rows` hand out that
    task's row alone ([1, ...]) and a method applies it to the whole batch at once, instead of a copy per row."""

    def __init__(self, task_ids: torch.Tensor | None, table: dict, table_ids: torch.Tensor | None = None,
                 shared: int | None = None):
        self.task_ids = task_ids
        self.table = table
        self.table_ids = task_ids if table_ids is None else table_ids
        self.shared = shared
        self._shared_row = None if shared is None else shared if table_ids is None else 0  # one task generated
        self._rows: dict = {}

    def ids(self, batch: int | None = None) -> torch.Tensor:
        """The task id of each of `batch` rows (beam search repeats every example: ids follow)."""
        if self.task_ids is None:
            raise ValueError("task_ids is required: a LongTensor [batch] of indices into model.tasks")
        return self.task_ids if batch is None else expand_rows(self.task_ids, batch)

    def select(self, params: torch.Tensor, batch: int | None = None) -> torch.Tensor:
        """A per-task parameter ([T, ...], one row per task of the model) for each of `batch` rows: [batch, ...],
        or [1, ...] (a view of the one row) when every row has the same task. Call it inside the module that owns
        `params` (ZeRO-3 gathers them there)."""
        return self._pick(params, self.task_ids, self.shared, batch)

    def rows(self, key, batch: int | None = None):
        """`table[key]` for each row's task, as `select` gives it: [batch | 1, ...] (a tuple stays a tuple)."""
        batch = batch if batch is not None else self.ids().numel()
        if (key, batch) not in self._rows:
            value = self.table[key]
            index = lambda t: self._pick(t, self.table_ids, self._shared_row, batch)
            self._rows[(key, batch)] = tuple(map(index, value)) if isinstance(value, tuple) else index(value)
        return self._rows[(key, batch)]

    def _pick(self, table: torch.Tensor, ids: torch.Tensor, shared: int | None, batch: int | None) -> torch.Tensor:
        if self.task_ids is None:
            self.ids()  # raises: task_ids is required
        if shared is not None:
            return table.narrow(0, shared, 1)
        return per_row(table, expand_rows(ids, batch if batch is not None else self.task_ids.numel()))


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, n, in] through a linear map per row, `weight` [B, out, in] and `bias` [B, out] (nn.Linear's layout),
    or one map for every row ([1, ...], `TaskContext.select`'s shared row): then a single matrix product. The bias
    is added inside the product (addmm / baddbmm), not by a second pass over the [B, n, out] output."""
    if weight.shape[0] == 1:
        return F.linear(x, weight[0], None if bias is None else bias[0])
    if bias is None:
        return x @ weight.transpose(1, 2)
    return torch.baddbmm(bias[:, None], x, weight.transpose(1, 2))


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; a CPU tensor goes to a GPU from pinned memory, without waiting."""
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def per_row(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`table[ids]` ([T, ...] -> [batch, ...]) by `index_select`, whose backward (index_add) is several times faster
    on CPU than advanced indexing's (an accumulating index_put: 1.0 vs 0.12 ms for a [8, 32, 512] table, 32 rows)."""
    return table.index_select(0, ids.to(table.device))


def values_absent(*params: torch.Tensor) -> bool:
    """True when a parameter holds no values here: on the meta device, or partitioned by ZeRO-3 (a skeleton built
    under `deepspeed.zero.Init`, whose values arrive afterwards). Initialisation that reads weights skips then."""
    return any(p.is_meta or hasattr(p, "ds_id") for p in params)


def count_trainable(module: nn.Module) -> int:
    """Trainable parameters, also under ZeRO-3 (where a partitioned parameter's local numel is 0)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad)


def sublayer_modules(t5) -> dict[Site, nn.Module]:
    """{(side, layer, kind): module} whose output is the sublayer output before dropout + residual."""
    modules = {}
    for side in SIDES:
        for i, block in enumerate(getattr(t5, side).block):
            modules[(side, i, "attention")] = block.layer[0].SelfAttention
            modules[(side, i, "ffn")] = block.layer[-1].DenseReluDense
    return modules


def residual_modules(t5) -> dict[Site, nn.Module]:
    """{(side, layer, "attention_residual" | "ffn_residual"): T5LayerSelfAttention | T5LayerFF}: the whole
    sublayer, whose output is h + dropout(sublayer(LN h)), and whose `layer_norm` gives LN h."""
    modules = {}
    for side in SIDES:
        for i, block in enumerate(getattr(t5, side).block):
            modules[(side, i, "attention_residual")], modules[(side, i, "ffn_residual")] = block.layer[0], \
                block.layer[-1]
    return modules


def projection_modules(t5) -> dict[Site, nn.Module]:
    """{(side, layer, "q" | "k" | "v" | "o"): nn.Linear} of every self-attention (not cross-attention)."""
    return {(side, i, name): getattr(attn, name)
            for (side, i), attn in self_attention_modules(t5).items() for name in PROJECTIONS}


class MultiTaskT5(nn.Module):
    def __init__(self, t5, tasks, cfg):
        super().__init__()
        self.t5 = t5
        self.tasks = list(tasks)
        self.cfg = cfg
        self._frozen: dict | None = None
        self._ctx: TaskContext | None = None
        use_prompted_attention(t5)
        # the backbone's modules get forward hooks only where this method has work (`hooks_site`): a module with a
        # hook leaves torch's fast call path (MTL's 72 hooks that did nothing cost 1.7 % of its greedy generation)
        for site, module in sublayer_modules(t5).items():
            module.hp_site = site
            if self.hooks_site(site):
                module.register_forward_hook(self._sublayer_hook, with_kwargs=True)
        for site, module in residual_modules(t5).items():
            module.hp_site = site
            if self.hooks_site(site):
                module.register_forward_hook(self._residual_hook, with_kwargs=True)
        for site, module in projection_modules(t5).items():
            module.hp_site = site
            if self.hooks_site(site):
                module.register_forward_hook(self._projection_hook)
        if cfg.train_task_params_only:
            t5.requires_grad_(False)

    @classmethod
    def fills_in(cls, hook: str) -> bool:
        """Whether this method overrides the base class's `hook` (e.g. "parallel_branch")."""
        return getattr(cls, hook) is not getattr(MultiTaskT5, hook)

    @property
    def config(self):
        return self.t5.config

    def get_input_embeddings(self) -> nn.Embedding:
        """The backbone's token-embedding table (T5 shares it between encoder and decoder; tied, it is the output
        layer too): the training recipe can give it its own learning rate (`train.embedding_lr_scale`)."""
        return self.t5.get_input_embeddings()

    # ---- the hooks a method fills in ----------------------------------------------------------------------
    def generate_task_tensors(self, device=None, tasks: torch.Tensor | None = None) -> dict:
        """Per-task tensors for `tasks` (sorted task indices; None: all), {key: tensor | tuple, each
        [len(tasks), ...]}. MTL: none."""
        return {}

    def attention_prompts(self, ctx: TaskContext) -> Prompts:
        """{(side, layer): (keys, values)}, each [batch | 1, heads, l, d_kv] (`ctx.rows`). MTL: none."""
        return {}

    def prepare_encoder_inputs(self, ctx: TaskContext, inputs: dict) -> dict:
        """{input_ids, attention_mask, inputs_embeds} as the encoder will get them. MTL: unchanged."""
        return inputs

    def parallel_branch(self, ctx: TaskContext, site: Site, x: torch.Tensor) -> torch.Tensor | None:
        """Added to the output of the module at `site` given its input x [rows, n, d_in]. MTL: no branch."""
        return None

    def adapt_sublayer(self, ctx: TaskContext, site: Site, output: torch.Tensor) -> torch.Tensor:
        """The sublayer's new output [rows, n, d_model]. MTL: unchanged."""
        return output

    def residual_branch(self, ctx: TaskContext, site: Site, x: torch.Tensor) -> torch.Tensor | None:
        """Added to the sublayer's output after T5's dropout, given x = LN h [rows, n, d_model]. MTL: none."""
        return None

    def auxiliary_losses(self, ctx: TaskContext, encoder_hidden: torch.Tensor, encoder_mask: torch.Tensor):
        """(a term added to the loss, {name: its parts to log}) on a forward with labels. MTL: none."""
        return None, {}

    def hooks_site(self, site: Site) -> bool:
        """Whether the module at `site` (a sublayer or a self-attention projection) may get a parallel branch or
        an adapted output: the base class hooks only those modules. Asked while the base class is built, so it may
        read `self.cfg` and `self.t5` only. By default every site of the hooks the method fills in (parallel_branch:
        sublayers and projections; adapt_sublayer: sublayers; residual_branch: the whole sublayers, kinds
        `RESIDUAL_KINDS`); a method narrows it to the sites it uses."""
        if site[2] in RESIDUAL_KINDS:
            return self.fills_in("residual_branch")
        branches = self.fills_in("parallel_branch")
        return branches or (site[2] in SUBLAYER_KINDS and self.fills_in("adapt_sublayer"))

    def parameter_formula(self) -> Formula:
        return Formula("0")

    @torch.no_grad()
    def nearest_task(self, batch: dict) -> int:
        """The existing task whose conditioning gives these rows (input_ids, attention_mask, labels) the lowest
        loss: the task a new task's parameters start from in few-shot transfer (PHA: its nearest prototype)."""
        rows = batch["input_ids"].shape[0]
        losses = [float(self(**{**batch, "task_ids": torch.full((rows,), t, dtype=torch.long)}).loss)
                  for t in range(len(self.tasks))]
        return min(range(len(losses)), key=losses.__getitem__)

    def init_task_params(self, label_token_ids: list[list[list[int]]] | None = None) -> None:
        """Initialise task parameters from each task's class-label tokens (`label_token_ids[task][label]`), once,
        before training and before ZeRO-3 partitions the model. Most methods: nothing to do."""

    def extra_parameters(self) -> dict[str, int]:
        """Trainable parameters the method adds beyond the backbone, per component and under "total"."""
        counts = {name: count_trainable(m) for name, m in self.named_children() if name != "t5"}
        counts["total"] = sum(counts.values())
        return counts

    # ---- per-call task context ------------------------------------------------------------------------------
    def task_context(self, task_ids, batch_size: int | None = None) -> TaskContext:
        """The call's TaskContext. `task_ids` may be on the CPU while the model is on a GPU (the training loop
        keeps them there): then checking them and finding the batch's tasks need no device synchronisation, and
        the ids go to the device once, asynchronously from pinned memory."""
        if task_ids is None:
            return TaskContext(None, self._frozen if self._frozen is not None else self.generate_task_tensors())
        task_ids = torch.as_tensor(task_ids).long()
        if task_ids.dim() != 1 or (batch_size is not None and task_ids.numel() != batch_size):
            raise ValueError(f"task_ids must be a LongTensor [batch] with one id per row ({batch_size}); "
                             f"got shape {tuple(task_ids.shape)}")
        if task_ids.numel() and (task_ids.min() < 0 or task_ids.max() >= len(self.tasks)):
            raise ValueError(f"task_ids must lie in [0, {len(self.tasks)}); got {task_ids.tolist()}")
        device = next(self.t5.parameters()).device
        present, table_ids = torch.unique(task_ids, sorted=True, return_inverse=True)
        shared = int(present[0]) if present.numel() == 1 else None  # a one-task batch
        if self._frozen is not None:
            return TaskContext(_to(task_ids, device), self._frozen, shared=shared)
        # the generators run for the tasks the batch holds only: every rank still calls the same modules (ZeRO-3),
        # with fewer rows
        return TaskContext(_to(task_ids, device), self.generate_task_tensors(device, _to(present, device)),
                           _to(table_ids, device), shared=shared)

    def hyper_prompts(self, task_ids, batch_size: int | None = None) -> Prompts:
        """{(side, layer): (keys, values)}, each [batch, heads, l, d_kv] ([1, ...] when every row has the same task:
        attention expands them), exactly as they enter attention."""
        return self.attention_prompts(self.task_context(task_ids, batch_size))

    @contextmanager
    def _using(self, ctx: TaskContext, recorders: dict | None = None):
        self._ctx = ctx
        try:
            with attach(self.t5, self.attention_prompts(ctx), recorders):
                yield
        finally:
            self._ctx = None

    def _sublayer_hook(self, module, args, kwargs, output):
        if self._ctx is None:  # the backbone called on its own: stock T5
            return None
        y = output[0] if isinstance(output, tuple) else output  # T5Attention: (attn_output, position_bias, weights)
        branch = self.parallel_branch(self._ctx, module.hp_site, args[0] if args else kwargs["hidden_states"])
        y = self.adapt_sublayer(self._ctx, module.hp_site, y if branch is None else y + branch)
        return (y, *output[1:]) if isinstance(output, tuple) else y

    def _residual_hook(self, module, args, kwargs, output):
        if self._ctx is None:
            return None
        h = args[0] if args else kwargs["hidden_states"]
        branch = self.residual_branch(self._ctx, module.hp_site, module.layer_norm(h))
        if branch is None:
            return None
        return (output[0] + branch, *output[1:]) if isinstance(output, tuple) else output + branch

    def _projection_hook(self, module, args, output):
        if self._ctx is None:
            return None
        branch = self.parallel_branch(self._ctx, module.hp_site, args[0])
        return None if branch is None else output + branch

    def _encoder_inputs(self, ctx, input_ids, attention_mask, kwargs) -> dict:
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask,
                      inputs_embeds=kwargs.pop("inputs_embeds", None))
        if kwargs.get("encoder_outputs") is not None:  # the encoder already ran (the mask must match its output)
            return inputs
        return self.prepare_encoder_inputs(ctx, inputs)

    # ---- frozen task parameters (inference) -----------------------------------------------------------------
    def freeze_task_params(self, device=None) -> None:
        """Run the generators once for every task; serve these static tensors until `train()`."""
        with torch.no_grad():
            table = self.generate_task_tensors(device)
            detach = lambda v: tuple(t.detach() for t in v) if isinstance(v, tuple) else v.detach()
            self._frozen = {key: detach(value) for key, value in table.items()}

    def unfreeze_task_params(self) -> None:
        self._frozen = None

    @property
    def task_params_frozen(self) -> bool:
        return self._frozen is not None

    freeze_prompts = freeze_task_params      # the names train.py and older code use
    unfreeze_prompts = unfreeze_task_params
    prompts_frozen = task_params_frozen

    def train(self, mode: bool = True):
        if mode:
            self.unfreeze_task_params()
        return super().train(mode)

    # ---- the Hugging Face interface -----------------------------------------------------------------------
    def forward(self, input_ids=None, attention_mask=None, labels=None, decoder_input_ids=None,
                decoder_attention_mask=None, task_ids=None, **kwargs):
        rows = next((x.shape[0] for x in (input_ids, decoder_input_ids, labels, kwargs.get("inputs_embeds"))
                     if x is not None), None)
        ctx = self.task_context(task_ids, rows)
        with self._using(ctx):
            inputs = self._encoder_inputs(ctx, input_ids, attention_mask, kwargs)
            out = self.t5(**inputs, labels=labels, decoder_input_ids=decoder_input_ids,
                          decoder_attention_mask=decoder_attention_mask, **kwargs)
        if labels is not None:
            mask = inputs["attention_mask"]
            if mask is None:
                mask = torch.ones(out.encoder_last_hidden_state.shape[:2], device=out.encoder_last_hidden_state.device)
            extra, parts = self.auxiliary_losses(ctx, out.encoder_last_hidden_state, mask)
            out.lm_loss = out.loss  # the language-model part: a mean over this batch's target tokens
            if extra is not None and self.training:  # a training objective: in eval, `loss` is T5's own
                out.loss = out.loss + extra
            out.aux_losses = {name: value.detach() for name, value in parts.items()}  # the loop logs their means
        return out

    @torch.no_grad()
    def generate(self, input_ids=None, attention_mask=None, task_ids=None, **generation_kwargs):
        embeds = generation_kwargs.get("inputs_embeds")
        ctx = self.task_context(task_ids, (input_ids if input_ids is not None else embeds).shape[0])
        with self._using(ctx):
            inputs = self._encoder_inputs(ctx, input_ids, attention_mask, generation_kwargs)
            inputs = {k: v for k, v in inputs.items() if v is not None}
            if self._default_cache(generation_kwargs):
                cache = prompt_cache(self.t5)  # decoder prompts held in the cache, not copied in each step
                if cache is not None:
                    generation_kwargs = {**generation_kwargs, "past_key_values": cache}
            return self.t5.generate(**inputs, **generation_kwargs)

    def _default_cache(self, generation_kwargs: dict) -> bool:
        """True when this generate call would cache with transformers' default (dynamic) cache: caching on, no cache
        passed in, no other cache asked for (`cache_implementation`). Each setting is resolved as transformers does:
        the keyword, else the passed generation config's value, else the model's, else the default (caching on).
        Only then does the prompt-holding cache stand in: a cache handed to `generate` is used even with
        `use_cache=False`, which would feed the whole prefix into it at every step."""
        configs = [generation_kwargs.get("generation_config"), self.t5.generation_config]

        def setting(name: str):
            if name in generation_kwargs:
                return generation_kwargs[name]
            return next((v for v in (getattr(c, name, None) for c in configs if c is not None) if v is not None), None)
        return setting("use_cache") is not False and setting("cache_implementation") is None and \
            generation_kwargs.get("past_key_values") is None

    # ---- analysis -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def attention_stats(self, batch: dict) -> dict[str, list[dict]]:
        """Per side and layer: attention mass on the prompt positions and entropy over real tokens (Fig. 3).

        Averaged over heads and the batch's real (unpadded) query positions. `batch` holds the forward's keys
        (input_ids, attention_mask, labels or decoder_input_ids, task_ids, ...).
        """
        inputs = {k: v for k, v in batch.items() if k != "task_ids"}
        ctx = self.task_context(batch.get("task_ids"), None)
        enc = self._encoder_inputs(ctx, inputs.pop("input_ids", None), inputs.pop("attention_mask", None), inputs)
        query_masks = {"encoder": enc["attention_mask"]}
        if batch.get("decoder_attention_mask") is not None:
            query_masks["decoder"] = batch["decoder_attention_mask"]
        elif batch.get("labels") is not None:
            query_masks["decoder"] = batch["labels"] != -100
        sums: dict[tuple[str, int], list[float]] = {}

        def recorder(key):
            def record(probs, n_prompt, bias):
                q_mask = query_masks.get(key[0])
                if q_mask is None:
                    q_mask = torch.ones(probs.shape[0], probs.shape[2], device=probs.device)
                weight = q_mask[:, None, -probs.shape[2]:].to(probs.dtype).expand(-1, probs.shape[1], -1)
                mass = probs[..., :n_prompt].sum(-1)
                real = probs[..., n_prompt:]
                real = real / real.sum(-1, keepdim=True).clamp_min(1e-30)
                entropy = -(real * real.clamp_min(1e-30).log()).sum(-1)
                total = weight.sum().clamp_min(1)
                sums[key] = [float((mass * weight).sum() / total), float((entropy * weight).sum() / total)]
            return record

        recorders = {key: recorder(key) for key in self_attention_modules(self.t5)}
        was_training = self.training
        self.eval()
        try:
            with self._using(ctx, recorders):
                self.t5(**enc, **inputs)
        finally:
            self.train(was_training)
        return {side: [{"layer": i, "prompt_mass": sums[(s, i)][0], "token_entropy": sums[(s, i)][1]}
                       for (s, i) in sorted(sums) if s == side] for side in SIDES}
