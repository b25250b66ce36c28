"""Prompt Tuning (Lester, Al-Rfou, Constant 2021), made multi-task as in the HyperPrompt paper's comparison.

Each task tau owns l soft-prompt vectors P_tau in R^{l x d}, prepended to the encoder's input embeddings:

    encoder(inputs_embeds = [P_tau; embed(ids)], attention_mask = [1 ... 1; mask])

so T5's relative positions include the prompt (as in the original); the decoder is untouched and its
cross-attention sees the prompt positions too. `train_task_params_only=True` is Lester's setting (frozen model);
the HyperPrompt paper tunes the whole model.

Initialisation (`prompt_init`):
- random: uniform in [-0.5, 0.5] (Lester's random-uniform init).
- vocab:  embeddings of tokens sampled from the 5,000 most common vocabulary entries. T5's SentencePiece
          vocabulary is ordered by piece score (roughly frequency), so these are ids 3 .. 5002 (after pad, eos,
          unk); with a real tokenizer's counts, pass them through `init_prompts(frequent_ids=...)`.
- labels: the embeddings of each task's class labels (a multi-token label: the mean of its tokens' embeddings,
          as Lester), then sampled vocabulary once the labels run out. The model cannot know label tokens
          without a tokenizer: construction falls back to vocab, and the trainer calls
          `model.init_prompts(label_token_ids)` once the tokenizer is known (before `deepspeed.initialize`).

Extra parameters: T * l * d.

The prompts are an embedding row per task read by calling the embedding module (ZeRO-3 safe), and the token
embeddings come from calling the encoder's own embedding module, as stock T5 would.
"""
from __future__ import annotations

import torch
from torch import nn

from hpsearch.model.base import Formula, MultiTaskT5, TaskContext, values_absent

FREQUENT = range(3, 5003)  # T5 SentencePiece ids after pad/eos/unk; see the module docstring


class PromptTuningT5(MultiTaskT5):
    """Multi-task T5 with per-task soft prompts prepended to the encoder input."""

    def __init__(self, t5, tasks, cfg):
        super().__init__(t5, tasks, cfg)
        self.prompt_length, self.d_model = cfg.prompt_length, t5.config.d_model
        self.prompts = nn.Embedding(len(self.tasks), self.prompt_length * self.d_model)
        self.init_prompts()

    def init_task_params(self, label_token_ids=None) -> None:
        if self.cfg.prompt_init == "labels" and label_token_ids is not None:
            self.init_prompts(label_token_ids)  # the class labels' embeddings, then vocabulary

    @torch.no_grad()
    def init_prompts(self, token_ids_per_task=None, frequent_ids=None) -> None:
        """(Re-)initialise the prompts per `cfg.prompt_init`.

        token_ids_per_task[k]: task k's class labels, each a token id or a list of token ids (labels init only);
        frequent_ids: candidate token ids for vocab sampling (default: ids 3 .. 5002, clipped to the vocabulary).
        Runs the embedding module on the whole model: call before ZeRO-3 partitions the parameters.
        """
        weight = self.prompts.weight
        if values_absent(weight, self.t5.encoder.embed_tokens.weight):  # a skeleton: its values come later
            return
        n_tasks, l, d = len(self.tasks), self.prompt_length, self.d_model
        if self.cfg.prompt_init == "random":
            weight.uniform_(-0.5, 0.5)
            return
        vocab = self.t5.config.vocab_size
        pool = torch.as_tensor(list(frequent_ids) if frequent_ids is not None else
                               [i for i in FREQUENT if i < vocab] or list(range(vocab)), dtype=torch.long)
        ids = pool[torch.randint(len(pool), (n_tasks, l))]
        embed = self.t5.encoder.embed_tokens
        prompts = embed(ids.to(embed.weight.device)).to(weight.dtype)                   # [T, l, d]
        if self.cfg.prompt_init == "labels" and token_ids_per_task is not None:
            if len(token_ids_per_task) != n_tasks:
                raise ValueError(f"token_ids_per_task: {len(token_ids_per_task)} entries for {n_tasks} tasks")
            for task, labels in enumerate(token_ids_per_task):
                for row, label in enumerate(list(labels)[:l]):
                    tokens = torch.as_tensor([label] if isinstance(label, int) else list(label), dtype=torch.long)
                    prompts[task, row] = embed(tokens.to(embed.weight.device)).mean(0).to(weight.dtype)
        weight.copy_(prompts.reshape(n_tasks, l * d))

    def prepare_encoder_inputs(self, ctx: TaskContext, inputs: dict) -> dict:
        embeds = inputs["inputs_embeds"]
        if embeds is None:
            embeds = self.t5.encoder.embed_tokens(inputs["input_ids"])
        rows, n = embeds.shape[:2]
        prompts = self.prompts(ctx.ids(rows).to(embeds.device)).view(rows, self.prompt_length, self.d_model)
        mask = inputs["attention_mask"]
        if mask is None:
            mask = torch.ones(rows, n, dtype=torch.long, device=embeds.device)
        ones = torch.ones(rows, self.prompt_length, dtype=mask.dtype, device=mask.device)
        return dict(input_ids=None, inputs_embeds=torch.cat([prompts.to(embeds.dtype), embeds], dim=1),
                    attention_mask=torch.cat([ones, mask], dim=1))

    def parameter_formula(self) -> Formula:
        T, l, d = len(self.tasks), self.prompt_length, self.d_model
        return Formula("T * l * d", dict(T=T, l=l, d=d), T * l * d)
