"""The DeepSpeed config and the learning-rate schedule generated from a run config."""
from __future__ import annotations

from hpsearch.config import RunConfig


def use_bf16(cfg: RunConfig) -> bool:
    return cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and cfg.train.use_gpu)


def deepspeed_config(cfg: RunConfig, world_size: int) -> dict:
    """The DeepSpeed config generated from a run config (ZeRO stage 3 by default)."""
    t = cfg.train
    zero: dict = {"stage": t.zero_stage}
    if t.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": t.use_gpu}
    if t.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": t.use_gpu}
    config = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": use_bf16(cfg)},
        "fp16": {"enabled": t.precision == "fp16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,  # torch AdamW: no fused-Adam op build, works on CPU and GPU
        "zero_force_ds_cpu_optimizer": False,    # ...also with ZeRO-Offload (optimizer step on CPU in torch)
    }
    return config


def lr_lambda(cfg: RunConfig):
    """Linear warm-up to train.lr, then linear decay to 0 at train.max_steps."""
    warm, total = cfg.train.warmup_steps, cfg.train.max_steps

    def factor(step: int) -> float:  # step = index of the optimizer update, 0-based
        if step < warm:
            return (step + 1) / warm
        return max(0.0, (total - step) / (total - warm + 1))
    return factor

