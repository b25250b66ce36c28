"""The multi-task T5 wrapper every method shares: task ids in, Hugging Face seq2seq outputs out.

A method subclasses `MultiTaskT5` and overrides `generate_prompts` (per-layer key/value prompts for all tasks)
and `extra_parameters`. Plain multi-task T5 (MTL) is this class as it is: no prompts.
"""
from __future__ import annotations

import torch
from torch import nn

from hpsearch.model.attention import SIDES, attach, self_attention_modules, use_prompted_attention

Prompts = dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]


class MultiTaskT5(nn.Module):
    def __init__(self, t5, tasks, cfg):
        super().__init__()
        self.t5 = t5
        self.tasks = list(tasks)
        self.cfg = cfg
        self._frozen: Prompts | None = None
        use_prompted_attention(t5)
        if cfg.train_task_params_only:
            t5.requires_grad_(False)

    @property
    def config(self):
        return self.t5.config

    # ---- prompts -------------------------------------------------------------------------------------------
    def generate_prompts(self, device=None) -> Prompts:
        """{(side, layer): (keys, values)} for every task, each [num_tasks, heads, l, d_kv]. MTL: none."""
        return {}

    def hyper_prompts(self, task_ids: torch.Tensor | None, batch_size: int | None = None) -> Prompts:
        """{(side, layer): (keys, values)}, each [batch, heads, l, d_kv], exactly as they enter attention."""
        if task_ids is not None:
            task_ids = torch.as_tensor(task_ids).long()
            if task_ids.dim() != 1 or (batch_size is not None and task_ids.numel() != batch_size):
                raise ValueError(f"task_ids must be a LongTensor [batch] with one id per row ({batch_size}); "
                                 f"got shape {tuple(task_ids.shape)}")
        if self._frozen is not None:
            table = self._frozen
        else:
            table = self.generate_prompts(task_ids.device if task_ids is not None else None)
        if not table:
            return {}
        if task_ids is None:
            raise ValueError("task_ids is required: a LongTensor [batch] of indices into model.tasks")
        task_ids = task_ids.to(next(iter(table.values()))[0].device)
        if task_ids.numel() and (task_ids.min() < 0 or task_ids.max() >= len(self.tasks)):
            raise ValueError(f"task_ids must lie in [0, {len(self.tasks)}); got {task_ids.tolist()}")
        return {key: (k[task_ids], v[task_ids]) for key, (k, v) in table.items()}

    def freeze_prompts(self, device=None) -> None:
        """Evaluate the generators once per task and layer; serve these static prompts until `train()`."""
        with torch.no_grad():
            self._frozen = {key: (k.detach(), v.detach()) for key, (k, v) in self.generate_prompts(device).items()}

    def unfreeze_prompts(self) -> None:
        self._frozen = None

    @property
    def prompts_frozen(self) -> bool:
        return self._frozen is not None

    def train(self, mode: bool = True):
        if mode:
            self.unfreeze_prompts()
        return super().train(mode)

    def extra_parameters(self) -> dict[str, int]:
        """Trainable parameters the method adds beyond the backbone, per component and under "total"."""
        return {"total": 0}

    # ---- the Hugging Face interface -----------------------------------------------------------------------
    def forward(self, input_ids=None, attention_mask=None, labels=None, decoder_input_ids=None,
                decoder_attention_mask=None, task_ids=None, **kwargs):
        rows = next((x.shape[0] for x in (input_ids, decoder_input_ids, labels, kwargs.get("inputs_embeds"))
                     if x is not None), None)
        with attach(self.t5, self.hyper_prompts(task_ids, rows)):
            return self.t5(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                           decoder_input_ids=decoder_input_ids, decoder_attention_mask=decoder_attention_mask,
                           **kwargs)

    def generate(self, input_ids, attention_mask=None, task_ids=None, **generation_kwargs):
        with attach(self.t5, self.hyper_prompts(task_ids, input_ids.shape[0])):
            return self.t5.generate(input_ids=input_ids, attention_mask=attention_mask, **generation_kwargs)

    # ---- analysis -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def attention_stats(self, batch: dict) -> dict[str, list[dict]]:
        """Per side and layer: attention mass on the prompt positions and entropy over real tokens (Fig. 3).

        Averaged over heads and the batch's real (unpadded) query positions. `batch` holds the forward's keys
        (input_ids, attention_mask, labels or decoder_input_ids, task_ids, ...).
        """
        query_masks = {"encoder": batch.get("attention_mask")}
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
        inputs = {k: v for k, v in batch.items() if k != "task_ids"}
        was_training = self.training
        self.eval()
        try:
            with attach(self.t5, self.hyper_prompts(batch.get("task_ids")), recorders):
                self.t5(**inputs)
        finally:
            self.train(was_training)
        return {side: [{"layer": i, "prompt_mass": sums[(s, i)][0], "token_entropy": sums[(s, i)][1]}
                       for (s, i) in sorted(sums) if s == side] for side in SIDES}
