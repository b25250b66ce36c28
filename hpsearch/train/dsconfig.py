"""The DeepSpeed config, the optimizer's parameter groups and the learning-rate schedule from a run config."""
from __future__ import annotations

from hpsearch.config import RunConfig


def use_bf16(cfg: RunConfig) -> bool:
    return cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and cfg.train.use_gpu)


# bytes of training state per parameter: weights, gradients and AdamW's two moments in fp32 (4 + 4 + 8), or bf16
# weights and gradients with fp32 master weights and moments (2 + 2 + 12)
STATE_BYTES_PER_PARAM = 16
DDP_BUCKET_BYTES = 25 * 2**20  # torch DistributedDataParallel's default bucket_cap_mb
AUTO_FITS = 0.5  # auto: stage 0 when the training state takes at most this share of a worker's memory


def auto_zero_stage(cfg: RunConfig, n_params: int, worker_memory: float, workers: int) -> tuple[int, str]:
    """`train.zero_stage=auto`: the stage for a model of `n_params` on `workers` workers with `worker_memory` bytes
    each (GPU memory, or the node's RAM shared by its workers), and why. When the whole training state fits
    comfortably, every rank keeps it (stage 0: plain data parallelism, no gathering of weights per layer, the
    fastest); else ZeRO-3 partitions it across the workers. One worker has no one to partition with (its one
    partition is the whole state, and ZeRO-3 only adds its gathers: 1.15-1.36x a step here), so it keeps stage 0
    and says it may run out of memory. Offloading asks for the stage it needs."""
    need = STATE_BYTES_PER_PARAM * n_params
    why = f"training state ~{need / 2**30:.2f} GiB, {worker_memory / 2**30:.1f} GiB per worker"
    fits = need <= AUTO_FITS * worker_memory
    too_big = " (more than half of it: may run out of memory)"
    if cfg.train.optimizer == "adafactor":
        return 0, why + ("" if fits else too_big) + "; adafactor needs each weight whole"
    if cfg.train.offload_params:
        return 3, "parameter offload needs stage 3"
    if not fits and workers > 1:
        return 3, why + ": partitioned"
    if cfg.train.offload_optimizer:
        return 2, why + "; optimizer offload needs stage >= 1"
    if not fits:
        return 0, (why + too_big + "; one worker: nothing to partition across (train.offload_optimizer=true moves the "
                   "optimizer state to the host, more workers partition it)")
    return 0, why + ": fits each worker"


def deepspeed_config(cfg: RunConfig, world_size: int, stage: int | None = None, hidden: int | None = None) -> dict:
    """The DeepSpeed config generated from a run config; `stage` resolves `train.zero_stage=auto` (default 3).
    `hidden` (the model's d_model) sizes ZeRO's buffers to the model, as the Hugging Face integration's "auto" values
    do: DeepSpeed's defaults (a 5e8-element reduce bucket, 2 GB in fp32, on every rank whatever the model) are
    sized for billion-parameter models. The reduce bucket is d_model² elements but at least the 25 MiB of gradients
    of a PyTorch DDP bucket: at d_model² (1 MiB in fp32 at t5-small) a step's gradients go out in ~230 reductions,
    each a collective call and a bucket's worth of Python, and one ZeRO-3 rank's t5-small step took 3.7 % longer
    (docs/performance.md)."""
    t = cfg.train
    zero: dict = {"stage": t.zero_stage if isinstance(t.zero_stage, int) else (3 if stage is None else stage)}
    if hidden:
        grad_bytes = 2 if use_bf16(cfg) or t.precision == "fp16" else 4
        zero["reduce_bucket_size"] = max(hidden * hidden, DDP_BUCKET_BYTES // grad_bytes)
        if zero["stage"] == 3:
            zero["stage3_prefetch_bucket_size"] = int(0.9 * hidden * hidden)
            zero["stage3_param_persistence_threshold"] = 10 * hidden
    if t.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": t.use_gpu}
    if t.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": t.use_gpu}
    config = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        # bf16 at stage 0 is torch's autocast (fp32 weights, bf16 matmuls): DeepSpeed's bf16 there wraps the optimizer
        # in FP16_UnfusedOptimizer, whose overflow check reads every gradient on the host (a device synchronisation
        # per parameter tensor, every optimizer step: 55 a step at t5-tiny, ~260 at t5-base); stages 1-3 keep bf16
        "bf16": {"enabled": use_bf16(cfg) and zero["stage"] != 0},
        "torch_autocast": {"enabled": use_bf16(cfg) and zero["stage"] == 0, "dtype": "bfloat16"},
        "fp16": {"enabled": t.precision == "fp16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default) synchronises the device as each forward starts and each step
        # ends, to time them for a samples/s line the recipe never prints: two synchronisations every micro-step
        "timers": {"throughput": {"enabled": False}},
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



def optimizer_groups(model, cfg: RunConfig) -> list[dict]:
    """The trainable parameters as AdamW's groups: everything at train.lr, and the token-embedding table at
    train.lr x train.embedding_lr_scale when that is not 1 (and the table trains). The first group is always the
    one at train.lr, which is the rate the loop logs; the schedule (`lr_lambda`) scales every group alike.

    Why a separate rate: T5's embeddings start at std 1 while AdamW moves every weight by about the same absolute
    amount per step, so at the rate that suits the layers the table barely moves (README, pretraining)."""
    params = [p for p in model.parameters() if p.requires_grad]
    scale = cfg.train.embedding_lr_scale
    table = model.get_input_embeddings().weight if scale != 1 else None
    if table is None or not table.requires_grad:
        return [{"params": params, "lr": cfg.train.lr}]
    rest = [p for p in params if p is not table]
    return [{"params": rest, "lr": cfg.train.lr}, {"params": [table], "lr": cfg.train.lr * scale}]


def optimizer_and_schedule(model, cfg: RunConfig):
    """The optimizer (`train.optimizer`) over `optimizer_groups` and its schedule (`lr_lambda`), which the DeepSpeed
    engine steps. AdamW moves every weight by about lr per step whatever its size; Adafactor (torch's, as in T5:
    factored second moments, no momentum, update clipping at 1) moves each by lr x max(1e-3, RMS(weight)), so T5's
    embeddings (std 1) and its query projections (std (d_model x d_kv)^-0.5) each move by the same share of
    themselves. Its lr is that share (T5: 1e-2); the schedule scales it like AdamW's. AdamW is torch's fused
    implementation; DeepSpeed's ZeRO steps it over its flat partitions the same way."""
    import torch

    groups = optimizer_groups(model, cfg)
    if cfg.train.optimizer == "adafactor":
        optimizer = torch.optim.Adafactor(groups, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    else:
        # fused: one kernel over every tensor (CPU and CUDA). The default on CPU is a Python loop of about ten
        # ops per tensor, 209 ms of a 2.1 s t5-small step here against 45 ms fused (docs/performance.md)
        optimizer = torch.optim.AdamW(groups, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, fused=True)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
