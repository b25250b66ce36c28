"""Shared pieces of the model tests: a tiny T5 shape, a stock copy with the same weights, logits, a short overfit."""
from __future__ import annotations

import torch
from transformers import T5Config, T5ForConditionalGeneration


def tiny_config(**kw) -> T5Config:
    values = dict(d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=8, vocab_size=64,
                  dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                  relative_attention_num_buckets=8, relative_attention_max_distance=16)
    values.update(kw)
    return T5Config(**values)


def stock_copy(model) -> T5ForConditionalGeneration:
    """Stock `T5ForConditionalGeneration` (eager attention) with the wrapped backbone's weights."""
    stock = T5ForConditionalGeneration(model.t5.config.__class__(**model.t5.config.to_dict()))
    stock.load_state_dict(model.t5.state_dict())
    stock.set_attn_implementation("eager")
    return stock.eval()


def logits(model, batch, **kw):
    with torch.no_grad():
        return model(**{**batch, **kw}).logits


def overfit(model, batch, steps=30):
    """A few Adam steps on one batch: an untrained model decodes one token over and over."""
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    model.eval()
