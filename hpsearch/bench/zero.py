"""Group `deepspeed`: one DeepSpeed rank (in this process, gloo, world size 1) ÷ a plain torch loop, same model.

The model is the run config's default method at the benchmark's shape; the DeepSpeed config is the one the
training recipe generates (`hpsearch.train.deepspeed_config`) for the config's ZeRO stage, for stage 3 and for
stage 0. The plain loop does what the engine does: forward, backward, gradient clipping, AdamW, LR schedule; the
engine's backward is the recipe's (`gradient_sync`: one rank at stage 0 does not reduce its gradients).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import socket
import sys
import warnings

import torch

from hpsearch.bench.rows import BATCH, BatchShape
from hpsearch.bench.timing import Pool, error_line, ratio

GOAL = 1.10


def _init_process_group() -> bool:
    """A one-rank gloo group, unless one exists; True when this call created it."""
    if torch.distributed.is_initialized():
        return False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    return True


def plain_step(model, cfg, batch):
    from hpsearch.train import optimizer_and_schedule

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = optimizer_and_schedule(model, cfg)

    def step():
        model(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def engine_step(model, cfg, batch):
    import deepspeed

    from hpsearch.train import deepspeed_config, optimizer_and_schedule
    from hpsearch.train.loop import gradient_sync

    optimizer, scheduler = optimizer_and_schedule(model, cfg)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                      config=deepspeed_config(cfg, 1, hidden=model.config.d_model))

    def step():
        loss = engine(**batch).loss
        with gradient_sync(engine):  # the recipe's backward
            engine.backward(loss)
        engine.step()
    return step, engine


def _with_linear(setup, linear):
    """`setup`, after making `linear` torch.nn.functional's."""
    def setup_with_linear():
        torch.nn.functional.linear = linear
        setup()
    return setup_with_linear


def run(shape: str, n_tasks: int, reps: int, batching: str, log,
        batch_shape: BatchShape = BATCH) -> tuple[list, dict]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import psutil

    from hpsearch.bench.models import batch_shape_of, make_batch
    from hpsearch.config import load_config
    from hpsearch.model import build_from_config
    from hpsearch.train.build import release
    from hpsearch.train.dsconfig import auto_zero_stage
    from hpsearch.train.ops import import_deepspeed, load_ops

    deepspeed = import_deepspeed()

    deepspeed.utils.logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated")
    cfg = load_config(None, [f"model.backbone={shape}", f"train.micro_batch_size={batch_shape.rows}",
                             "train.num_workers=1"])
    stages = [3, 0]
    created = _init_process_group()
    load_ops()
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's op builder prints; stdout is the report's
        deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    base = build_from_config(cfg.model, [f"task{i}" for i in range(n_tasks)])
    batch = make_batch(base.config.vocab_size, n_tasks, batching, batch_shape)
    auto, _ = auto_zero_stage(cfg, sum(p.numel() for p in base.parameters()), psutil.virtual_memory().total, 1)
    log(f"DeepSpeed stages {stages} vs a plain loop: {cfg.model.method} at {shape} (zero_stage=auto: {auto})")
    pool, errors, engines = Pool(), {}, []
    plain = copy.deepcopy(base)
    # ZeRO-3's engine replaces torch.nn.functional.linear process-wide (memory_efficient_linear), and nn.Linear
    # looks it up at each call: every entry runs with the one it would have in a process of its own
    native = torch.nn.functional.linear
    pool.add("torch", plain_step(plain, cfg, batch), setup=_with_linear(plain.train, native))
    for stage in stages:
        cfg.train.zero_stage = stage
        try:
            with contextlib.redirect_stdout(sys.stderr):
                step, engine = engine_step(copy.deepcopy(base), cfg, batch)
            engines.append(engine)
            pool.add(f"zero{stage}", step, setup=_with_linear(engine.train, torch.nn.functional.linear))
        except Exception as e:
            errors[f"deepspeed:zero{stage}"] = error_line(e)
        finally:
            torch.nn.functional.linear = native
    del base
    try:
        timings, failed = pool.run(reps, log)
    finally:
        torch.nn.functional.linear = native  # the groups after this one time plain torch
        for engine in engines:  # else DeepSpeed keeps a ZeRO-3 engine and its model for the rest of the run
            release(engine)
        if created:
            torch.distributed.destroy_process_group()
    errors.update(failed)
    figures = [ratio(f"deepspeed/zero{s}_vs_torch", f"zero{s}", "torch", timings, GOAL,
                     f"train step, one DeepSpeed ZeRO-{s} rank (recipe's config) ÷ plain torch loop, same model"
                     + (" (the default, zero_stage=auto, picks it here)" if s == auto else ""))
               for s in stages]
    figures = [f for f in figures if f is not None]
    for f in figures:  # the batch these were timed on, read off its tensors
        f.parts["batch_shape"] = batch_shape_of(batch)
    return figures, errors
