"""`python -m hpsearch.train`: train one configuration. Ray Train runs the workers; each runs DeepSpeed ZeRO-3.

    python -m hpsearch.train [--config FILE.yaml] [--local] [--resume-from DIR] [key=value ...]

The one place that knows DeepSpeed. The same `train_loop` runs in Ray Train workers (`build_trainer`, also used
by the search) and, with `--local`, in this process without Ray, for debugging.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

from hpsearch.cli import run_main
from hpsearch.config import RunConfig, dump_yaml, load_config
from hpsearch.errors import UserError


# ---- DeepSpeed config ---------------------------------------------------------------------------------------------
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


# ---- where reports and checkpoints go --------------------------------------------------------------------------
class LocalSession:
    """`--local`: report to stdout, checkpoints under output_dir/checkpoints/step_N."""

    def __init__(self, cfg: RunConfig, resume_from: str | None):
        self.dir = Path(cfg.train.output_dir) / "checkpoints"
        self.resume_from = resume_from
        self.history: list[dict] = []

    rank, world_size = 0, 1

    def get_checkpoint_dir(self) -> str | None:
        return self.resume_from

    def report(self, metrics: dict, checkpoint_dir: str | None) -> None:
        if checkpoint_dir:
            target = self.dir / f"step_{metrics['step']}"
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(checkpoint_dir, target)
            metrics = {**metrics, "checkpoint": str(target)}
        self.history.append(metrics)


class RaySession:
    """Inside a Ray Train worker: ray.train.report (every rank, its own ZeRO shard) and get_checkpoint."""

    def __init__(self):
        import ray.train
        ctx = ray.train.get_context()
        self.rank, self.world_size = ctx.get_world_rank(), ctx.get_world_size()
        self._ckpt = ray.train.get_checkpoint()
        self._resume_dir = None

    def get_checkpoint_dir(self) -> str | None:
        if self._ckpt is None:
            return None
        self._resume_dir = tempfile.mkdtemp(prefix="hpsearch-resume-")
        return self._ckpt.to_directory(self._resume_dir)

    def report(self, metrics: dict, checkpoint_dir: str | None) -> None:
        import ray.train
        ckpt = ray.train.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
        ray.train.report(metrics, checkpoint=ckpt)


# ---- the training loop (one per worker) ------------------------------------------------------------------------
class NonFiniteLoss(RuntimeError):
    pass


def _all_ranks_any(flag: bool, device) -> bool:
    t = torch.tensor([1.0 if flag else 0.0], device=device)  # on the backend's device (NCCL: CUDA)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def _all_ranks_sum(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t)
    return t.tolist()


def _copy_rank_files(src: Path, dst: Path, rank: int) -> None:
    """Copy this rank's files of a DeepSpeed checkpoint folder (rank 0 also the shared ones)."""
    for f in sorted(src.rglob("*")):
        if f.is_file() and (f"zero_pp_rank_{rank}_" in f.name or (rank == 0 and "zero_pp_rank_" not in f.name)):
            target = dst / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def train_loop(loop_config: dict, session=None) -> dict:
    """Train `loop_config["run"]` (a RunConfig dict) on this rank; returns the final metrics."""
    cfg = load_config(base=loop_config["run"])
    if not cfg.train.use_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    from hpsearch.data import MultiTaskSampler, encode_batch, get_tokenizer, load_suite
    from hpsearch.model import build_from_config

    session = session or RaySession()
    rank, world = session.rank, session.world_size
    if not torch.distributed.is_initialized():
        _init_single_process_group("nccl" if cfg.train.use_gpu else "gloo")
    deepspeed.init_distributed(dist_backend="nccl" if cfg.train.use_gpu else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.train.use_gpu else torch.device("cpu")

    suite = load_suite(cfg.data)
    torch.manual_seed(cfg.train.seed)
    model = build_from_config(cfg.model, suite.tasks)
    tokenizer = get_tokenizer(cfg.model.backbone, cfg.data, suite, model.t5.config.vocab_size)
    extra_params = model.extra_parameters()["total"]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                      config=deepspeed_config(cfg, world))  # the engine steps both
    sampler = MultiTaskSampler(suite.sizes("train"), cfg.train.micro_batch_size, cfg.data.temperature,
                               cfg.data.batching, cfg.data.seed, rank, world)
    step, best = 0, {"score": -math.inf, "step": 0}
    out_dir = Path(cfg.train.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    resume_dir = session.get_checkpoint_dir()
    if resume_dir:
        try:
            _, client = engine.load_checkpoint(resume_dir, tag="state")
            sampler.load_state_dict(client["sampler"])
        except Exception as e:
            raise UserError(f"resume checkpoint {resume_dir} does not match this run's config "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None
        step, best = client["step"], client["best"]
        _set_rng_state(client["rng"])
        # the best weights so far: rank 0 clears the folder, then every rank copies in its own shard
        if rank == 0:
            shutil.rmtree(out_dir / "best", ignore_errors=True)
        torch.distributed.barrier()
        _copy_rank_files(Path(resume_dir) / "best", out_dir / "best", rank)
        torch.distributed.barrier()
        _rank0_print(rank, f"resumed from {resume_dir} at step {step}")
        if isinstance(session, RaySession):
            shutil.rmtree(resume_dir, ignore_errors=True)  # a downloaded copy of the Ray checkpoint
    elif rank == 0:
        (out_dir / "metrics.jsonl").unlink(missing_ok=True)
    evaluator = Evaluator(engine, suite, tokenizer, cfg, rank, world, device)
    t_start, tokens, loss_sum, loss_n, t_last = time.perf_counter(), 0, 0.0, 0, time.perf_counter()
    lr_used = cfg.train.lr
    steps_at_start = step
    final: dict = {}
    while step < cfg.train.max_steps:
        engine.train()
        step_loss = 0.0
        for _ in range(cfg.train.grad_accum):
            picks = next(sampler)
            examples = [suite.split(suite.tasks[t], "train")[i] for t, i in picks]
            batch = {k: v.to(device) for k, v in encode_batch(examples, [t for t, _ in picks], tokenizer,
                                                              cfg.data).items()}
            loss = engine(**batch).loss
            if cfg.train.debug_nan_at_step is not None and step + 1 == cfg.train.debug_nan_at_step:
                loss = loss * float("nan")
            if _all_ranks_any(not torch.isfinite(loss).item(), device):
                raise NonFiniteLoss(f"non-finite loss ({loss.item()}) at step {step + 1}: stopping the run "
                                    f"(lower train.lr or raise train.warmup_steps)")
            engine.backward(loss)
            lr_used = engine.get_lr()[0]  # the learning rate this update uses
            engine.step()
            step_loss += loss.item() / cfg.train.grad_accum
            tokens += int(batch["attention_mask"].sum() + (batch["labels"] != -100).sum())
        step += 1
        if cfg.train.debug_crash_at_step == step and not resume_dir and rank == 0:
            time.sleep(5)  # let the controller collect the last report (V2 polls workers for reports)
            os._exit(17)  # a worker dies (simulated preemption); Ray Train restarts from the last checkpoint
        loss_sum, loss_n = loss_sum + step_loss, loss_n + 1
        if step % cfg.train.log_every == 0 or step == cfg.train.max_steps:
            elapsed = time.perf_counter() - t_start
            rate = (step - steps_at_start) / elapsed
            _rank0_print(rank, f"step {step}/{cfg.train.max_steps} loss {step_loss:.4f} {rate:.2f} steps/s "
                               f"ETA {(cfg.train.max_steps - step) / max(rate, 1e-9):.0f}s")
        if step % cfg.train.eval_every == 0 or step == cfg.train.max_steps:
            now = time.perf_counter()
            loss_total, tokens_total = _all_ranks_sum([loss_sum, tokens], device)  # over all ranks' shards
            metrics = {"step": step, "loss": loss_total / (loss_n * world), "lr": lr_used,
                       "step_time": (now - t_last) / loss_n, "tokens_per_s": tokens_total / (now - t_last),
                       "extra_params": extra_params}
            metrics.update(evaluator.evaluate("validation"))
            if metrics["score"] > best["score"]:
                best = {"score": metrics["score"], "step": step}
                engine.save_checkpoint(str(out_dir / "best"), tag="best")  # every rank: its own shard
            final = metrics
            with tempfile.TemporaryDirectory(prefix="hpsearch-ckpt-") as ckpt:
                engine.save_checkpoint(ckpt, tag="state", client_state={
                    "sampler": sampler.state_dict(), "step": step, "best": best, "rng": _rng_state()})
                _copy_rank_files(out_dir / "best", Path(ckpt) / "best", rank)  # best weights travel along
                if step == cfg.train.max_steps:
                    final = {**metrics, **finish(engine, evaluator, cfg, rank, best)}
                if rank == 0:
                    with open(out_dir / "metrics.jsonl", "a") as f:
                        f.write(json.dumps(final) + "\n")
                session.report(final, ckpt)
            tokens, loss_sum, loss_n, t_last = 0, 0.0, 0, time.perf_counter()
    return final


def finish(engine, evaluator, cfg, rank, best) -> dict:
    """Load the best validation checkpoint, export it, and score it on the test split."""
    import deepspeed

    from hpsearch.model import save_export, save_task_params

    out_dir = Path(cfg.train.output_dir)
    has_best = _all_ranks_sum([float((out_dir / "best" / "best").is_dir())], evaluator.device)[0] == evaluator.world
    if best["step"] and has_best:
        engine.load_checkpoint(str(out_dir / "best"), tag="best", load_optimizer_states=False,
                               load_lr_scheduler_states=False)
    else:  # no validation score ever (no validation rows): the last weights are the result
        best = {"score": best["score"], "step": cfg.train.max_steps}  # finish() runs at the last step
    model = engine.module
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):  # every rank joins the gather
        if rank == 0:
            state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            save_export(model, out_dir / "model", state)
            save_task_params(model, out_dir / "task_params", state)
            (out_dir / "config.yaml").write_text(dump_yaml(cfg))
    test = evaluator.evaluate("test", prefix="test")
    return {"test_score": test.pop("test_score"), **test, "best_step": best["step"], "final": 1.0,
            "output_dir": str(out_dir.resolve())}


class Evaluator:
    """Generate on every task's split, parse, score. Rows are sharded over ranks; every rank runs the same
    number of generate calls (ZeRO-3 gathers parameters collectively), with `synced_gpus` across ranks."""

    def __init__(self, engine, suite, tokenizer, cfg, rank, world, device):
        self.engine, self.suite, self.tok, self.cfg = engine, suite, tokenizer, cfg
        self.rank, self.world, self.device = rank, world, device

    @torch.no_grad()
    def evaluate(self, split: str, prefix: str = "") -> dict:
        from hpsearch.data import decode, encode_batch, score_task, suite_score

        model = self.engine.module
        model.eval()
        model.freeze_prompts()  # inference pays no hypernetwork cost
        bs = self.cfg.train.eval_batch_size
        metrics, scores = {}, {}
        for task_id, task in enumerate(self.suite.tasks):
            rows = self.suite.split(task, split)
            if not rows:
                continue
            mine = list(range(self.rank, len(rows), self.world))
            n_batches = math.ceil(math.ceil(len(rows) / self.world) / bs)
            preds: dict[int, str] = {}
            for b in range(n_batches):
                idx = mine[b * bs:(b + 1) * bs]
                examples = [rows[i] for i in idx] or [rows[0]]  # a dummy row keeps ranks in lockstep
                batch = encode_batch(examples, [task_id] * len(examples), self.tok, self.cfg.data)
                out = model.generate(batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device),
                                     task_ids=batch["task_ids"].to(self.device),
                                     max_new_tokens=self.cfg.train.max_new_tokens, do_sample=False, num_beams=1,
                                     synced_gpus=self.world > 1)
                preds.update(zip(idx, decode(self.tok, out)))
            if self.world > 1:
                gathered: list = [None] * self.world
                torch.distributed.all_gather_object(gathered, preds)
                preds = {k: v for part in gathered for k, v in part.items()}
            result = score_task(task, [preds[i] for i in range(len(rows))], rows)
            scores[task] = result["score"]
            tag = prefix or "task"
            metrics.update({f"{tag}/{task}/{name}": value for name, value in result.items()})
        model.train()
        metrics[f"{prefix}_score" if prefix else "score"] = suite_score(scores) if scores else float("nan")
        return metrics


def _rank0_print(rank: int, text: str) -> None:
    if rank == 0:
        print(f"[hpsearch.train] {text}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_single_process_group(backend: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.distributed.init_process_group(backend, rank=0, world_size=1)


# ---- Ray Train ----------------------------------------------------------------------------------------------------
def _ray_train_loop(loop_config: dict) -> None:
    train_loop(loop_config)


def runtime_env_vars(cfg: RunConfig) -> dict[str, str]:
    env = {"PYTHONWARNINGS": "ignore::FutureWarning,ignore::UserWarning", "TOKENIZERS_PARALLELISM": "false"}
    if not cfg.train.use_gpu:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def init_ray(cfg: RunConfig) -> None:
    """Join the cluster named by RAY_ADDRESS (set for a job by `ray job submit`), else start a private local Ray
    (never another Ray found on this machine) with its dashboard on 127.0.0.1.

    The dashboard stays on and its address is handed to every actor: Ray Train's placement-group cleaner asks the
    State API whether a run's Train controller is still alive, and without a dashboard, or with several Ray
    instances on one machine, it cannot tell, so a stopped run's workers are never released and the next run
    waits for them forever."""
    import ray

    env = runtime_env_vars(cfg)
    if os.environ.get("RAY_ADDRESS"):
        env["RAY_ADDRESS"] = os.environ["RAY_ADDRESS"]
        ray.init(include_dashboard=True, runtime_env={"env_vars": env})
        return
    port = free_port()
    env["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    ray.init(address="local", include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=port,
             _node_ip_address="127.0.0.1", runtime_env={"env_vars": env})  # every service on loopback


def build_trainer(cfg: RunConfig, *, name: str, storage_path: str, callbacks=(), resume_from_checkpoint=None):
    """A Ray Train V2 TorchTrainer running `train_loop` on `train.num_workers` DeepSpeed ranks."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    resources = {"CPU": cfg.train.cpus_per_worker}
    if cfg.train.use_gpu:
        resources["GPU"] = cfg.train.gpus_per_worker
    import importlib
    # by reference (module hpsearch.train), even when this file runs as __main__ (`python -m hpsearch.train`)
    loop = importlib.import_module("hpsearch.train")._ray_train_loop
    return TorchTrainer(
        loop,
        train_loop_config={"run": cfg.to_dict()},
        torch_config=TorchConfig(backend="nccl" if cfg.train.use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=cfg.train.num_workers, use_gpu=cfg.train.use_gpu,
                                               resources_per_worker=resources),
        run_config=ray.train.RunConfig(
            name=name, storage_path=storage_path, callbacks=list(callbacks),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1),
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),  # quiet the controller's INFO lines
            failure_config=ray.train.FailureConfig(max_failures=cfg.train.max_failures)),
        resume_from_checkpoint=resume_from_checkpoint,
    )


def run_with_ray(cfg: RunConfig, resume_from: str | None) -> dict:
    import ray
    import ray.train

    started = not ray.is_initialized()
    if started:
        init_ray(cfg)
    storage = str(Path(cfg.train.output_dir, "ray").resolve())
    ckpt = ray.train.Checkpoint.from_directory(resume_from) if resume_from else None
    name = time.strftime("train-%Y%m%d-%H%M%S")  # a new Ray Train run (a same-named one would auto-resume)
    trainer = build_trainer(cfg, name=name, storage_path=storage, resume_from_checkpoint=ckpt)
    try:
        result = trainer.fit()
    except Exception as e:  # Ray wraps a worker's error; surface its reason in one line
        if os.environ.get("HPSEARCH_DEBUG"):
            raise
        raise TrainingFailed(failure_reason(e)) from None
    finally:
        if started:
            ray.shutdown()  # flushes worker logs before the final JSON line
    return dict(result.metrics)


class TrainingFailed(UserError):
    """The run stopped with a reason (non-finite loss, a worker error): one line, exit code 2."""


def failure_reason(e: BaseException) -> str:
    """One line from Ray's wrapped worker error: the non-finite-loss reason, else the last error line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not set(ln.strip()) <= set("=-")]
    for line in lines:
        if "non-finite loss" in line:
            return line[line.index("non-finite loss"):]
    errors = [ln for ln in lines if "Error" in ln.split(":")[0]]
    return (errors or lines or [type(e).__name__])[-1]


# ---- command line -----------------------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpsearch.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="run config YAML (sections model, data, train)")
    parser.add_argument("--local", action="store_true", help="run the loop in this process, without Ray")
    parser.add_argument("--resume-from", help="a checkpoint directory to resume from")
    parser.add_argument("overrides", nargs="*", help="dotted key=value, e.g. model.variant=global")
    args = parser.parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides)
    from hpsearch.data import load_suite
    load_suite(cfg.data)  # data mistakes fail here, before any worker starts
    if args.resume_from and not (Path(args.resume_from) / "state").is_dir():
        raise UserError(f"--resume-from: {args.resume_from} is not a checkpoint (expected a directory holding "
                        "state/, e.g. <train.output_dir>/checkpoints/step_N)")
    if args.local and cfg.train.use_gpu and not torch.cuda.is_available():
        raise UserError("train.use_gpu=true but this machine has no CUDA device; use train.use_gpu=false")
    if args.local:
        if cfg.train.num_workers != 1:
            print("[hpsearch.train] --local runs one rank (train.num_workers ignored)", file=sys.stderr)
            cfg.train.num_workers = 1
        try:
            metrics = train_loop({"run": cfg.to_dict()}, LocalSession(cfg, args.resume_from))
        except NonFiniteLoss as e:
            raise TrainingFailed(str(e)) from None
    else:
        metrics = run_with_ray(cfg, args.resume_from)
    tasks = {k.split("/")[1]: v for k, v in metrics.items() if k.startswith("task/") and k.endswith("/score")}
    summary = {"step": metrics.get("step"), "loss": metrics.get("loss"), "score": metrics.get("score"),
               "test_score": metrics.get("test_score"), "tasks": tasks, "output_dir": metrics.get("output_dir"),
               "extra_params": metrics.get("extra_params"), "best_step": metrics.get("best_step")}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    run_main(main)
