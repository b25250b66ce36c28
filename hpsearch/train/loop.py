"""The training loop, one per rank: DeepSpeed engine, sampled batches, evaluations, checkpoints, the final export."""
from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import time
from pathlib import Path

import torch

from hpsearch.config import load_config
from hpsearch.errors import UserError, disk_full
from hpsearch.model import backbones
from hpsearch.train import bestweights, checkpoints, hostmem, startup
from hpsearch.train.build import ModelBuilder, release, unique_parameters, use_zero_init
from hpsearch.train.dsconfig import auto_zero_stage, deepspeed_config, optimizer_and_schedule
from hpsearch.train.launch import free_port
from hpsearch.train.objective import LABEL_TOKENS, load_objective
from hpsearch.train.ops import import_deepspeed, load_ops
from hpsearch.train.prefetch import Prefetch
from hpsearch.train.sessions import RaySession


class NonFiniteLoss(RuntimeError):
    pass


class Window:
    """Sums kept on the device between host synchronisations (no `.item()` per micro-step): the evaluation window's
    loss and tokens, the log window's loss, the first step whose loss was not finite, a method's auxiliary losses.
    `fold()` all-reduces them in one collective at a log or evaluation boundary."""

    def __init__(self, device):
        self.zero = lambda: torch.zeros((), dtype=torch.float64, device=device)
        self.eval_loss, self.tokens, self.log_loss, self.first_bad = self.zero(), self.zero(), self.zero(), \
            self.zero()
        self.aux: dict[str, torch.Tensor] = {}

    def add(self, step: int, loss: torch.Tensor, tokens: torch.Tensor, aux: dict, grad_accum: int) -> None:
        value = loss.detach().to(torch.float64)
        bad = ~torch.isfinite(value)
        self.first_bad = torch.where(bad & (self.first_bad == 0), torch.full_like(self.first_bad, step),
                                     self.first_bad)
        self.eval_loss += value / grad_accum
        self.log_loss += value / grad_accum
        self.tokens += tokens.to(torch.float64)
        for name, v in aux.items():
            self.aux[name] = self.aux.get(name, self.zero()) + v.detach().to(torch.float64) / grad_accum

    def fold(self, bad_weights: torch.Tensor | None = None) -> dict:
        """Sums over all ranks: {eval_loss, tokens, log_loss, bad_ranks, bad_weights, aux: {...}}; `first_bad`
        stays local. `bad_weights`: this rank's count of non-finite weights (`non_finite_weights`, at evaluation
        boundaries, where every rank passes one), summed in the same collective."""
        names = sorted(self.aux)
        extra = [] if bad_weights is None else [bad_weights.to(self.eval_loss.device, torch.float64)]
        t = torch.stack([self.eval_loss, self.tokens, self.log_loss, (self.first_bad > 0).to(torch.float64),
                         *extra, *(self.aux[n] for n in names)])
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(t)
        values = t.tolist()  # the one host synchronisation of the window
        weights = values.pop(4) if extra else 0.0
        return {"eval_loss": values[0], "tokens": values[1], "log_loss": values[2], "bad_ranks": values[3],
                "bad_weights": weights, "aux": dict(zip(names, values[4:]))}


def non_finite_weights(module: torch.nn.Module) -> torch.Tensor:
    """How many of the weights are not finite, as this rank's share of the count (a device scalar; summed over the
    ranks it is the model's). Under ZeRO-3 this rank's own partition of each (`ds_tensor`, the real elements only:
    the last rank's padding is never written; a partitioned `.weight` is never read); otherwise every rank holds
    every weight, and each counts its 1 / world of them."""
    counts, partitioned = [], False
    for p in module.parameters():
        if hasattr(p, "ds_tensor"):
            partitioned, (_, real) = True, bestweights.partition_range(p)
            if real:
                counts.append((~torch.isfinite(p.ds_tensor.view(-1)[:real])).sum())
        elif p.numel():
            counts.append((~torch.isfinite(p)).sum())
    total = torch.stack(counts).sum().to(torch.float64) if counts else torch.zeros((), dtype=torch.float64)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return total if partitioned else total / world


class _NaNGradient(torch.autograd.Function):
    """Fault injection (train.debug_nan_gradient_at_step): the value passes unchanged, its gradient is NaN."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def token_weighted(out, label_tokens: tuple[int, int] | None, shares: int) -> torch.Tensor:
    """The loss this rank backpropagates in one micro-step. The model's language-model loss is a mean over this
    micro-batch's target tokens, and DeepSpeed averages the `shares` = ranks x train.grad_accum micro-batches'
    gradients of a step, so each weighed the same whatever its tokens: a token of a short-target batch counted more
    than one of a long-target batch (on GLUE, a rank's targets were up to 1.75x another's in the same step). Scaled
    by this micro-batch's share of the step's tokens (`label_tokens`: its own and every micro-batch's of every rank,
    counted by the objective from the sampler's picks, so no collective and no tensor read), the average is the
    mean over all the step's tokens, as one batch of every row would give. A method's auxiliary losses (PHA's) keep
    their weight. Without the counts (an objective that does not know every rank's batch), the model's loss."""
    if label_tokens is None:
        return out.loss
    mine, everyone = label_tokens
    weight = mine * shares / max(everyone, 1)
    if weight == 1:  # one micro-batch a step, or micro-batches with as many tokens each
        return out.loss
    return out.loss + getattr(out, "lm_loss", out.loss) * (weight - 1.0)


def train_loop(loop_config: dict, session=None) -> dict:
    """Train `loop_config["run"]` (a RunConfig dict) on this rank; returns the final metrics. The objective is
    `loop_config["objective"]` ("module:Class", default the suite's FineTuning) with `loop_config["options"]`. With
    `loop_config["system_metrics"]` ({tracking_uri, run_id, interval}), the first rank of each node samples the
    node's system metrics into that MLflow run while it trains."""
    session = session or RaySession(loop_config.get("resume_from"))
    monitor, watch = None, loop_config.get("system_metrics")
    if watch and session.local_rank == 0:
        from hpsearch.tracking import system_metrics_monitor
        monitor = system_metrics_monitor(watch["tracking_uri"], watch["run_id"], watch["interval"],
                                         node_id=f"node_{session.node_rank}" if session.nodes > 1 else None)
    linear = torch.nn.functional.linear  # DeepSpeed's ZeRO-3 engine swaps in its own (below)
    try:
        with contextlib.ExitStack() as on_exit:  # the run's engine is released however the run ends
            return _train(loop_config, session, on_exit)
    except Exception as e:  # OSError, RuntimeError (torch.save), SafetensorError (a Hugging Face save_pretrained)
        if disk_full(e):  # checkpoints, exports or Ray's upload of them: say so, do not retry
            where = getattr(e, "filename", None) or load_config(base=loop_config["run"], read=False).train.output_dir
            raise checkpoints.DiskFull(f"no space left on device writing {where}; free space there, then resume "
                                       "(python -m hpsearch.tune --resume, or --resume-from)") from None
        raise
    finally:
        if monitor is not None:
            monitor.finish()
        # ZeRO-3's engine replaces torch.nn.functional.linear for the whole process (DeepSpeed's memory-efficient
        # linear: "this will persist unless manually reset"), and nn.Linear looks it up at every call: a process that
        # trains trial after trial (a reused Tune actor, kept ranks) starts each with the linear it started with
        torch.nn.functional.linear = linear


def _train(loop_config: dict, session, on_exit: contextlib.ExitStack) -> dict:
    # checked in the driver; the objective reads its data itself (pretraining on a corpus folder never reads the
    # suite, whose folder need not exist: the run's data.source is the driver's default, made absolute there)
    cfg = load_config(base=loop_config["run"], read=False)
    if not cfg.train.use_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_flush_denormal(True)  # subnormal floats (tiny optimizer moments, late in training) are slow on CPU
    hostmem.apply(cfg.train.host_allocator, cfg.train.use_gpu)  # CPU workers: malloc reuses freed tensor memory
    deepspeed = import_deepspeed()
    startup.freeze_imports()  # DeepSpeed's own full collections skip the imported modules

    marks = {**(loop_config.get("startup") or {}), "imports": time.time()}  # start-up phases (startup.py)
    rank, world = session.rank, session.world_size
    if not torch.distributed.is_initialized():
        _init_single_process_group("nccl" if cfg.train.use_gpu else "gloo")
    load_ops()  # before DeepSpeed builds them, without a stale lock's hang
    deepspeed.init_distributed(dist_backend="nccl" if cfg.train.use_gpu else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.train.use_gpu else torch.device("cpu")

    builder = ModelBuilder(lambda n_params: _zero_stage(cfg, n_params, device, session, rank),
                           lambda stage, hidden: deepspeed_config(cfg, world, stage, hidden), rank,
                           use_zero_init(cfg.train.zero_init, cfg.train.use_gpu))
    objective_class = load_objective(loop_config.get("objective"))
    takes_build = "build" in inspect.signature(objective_class).parameters  # else it builds its model itself
    copies = backbones.copies
    objective = objective_class(cfg, rank, world, loop_config.get("options"), **({"build": builder} if takes_build
                                                                                 else {}))
    if backbones.copies > copies:  # a process that trains trial after trial (keep_random_backbones)
        _rank0_print(rank, "backbone: a copy of the initial weights this process kept from its last trial (the same "
                           "backbone and seed)")
    model, sampler, stage = objective.model, objective.sampler, builder.stage
    if stage is None:  # an objective that built its model itself (whole on every rank)
        stage = _zero_stage(cfg, sum(p.numel() for p in unique_parameters(model)), device, session, rank)
    hidden = getattr(model.config, "d_model", None)
    if builder.partitioned:
        _rank0_print(rank, "model built under deepspeed.zero.Init: rank 0 built it whole and sent each rank its shards")
    marks["model"] = time.time()
    torch.manual_seed(cfg.train.seed * 1000 + rank)  # dropout: a stream per rank (a resume restores it)
    extra_params = model.extra_parameters()["total"]
    optimizer, scheduler = optimizer_and_schedule(model, cfg)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                      config=deepspeed_config(cfg, world, stage, hidden))  # the engine steps both
    on_exit.callback(_release, engine, rank)
    marks["engine"] = time.time()
    step, best = 0, {"score": -math.inf, "step": 0}
    out_dir = Path(cfg.train.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    resume_dir = session.get_checkpoint_dir()
    if resume_dir:
        try:  # a downloaded copy goes however this ends: ASHA stops trials inside a report (Tune's SystemExit)
            done = checkpoints.read_report(resume_dir)
            if checkpoints.is_result_only(resume_dir, done):  # a finished run's last checkpoint: its result
                if done["step"] < cfg.train.max_steps:
                    raise UserError(f"checkpoint {resume_dir} is a finished run's last one (step {done['step']}, its "
                                    f"result only): it cannot train on to train.max_steps={cfg.train.max_steps}")
                _rank0_print(rank, f"resumed from {resume_dir} at its last step {done['step']}: reporting its result")
                session.report(done, resume_dir if rank == 0 else None)  # the run's result is its final checkpoint
                return done
            checkpoints.past_end(resume_dir, done, cfg.train.max_steps)
            client = checkpoints.load(engine, resume_dir, tag="state")
            try:
                sampler.load_state_dict(client["sampler"])
                step, best = client["step"], client["best"]
                if not checkpoints.set_rng_state(client["rng"], rank):
                    print(f"[hpsearch.train] rank {rank}: checkpoint {resume_dir} was written by fewer ranks and "
                          "keeps no random state for this one; it goes on with its own seeded stream", flush=True)
            except (KeyError, TypeError, ValueError) as e:
                raise UserError(f"checkpoint {resume_dir} does not match this run's config (client state: "
                                f"{type(e).__name__}: {e})") from None
            _rank0_print(rank, f"resumed from {resume_dir} at step {step}")
            if rank == 0:
                _forget_evaluations_after(out_dir / "metrics.jsonl", step)
            lost = checkpoints.read_report(resume_dir) if session.unregistered else None
            if lost is not None:  # a worker died before Ray took this report: its metrics reach Tune and MLflow now
                session.report(lost, resume_dir if rank == 0 else None)
        finally:
            session.release_checkpoint_dir()
    elif rank == 0:
        (out_dir / "metrics.jsonl").unlink(missing_ok=True)
    objective.start(engine, device)
    t_start, loss_n, log_n, t_last = time.perf_counter(), 0, 0, time.perf_counter()
    timed_n, t_timed = 0, t_last  # step_time: the steps since the last evaluation, less this process's first
    window = Window(device)
    batches = Prefetch(objective.batch, sampler.state_dict, device)  # the next batch, made meanwhile
    # task ids stay on the CPU: the model checks them and finds the batch's tasks there (no device synchronisation)
    copy = lambda k, v: v if k == "task_ids" else v.to(device, non_blocking=True)
    lr_used = cfg.train.lr
    steps_at_start = step
    skipped_said = getattr(engine, "skipped_steps", 0)
    final: dict = {}
    try:
        while step < cfg.train.max_steps:
            engine.train()
            for _ in range(cfg.train.grad_accum):
                host = batches.next()
                label_tokens = host.pop(LABEL_TOKENS, None)
                batch = {k: copy(k, v) for k, v in host.items()}
                out = engine(**batch)
                loss = token_weighted(out, label_tokens, world * cfg.train.grad_accum)
                if cfg.train.debug_nan_at_step is not None and step + 1 == cfg.train.debug_nan_at_step:
                    loss = loss * float("nan")
                if cfg.train.debug_nan_gradient_at_step == step + 1:
                    loss = _NaNGradient.apply(loss)
                with gradient_sync(engine):
                    engine.backward(loss)
                lr_used = engine.get_lr()[0]  # the learning rate this update uses
                engine.step()
                window.add(step + 1, loss, batch["attention_mask"].sum() + (batch["labels"] != -100).sum(),
                           getattr(out, "aux_losses", {}), cfg.train.grad_accum)
            step += 1
            loss_n, log_n, timed_n = loss_n + 1, log_n + 1, timed_n + 1
            evaluating = step % cfg.train.eval_every == 0 or step == cfg.train.max_steps
            if step == steps_at_start + 1:
                _rank0_print(rank, startup.line({**marks, "step": time.time()}))
                if not evaluating:  # its one-off work (tokenization, first allocations) is start-up, not a step
                    timed_n, t_timed = 0, time.perf_counter()
            logging_ = step % cfg.train.log_every == 0 or step == cfg.train.max_steps
            if not (evaluating or logging_):
                _maybe_crash(cfg, step, resume_dir, rank)
                continue
            # every rank, at every log and evaluation boundary: before any checkpoint is written. At an evaluation,
            # the weights too: a non-finite gradient with a finite loss (clipping at ZeRO stage 0 spreads it to
            # every weight) shows in the loss only a step later, after this step's checkpoint had kept the weights
            trained = time.perf_counter()  # the steps' time ends here: the weights' check below is the evaluation's
            sums = window.fold(non_finite_weights(engine.module) if evaluating else None)
            if sums["bad_ranks"]:
                at = f"at step {int(window.first_bad)}" if window.first_bad > 0 else f"on another rank by step {step}"
                raise NonFiniteLoss(f"non-finite loss {at}: stopping the run (lower train.lr or raise "
                                    f"train.warmup_steps)")
            if sums["bad_weights"]:
                raise NonFiniteLoss(f"non-finite weights at step {step} ({round(sums['bad_weights'])} of them: a "
                                    "non-finite gradient, with a finite loss): stopping the run before it writes a "
                                    "checkpoint (lower train.lr or raise train.warmup_steps)")
            skipped = getattr(engine, "skipped_steps", 0)  # a plain count: ZeRO's optimizers skip a step whose
            if skipped > skipped_said and not engine.fp16_enabled():  # gradient is not finite (fp16: loss scaling)
                _rank0_print(rank, f"DeepSpeed skipped {skipped - skipped_said} optimizer step(s) with a non-finite "
                                   f"gradient by step {step} (the loss was finite; {skipped} in all)")
                skipped_said = skipped
            if logging_:
                elapsed = time.perf_counter() - t_start
                rate = (step - steps_at_start) / elapsed
                _rank0_print(rank, f"step {step}/{cfg.train.max_steps} loss {sums['log_loss'] / (log_n * world):.4f} "
                                   f"{rate:.2f} steps/s ETA {(cfg.train.max_steps - step) / max(rate, 1e-9):.0f}s")
                window.log_loss, log_n = window.zero(), 0
            if evaluating:
                now = time.perf_counter()
                metrics = {"step": step, "loss": sums["eval_loss"] / (loss_n * world), "lr": lr_used,
                           "step_time": (trained - t_timed) / timed_n, "tokens_per_s": sums["tokens"] / (now - t_last),
                           "extra_params": extra_params,
                           **{n: total / (loss_n * world) for n, total in sums["aux"].items()}}
                metrics.update(objective.evaluate())
                if metrics["score"] > best["score"]:  # weights only, once; later checkpoints refer to them
                    filesystem, folder = session.best_dir()
                    best = {"score": metrics["score"], "step": step,
                            "weights": bestweights.best_weights_path(filesystem, folder, step, rank),
                            "tasks": {k: v for k, v in metrics.items()
                                      if k.startswith("task/") and k.endswith("/score")}}
                    bestweights.save_best(engine, rank, filesystem, best["weights"])
                # what the run delivers so far: its best step's suite score, and each task's score at that step
                metrics.update(best_score=best["score"], best_step=best["step"],
                               **{f"best_{k}": v for k, v in best.get("tasks", {}).items()})
                final = metrics
                with session.staging() as ckpt:  # beside where the session keeps it: stored by a rename
                    if step < cfg.train.max_steps:
                        engine.save_checkpoint(ckpt, tag="state", client_state={
                            "sampler": batches.state(), "step": step, "best": best, "rng": checkpoints.rng_state()})
                    else:  # the last checkpoint holds the run's result, no training state: nothing trains on from it
                        final = {**metrics, **finish(engine, objective, cfg, rank, best, session)}
                    if rank == 0:
                        with open(out_dir / "metrics.jsonl", "a") as f:
                            f.write(json.dumps(final) + "\n")
                        checkpoints.write_report(Path(ckpt), final)  # a resume at this step reports it again
                        checkpoints.write_best(Path(ckpt), best)
                        # what a resume is checked against: the run config and the objective's options (corpus)
                        checkpoints.write_config(Path(ckpt), {**loop_config["run"],
                                                              **(loop_config.get("options") or {})})
                        if final.get("final") and loop_config.get("export_to"):  # a study in a bucket: exports go there
                            checkpoints.upload_exports(out_dir, *loop_config["export_to"])
                    session.report(final, ckpt)
                    torch.distributed.barrier()  # every rank's report is stored: older best weights may go
                    if rank == 0 and "weights" in best:
                        session.prune_best(best["weights"])
                loss_n, t_last = 0, time.perf_counter()
                timed_n, t_timed = 0, t_last
                window.eval_loss, window.tokens, window.aux = window.zero(), window.zero(), {}
            _maybe_crash(cfg, step, resume_dir, rank)
    finally:  # also on an error: no thread left making batches
        batches.close()
    return final


def _release(engine, rank: int) -> None:
    """Release the run's engine (build.release) as the run ends, however it ends (its result reported, an error, a
    stop inside a report). A failure here, never expected, is one line: it does not replace how the run ended."""
    try:
        release(engine)
    except Exception as e:
        print(f"[hpsearch.train] rank {rank}: releasing the DeepSpeed engine failed ({type(e).__name__}: {e}); "
              "this process may keep the run's model in memory", flush=True)


@contextlib.contextmanager
def gradient_sync(engine):
    """The context `engine.backward` runs in. A single data-parallel rank at ZeRO stage 0 has no one to average its
    gradients with, yet DeepSpeed would still flatten every gradient into buckets, all-reduce them over that one
    rank and copy them back after each backward (4-6 % of a one-worker t5-small step here); its `no_sync()` skips
    that. What the reduction also did is kept: at an accumulation boundary every trainable parameter that got no
    gradient gets a zero one, so the optimizer steps it (momentum, weight decay) as it does with several ranks.
    The weights come out bitwise the same (tests/workers/stage0.py). Anything else reduces as DeepSpeed does:
    several ranks average their gradients, and stages 1-3 reduce into their partitions."""
    if engine.dp_world_size > 1 or engine.zero_optimization_stage() != 0:
        yield
        return
    with engine.no_sync():
        yield
    if engine.is_gradient_accumulation_boundary():
        for p in engine.module.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)


def _zero_stage(cfg, n_params: int, device, session, rank) -> int:
    """The ZeRO stage: `train.zero_stage`, or for `auto` the one `auto_zero_stage` picks from the model's size
    (`n_params`) and the smallest worker's memory (every rank the same)."""
    if isinstance(cfg.train.zero_stage, int):
        return cfg.train.zero_stage
    import psutil

    if cfg.train.use_gpu:
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        memory = psutil.virtual_memory().total / max(1, session.local_world_size)
    memory = torch.tensor([float(memory)], device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(memory, op=torch.distributed.ReduceOp.MIN)
    stage, why = auto_zero_stage(cfg, n_params, memory.item(), session.world_size)
    _rank0_print(rank, f"ZeRO stage {stage} (train.zero_stage=auto: {why})")
    return stage


def finish(engine, objective, cfg, rank, best, session) -> dict:
    """Load the best validation weights; the objective exports them (and scores them on the test split)."""
    out_dir = Path(cfg.train.output_dir)
    if best.get("weights"):
        if best["step"] != cfg.train.max_steps:  # else the engine holds them already
            filesystem, _ = session.best_dir()
            bestweights.load_best(engine, rank, filesystem, best["weights"])
    else:  # no validation score ever (no validation rows): the last weights are the result
        best = {"score": best["score"], "step": cfg.train.max_steps}  # finish() runs at the last step
    return {**objective.finish(engine, best), "best_step": best["step"], "final": 1.0,
            "output_dir": str(out_dir.resolve())}


def _maybe_crash(cfg, step: int, resumed: str | None, rank: int) -> None:
    """Fault injection (`train.debug_crash_at_step`): rank 0 dies at the end of that step, once (not after a restart),
    at once: at an evaluation step right after its report, so possibly before Ray Train's controller polled it."""
    if cfg.train.debug_crash_at_step == step and not resumed and rank == 0:
        os._exit(17)


def _forget_evaluations_after(path: Path, step: int) -> None:
    """The run's metrics.jsonl without the lines of evaluations after `step`: a run resumed from its step-`step`
    checkpoint makes them again (each line is written just before its checkpoint is stored, so a kill in between
    left one written for a checkpoint that never was). A line cut short by a kill goes too. Replaced whole."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)

    def evaluated_at(line: str) -> float:
        try:
            return json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            return math.inf
    kept = [line for line in lines if evaluated_at(line) <= step]
    if len(kept) != len(lines):
        checkpoints.write_whole(path, "".join(kept))


def _rank0_print(rank: int, text: str) -> None:
    if rank == 0:
        print(f"[hpsearch.train] {text}", flush=True)


def _init_single_process_group(backend: str) -> None:
    """One rank (`--local`, or a trial training in its own Tune actor): an in-memory store, so no rendezvous port is
    served and a MASTER_ADDR / MASTER_PORT inherited from the user's shell (another job's) is not followed. The
    environment still names rank 0 of 1 at 127.0.0.1 with a free port: DeepSpeed's CPU all-reduce names its shared
    memory after MASTER_ADDR / MASTER_PORT."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if backend == "gloo":
        from hpsearch.train.rendezvous import bind_gloo_to_loopback
        bind_gloo_to_loopback("127.0.0.1")  # gloo listens even alone: on loopback, not the hostname's address
    torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)


