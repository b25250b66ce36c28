"""The training recipe: DeepSpeed config, local loop (loss, resume, NaN), and Ray Train with 2 ZeRO-3 workers."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpsearch.config import load_config
from hpsearch.errors import ConfigError
from hpsearch.train import startup
from hpsearch.train.launch import free_port

FAST = ["train.max_steps=40", "train.eval_every=20", "train.log_every=10", "train.micro_batch_size=16",
        "data.synthetic_train_rows=300", "data.synthetic_eval_rows=60", "train.lr=3e-3", "train.warmup_steps=5"]


def run_train(*args, timeout=600, cwd=None, env=None, script=None):
    """`python -m hpsearch.train *args`, or with `script`, `python -c script *args` (the recipe with a change)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore", **(env or {})}
    entry = ["-c", script] if script else ["-m", "hpsearch.train"]
    return subprocess.run([sys.executable, *entry, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=cwd)


# `python -m hpsearch.train` whose Ray Train run also has a callback (in Train's controller) appending the step of
# every report Ray takes to a file: what Tune and MLflow would get in a study; and whether Train's controller (at
# each report) and the driver (at its end) had imported torch, in FILE.controller and FILE.driver
RECORDING = """
import sys
import ray.train
import ray.util
import hpsearch.train.launch as launch
from hpsearch.cli import run_main
from hpsearch.train.__main__ import main

class Steps(ray.train.UserCallback):  # runs in Train's controller: it holds the file's name
    def __init__(self, path):
        self.path = path

    def after_report(self, run_context, metrics, checkpoint):
        with open(self.path, "a") as f:
            f.write(f"{metrics[0]['step']}\\n")
        with open(self.path + ".controller", "a") as f:
            f.write(f"{'torch' in sys.modules}\\n")

def build(*a, **k):  # and whether Ray Train's autoscaling coordinator was up before its controller started
    trainer = launch_build(*a, **{**k, "callbacks": [Steps(sys.argv[1])]})
    with open(sys.argv[1] + ".coordinator", "a") as f:
        f.write(f"{[x['name'] for x in ray.util.list_named_actors(all_namespaces=True)]}\\n")
    return trainer

launch_build, launch.build_trainer = launch.build_trainer, build
try:
    run_main(main, sys.argv[2:])
finally:
    with open(sys.argv[1] + ".driver", "w") as f:
        f.write(f"{'torch' in sys.modules}\\n")
"""


# the loop resuming from a copy of a checkpoint (as TuneSession downloads one from a bucket) whose report ASHA stops
STOPPED_IN_REPORT = """
import os, shutil, sys
from hpsearch.config import load_config
from hpsearch.train import loop_config
from hpsearch.train.loop import train_loop
from hpsearch.train.sessions import LocalSession

class Downloaded(LocalSession):
    def get_checkpoint_dir(self):
        return shutil.copytree(self.resume_from, sys.argv[2])

    def release_checkpoint_dir(self):
        shutil.rmtree(sys.argv[2])

    def report(self, metrics, checkpoint_dir=None):
        print(f"reported step {metrics['step']}")
        raise SystemExit(0)  # what Tune raises in a trial ASHA stops

cfg = load_config(None, sys.argv[3:])
try:
    train_loop(loop_config(cfg), Downloaded(cfg, sys.argv[1]))
finally:
    print("copy left" if os.path.exists(sys.argv[2]) else "copy removed", flush=True)
"""


def run_train_recording(steps_file, *args, timeout=600):
    return run_train(str(steps_file), *args, timeout=timeout, script=RECORDING)


def final_json(proc) -> dict:
    errors = "\n".join(ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:"))  # -X importtime
    assert proc.returncode == 0, errors[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith('{"step"'), proc.stdout[-2000:]
    return json.loads(last)


def imported_modules(proc) -> set[str]:
    """The modules a process run with PYTHONPROFILEIMPORTTIME=1 imported (or tried to: a refused import is listed)."""
    return {ln.rsplit("|", 1)[1].strip() for ln in proc.stderr.splitlines() if ln.startswith("import time:")}


def imported_mlflow(proc) -> bool:
    """Whether that process imported MLflow: a refused `import mlflow` is listed as `mlflow` alone, an import that
    happens brings MLflow's own modules."""
    return any(m.startswith("mlflow.") for m in imported_modules(proc))


# ---- DeepSpeed config ---------------------------------------------------------------------------------------------
def test_optimizer_groups_give_the_embedding_table_its_rate_only_when_asked_and_only_when_it_trains():
    from hpsearch.model import build_model
    from hpsearch.train.dsconfig import optimizer_groups

    model = build_model("t5-tiny", "mtl", ["a", "b"])
    table = model.t5.shared.weight
    trainable = [p for p in model.parameters() if p.requires_grad]
    (one,) = optimizer_groups(model, load_config(None, ["train.lr=1e-3"]))
    assert one["lr"] == 1e-3 and one["params"] == trainable
    rest, emb = optimizer_groups(model, load_config(None, ["train.lr=1e-3", "train.embedding_lr_scale=20"]))
    assert emb["params"] == [table] and emb["lr"] == pytest.approx(2e-2) and rest["lr"] == 1e-3
    assert all(p is not table for p in rest["params"]) and len(rest["params"]) + 1 == len(trainable)
    # a method that trains only its task parameters: the frozen table is in no group, and no group is empty
    frozen = build_model("t5-tiny", "adapter", ["a", "b"], bottleneck=4, train_task_params_only=True)
    assert not frozen.t5.shared.weight.requires_grad
    (only,) = optimizer_groups(frozen, load_config(None, ["train.embedding_lr_scale=20"]))
    assert only["params"] == [p for p in frozen.parameters() if p.requires_grad] and only["lr"] == 1e-3


def test_adafactor_first_step_is_the_papers_update_relative_to_each_weight():
    """`train.optimizer=adafactor`: one step of the recipe's optimizer equals Adafactor's update re-computed by hand
    from each weight's gradient (tests/adafactor_ref.py), so each weight moves by about lr x its own RMS, unlike
    AdamW's lr for every weight: T5's embeddings (std 1) by ~1e-2, its first query projection (std 1/32 at t5-tiny)
    by ~3e-4."""
    import torch
    from adafactor_ref import adafactor_first_update

    from hpsearch.model import build_model
    from hpsearch.train.dsconfig import optimizer_and_schedule

    cfg = load_config(None, ["train.optimizer=adafactor", "train.lr=1e-2", "train.warmup_steps=0",
                             "train.max_steps=10"])
    torch.manual_seed(0)
    model = build_model("t5-tiny", "mtl", ["a", "b"])
    optimizer, _ = optimizer_and_schedule(model, cfg)
    assert type(optimizer) is torch.optim.Adafactor
    (group,) = optimizer.param_groups
    assert group["lr"] == pytest.approx(1e-2 * 10 / 11)  # the schedule's first factor, as for AdamW
    g = torch.Generator().manual_seed(1)
    batch = dict(input_ids=torch.randint(3, 200, (4, 9), generator=g),
                 labels=torch.randint(3, 200, (4, 4), generator=g), task_ids=torch.tensor([0, 1, 0, 1]))
    model(**batch, attention_mask=torch.ones_like(batch["input_ids"])).loss.backward()
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    before = {n: p.detach().clone() for n, p in named}
    expected = {n: adafactor_first_update(p.detach(), p.grad, group["lr"]) for n, p in named}
    optimizer.step()
    for n, p in named:  # to fp32's rounding of the weights themselves (2 ulps of the largest)
        ulp = torch.finfo(torch.float32).eps * before[n].abs().max().item()
        torch.testing.assert_close(p.detach() - before[n], expected[n], rtol=1e-4, atol=2 * ulp,
                                   msg=lambda m, n=n: f"{n}: {m}")
    rms = lambda t: t.pow(2).mean().sqrt().item()  # noqa: E731
    table, query = "t5.shared.weight", "t5.encoder.block.0.layer.0.SelfAttention.q.weight"
    for n in (table, query):
        moved = rms(dict(model.named_parameters())[n].detach() - before[n]) / rms(before[n])
        assert 0.3 * group["lr"] < moved <= group["lr"] * 1.0001, (n, moved)
    assert rms(before[table]) > 30 * rms(before[query])  # so the two moved by very different absolute amounts


def test_adamw_is_fused_and_its_first_two_steps_are_adamws_update_by_hand():
    """The recipe's AdamW (the default `train.optimizer`) is torch's fused kernel (one kernel over every tensor; the
    default on CPU is a Python loop, 4-5x slower at t5-small) and its steps are AdamW's update re-computed from each
    weight's gradients: decoupled weight decay, bias-corrected moments, the schedule's rate."""
    import torch

    from hpsearch.model import build_model
    from hpsearch.train.dsconfig import optimizer_and_schedule

    cfg = load_config(None, ["train.lr=1e-2", "train.weight_decay=0.1", "train.warmup_steps=0", "train.max_steps=10"])
    torch.manual_seed(0)
    model = build_model("t5-tiny", "mtl", ["a", "b"])
    optimizer, scheduler = optimizer_and_schedule(model, cfg)
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"] is True
    (group,) = optimizer.param_groups
    b1, b2 = group["betas"]
    eps, wd = group["eps"], group["weight_decay"]
    assert wd == 0.1
    g = torch.Generator().manual_seed(1)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    m = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named}
    v = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named}
    for t in (1, 2):
        batch = dict(input_ids=torch.randint(3, 200, (4, 9), generator=g),
                     labels=torch.randint(3, 200, (4, 4), generator=g), task_ids=torch.tensor([0, 1, 0, 1]))
        optimizer.zero_grad(set_to_none=False)
        model(**batch, attention_mask=torch.ones_like(batch["input_ids"])).loss.backward()
        lr = group["lr"]
        expected = {}
        for n, p in named:
            w, grad = p.detach().double(), p.grad.double()
            m[n] = b1 * m[n] + (1 - b1) * grad
            v[n] = b2 * v[n] + (1 - b2) * grad * grad
            step = lr * (m[n] / (1 - b1 ** t)) / ((v[n] / (1 - b2 ** t)).sqrt() + eps)
            expected[n] = w * (1 - lr * wd) - step
        optimizer.step()
        scheduler.step()
        for n, p in named:  # fp32's rounding of the weights (a few ulps of the largest) and of the moments
            ulp = torch.finfo(torch.float32).eps * expected[n].abs().max().item()
            torch.testing.assert_close(p.detach().double(), expected[n], rtol=1e-5, atol=4 * ulp + 1e-7 * lr,
                                       msg=lambda msg, n=n, t=t: f"step {t}, {n}: {msg}")


def test_gpu_deepspeed_config_is_built_and_validated_without_gpu():
    from deepspeed.runtime.config import DeepSpeedConfig

    from hpsearch.train import build_trainer, deepspeed_config

    cfg = load_config(None, ["train.use_gpu=true", "train.num_workers=1", "train.micro_batch_size=8",
                             "train.grad_accum=4", "train.offload_optimizer=true"])
    ds = deepspeed_config(cfg, world_size=1)
    parsed = DeepSpeedConfig(ds)  # DeepSpeed's own validation of the generated dict
    assert parsed.zero_optimization_stage == 3
    assert parsed.bfloat16_config.enabled and not parsed.float16_config.enabled
    assert parsed.train_batch_size == 8 * 4 and parsed.gradient_clipping == cfg.train.grad_clip
    assert parsed.zero_config.offload_optimizer.device == "cpu"
    trainer = build_trainer(cfg, name="gpu-form", storage_path="/tmp/hpsearch-gpu-form")
    import ray
    assert not ray.is_initialized()  # building a trainer starts no Ray (a stray one held ports until the suite ended)
    assert trainer.train_loop_config["run"]["train"]["use_gpu"] is True
    assert trainer.scaling_config.use_gpu and trainer.scaling_config.resources_per_worker["GPU"] == 1.0
    assert trainer.backend_config.backend == "nccl"
    cpu = deepspeed_config(load_config(), world_size=2)
    assert not cpu["bf16"]["enabled"] and cpu["zero_optimization"]["stage"] == 3
    # ZeRO's buffers sized to the model (Hugging Face's "auto" values), not DeepSpeed's 5e8-element defaults; the
    # reduce bucket at least a DDP bucket's 25 MiB of gradients (fp32 here, bf16 on GPU), d_model² when larger
    sized = DeepSpeedConfig(deepspeed_config(load_config(), 2, 3, hidden=768)).zero_config
    assert sized.reduce_bucket_size == 25 * 2**20 // 4 and sized.prefetch_bucket_size == int(0.9 * 768**2)
    assert sized.param_persistence_threshold == 7680
    gpu = load_config(None, ["train.use_gpu=true"])
    assert deepspeed_config(gpu, 2, 3, hidden=768)["zero_optimization"]["reduce_bucket_size"] == 25 * 2**20 // 2
    assert deepspeed_config(gpu, 2, 3, hidden=4096)["zero_optimization"]["reduce_bucket_size"] == 4096**2
    assert DeepSpeedConfig(cpu).zero_config.reduce_bucket_size == 5e8  # without the model's size: DeepSpeed's own
    # bf16 at stage 0 is torch's autocast (DeepSpeed's bf16 there reads every gradient on the host each step);
    # stages 1-3 keep DeepSpeed's bf16; fp32 neither
    import torch
    for stage, autocast in ((0, True), (1, False), (3, False)):
        parsed = DeepSpeedConfig(deepspeed_config(gpu, 1, stage))
        assert (parsed.torch_autocast_enabled, parsed.bfloat16_config.enabled) == (autocast, not autocast), stage
        assert not autocast or parsed.torch_autocast_dtype == torch.bfloat16
    parsed = DeepSpeedConfig(deepspeed_config(load_config(), 1, 0))
    assert not parsed.torch_autocast_enabled and not parsed.bfloat16_config.enabled


def test_auto_zero_stage_keeps_a_model_that_fits_whole_and_partitions_one_that_does_not(monkeypatch):
    import psutil
    import torch

    from hpsearch.train.dsconfig import auto_zero_stage, deepspeed_config
    from hpsearch.train.loop import _zero_stage

    cfg = load_config(None, [])
    assert cfg.train.zero_stage == "auto"
    gib = 2**30
    assert auto_zero_stage(cfg, 60_000_000, 12 * gib, 2)[0] == 0  # t5-small: ~0.9 GiB of training state
    assert auto_zero_stage(cfg, 220_000_000, 6 * gib, 2)[0] == 3  # t5-base: 3.3 GiB > half of 6 GiB
    assert auto_zero_stage(cfg, 11_000_000_000, 80 * gib, 8)[0] == 3  # t5-11b on 80 GB GPUs
    offload = load_config(None, ["train.offload_optimizer=true"])
    assert auto_zero_stage(offload, 60_000_000, 12 * gib, 2)[0] == 2
    assert auto_zero_stage(load_config(None, ["train.offload_params=true"]), 60_000_000, 12 * gib, 2)[0] == 3
    # Adafactor needs each weight whole: auto keeps stage 0 even when ZeRO-3 would have partitioned the model
    stage, why = auto_zero_stage(load_config(None, ["train.optimizer=adafactor"]), 220_000_000, 6 * gib, 2)
    assert stage == 0 and "may run out of memory" in why
    # one worker has nothing to partition across: stage 0 (said to be tight), or 2 when the optimizer is offloaded
    stage, why = auto_zero_stage(cfg, 220_000_000, 6 * gib, 1)
    assert stage == 0 and "may run out of memory" in why and "one worker" in why
    assert auto_zero_stage(offload, 220_000_000, 6 * gib, 1)[0] == 2
    # the loop asks with its world size (and a CPU worker's share of the node's memory)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=12 * gib))
    for world, local, want in ((1, 1, 0), (2, 2, 3), (2, 1, 3)):
        session = SimpleNamespace(world_size=world, local_world_size=local)
        assert _zero_stage(cfg, 500_000_000, torch.device("cpu"), session, 0) == want  # 7.5 GiB of state
    assert deepspeed_config(cfg, 2, 0)["zero_optimization"]["stage"] == 0
    fixed = load_config(None, ["train.zero_stage=1"])
    assert fixed.train.zero_stage == 1 and deepspeed_config(fixed, 2, 0)["zero_optimization"]["stage"] == 1
    with pytest.raises(ConfigError, match="train.zero_stage: 'four' is not one of 0, 1, 2, 3, auto"):
        load_config(None, ["train.zero_stage=four"])
    with pytest.raises(ConfigError, match="train.zero_init: 'sometimes' is not one of true, false, auto"):
        load_config(None, ["train.zero_init=sometimes"])
    from hpsearch.train.build import use_zero_init

    assert [use_zero_init(s, gpu) for s in ("auto", True, False) for gpu in (False, True)] == [
        False, True, True, True, False, False]  # auto: on GPU workers, whose shards live in device memory


def test_the_ray_variables_every_run_sets_are_ones_this_ray_reads():
    """The run's environment tunes Ray Train (its print patch, how often its controller polls the workers) and Tune
    (how long a reused actor waits for a stopped trial's threads) by variable name: a name this Ray no longer reads
    would silently do nothing. Each is in the list Ray keeps of the variables it reads, with a value it parses."""
    from ray.train.v2._internal.constants import ENV_VARS_TO_PROPAGATE
    from ray.tune.constants import TUNE_ENV_VARS

    from hpsearch.train.launch import runtime_env_vars
    env = runtime_env_vars(load_config(None, []))
    ray_vars = {k: v for k, v in env.items() if k.startswith(("RAY_TRAIN_", "TUNE_"))}
    assert set(ray_vars) == {"RAY_TRAIN_ENABLE_PRINT_PATCH", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S",
                             "TUNE_FUNCTION_THREAD_TIMEOUT_S"}
    assert set(ray_vars) <= ENV_VARS_TO_PROPAGATE | TUNE_ENV_VARS
    assert float(ray_vars["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"]) == 0.5
    assert ray_vars["RAY_TRAIN_ENABLE_PRINT_PATCH"] == "0"
    assert int(ray_vars["TUNE_FUNCTION_THREAD_TIMEOUT_S"]) == 60  # Tune reads it with int()
    # and a private local Ray's own (the job's env vars, which its Train controller gets): one of Ray Train's own
    # variables, parsed as off
    from ray._private.ray_constants import env_bool

    from hpsearch.train.launch import PRIVATE_RAY_ENV
    assert set(PRIVATE_RAY_ENV) == {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"} <= ENV_VARS_TO_PROPAGATE
    os.environ.update(PRIVATE_RAY_ENV)
    try:
        assert env_bool("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", True) is False
    finally:
        del os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"]


def test_bad_override_is_one_line_error():
    proc = run_train("train.max_step=3", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "unknown field 'train.max_step'" in proc.stderr
    proc = run_train("data.tasks=first,nosuchtask", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "nosuchtask" in proc.stderr


# the driver of a Ray run, stopped where it would start Ray: which heavy modules its checks imported
DRIVER_CHECKS = """
import sys
import hpsearch.train.__main__ as cli

real_fits = cli.check_fits_locally

def fits(cfg):  # the last check, which counts the CPUs as Ray does: with Ray's own utilities, which Ray's start
    print(sorted(m for m in ("torch", "transformers", "deepspeed", "ray") if m in sys.modules))  # imports next
    real_fits(cfg)

def stop(cfg, resume_from):
    raise SystemExit(0)

cli.check_fits_locally, cli.run_with_ray = fits, stop
cli.main(sys.argv[1:])
"""


def test_the_driver_checks_a_run_without_importing_torch(tmp_path):
    """Config, data and backbone checks run before Ray starts and import neither torch nor transformers (the
    workers' imports, ~4 s here): a mistake is one line at once, and a run reaches Ray sooner. The local checkpoint's
    tokenizer is read for the targets' check too (with `tokenizers`), so its run gives them room: its 300-token
    vocabulary spells RTE's 'not_entailment' in more than the default 8 tokens."""
    from hpsearch.data.tokenizer import train_tokenizer
    from hpsearch.model.backbones import load_backbone

    load_backbone("t5-tiny").save_pretrained(tmp_path / "backbone")  # a local checkpoint, as pretrain writes one,
    train_tokenizer(["a few words", "to train on"] * 20, 300, tmp_path / "cache").save_pretrained(
        tmp_path / "backbone")  # with its tokenizer
    glue = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"
    data = [f"data.source={glue}", "data.tasks=rte,cb"] if glue.is_dir() else []
    for args in (["model.method=hyperprompt"], ["model.method=lora", "model.backbone=t5-small", *data],
                 [f"model.backbone={tmp_path / 'backbone'}", *data, "data.max_target_length=32",
                  "train.max_new_tokens=32"]):
        proc = subprocess.run([sys.executable, "-c", DRIVER_CHECKS, *args, f"train.output_dir={tmp_path}"],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip().splitlines()[-1] == "[]", args


# ---- DeepSpeed's JIT ops ---------------------------------------------------------------------------------------------
def test_deepspeed_is_imported_without_mlflow_and_mlflow_imports_as_ever_after():
    hidden = ("import sys; from hpsearch.train.ops import import_deepspeed; ds = import_deepspeed(); "
              "print('mlflow' in sys.modules, ds.autotuning.autotuner.has_mlflow); import mlflow; "
              "print(mlflow.MlflowClient.__name__)")
    kept = ("import sys, mlflow; from hpsearch.train.ops import import_deepspeed; ds = import_deepspeed(); "
            "print(sys.modules['mlflow'] is mlflow, ds.autotuning.autotuner.has_mlflow)")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
            for code in (hidden, kept)]
    assert all(o.returncode == 0 for o in outs), [o.stderr[-2000:] for o in outs]
    assert outs[0].stdout.split() == ["False", "False", "MlflowClient"]  # not imported with DeepSpeed; then as ever
    assert outs[1].stdout.split() == ["True", "True"]  # a process that had MLflow keeps its module


@pytest.mark.slow
def test_a_stale_extension_lock_left_by_a_killed_run_does_not_hang_the_next():
    """A run killed while torch held `<build dir>/lock` leaves the file; DeepSpeed alone then waits forever. A lock
    no process has open is removed at once; one a live process holds (another program loading the op) is waited
    for, and left to that program, whose release then works (removing it under that program made its release
    fail)."""
    import time

    from torch.utils.cpp_extension import _get_build_directory
    from torch.utils.file_baton import FileBaton

    from hpsearch.train.ops import SHM_COMM, holders, load_ops

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    assert load_ops([SHM_COMM]) == [SHM_COMM]  # built (the first time on this machine: ~1 min) and loaded
    lock = Path(_get_build_directory("deepspeed_shm_comm", verbose=False)) / "lock"
    code = ("from hpsearch.train.ops import load_ops, SHM_COMM; import deepspeed; load_ops([SHM_COMM]); "
            "deepspeed.init_distributed('gloo')")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    lock.touch()  # what the killed process left: the file, open in no process
    assert holders(lock) == []
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not lock.exists() and "waiting for process" not in proc.stderr
    # another program loading the op (here this process, through torch's own baton): the run waits and leaves the
    # lock alone; once that program releases it, the run goes on
    baton = FileBaton(str(lock))
    assert baton.try_acquire() and holders(lock) == [os.getpid()]
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stderr.readline()
        while line and "waiting for process" not in line:
            line = proc.stderr.readline()
        assert f"waiting for process {os.getpid()}, which is loading deepspeed_shm_comm" in line, line
        time.sleep(1.0)
        assert lock.exists() and proc.poll() is None  # still that program's
        baton.release()  # raised FileNotFoundError when the run had removed the lock
        assert proc.wait(timeout=180) == 0, proc.stderr.read()[-2000:]
    finally:
        proc.kill()
        lock.unlink(missing_ok=True)


@pytest.mark.slow
def test_the_op_built_under_one_path_is_not_rebuilt_under_another():
    """Two `ninja`s on one machine (the system's and the one installed with DeepSpeed) hash build commands
    differently: a process whose PATH finds the system's first and one whose PATH finds the environment's first
    (an activated venv, a `ray start` node) each rebuilt the other's op. The loads here use one ninja either way:
    after the first process, the second adds nothing to the build log."""
    import ninja
    from torch.utils.cpp_extension import _get_build_directory

    env_ninja = Path(ninja.BIN_DIR) / "ninja"
    system = [d for d in ("/usr/bin", "/bin", "/usr/local/bin") if (Path(d) / "ninja").is_file()]
    version = lambda exe: subprocess.run([str(exe), "--version"], capture_output=True, text=True).stdout.strip()
    if not system or version(Path(system[0]) / "ninja") == version(env_ninja):
        pytest.skip("this machine has one ninja version: nothing to tell apart")
    log = Path(_get_build_directory("deepspeed_shm_comm", verbose=False)) / ".ninja_log"
    code = "from hpsearch.train.ops import load_ops, SHM_COMM; print(load_ops([SHM_COMM]))"
    entries = []
    for first in (system[0], ninja.BIN_DIR, system[0]):  # the system's ninja first on PATH, then the environment's
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "PATH": os.pathsep.join([first, os.environ.get("PATH", "")])}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0 and "ShareMemCommBuilder" in proc.stdout, proc.stderr[-2000:]
        entries.append(len(log.read_text().splitlines()) if log.is_file() else 0)
    assert entries[0] > 0 and entries[1] == entries[0] and entries[2] == entries[0], entries  # built once at most


# ---- local loop ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_local_run_resume_equals_uninterrupted(tmp_path):
    # with dropout (t5-tiny has none of its own): the resume must restore the random stream, not only the weights
    FAST = [*globals()["FAST"], "model.dropout=0.1"]
    proc = run_train("--local", *FAST, f"train.output_dir={tmp_path}/full",
                     env={"PYTHONPROFILEIMPORTTIME": "1"})
    full = final_json(proc)
    # the training process imports DeepSpeed without MLflow (DeepSpeed's autotuner imports it if it can: 1.1 s)
    assert "deepspeed" in imported_modules(proc) and not imported_mlflow(proc)
    # where the start-up went, from the process's start to the end of step 1: its phases add up to the total
    phases = startup.parse(proc.stdout)
    assert list(phases) == ["total_s", "imports", "model and data", "DeepSpeed",
                            "step 1 (with resume and tokenization)"]
    assert sum(list(phases.values())[1:]) == pytest.approx(phases["total_s"], abs=0.25)
    assert phases["imports"] > 0.5  # counted from the process's start (python, torch), not from the loop's
    assert full["step"] == 40 and set(full["tasks"]) and full["output_dir"] == str(tmp_path / "full")
    assert (tmp_path / "full" / "model" / "model.safetensors").is_file()
    assert (tmp_path / "full" / "task_params" / "task_params.safetensors").is_file()
    assert (tmp_path / "full" / "config.yaml").is_file()
    assert sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir()) == ["best", "step_20", "step_40"]
    # the yardstick beside the score: majority class and chance on the same splits (here: the synthetic suite)
    assert 0 < full["majority_score"] < 100 and 0 < full["test_majority_score"] < 100
    assert full["chance_score"] < full["majority_score"]
    # resume from the step-20 checkpoint of the same run: the second half must repeat exactly
    resumed_proc = run_train("--local", *FAST, f"train.output_dir={tmp_path}/resumed",
                             "--resume-from", str(tmp_path / "full" / "checkpoints" / "step_20"),
                             env={"PYTHONPROFILEIMPORTTIME": "1"})
    resumed = final_json(resumed_proc)
    # its checkpoint check (which reads DeepSpeed's types) imports DeepSpeed first, also without MLflow
    assert not imported_mlflow(resumed_proc)
    assert resumed["step"] == 40
    assert resumed["loss"] == pytest.approx(full["loss"], rel=1e-5, abs=1e-6)
    assert resumed["score"] == pytest.approx(full["score"], abs=1e-6)
    assert resumed["tasks"] == pytest.approx(full["tasks"], abs=1e-6)
    assert resumed["test_score"] == pytest.approx(full["test_score"], abs=1e-6)
    assert resumed["best_step"] == full["best_step"] and resumed["best_score"] == full["best_score"]
    # every evaluation carries each task's score at the best step so far (what the run delivers)
    history = [json.loads(line) for line in open(tmp_path / "full" / "metrics.jsonl")]
    for h in history:
        (at_best,) = [e for e in history if e["step"] == h["best_step"]]
        tasks = [k for k in at_best if k.startswith("task/") and k.endswith("/score")]
        assert tasks and all(h[f"best_{k}"] == at_best[k] for k in tasks), h
    # restored at its last step (the run had finished): nothing to train, the finished run's result is reported
    again = final_json(run_train("--local", *FAST, f"train.output_dir={tmp_path}/again",
                                 "--resume-from", str(tmp_path / "full" / "checkpoints" / "step_40")))
    assert again == full and again["test_score"] is not None  # exports stay where the run wrote them
    # the same, into the run's own folder: its last checkpoint is the one reported, and stays (it was deleted
    # before it could be copied onto itself, and the run failed)
    last = tmp_path / "full" / "checkpoints" / "step_40"
    files = sorted(p.name for p in last.iterdir())
    in_place = final_json(run_train("--local", *FAST, f"train.output_dir={tmp_path}/full", "--resume-from", str(last)))
    assert in_place == full and sorted(p.name for p in last.iterdir()) == files
    assert sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir()) == ["best", "step_20", "step_40"]
    # resumed from a downloaded copy of it (a study in a bucket) and stopped by ASHA inside that report (Tune's
    # SystemExit): the copy is removed all the same
    stopped = subprocess.run([sys.executable, "-c", STOPPED_IN_REPORT, str(last), str(tmp_path / "copy"), *FAST,
                              f"train.output_dir={tmp_path}/stopped"],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"})
    assert stopped.stdout.splitlines()[-2:] == ["reported step 40", "copy removed"], stopped.stderr[-2000:]
    # that last checkpoint holds the result, not the training state (nothing trains on from it): a longer run
    # from it is refused in one line before anything starts
    assert not (tmp_path / "full" / "checkpoints" / "step_40" / "state").exists()
    assert (tmp_path / "full" / "checkpoints" / "step_20" / "state").is_dir()
    longer = run_train("--local", *FAST, "train.max_steps=60", f"train.output_dir={tmp_path}/longer",
                       "--resume-from", str(tmp_path / "full" / "checkpoints" / "step_40"), timeout=120)
    assert longer.returncode == 2 and longer.stderr.count("\n") == 1, longer.stderr[-2000:]
    assert "holds the run's result, not its training state" in longer.stderr
    assert not (tmp_path / "longer").exists()
    # a resume continues the checkpoint's run as it was: another learning rate (the optimizer's and schedule's state
    # come from the checkpoint, so it was silently ignored) or data order is refused before anything starts, and so
    # is a max_steps below the checkpoint's step (it was reported as the finished run's result)
    step_20 = str(tmp_path / "full" / "checkpoints" / "step_20")
    for change, said in ((["train.lr=1e-2"], "was trained with train.lr=0.003 (this run: 0.01); a resume continues"),
                         (["data.seed=5", "model.dropout=0.2"], "was trained with data.seed=0 (this run: 5), "
                                                                 "model.dropout=0.1 (this run: 0.2); a resume"),
                         (["train.max_steps=10", "train.eval_every=10"], "is at step 20, not before train.max_steps"
                                                                         "=10; set train.max_steps above 20"),
                         # at its step: nothing to train, and no result to report (it returned an empty one)
                         (["train.max_steps=20", "train.eval_every=10"], "is at step 20, not before train.max_steps"
                                                                         "=20")):
        refused = run_train("--local", *FAST, *change, f"train.output_dir={tmp_path}/changed", "--resume-from",
                            step_20, timeout=120)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr[-2000:]
        assert said in refused.stderr, refused.stderr
        assert not (tmp_path / "changed").exists()
    # the exported model reloads with build_model and is a full model
    from hpsearch.model import build_model
    model = build_model(str(tmp_path / "full" / "model"))
    assert model.cfg.variant == "global" and model.extra_parameters()["total"] == full["extra_params"]
    # into its own folder from its step-20 checkpoint, whose metrics.jsonl already holds step 40's line (as when a
    # kill came between that line and its checkpoint's store): the resumed run evaluates step 40 again, and its
    # line is there once
    metrics = tmp_path / "full" / "metrics.jsonl"
    lines = lambda: [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert lines() == [20, 40]
    again = final_json(run_train("--local", *FAST, f"train.output_dir={tmp_path}/full", "--resume-from",
                                 str(tmp_path / "full" / "checkpoints" / "step_20")))
    assert lines() == [20, 40] and again["score"] == pytest.approx(full["score"], abs=1e-6)


def test_pha_trains_and_logs_its_auxiliary_losses(tmp_path):
    args = ["--local", "model.method=pha", "data.batching=mixed", "train.max_steps=10", "train.eval_every=2",
            "train.keep_checkpoints=1", "train.micro_batch_size=8",
            "data.synthetic_train_rows=100", "data.synthetic_eval_rows=20", f"train.output_dir={tmp_path}"]
    out = final_json(run_train(*args))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6, 8, 10]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["best", "step_10"]  # keep_checkpoints=1
    # the best weights: one version kept (the one the kept checkpoint refers to), weights only, not copied into the
    # checkpoint; they are what was exported (the run loaded them at its end)
    import torch
    from safetensors.torch import load_file

    from hpsearch.train import checkpoints
    weights = tmp_path / "checkpoints" / "best" / f"step_{out['best_step']}.safetensors"
    assert list((tmp_path / "checkpoints" / "best").iterdir()) == [weights]
    assert checkpoints.read_best(tmp_path / "checkpoints" / "step_10")["weights"] == str(weights)
    assert not [f for f in (tmp_path / "checkpoints" / "step_10").rglob("*") if "best" in f.name and f.name !=
                "best.json"]
    best, exported = load_file(weights), load_file(tmp_path / "model" / "model.safetensors")
    assert best and all(torch.equal(v, exported[k]) for k, v in best.items())
    for r in rows:  # the mean of each evaluation window's auxiliary losses (batches mix tasks: both are positive)
        assert r["ir_loss"] > 0 and r["proto_loss"] > 0
    assert out["step"] == 10 and out["test_score"] is not None


@pytest.mark.slow
def test_resume_restores_an_older_best_checkpoint(tmp_path):
    """lr=0 after warm-up: the score never improves, so the best stays at step 20 across the resume."""
    args = ["--local", *FAST, "train.warmup_steps=0", "train.lr=1e-9"]
    full = final_json(run_train(*args, f"train.output_dir={tmp_path}/full"))
    assert full["best_step"] == 20
    resumed = final_json(run_train(*args, f"train.output_dir={tmp_path}/resumed",
                                   "--resume-from", str(tmp_path / "full" / "checkpoints" / "step_20")))
    assert resumed["best_step"] == 20 and resumed["test_score"] == pytest.approx(full["test_score"], abs=1e-6)
    # each task's score at the best step travels with it (a task objective ranks by what the run delivers), also
    # across the resume (the checkpoint's state); the last step's own task scores are other numbers
    history = [json.loads(line) for line in open(tmp_path / "full" / "metrics.jsonl")]
    at_best = {k: v for k, v in history[0].items() if k.startswith("task/") and k.endswith("/score")}
    assert history[0]["step"] == 20 and len(at_best) >= 2, history[0]
    for run in ("full", "resumed"):
        last = [json.loads(line) for line in open(tmp_path / run / "metrics.jsonl")][-1]
        assert last["step"] == 40 and {k: last[f"best_{k}"] for k in at_best} == at_best, run


# a finished run's engine, counted in this process (automatic collection off: the count is deterministic), before
# and after what a reused Tune actor does before its next trial; what the loop froze (objects the collector no longer
# tracks) before and after the run, and after a second trial's start and the loop's freeze again; whether the
# process's linear function was torch's own during the run's steps and after it; and the same for a second trial
RELEASED = """
import gc, sys
gc.disable()
import torch
from hpsearch.config import load_config
from hpsearch.train import loop_config
from hpsearch.train.loop import train_loop
from hpsearch.train.sessions import LocalSession
from hpsearch.train.startup import freeze_imports
from hpsearch.tune.inprocess import start_reused_trial
from hpsearch.train.ops import import_deepspeed

DeepSpeedEngine = import_deepspeed().DeepSpeedEngine
cfg = load_config(None, sys.argv[1:])
start_reused_trial()
before = gc.get_freeze_count()
native, seen = torch.nn.functional.linear, set()
engine_step = DeepSpeedEngine.step
def step(self, *args, **kwargs):  # the linear every optimizer step of the run saw
    seen.add(torch.nn.functional.linear is native)
    return engine_step(self, *args, **kwargs)
DeepSpeedEngine.step = step
train_loop(loop_config(cfg), LocalSession(cfg, None))
DeepSpeedEngine.step = engine_step
frozen_by_loop = gc.get_freeze_count()
count = lambda: (sum(type(o).__name__ == "DeepSpeedEngine" for o in gc.get_objects()),
                 sum(getattr(o, "ds_numel", o.numel()) for o in gc.get_objects()  # ZeRO-3's: local shape [0]
                     if isinstance(o, torch.nn.Parameter)))
print("R", *count())
start_reused_trial()
freeze_imports()  # as the next trial's loop does
frozen_later = gc.get_freeze_count()
gc.unfreeze()  # gc.get_objects() leaves frozen objects out: count them too (an engine frozen is never collected)
print("R", *count())
print("R", before, frozen_by_loop, frozen_later)
print("R", int(seen == {True}), int(torch.nn.functional.linear is native))

# a second trial in this process, stopped inside its first report as ASHA stops one (Tune raises SystemExit there)
class Stopped(LocalSession):
    def report(self, metrics, checkpoint_dir):
        raise SystemExit

cfg = load_config(None, [*sys.argv[1:], "train.eval_every=2", f"train.output_dir={cfg.train.output_dir}/stopped"])
start_reused_trial()
try:
    train_loop(loop_config(cfg), Stopped(cfg, None))
    stopped = 0
except SystemExit:
    stopped = 1
start_reused_trial()
print("R", stopped, *count(), int(torch.nn.functional.linear is native))
"""


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["auto", "3"])
def test_a_reused_actor_frees_the_last_trials_engine_before_the_next(tmp_path, stage):
    """The engine a run leaves is in reference cycles (only a full collection frees it): an actor that trains the next
    trial would hold two models at once without `free_trial_memory`. ZeRO-3's engine (one rank, in this process) also
    replaces torch's linear function for the whole process: the run trains with DeepSpeed's, the next starts with
    torch's again. The same for a second trial that a stop ends inside its report."""
    run = run_train("train.max_steps=4", "train.eval_every=4", "train.micro_batch_size=8", f"train.zero_stage={stage}",
                    f"train.output_dir={tmp_path}", timeout=300, script=RELEASED)
    assert run.returncode == 0, run.stderr[-2000:]
    (engines, params), after, (before, by_loop, frozen_later), (native_in_run, native_after), stopped = [
        tuple(map(int, ln.split()[1:])) for ln in run.stdout.splitlines() if ln.startswith("R ")]
    assert engines == 1 and params > 0  # left by the run, until a collection
    assert after == (0, 0)  # collected, although the loop froze what was alive before it built
    # nothing frozen before the loop; the loop froze what was imported (torch, DeepSpeed, ...) before it built, once
    # per process (nothing since: some freed)
    assert before == 0 and by_loop > 100_000 and frozen_later <= by_loop
    assert native_in_run == (stage == "auto")  # ZeRO-3 trains with its own linear, stage 0 with torch's
    assert native_after == 1
    # the next trial trains in the same process; stopped inside a report, its engine goes too, torch's linear is back
    assert stopped == (1, 0, 0, 1)


# an engine whose DeepSpeed clean-up fails: its modules still leave DeepSpeed's forward-module stack, in one line
RELEASE_FAILS = """
import torch
from hpsearch.train.loop import _release
from hpsearch.train.ops import import_deepspeed

import_deepspeed()
from deepspeed.runtime.zero import parameter_offload

module, other = torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Linear(2, 2)


class Engine:
    module = module

    def destroy(self):
        raise RuntimeError("device lost")


parameter_offload.FWD_MODULE_STACK.extend([other, module, module[0]])  # a forward that raised left its submodule
print(_release(Engine(), 1), [m is other for m in parameter_offload.FWD_MODULE_STACK])
"""


def test_an_engine_whose_clean_up_fails_is_one_line_and_still_leaves_deepspeeds_stack():
    run = run_train(script=RELEASE_FAILS, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == [
        "[hpsearch.train] rank 1: releasing the DeepSpeed engine failed (RuntimeError: device lost); this process may "
        "keep the run's model in memory", "None [True]"]


# `python -m hpsearch.train` in which DeepSpeed's CPU Adam op cannot be built or loaded
WITHOUT_CPU_ADAM = """
import sys
from deepspeed.accelerator import get_accelerator
from hpsearch.cli import run_main
from hpsearch.train.__main__ import main

def refuse(*args, **kwargs):
    raise RuntimeError("DeepSpeed's CPU Adam op was asked for")

builder = type(get_accelerator().create_op_builder("CPUAdamBuilder"))
builder.load = builder.jit_load = refuse
run_main(main, sys.argv[1:])
"""


@pytest.mark.slow
def test_cpu_offload_of_optimizer_and_parameters_trains(tmp_path):
    """ZeRO-Offload steps torch's AdamW on the CPU: DeepSpeed's CPU Adam op (a 40 s compile on a new install) is
    neither built nor loaded."""
    proc = run_train("--local", "train.max_steps=6", "train.eval_every=6", "train.offload_optimizer=true",
                     "train.offload_params=true", "data.synthetic_eval_rows=20", f"train.output_dir={tmp_path}",
                     script=WITHOUT_CPU_ADAM)
    assert "offload" in proc.stdout and "ZeRO stage 3" in proc.stdout, proc.stdout[-2000:]
    out = final_json(proc)
    assert out["step"] == 6 and out["loss"] == out["loss"]  # finite


SLOW_FIRST_BATCH = """
import sys, time
from hpsearch.cli import run_main
from hpsearch.train import objective
from hpsearch.train.__main__ import main

made = objective.FineTuning.batch
def batch(self):  # the first batch takes 2 s (as step 1's one-off work: tokenization, first allocations)
    if not getattr(self, "_made_one", False):
        self._made_one = True
        time.sleep(2.0)
    return made(self)
objective.FineTuning.batch = batch
run_main(main, sys.argv[1:])
"""


@pytest.mark.slow
def test_step_time_leaves_out_the_runs_first_step(tmp_path):
    """`step_time` is a step's time (the compare table's cost column; the benchmark subtracts it from a trial's wall
    time to find its fixed cost): the first step's one-off work is the run's start-up, not spread over its steps."""
    out = final_json(run_train("--local", "train.max_steps=8", "train.eval_every=4", "train.log_every=4",
                               "data.synthetic_eval_rows=20", f"train.output_dir={tmp_path}", script=SLOW_FIRST_BATCH))
    history = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [h["step"] for h in history] == [4, 8] and out["step"] == 8
    # with the first step, 4 steps would average over 0.5 s each; a tiny model's step is far below that
    assert history[0]["step_time"] < 0.25 and history[1]["step_time"] < 0.25, history


def test_a_private_ray_starts_its_dashboard_only_when_asked(monkeypatch, tmp_path):
    """Ray Train's worker group needs the dashboard (its State API), so `init_ray(dashboard=True)` starts it on
    loopback and hands its address to every actor; without it, neither (a study whose trials never start a Train
    worker group)."""
    import ray
    from ray._private import ray_constants

    from hpsearch.config import load_config
    from hpsearch.train.launch import init_ray

    calls = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "token"))  # not this user's own
    monkeypatch.setenv(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, "1")  # init_ray's own changes, undone after
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", ray_constants.ENABLE_RAY_CLUSTER)
    cfg = load_config(None, [])
    init_ray(cfg, dashboard=True)
    init_ray(cfg, dashboard=False)
    on, off = calls
    assert on["include_dashboard"] is True and on["dashboard_host"] == "127.0.0.1"
    assert on["runtime_env"]["env_vars"]["RAY_API_SERVER_ADDRESS"] == f"http://127.0.0.1:{on['dashboard_port']}"
    assert off["include_dashboard"] is False and "dashboard_port" not in off and "dashboard_host" not in off
    assert "RAY_API_SERVER_ADDRESS" not in off["runtime_env"]["env_vars"]
    assert on["_node_ip_address"] == off["_node_ip_address"] == "127.0.0.1"  # every service on loopback either way


@pytest.mark.slow
def test_a_private_rays_token_is_readable_by_this_user_alone(tmp_path, monkeypatch):
    """A local `ray.init` turns token authentication on and wrote `~/.ray/auth_token` readable by every user of the
    machine (mode 0644), who could then use this Ray's services (run code as this user). A private Ray's token is
    now created 0600 before Ray starts, and an existing one made 0600, kept as it was (Ray authenticates with it:
    the run starts)."""
    code = ("from hpsearch.config import load_config\nfrom hpsearch.train.launch import init_ray\nimport ray\n"
            "init_ray(load_config(None, []), dashboard=False)\n"
            "print('tasks', ray.get(ray.remote(lambda: 1).remote()))\nray.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    token = tmp_path / ".ray" / "auth_token"
    run = subprocess.run([sys.executable, "-c", code], env={**env, "HOME": str(tmp_path)}, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and "tasks 1" in run.stdout, run.stderr[-3000:]  # Ray authenticated with it
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) >= 32, oct(token.stat().st_mode)
    # an existing token of this user's, readable by others: made 0600 and kept as it was (what Ray then reads)
    from hpsearch.train.launch import keep_token_private
    mine = tmp_path / "other" / "auth_token"
    mine.parent.mkdir()
    mine.write_text("0123456789abcdef" * 4)
    mine.chmod(0o644)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(mine))
    assert keep_token_private() == mine
    assert mine.stat().st_mode & 0o777 == 0o600 and mine.read_text() == "0123456789abcdef" * 4


def test_the_torch_backend_config_says_what_ray_trains_own_says():
    """`BoundTorchConfig` is Ray Train's torch backend defined without torch (torchconfig.py): what Ray Train reads of
    it (state export, framework, GPU sharing, the context around the loop) is what its own `TorchConfig` gives."""
    from ray.train.torch.config import TorchConfig, TorchConfigContextManager, _TorchBackend

    from hpsearch.train.torchconfig import BoundTorchConfig

    for backend, timeout in (("gloo", 1800), ("nccl", 30)):
        ours, theirs = BoundTorchConfig(backend=backend, timeout_s=timeout), TorchConfig(backend=backend,
                                                                                          timeout_s=timeout)
        assert ours.to_dict() == theirs.to_dict() and ours.framework == theirs.framework
    assert BoundTorchConfig().backend == "gloo"
    assert BoundTorchConfig().backend_cls.share_cuda_visible_devices is _TorchBackend.share_cuda_visible_devices
    context = BoundTorchConfig().train_func_context()
    with context:  # Ray's own context inside (it sets the worker's CUDA device; none here)
        assert isinstance(context._inner, TorchConfigContextManager)


# a private Ray started and stopped as a run does: which of its processes were still running when Ray's shutdown
# came to them, and which are running after it
PRIVATE_RAY_SHUTDOWN = """
import json
import psutil
from ray._private import node, worker
from hpsearch.config import load_config
from hpsearch.train.launch import init_ray, shutdown_ray

init_ray(load_config(None, []), dashboard=False)
processes = {kind: [info.process for info in infos] for kind, infos in worker._global_node.all_processes.items()}
running_when_ray_came = {}
kill = node.Node._kill_process_type
def recording(self, kind, *args, **kwargs):
    running_when_ray_came[kind] = any(p.poll() is None for p in processes[kind])
    return kill(self, kind, *args, **kwargs)
node.Node._kill_process_type = recording
shutdown_ray()
def running(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # a zombie has exited
    except psutil.NoSuchProcess:
        return False
print(json.dumps({"came": running_when_ray_came,
                  "left": [kind for kind, ps in processes.items() for p in ps if running(p.pid)]}))
"""


def test_a_private_rays_shutdown_does_not_wait_on_its_autoscaler_monitor():
    """Ray's shutdown stops the GCS first, then asks the monitor to stop, which then hangs telling the drivers
    through the gone GCS until Ray kills it a second later: `shutdown_ray` kills the monitor first (one machine
    autoscales nothing), and Ray stops every other process of its own as ever."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("RAY_ADDRESS", None)
    run = subprocess.run([sys.executable, "-c", PRIVATE_RAY_SHUTDOWN], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["came"]["monitor"] is False  # already gone: nothing to wait for
    assert out["came"]["raylet"] is True and out["came"]["gcs_server"] is True  # stopped by Ray, as ever
    assert out["left"] == []  # no process of that Ray left running


def test_one_rank_process_group_ignores_a_master_address_inherited_from_the_shell():
    """`--local` and in-process trials start a process group of one rank: a MASTER_ADDR / MASTER_PORT left in the
    user's environment (another job's rendezvous) must not be dialled."""
    code = ("import torch, deepspeed; from hpsearch.train.loop import _init_single_process_group as init; "
            "from hpsearch.train.ops import load_ops; init('gloo'); load_ops(); "
            "deepspeed.init_distributed('gloo'); t = torch.ones(2); torch.distributed.all_reduce(t); "
            "print(torch.distributed.get_world_size(), t.tolist())")  # load_ops: no lock left if the timeout kills it
    env = {**os.environ, "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONWARNINGS": "ignore"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines()[-1] == "1 [1.0, 1.0]"


def test_resume_from_a_non_checkpoint_is_one_line(tmp_path):
    proc = run_train("--local", "--resume-from", str(tmp_path), "train.max_steps=3", timeout=120)
    assert proc.returncode == 2 and "is not a checkpoint" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_nan_loss_stops_with_clear_reason(tmp_path):
    proc = run_train("--local", *FAST, "train.debug_nan_at_step=7", f"train.output_dir={tmp_path}")
    assert proc.returncode == 2
    assert "non-finite loss" in proc.stderr and "at step 7" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_non_finite_gradient_with_a_finite_loss_is_never_checkpointed(tmp_path):
    """A NaN gradient while the loss is finite (fault injection at an evaluation step): at ZeRO stage 0 the clipping
    spreads it to every weight, and the loss shows it only at the next step, after the evaluation's checkpoint had
    kept NaN weights (a resume or a retry then trained from them). The weights are checked at each evaluation, in
    the window's one collective: the run stops before writing it. ZeRO's optimizers skip such a step instead: the
    run goes on and says so."""
    at = ["train.max_steps=4", "train.eval_every=2", "train.log_every=2", "train.debug_nan_gradient_at_step=2",
          "train.micro_batch_size=8", "data.synthetic_train_rows=100", "data.synthetic_eval_rows=20"]
    stage0 = run_train("--local", *at, "train.zero_stage=0", f"train.output_dir={tmp_path}/s0")
    assert stage0.returncode == 2, stage0.stderr[-3000:]
    assert "non-finite weights at step 2" in stage0.stderr and "stopping the run before it writes a checkpoint" \
        in stage0.stderr and "Traceback" not in stage0.stderr, stage0.stderr[-3000:]
    assert not list((tmp_path / "s0").glob("checkpoints/step_*")) and not (tmp_path / "s0" / "checkpoints" /
                                                                          "best").exists()
    stage1 = run_train("--local", *at, "train.zero_stage=1", f"train.output_dir={tmp_path}/s1")
    assert final_json(stage1)["step"] == 4
    assert "DeepSpeed skipped 1 optimizer step(s) with a non-finite gradient by step 2" in stage1.stdout


# `python -m hpsearch.train` whose export finds the disk full, as safetensors says it (a SafetensorError, not an
# OSError; version 0.8 on a full device): argv[1] "file" fails our export's writer, "pretrained" fails the whole export
# the way a Hugging Face save_pretrained (the pretraining export) raises it
EXPORT_DISK_FULL = """
import sys
from safetensors import SafetensorError
import hpsearch.model.export as export
import hpsearch.train.objective as objective
from hpsearch.cli import run_main
from hpsearch.train.__main__ import main

def full(*args, **kwargs):
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

if sys.argv[1] == "file":
    export.save_file = full
else:
    objective.save_export = full
run_main(main, sys.argv[2:])
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["file", "pretrained"])
def test_a_full_disk_at_the_export_is_one_line_naming_where(tmp_path, where):
    """Checkpoints fit but the export does not: one line naming where and how to go on, exit 2, no traceback; after
    space is freed the run resumes from its last checkpoint and exports."""
    args = ["--local", *FAST, "train.max_steps=8", "train.eval_every=4", f"train.output_dir={tmp_path}"]
    proc = run_train(where, *args, script=EXPORT_DISK_FULL)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    named = tmp_path / "model" / "model.safetensors" if where == "file" else tmp_path
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: no space left on device writing {named}; free space there, then resume "
        "(python -m hpsearch.tune --resume, or --resume-from)"), proc.stderr[-1000:]
    # the last step's checkpoint is written after the export, so none is left for step 8: step 4's is the last
    assert not (tmp_path / "checkpoints" / "step_8").exists() and (tmp_path / "checkpoints" / "step_4").is_dir()
    assert not (tmp_path / "model" / "model.safetensors").exists()
    if where == "file":
        resumed = final_json(run_train(*args, "--resume-from", str(tmp_path / "checkpoints" / "step_4")))
        assert resumed["step"] == 8 and (tmp_path / "model" / "model.safetensors").stat().st_size > 1000

# ---- Ray Train: 2 workers, ZeRO-3 -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_ray_two_workers_loss_falls_and_survive_a_worker_crash(tmp_path):
    args = [*FAST, "train.num_workers=2", "train.micro_batch_size=8", "train.zero_stage=3"]  # partitioned
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 characters
    base_proc = run_train(*args, "train.output_dir=a", cwd=tmp_path, env={"RAY_TMPDIR": ray_dir})
    base = final_json(base_proc)  # output_dir relative: this directory's
    # the private Ray started no process the run does not use: no idle Python worker per CPU started for the first
    # driver (job id ffffffff), no preemption watcher (one machine), no Ray Data dataset manager (no datasets), no
    # placement-group cleaner and so no dashboard (the Ray ends with the run); its Train workers' logs are where
    # this looks
    logs = list(Path(ray_dir).glob("ray/session_latest/logs/worker-*.out"))
    actors = [f.read_text().partition(":actor_name:")[2].split("\n")[0] for f in logs]
    heads = [f.name for f in Path(ray_dir).glob("ray/session_latest/logs/dashboard_*Head.log")]
    # its checkpoints were written beside the run's, in the staging area, and moved: nothing is left there
    runs = tmp_path / "a" / "ray"
    assert list(runs.glob("*/checkpoint_*")) and not list(runs.glob("*/.staging"))
    shutil.rmtree(ray_dir, ignore_errors=True)
    assert actors.count("RayTrainWorker") == 2 and "TrainController" in actors, actors
    assert not {"PreemptionWatcher", "DatasetManager", "PlacementGroupCleaner"} & set(actors), actors
    assert not heads, heads
    assert not [f.name for f in logs if "-ffffffff-" in f.name], [f.name for f in logs]
    assert base["output_dir"] == str(tmp_path / "a")
    phases = startup.parse(base_proc.stdout)  # the driver's phases, then the worker's (rank 0 prints them)
    assert list(phases)[1:5] == ["driver imports and checks", "Ray start", "trainer set-up",
                                 "Train controller and worker group"]
    assert sum(list(phases.values())[1:]) == pytest.approx(phases["total_s"], abs=0.5)
    # each line a worker prints reaches the terminal once (not on stdout and again on stderr)
    worker_lines = [ln for ln in (base_proc.stdout + base_proc.stderr).splitlines() if "[hpsearch.train] " in ln
                    and "RayTrainWorker" in ln]
    assert sum("[hpsearch.train] start-up " in ln for ln in worker_lines) == 1, worker_lines
    assert len(worker_lines) == len(set(worker_lines)), worker_lines
    assert "Reporting training result" not in base_proc.stdout + base_proc.stderr  # Ray Train's per-rank lines
    for name in ("config.yaml", "metrics.jsonl", "model/model.safetensors", "task_params/task_params.safetensors"):
        assert (tmp_path / "a" / name).is_file(), name
    history = [json.loads(line) for line in open(tmp_path / "a" / "metrics.jsonl")]
    assert [h["step"] for h in history] == [20, 40]
    assert history[-1]["loss"] < history[0]["loss"] and base["loss"] == history[-1]["loss"]
    assert [h["best_score"] for h in history] == [history[0]["score"], max(h["score"] for h in history)]
    # --resume-from with Ray (Train V2 has no resume_from_checkpoint): from the run's last Ray checkpoint, which is
    # its final step (its result, no training state), the run reports the finished run's result again
    (last,) = [p for p in (tmp_path / "a" / "ray").glob("*/checkpoint_*") if (p / "report.json").is_file()]
    assert not (last / "state").exists()
    again = final_json(run_train(*args, "train.output_dir=c", "--resume-from", str(last), cwd=tmp_path))
    assert again == base  # the same result, exports included (they stay where the run wrote them)
    # a worker dies right after its step-20 report, before Ray Train's controller polled it (Train V2 polls): the
    # checkpoint is complete in storage but unknown to Ray; both ranks restart from it, not from step 0, and finish
    steps = tmp_path / "reported_steps"
    proc = run_train_recording(steps, *args, "train.debug_crash_at_step=20", "train.max_failures=1",
                               "train.zero_init=true", f"train.output_dir={tmp_path}/b")
    crashed = final_json(proc)  # also built under zero.Init (on CPU workers only on request): the same run
    assert "model built under deepspeed.zero.Init" in proc.stdout
    assert "model built under deepspeed.zero.Init" not in base_proc.stdout
    assert re.search(r"resumed from \S+ at step 20\b", proc.stdout), proc.stdout[-3000:]
    assert steps.read_text().split() == ["20", "40"]  # Ray took step 20's report once: from the restarted run
    # neither the driver nor Train's controller imported torch (1.4 s each): only the workers use it
    assert Path(f"{steps}.controller").read_text().split() == ["False", "False"]
    assert Path(f"{steps}.driver").read_text().split() == ["False"]
    # Ray Train's autoscaling coordinator was started with the trainer, before its controller asked for it
    assert Path(f"{steps}.coordinator").read_text().splitlines() == ["['AutoscalingCoordinator']"]
    assert crashed["step"] == 40
    assert crashed["loss"] == pytest.approx(base["loss"], rel=1e-4)
    assert crashed["score"] == pytest.approx(base["score"], abs=1e-6)


@pytest.mark.slow
def test_ray_nan_loss_is_reported_not_hung(tmp_path):
    proc = run_train(*FAST, "train.num_workers=2", "train.debug_nan_at_step=3", f"train.output_dir={tmp_path}")
    assert proc.returncode == 2 and "non-finite loss" in proc.stderr and "at step 3" in proc.stderr



def test_a_manifest_reported_again_is_left_alone_and_a_new_one_replaces_the_old_whole(tmp_path):
    """A checkpoint reported again (a finished run's result; one Tune never took) already holds its manifest: it is
    not rewritten (the folder may be the stored checkpoint, or the user's, read-only; a kill during the old in-place
    rewrite left the trial's only checkpoint looking incomplete). A manifest that changes is written beside and
    renamed over the old one (a new file), never truncated in place."""
    from pyarrow import fs

    from hpsearch.train import checkpoints

    folder = tmp_path / "checkpoint_1"
    (folder / "state").mkdir(parents=True)
    (folder / "state" / "weights.pt").write_bytes(b"w" * 10)
    checkpoints.write_report(folder, {"step": 1})
    checkpoints.write_manifest(folder, 0)
    manifest = folder / "manifest_rank_0.json"
    os.utime(manifest, ns=(10**18, 10**18))
    first = manifest.stat().st_ino
    checkpoints.write_manifest(folder, 0)
    assert manifest.stat().st_mtime_ns == 10**18 and manifest.stat().st_ino == first  # not written at all
    (folder / "state" / "more.pt").write_bytes(b"m")
    checkpoints.write_manifest(folder, 0)
    assert manifest.stat().st_ino != first and "state/more.pt" in json.loads(manifest.read_text())
    assert sorted(p.name for p in folder.iterdir()) == ["manifest_rank_0.json", "report.json", "state"]
    (folder / ".manifest_rank_0.json.partial").write_text("{")  # what a kill while writing it left
    checkpoints.write_manifest(folder, 0)
    assert ".manifest_rank_0.json.partial" not in manifest.read_text()  # not taken for one of the checkpoint's files
    assert checkpoints.complete_step(fs.LocalFileSystem(), str(folder), 1) == 1

def test_newest_complete_checkpoint_needs_every_ranks_files_in_full(tmp_path):
    """A worker that dies just after its upload leaves a checkpoint Ray never registered: the restarted run takes it
    only when every rank's manifest is there and every listed file has its listed size."""
    from pyarrow import fs

    from hpsearch.train import checkpoints
    local = fs.LocalFileSystem()

    def reported(name, step, ranks, payload=b"x" * 100):
        folder = tmp_path / name
        for rank in ranks:  # each rank writes and reports its own files into the shared folder
            mine = tmp_path / f"rank{rank}" / name
            (mine / "state").mkdir(parents=True)
            (mine / "state" / f"zero_pp_rank_{rank}_model_states.pt").write_bytes(payload)
            if rank == 0:
                checkpoints.write_report(mine, {"step": step})
            checkpoints.write_manifest(mine, rank)
            for f in mine.rglob("*"):
                if f.is_file():
                    (folder / f.relative_to(mine)).parent.mkdir(parents=True, exist_ok=True)
                    (folder / f.relative_to(mine)).write_bytes(f.read_bytes())
        return folder

    assert checkpoints.newest_complete(local, str(tmp_path / "absent"), 2) is None
    reported("checkpoint_a", 20, [0, 1])
    assert checkpoints.newest_complete(local, str(tmp_path), 2) == (20, str(tmp_path / "checkpoint_a"))
    reported("checkpoint_b", 40, [0])  # rank 1 never uploaded
    assert checkpoints.complete_step(local, str(tmp_path / "checkpoint_b"), 2) is None
    assert checkpoints.complete_step(local, str(tmp_path / "checkpoint_b"), 1) == 40
    c = reported("checkpoint_c", 60, [0, 1])
    assert checkpoints.newest_complete(local, str(tmp_path), 2) == (60, str(c))
    shard = c / "state" / "zero_pp_rank_1_model_states.pt"
    shard.write_bytes(shard.read_bytes()[:50])  # an upload cut short
    assert checkpoints.newest_complete(local, str(tmp_path), 2) == (20, str(tmp_path / "checkpoint_a"))
    assert checkpoints.reported_step(local, str(c)) == 60 and checkpoints.reported_step(local, str(tmp_path)) == -1
    # whether Ray took the newest one's report: it hands back the checkpoint it registered last (or none)
    taken = lambda folder: SimpleNamespace(filesystem=local, path=str(tmp_path / folder))
    a = (20, str(tmp_path / "checkpoint_a"))
    assert checkpoints.newest_unreported(local, str(tmp_path), 2, None) == (a, True)
    assert checkpoints.newest_unreported(local, str(tmp_path), 2, taken("checkpoint_a")) == (a, False)
    assert checkpoints.newest_unreported(local, str(tmp_path), 1, taken("checkpoint_a")) == ((60, str(c)), True)
    assert checkpoints.newest_unreported(local, str(tmp_path / "absent"), 2, None) == (None, False)


def test_failure_reason_is_the_exception_line_not_a_header_or_the_source_that_raised_it():
    from hpsearch.train.launch import failure_reason
    wrapped = RuntimeError(
        "Training failed.\n[Rank 0,1 Error Snippet]:\nTraceback (most recent call last):\n"
        '  File "loop.py", line 9, in train_loop\n'
        '    raise checkpoints.DiskFull(f"no space left on device writing {where}; free space there")\n'
        "hpsearch.train.checkpoints.DiskFull: no space left on device writing /runs/t1; free space there")
    assert failure_reason(wrapped) == "no space left on device writing /runs/t1; free space there"
    assert failure_reason(RuntimeError("[Rank 0 Error Snippet]:\nTraceback:\nValueError: bad row")) == \
        "ValueError: bad row"


NON_FINITE = """
import torch, torch.distributed as dist
from hpsearch.train.loop import non_finite_weights
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
module = torch.nn.Module()
module.whole = torch.nn.Parameter(torch.tensor([1.0, float("inf"), 2.0]))
module.shard = torch.nn.Parameter(torch.empty(0))  # ZeRO-3: local shape [0], this rank's partition in ds_tensor
module.shard.ds_numel, module.shard.ds_process_group = 5, dist.group.WORLD
part = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, float("nan"), float("nan"), float("nan")])  # 3 of padding
part.ds_numel = 8
module.shard.ds_tensor = part
print(float(non_finite_weights(module)))
part[2] = float("nan")
print(float(non_finite_weights(module)))
"""


def test_the_weights_check_counts_a_zero3_partitions_real_elements_only():
    """Under ZeRO-3 a rank's partition is padded to the same size on every rank, and DeepSpeed never writes the
    padding (`torch.empty`): whatever the allocator left there was counted, and a NaN bit pattern would stop a
    healthy run. Only the partition's real elements count (as `bestweights.load_best` reads them)."""
    run = subprocess.run([sys.executable, "-c", NON_FINITE], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["1.0", "2.0"]  # the whole weight's inf; then a real element of the partition


def test_window_folds_device_sums_with_the_first_non_finite_step():
    """The loop's device-side sums, written out by hand: micro-step losses averaged over grad_accum per step, tokens
    summed, auxiliary losses averaged like the loss, and the first step whose loss was not finite."""
    import torch

    from hpsearch.train.loop import Window
    window = Window(torch.device("cpu"))
    losses = {1: [2.0, 4.0], 2: [1.0, float("nan")], 3: [3.0, 5.0]}  # grad_accum = 2
    for step, pair in {**losses, 3: [3.0, float("inf")]}.items():  # a second bad step: the first one is kept
        for k, value in enumerate(pair):
            window.add(step, torch.tensor(value), torch.tensor(10 * step + k), {"ir_loss": torch.tensor(step * 1.0)},
                       grad_accum=2)
    sums = window.fold()
    assert sums["tokens"] == 10 + 11 + 20 + 21 + 30 + 31
    assert sums["bad_ranks"] == 1 and int(window.first_bad) == 2
    assert sums["aux"] == {"ir_loss": (1 + 2 + 3) * 2 / 2}
    clean = Window(torch.device("cpu"))
    for step in (1, 3):
        for value in losses[step]:
            clean.add(step, torch.tensor(value), torch.tensor(0), {}, grad_accum=2)
    folded = clean.fold()
    assert folded["eval_loss"] == folded["log_loss"] == (2 + 4) / 2 + (3 + 5) / 2  # per-step means, summed
    assert folded["bad_ranks"] == 0 and int(clean.first_bad) == 0 and folded["aux"] == {}


def test_a_local_checkpoint_is_moved_from_its_staging_folder_and_a_users_folder_is_copied(tmp_path):
    """`--local`'s session stores the checkpoint the loop wrote in its staging folder by moving it (a rename: the
    bytes are written once), copies a folder of the user's (the finished run it resumed from, reported again), leaves
    it alone when it is the very folder it would store it in, and replaces a link of the user's there without
    touching what the link points to."""
    from hpsearch.config import load_config
    from hpsearch.train.sessions import STAGING, LocalSession

    cfg = load_config(None, [f"train.output_dir={tmp_path / 'run'}"])
    session = LocalSession(cfg, None)
    with session.staging() as folder:
        assert Path(folder).parent == tmp_path / "run" / "checkpoints" / STAGING
        (Path(folder) / "state").mkdir()
        (Path(folder) / "state" / "weights").write_bytes(b"w" * 100)
        inode, folder_inode = (Path(folder) / "state" / "weights").stat().st_ino, Path(folder).stat().st_ino
        session.report({"step": 1}, folder)
        assert not Path(folder).exists()  # moved out
    stored = tmp_path / "run" / "checkpoints" / "step_1" / "state" / "weights"
    assert stored.read_bytes() == b"w" * 100 and stored.stat().st_ino == inode  # renamed, not written again
    # the folder itself was renamed: step_1 appeared whole, in one step (a kill while storing file by file left a
    # step_1 holding some of its files, which --resume-from took for a checkpoint)
    assert stored.parent.parent.stat().st_ino == folder_inode
    assert not (tmp_path / "run" / "checkpoints" / STAGING).exists()  # removed once empty
    users = tmp_path / "theirs"
    users.mkdir()
    (users / "report.json").write_text("{}")
    session.report({"step": 2}, str(users))
    assert (users / "report.json").is_file() and (tmp_path / "run" / "checkpoints" / "step_2" / "report.json").is_file()
    session.report({"step": 2}, str(tmp_path / "run" / "checkpoints" / "step_2"))  # the folder itself: kept
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "report.json").is_file()
    (tmp_path / "run" / "checkpoints" / "step_3").symlink_to(users, target_is_directory=True)
    session.report({"step": 3}, str(tmp_path / "run" / "checkpoints" / "step_2"))
    assert (users / "report.json").is_file() and not (tmp_path / "run" / "checkpoints" / "step_3").is_symlink()
    assert [h["step"] for h in session.history] == [1, 2, 2, 3]




def test_a_run_resumed_into_the_folder_of_one_that_went_further_keeps_its_own_checkpoints(tmp_path):
    """`--local` keeps the newest `train.keep_checkpoints`: newest as stored, not by step number. Resumed into the
    folder of a run that went further (from an older copy), the run kept the abandoned run's step_300 and step_400
    and deleted each of its own as it stored it (found by an independent review). Its best weights never take the
    name of the other run's, which that run's checkpoints still refer to."""
    from pyarrow import fs

    from hpsearch.config import load_config
    from hpsearch.train import bestweights
    from hpsearch.train.sessions import LocalSession

    run = tmp_path / "run" / "checkpoints"
    for step in (300, 400):  # the abandoned run's
        (run / f"step_{step}").mkdir(parents=True)
    (run / "best").mkdir()
    (run / "best" / "step_200.safetensors").write_bytes(b"theirs")
    cfg = load_config(None, [f"train.output_dir={tmp_path / 'run'}", "train.keep_checkpoints=2"])
    session = LocalSession(cfg, None)
    stored = []
    for step in (200, 250, 300):
        with session.staging() as folder:
            (Path(folder) / "report.json").write_text(json.dumps({"step": step, "mine": True}))
            session.report({"step": step}, folder)
        stored.append(sorted(p.name for p in run.glob("step_*")))
    assert stored == [["step_200", "step_400"], ["step_200", "step_250"], ["step_250", "step_300"]]
    assert json.loads((run / "step_300" / "report.json").read_text())["mine"]  # this run's step_300 replaced theirs
    assert session.history[0]["checkpoint"] == str(run / "step_200")
    local, folder = fs.LocalFileSystem(), str(run / "best")
    assert bestweights.best_weights_path(local, folder, 100, 0) == f"{folder}/step_100.safetensors"
    assert bestweights.best_weights_path(local, folder, 200, 0) == f"{folder}/step_200.1.safetensors"
    (run / "best" / "step_200.1.safetensors").write_bytes(b"mine")
    assert bestweights.best_weights_path(local, folder, 200, 0) == f"{folder}/step_200.2.safetensors"

def test_a_rank_entering_staging_while_others_leave_it_gets_its_folder(tmp_path, monkeypatch):
    """Each rank leaving its staging folder removes `.staging` once it is empty, which can fall between another
    rank's creating `.staging` and its own folder in it, and again on the retry (an independent review's 12
    processes entering and leaving 2,000 times each lost that race 3 times running): the rank tries again."""
    from hpsearch.train.sessions import STAGING, staged

    real_mkdir, lost = Path.mkdir, []

    def mkdir(self, *args, **kwargs):
        if self.name == "rank_1" and len(lost) < 5:  # another rank, leaving, removed the empty .staging just now
            lost.append(self)
            self.parent.rmdir()
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with staged(tmp_path, 1) as folder:
        assert Path(folder) == tmp_path / STAGING / "rank_1" and Path(folder).is_dir()
    assert len(lost) == 5 and not (tmp_path / STAGING).exists()

def test_a_ray_checkpoint_written_in_the_runs_staging_area_is_moved_into_its_folder(tmp_path, monkeypatch):
    """Ray Train's upload of a reported checkpoint, as the recipe hands it (`store_in_ray_storage`): a rank's folder
    in the run's staging area on a local (or shared) file system is moved into the checkpoint's folder, beside the
    other ranks' files, after Ray's check that the node sees the storage; any other folder goes through Ray's own
    upload (a copy)."""
    from types import SimpleNamespace

    import ray.train
    from pyarrow import fs

    from hpsearch.train.sessions import STAGING, staged, store_in_ray_storage

    experiment = tmp_path / "ray" / "train-1"
    calls = []
    storage = SimpleNamespace(
        storage_filesystem=fs.LocalFileSystem(), experiment_fs_path=str(experiment),
        build_checkpoint_path_from_name=lambda name: str(experiment / name),
        _check_validation_file=lambda: calls.append("checked"),
        persist_current_checkpoint=lambda ckpt, name: calls.append(("copied", ckpt.path, name)) or "ray's")
    monkeypatch.setattr(ray.train, "get_context", lambda: SimpleNamespace(get_storage=lambda: storage))
    for rank in (0, 1):  # each rank's files in the same subfolders, as DeepSpeed's ZeRO shards are
        with staged(experiment, rank) as folder:
            (Path(folder) / "state").mkdir()
            (Path(folder) / "state" / f"part_{rank}").write_bytes(b"x" * 10)
            (Path(folder) / f"manifest_rank_{rank}.json").write_text("{}")
            inode = (Path(folder) / "state" / f"part_{rank}").stat().st_ino
            stored = store_in_ray_storage(ray.train.Checkpoint.from_directory(folder), "checkpoint_1")
        assert stored.path == str(experiment / "checkpoint_1")
        assert (experiment / "checkpoint_1" / "state" / f"part_{rank}").stat().st_ino == inode  # renamed
    assert sorted(str(p.relative_to(experiment / "checkpoint_1")) for p in (experiment / "checkpoint_1").rglob("*")) \
        == ["manifest_rank_0.json", "manifest_rank_1.json", "state", "state/part_0", "state/part_1"]
    assert calls == ["checked", "checked"] and not (experiment / STAGING).exists()
    elsewhere = tmp_path / "downloaded"
    elsewhere.mkdir()
    assert store_in_ray_storage(ray.train.Checkpoint.from_directory(str(elsewhere)), "checkpoint_2") == "ray's"
    assert calls[-1] == ("copied", str(elsewhere), "checkpoint_2")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_micro_step_reads_nothing_on_the_host_and_a_window_folds_once(tmp_path, precision):
    """The recipe's loop (tests/workers/host_reads.py, a one-rank run in one process): between taking a batch and
    folding the window, its micro-steps (forward, backward, DeepSpeed's step, the window's sums) read no tensor value
    on the host and run one collective per optimizer step only, DeepSpeed's gradient-norm reduction for clipping; each
    log or evaluation boundary folds the window in one all-reduce and one read. On a GPU every such read is a device
    synchronisation. Before: DeepSpeed's throughput timer synchronised the device twice every micro-step. bf16 (the
    GPU workers' default, run here on DeepSpeed's CPU accelerator) at stage 0 is torch's autocast: DeepSpeed's own
    bf16 wrapped the optimizer in one whose overflow check read every gradient on the host (330 reads in these 6
    steps); its best weights are still 16-bit."""
    out = tmp_path / "reads.json"
    steps, log_every, accum = 6, 3, 2
    run = subprocess.run([sys.executable, str(Path(__file__).parent / "workers" / "host_reads.py"), str(out),
                          "model.backbone=t5-tiny", f"train.max_steps={steps}", f"train.log_every={log_every}",
                          f"train.eval_every={steps}", f"train.grad_accum={accum}", "train.micro_batch_size=4",
                          "data.batching=mixed", "data.synthetic_train_rows=60", "data.synthetic_eval_rows=8",
                          f"train.output_dir={tmp_path / 'run'}"],
                         env={**os.environ, "DS_ACCELERATOR": "cpu", **({"HOST_READS_BF16": "1"} if precision == "bf16"
                                                                         else {})},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["metrics"]["step"] == steps
    from safetensors import safe_open
    with safe_open(str(tmp_path / "run" / "checkpoints" / "best" / f"step_{steps}.safetensors"), "pt") as best:
        dtypes = {best.get_slice(name).get_dtype() for name in best.keys()}
    assert dtypes == {"BF16" if precision == "bf16" else "F32"}, dtypes
    assert report["events"].get("step") == {"collective all_reduce in deepspeed/runtime/utils.py:clip_grad_norm_":
                                            steps}, report["events"].get("step")
    assert report["folds"] == steps // log_every
    assert {k.split(" in ")[0]: v for k, v in report["events"]["fold"].items()} == {
        "collective all_reduce": report["folds"], "tolist": report["folds"]}
    # the spies saw the model's reads too: its CPU task ids (by design) and, on this CPU, transformers' mask skip
    assert report["task_context"] >= steps * accum and report["model"] > 0


@pytest.mark.slow
def test_the_reported_loss_of_an_accumulated_step_is_the_mean_over_its_tokens(tmp_path):
    """One `--local` step of two micro-batches of GLUE rows (targets of different lengths): the loss the run reports
    equals the mean over every target token of the step's rows under the initial weights, computed here from the
    model and the batches the objective makes, not the mean of the two micro-batches' means."""
    import torch

    from hpsearch.config import load_config
    from hpsearch.data.tokens import TokenizedSuite
    from hpsearch.train.objective import LABEL_TOKENS, FineTuning

    glue = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"
    overrides = ["model.backbone=t5-tiny", f"data.source={glue}", "data.tasks=rte,cola,stsb", "data.batching=mixed",
                 "data.max_train_rows=64", "data.max_eval_rows=4", f"data.cache_dir={tmp_path / 'cache'}",
                 "data.seed=3", "train.micro_batch_size=4", "train.grad_accum=2", "train.max_steps=1",
                 "train.eval_every=1", f"train.output_dir={tmp_path / 'run'}"]
    reported = final_json(run_train("--local", *overrides))["loss"]
    objective = FineTuning(load_config(None, overrides), 0, 1)
    objective.tokens = TokenizedSuite(objective.suite, objective.tokenizer, objective.cfg.data)
    model = objective.model.eval()
    sums, counts = [], []
    with torch.no_grad():
        for _ in range(2):
            batch = objective.batch()
            counts.append(batch.pop(LABEL_TOKENS)[0])
            sums.append(model(**batch).loss.item() * counts[-1])
    assert counts[0] != counts[1], counts
    assert reported == pytest.approx(sum(sums) / sum(counts), rel=1e-5)
    assert reported != pytest.approx(sum(s / n for s, n in zip(sums, counts)) / 2, rel=1e-4)


def test_prefetch_hands_out_the_same_batches_and_the_state_before_the_pending_one():
    import torch

    from hpsearch.data import MultiTaskSampler
    from hpsearch.train.prefetch import Prefetch

    def stream():
        sampler = MultiTaskSampler([7, 5, 3], 4, 1.0, "mixed", seed=3)
        return sampler, lambda: {"rows": torch.tensor(next(sampler))}

    plain_sampler, plain = stream()
    sampler, make = stream()
    batches = Prefetch(make, sampler.state_dict)
    try:
        for _ in range(6):
            expected_state = plain_sampler.state_dict()  # after the batches handed out so far
            assert batches.state() == expected_state
            assert torch.equal(batches.next()["rows"], plain()["rows"])
            assert batches.state() == plain_sampler.state_dict() != sampler.state_dict()  # one batch is ahead
        resumed_sampler, resumed = stream()
        resumed_sampler.load_state_dict(batches.state())  # a checkpoint's state resumes at the next batch
        assert torch.equal(resumed()["rows"], plain()["rows"])
    finally:
        batches.close()


def test_startup_line_names_each_phase_in_order_and_reads_back():
    marks = {"fit": 100.0, "process": 90.0, "worker": 107.5, "imports": 109.0, "step": 111.0}  # a subset, unordered
    text = startup.line(marks)
    assert text == ("start-up 21.0 s to the end of step 1: trainer set-up 10.0 s, Train controller and worker group "
                    "7.5 s, imports 1.5 s, step 1 (with resume and tokenization) 2.0 s")
    assert startup.parse(f"noise\n[hpsearch.train] {text}\nmore") == {
        "total_s": 21.0, "trainer set-up": 10.0, "Train controller and worker group": 7.5, "imports": 1.5,
        "step 1 (with resume and tokenization)": 2.0}
    assert startup.parse("no such line") is None


@pytest.mark.slow
def test_the_embedding_table_learns_at_its_own_rate_under_every_zero_stage(tmp_path):
    """`train.embedding_lr_scale`: the recipe's optimizer in a 2-rank DeepSpeed engine at stages 0, 2 and 3. AdamW's
    first update moves each weight with a gradient by lr exactly (lr x g / |g|): the token-embedding table (tied to
    the output layer) by lr x scale, every other weight by lr. And `train.optimizer=adafactor` at stage 0: torch's
    Adafactor over the model's own weights, its first update the paper's (tests/adafactor_ref.py)."""
    from test_zero3 import run_workers

    run_workers("embedding_lr.py", tmp_path, timeout=600)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        adafactor = report.pop("adafactor")
        assert sorted(report) == ["0/1", "0/20", "2/1", "2/20", "3/1", "3/20"]
        # Adafactor at stage 0: torch's own, over the model's weights whole, the paper's first update on every weight
        assert adafactor["optimizer"] == "Adafactor" and adafactor["own_weights"]
        assert adafactor["lr"] == pytest.approx(1e-2) and adafactor["trained"] == adafactor["params"]
        assert max(adafactor["errors"].values()) < 1e-3, adafactor["errors"]
        for key, r in report.items():
            scale = float(key.split("/")[1])
            assert r["tied"]
            assert r["rates"] == pytest.approx([1e-3] if scale == 1 else [1e-3, 20e-3]), key
            assert r["table"] == pytest.approx(1e-3 * scale, rel=1e-3), key
            assert max(r["others"]) == pytest.approx(1e-3, rel=1e-3), key
            assert min(r["others"]) > 0, key  # every weight trained



@pytest.mark.slow
def test_a_checkpoint_of_zero_stage_0_1_and_2_resumes_exactly_with_each_ranks_random_state(tmp_path):
    """ZeRO-1/2's optimizer state (fp32's and DeepSpeed's bf16 optimizer's) holds DeepSpeed's `fragment_address`,
    which the weights-only load refused: no stage-1/2 run (`offload_optimizer=true` picks stage 2) could resume,
    and a study marked such trials failed for good. Two ranks save, a fresh pair passes the resume check, loads and
    trains on to bitwise the same weights, and each rank draws what it would have drawn
    (tests/workers/zero_resume.py)."""
    from test_zero3 import run_workers

    run_workers("zero_resume.py", tmp_path, timeout=900)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(report) == {"stage0-fp32", "stage1-fp32", "stage2-fp32", "stage1-bf16", "stage2-bf16"}
        for case, r in report.items():
            assert r["error"] is None, (case, r["error"])
            assert r["max_diff"] == 0.0 and r["moved"] > 1e-3, (case, r)
            # each rank resumes its own random stream (DeepSpeed keeps the client state in rank 0's file only at
            # stages 0-2: every rank got rank 0's, the same dropout masks on every rank)
            assert r["redrawn"] == r["drawn"], (case, rank, r)
    drawn = [json.loads((tmp_path / f"rank{rank}.json").read_text())["stage0-fp32"]["drawn"] for rank in (0, 1)]
    assert drawn[0] != drawn[1]  # the ranks' streams differ

def test_kept_ranks_resume_from_the_checkpoint_rank_0_finds(tmp_path):
    """tests/workers/resume_choice.py: rank 1's listing lacks the newest checkpoint (a network file system's cached
    directory); both ranks resume from the one rank 0 found (step 20), and agree whether to report it again."""
    from test_zero3 import run_workers

    run_workers("resume_choice.py", tmp_path, timeout=300)
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert second["own"][0] == 10 and first["own"][0] == 20  # what each rank lists itself
    assert first["newest"] == second["newest"] and first["newest"][0] == 20
    assert first["unregistered"] is second["unregistered"] is True


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_stage_0_reduces_gradients_only_across_ranks_and_exports_without_copying(tmp_path, ranks):
    """The recipe at stage 0 (tests/workers/stage0.py). Its backward against DeepSpeed's own: one rank never reduces
    (nothing to average) and ends with bitwise the same weights, also for a parameter that stops getting gradients
    (DeepSpeed's reduction gave it zeros, which the optimizer steps); two ranks reduce at every backward and both
    end with the same weights, those of DeepSpeed's own path. The export's gather hands rank 0 the model's own tensors
    (whole already: nothing to copy), equal to the weights, and the other ranks nothing."""
    from test_zero3 import run_workers

    run_workers("stage0.py", tmp_path, timeout=600, ranks=ranks)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]
    for r in reports:
        assert r["world"] == ranks and r["deepspeed_reductions"] == 3
        assert r["recipe_reductions"] == (0 if ranks == 1 else 3)
        assert r["max_diff"] == 0.0 and r["moved"] > 1e-3
        assert r["probe_moved_later"] > 1e-3  # stepped with a zero gradient, as DeepSpeed's reduction gave it
    assert len({r["weights_sha256"] for r in reports}) == 1  # the ranks' replicas agree
    first, *others = reports
    assert first["export_tensors"] > 40 and first["export_own"] == first["export_tensors"] and first["export_equal"]
    assert all(r["export_none"] for r in others)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"),
                    reason="needs root, unshare and ip to make a namespace whose hostname names a network address")
def test_gloo_listens_on_loopback_where_the_hostname_names_a_network_address(tmp_path):
    """Gloo's sockets listen on the address the hostname resolves to, whatever MASTER_ADDR says: here (hostname ->
    127.0.0.1) that hid it, so the ranks run in a network namespace whose hostname resolves to 192.0.2.2 on a veth
    interface. Two ranks joined as on a private Ray, and one rank alone as `--local`, listen on 127.0.0.1 only (on
    the old code three gloo sockets listened on 192.0.2.2; found by an independent review)."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n192.0.2.2 gloohost\n")
    worker = Path(__file__).parent / "workers" / "gloo_listen.py"
    script = (f"ip link set lo up && ip link add v0 type veth peer name v1 && ip addr add 192.0.2.2/24 dev v0 && "
              f"ip link set v0 up && hostname gloohost && mount --bind {hosts} /etc/hosts && "
              f"exec {sys.executable} {worker}")
    run = subprocess.run(["unshare", "--net", "--uts", "--mount", "sh", "-c", script], capture_output=True,
                         text=True, timeout=300, env={k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"})
    if "Unknown device type" in run.stderr or "Operation not permitted" in run.stderr:
        pytest.skip(f"this kernel cannot make the namespace: {run.stderr.strip()[-200:]}")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0] == "hostname gloohost 192.0.2.2" and lines[-1] == "done True", run.stdout
    listening = [line.split()[1] for line in lines if line.startswith("LISTEN")]
    assert len(listening) >= 4 and set(listening) == {"127.0.0.1"}, listening  # the store and 3 gloo devices


# ---- the loss: a mean over every rank's tokens -----------------------------------------------------------------------
def test_each_micro_batch_loss_is_weighted_by_its_share_of_the_steps_tokens(tmp_path):
    """Two ranks' micro-batches of GLUE rows with targets of different lengths (RTE's 'not_entailment' against
    CoLA's 'acceptable'), two micro-batches a step: the average of the four micro-batches' gradients of
    `token_weighted` (what DeepSpeed's accumulation and all-reduce make) equals the gradient of the loss of all
    their rows in one batch, the mean over every target token; the plain mean of their own means does not. The
    count of every micro-batch's tokens comes from the sampler's picks, without a collective: it equals the label
    tokens of the step's batches on both ranks, and drawing a step at its first micro-batch leaves the sampler
    where it would be without accumulation at every step's end."""
    import torch
    from t5_testing import tiny_config

    from hpsearch.data import get_tokenizer, load_suite
    from hpsearch.data.config import DataConfig
    from hpsearch.data.tokens import TokenizedSuite, collate
    from hpsearch.model import build_model
    from hpsearch.train.loop import token_weighted

    glue = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"
    cfg = DataConfig(source=str(glue), tasks=["rte", "cola", "stsb"], batching="mixed", max_train_rows=64,
                     max_eval_rows=8, cache_dir=str(tmp_path / "cache"))
    suite = load_suite(cfg)
    tokens = TokenizedSuite(suite, get_tokenizer("t5-tiny", cfg, suite, 512), cfg)
    # the objective's batches on two ranks: (this micro-batch's label tokens, the step's sum), as the loop takes them
    from hpsearch.config import load_config
    from hpsearch.train.objective import LABEL_TOKENS, FineTuning
    run = load_config(None, [f"data.source={glue}", "data.tasks=rte,cola,stsb", "data.batching=mixed",
                             "data.max_train_rows=64", "data.max_eval_rows=8", f"data.cache_dir={tmp_path / 'cache'}",
                             "train.micro_batch_size=4", "train.num_workers=2", "data.temperature=1",
                             "train.grad_accum=2"])
    objectives = [FineTuning(run, rank, 2) for rank in (0, 1)]
    plain_sampler = FineTuning(run, 0, 2).sampler  # the same draws, one micro-batch at a time
    for objective in objectives:
        objective.tokens = TokenizedSuite(objective.suite, objective.tokenizer, run.data)  # what start() makes
    for _ in range(3):
        batches = [[objective.batch() for _ in range(2)] for objective in objectives]  # [rank][micro-step]
        mine = [[int((b["labels"] != -100).sum()) for b in rank] for rank in batches]
        step = sum(map(sum, mine))
        assert [[b[LABEL_TOKENS] for b in rank] for rank in batches] == [[(n, step) for n in rank] for rank in mine]
        next(plain_sampler), next(plain_sampler)
        assert objectives[0].sampler.state_dict() == plain_sampler.state_dict()
    # four micro-batches, two with short targets, two with long ones
    rte_long = [i for i, t in enumerate(tokens.ids("rte", "train")[1]) if len(t) > 2][:5]
    rows = [[(1, 0), (1, 1), (1, 2)], [(0, i) for i in rte_long[:3]], [(1, 3)], [(0, i) for i in rte_long[3:]]]
    ids = lambda picks: ([tokens.ids(suite.tasks[t], "train")[0][i] for t, i in picks],
                         [tokens.ids(suite.tasks[t], "train")[1][i] for t, i in picks], [t for t, _ in picks])
    micro_batches = [collate(*ids(r), tokens.pad) for r in rows]
    counts = [int((b["labels"] != -100).sum()) for b in micro_batches]
    assert len(set(counts)) == 4, counts
    torch.manual_seed(0)
    model = build_model(tiny_config(vocab_size=512, d_model=32), "hyperprompt", suite.tasks)

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    whole = grads(model(**collate(*ids(sum(rows, [])), tokens.pad)).loss)
    averaged = sum(grads(token_weighted(model(**b), (n, sum(counts)), 4))
                   for b, n in zip(micro_batches, counts)) / 4
    plain = sum(grads(model(**b).loss) for b in micro_batches) / 4
    torch.testing.assert_close(averaged, whole, rtol=1e-4, atol=1e-6)
    assert (plain - whole).abs().max() > 1e-4  # what each rank's own mean gave
