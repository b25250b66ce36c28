"""Ray Train: a data-parallel trainer running the loop on `train.num_workers` DeepSpeed ranks (Ray Train's torch
backend, torchconfig.py), and a private local Ray."""
from __future__ import annotations

import importlib
import logging
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

from hpsearch.errors import UserError

if TYPE_CHECKING:  # Ray Train's processes import this module for `_ray_train_loop`: keep it light
    from hpsearch.config import RunConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_train_loop(loop_config: dict) -> None:
    startup = {**(loop_config.get("startup") or {}), "worker": time.time()}  # before this worker's imports
    # the run's LoggingConfig keeps Ray Train's own INFO lines off the console, but its worker logs each report
    # ("Reporting training result 1: TrainingReport(...)", per rank) through a logger named after its file, which
    # only the root logger's level (Ray Train sets INFO) stops; the recipe prints what the user sees
    logging.getLogger().setLevel(logging.WARNING)
    from hpsearch.train.loop import train_loop
    train_loop({**loop_config, "startup": startup})


def runtime_env_vars(cfg: RunConfig) -> dict[str, str]:
    env = {"PYTHONWARNINGS": "ignore::FutureWarning,ignore::UserWarning", "TOKENIZERS_PARALLELISM": "false",
           # a reused Tune actor waits this long for the stopped trial's thread (its batch prefetcher, its system
           # metrics) before taking the next trial; Tune's 2 s default fails that trial on a busy machine
           "TUNE_FUNCTION_THREAD_TIMEOUT_S": "60",
           # Ray Train's workers route print() through its logger, which writes the line to stderr and, as Ray
           # wraps the worker's stdout, to stdout as well: every line of the run twice on the user's terminal
           "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
           # Ray Train's controller polls its workers (their reports, their end) this often (default 2 s): a run's
           # end reached `fit()` 5.4-6.6 s after its last step here, 2.9 s with 0.5 (2 workers, t5-tiny)
           "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
    if not cfg.train.use_gpu:
        env["DS_ACCELERATOR"] = "cpu"
    return env


PRIVATE_RAY_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
PRIVATE_RAY_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}


def keep_token_private() -> Path | None:
    """The Ray token a private local Ray authenticates with, readable by this user alone; returns its file. A local
    `ray.init` turns token authentication on and, without a token, writes `~/.ray/auth_token` with the default
    umask (readable by every user of the machine, who could then reach this Ray's services and run code as this
    user). The token is created here first with mode 0600, or an existing one of this user's is made 0600. Nothing
    when the token comes from RAY_AUTH_TOKEN or authentication is off."""
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        return None
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        if path.exists():
            if path.stat().st_mode & 0o077 and path.stat().st_uid == os.getuid():
                path.chmod(0o600)
            return path
        from ray._private.authentication.authentication_token_generator import generate_new_authentication_token

        path.parent.mkdir(parents=True, exist_ok=True)
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(generate_new_authentication_token())
    except FileExistsError:  # another process made it meanwhile (with this function: private)
        pass
    except OSError as e:  # e.g. a read-only home: Ray then says what it cannot do
        logging.getLogger(__name__).warning("could not make the Ray token %s private: %s", path, e)
    return path


def init_ray(cfg: RunConfig, log_to_driver: bool = True, dashboard: bool = True) -> None:
    """Join the cluster named by RAY_ADDRESS (set for a job by `ray job submit`), else start a private local Ray
    (never another Ray found on this machine), with its dashboard on 127.0.0.1 when `dashboard`.

    Ray Train needs the dashboard: its placement-group cleaner asks the State API whether a run's Train controller
    is still alive, and without a dashboard, or with several Ray instances on one machine, it cannot tell, so a
    stopped run's workers are never released and the next run waits for them forever. So the dashboard's address is
    handed to every actor. A study whose trials never start a Train worker group (they train in their own actor or
    on kept ranks) starts Ray without it (Ray's dashboard process then loads only its usage-stats module and no web
    front-end): 2 s less to start here (docs/performance.md); so does a standalone run on a private Ray of its own,
    whose trainer has no cleaner (`_trainer_class`)."""
    import ray

    from hpsearch.cli import stop_on_sigterm_as_on_ctrl_c

    env = runtime_env_vars(cfg)
    if os.environ.get("RAY_ADDRESS"):  # the cluster's own dashboard, whatever `dashboard` says
        env["RAY_ADDRESS"] = os.environ["RAY_ADDRESS"]
        ray.init(include_dashboard=True, runtime_env={"env_vars": env}, log_to_driver=log_to_driver,
                 logging_level="WARNING")
        stop_on_sigterm_as_on_ctrl_c()  # ray.init set its own (sys.exit)
        return
    # Ray's single-machine mode: its node IP is loopback, so the GCS, raylets, workers, the dashboard agent and the
    # runtime-env agent listen on 127.0.0.1 only (else they take the machine's network address and `::`, whatever
    # `_node_ip_address` says). Ray reads the switch when ray.init resolves the node IP; its processes read the
    # variable.
    from ray._private import ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    keep_token_private()
    # Nothing on one machine can be preempted, so Ray Train's preemption watcher (an actor process per run, started
    # while the workers import) only competes with them for the cores. Nor is Ray's first-driver prestart of a Python
    # worker per CPU any use here: Ray Train's and Tune's actors never took one (with or without a runtime
    # environment), the two idle processes only took CPU from those starting. Without both, a two-worker run reached
    # its first step 4-6 s sooner (docs/performance.md).
    env.update(PRIVATE_RAY_ENV)
    where = {}
    if dashboard:
        port = free_port()
        env["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
        where = {"dashboard_host": "127.0.0.1", "dashboard_port": port}
    ray.init(address="local", include_dashboard=dashboard, **where,
             _node_ip_address="127.0.0.1", runtime_env={"env_vars": env},  # every service on loopback
             _system_config=dict(PRIVATE_RAY_SYSTEM_CONFIG),  # a copy: Ray adds its session's spilling to it
             log_to_driver=log_to_driver, logging_level="WARNING")
    stop_on_sigterm_as_on_ctrl_c()  # ray.init set its own (sys.exit)


def local_resources(gpus: bool, as_ray_counts: bool = False) -> dict[str, float]:
    """What a private local Ray offers: this machine's CPUs and, when `gpus`, its CUDA devices (counting them
    imports torch, about 2 s here: a CPU-only run skips it, so its mistakes are said at once). `as_ray_counts`:
    the CPUs as Ray counts them (what `ray.init` offers): a container's CPU limit, whole CPUs only (a 1.5-CPU limit
    offers 1 where os.cpu_count() says the host's); it imports Ray."""
    cpus = float(os.cpu_count() or 1)
    if as_ray_counts:
        from ray._private.utils import get_num_cpus
        cpus = float(get_num_cpus(override_docker_cpu_warning=True))
    if not gpus:
        return {"CPU": cpus}
    import torch
    return {"CPU": cpus, "GPU": float(torch.cuda.device_count())}


def check_output_dir(cfg: RunConfig) -> None:
    """train.output_dir can be made and written (its nearest existing folder is writable), or one line, before
    anything starts (else the run failed in the loop, after Ray and DeepSpeed had started). Nothing is created."""
    from hpsearch.cli import unwritable

    why = unwritable(cfg.train.output_dir)
    if why:
        raise UserError(f"train.output_dir: {cfg.train.output_dir}: {why}; expected a folder this user can create "
                        "or write")


def shortfall(needs: dict[str, float]) -> tuple[str, float, float, bool] | None:
    """The first resource a private local Ray can never offer (`needs`: {"CPU": n, "GPU": m}), as (kind, need, what
    this machine has, whether as Ray counts it), or None. First against os.cpu_count() (no import: the usual mistakes
    are said at once), then against the CPUs Ray will offer (a container's limit)."""
    for as_ray_counts in (False, True):
        have = local_resources(gpus="GPU" in needs, as_ray_counts=as_ray_counts)
        for kind, need in needs.items():
            if need > have.get(kind, 0.0) + 1e-9:
                return kind, need, have.get(kind, 0.0), as_ray_counts
    return None


RAY_COUNTS = " (as Ray counts them: a container's CPU limit, whole CPUs)"  # said when that count falls short


def check_ray_address(timeout: float = 5.0) -> None:
    """RAY_ADDRESS names a cluster to join: something must answer at its host and port, else one line before anything
    starts (ray.init retried a dead address every 30 s until interrupted, e.g. after `ray stop` with the variable
    still set). `auto` and an address without a port are left to Ray."""
    import re

    address = os.environ.get("RAY_ADDRESS", "").strip()
    found = re.fullmatch(r"(?:ray://)?\[?([^\[\]/]+?)\]?:(\d+)/?", address)
    if not found:
        return
    try:
        socket.create_connection((found.group(1), int(found.group(2))), timeout=timeout).close()
    except OSError as e:
        raise UserError(f"RAY_ADDRESS={address}: no Ray cluster answers there ({e.strerror or type(e).__name__}); "
                        "unset RAY_ADDRESS for a private local Ray, or start the cluster (ray start --head)"
                        ) from None


def check_fits_locally(cfg: RunConfig) -> None:
    """A run on a private local Ray whose workers this machine can never hold would wait for them (Ray Train's
    worker group times out and retries): one line before Ray starts. Joined to a cluster (RAY_ADDRESS), the
    cluster decides; it must answer (`check_ray_address`)."""
    if os.environ.get("RAY_ADDRESS"):
        check_ray_address()
        return
    t = cfg.train
    needs = {"CPU": t.num_workers * t.cpus_per_worker}
    if t.use_gpu:
        needs["GPU"] = t.num_workers * t.gpus_per_worker
    short = shortfall(needs)
    if short:
        kind, need, have, as_ray_counts = short
        per_worker, field = (t.cpus_per_worker, "cpus") if kind == "CPU" else (t.gpus_per_worker, "gpus")
        gpu = "; or train.use_gpu=false" if kind == "GPU" else ""
        raise UserError(f"train.num_workers: {t.num_workers} workers x {per_worker:g} {kind} need {need:g} {kind} "
                        f"but this machine has {have:g}{RAY_COUNTS if as_ray_counts else ''}; lower "
                        f"train.num_workers or train.{field}_per_worker{gpu} (or join a cluster that has them: "
                        "RAY_ADDRESS)")


def shutdown_ray() -> None:
    """`ray.shutdown()`, less the second it spends on a private Ray's autoscaler monitor. Ray stops its GCS first
    and then asks the monitor to stop (SIGTERM); the monitor's handler then tries to tell the drivers, through the
    GCS now gone, that the autoscaler stopped, and Ray waits its whole one-second grace period before it kills it:
    1.0 s of the 1.4 s a shutdown took here, in every run and study. A one-machine Ray autoscales nothing, so its
    monitor is killed first; Ray then finds it gone and stops the rest as ever. Joined to a cluster, this process
    started no monitor, and nothing changes."""
    import signal
    import subprocess

    import ray
    from ray._private import ray_constants, worker

    node = worker._global_node
    monitors = getattr(node, "all_processes", {}).get(ray_constants.PROCESS_TYPE_MONITOR, []) if node else []
    for info in monitors:
        if info.process.poll() is None:
            info.process.send_signal(signal.SIGKILL)
            try:
                info.process.wait(timeout=10)
            except subprocess.TimeoutExpired:  # not reaped (stuck in the kernel): Ray's shutdown carries on as ever
                pass
    ray.shutdown()


def loop_config(cfg: RunConfig, *, resume_from: str | None = None, system_metrics: dict | None = None,
                objective: str | None = None, options: dict | None = None, export_to: tuple | None = None,
                startup: dict | None = None) -> dict:
    """What `train_loop` takes (see build_trainer for the fields)."""
    return {"run": cfg.to_dict(), "resume_from": str(Path(resume_from).resolve()) if resume_from else None,
            "system_metrics": system_metrics, "objective": objective, "options": options, "export_to": export_to,
            "startup": startup or {}}


def _lean_callbacks():
    """Ray Train's callback classes `_trainer_class` leaves out, or None when this Ray has no such names."""
    try:
        from ray.train.v2._internal.callbacks import DatasetsCallback
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    except ImportError:
        return None
    return DatasetsCallback, PlacementGroupCleanerCallback


def _trainer_class(own_ray: bool):
    """Ray Train V2's `DataParallelTrainer` (TorchTrainer's base), less two helpers that each start an actor process
    when the run would not use them. Ray Data's `DatasetManager`: started for every run, datasets or none (this
    recipe passes none: its ranks read their own batches). Ray Train's `PlacementGroupCleaner` (a detached actor that
    removes the run's placement group should its controller die, asking the dashboard's State API whether it lives)
    when `own_ray`: the Ray this process started for this one run ends with it, so nothing outlives the controller,
    and without the cleaner nothing needs the dashboard. On this 2-core box the two processes started as the workers
    imported torch; without them (and the dashboard) a standalone two-worker run reached its first step 1.2-3.3 s
    sooner (docs/performance.md). Another Ray without these names: its trainer as it is."""
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
    lean = _lean_callbacks()
    if lean is None:
        return DataParallelTrainer
    DatasetsCallback, PlacementGroupCleanerCallback = lean

    class Trainer(DataParallelTrainer):
        def _create_default_callbacks(self):
            def unused(callback) -> bool:
                return (isinstance(callback, DatasetsCallback) and not self.datasets) or \
                    (own_ray and isinstance(callback, PlacementGroupCleanerCallback))
            return [c for c in super()._create_default_callbacks() if not unused(c)]

    return Trainer


def build_trainer(cfg: RunConfig, *, name: str, storage_path: str, callbacks=(), resume_from: str | None = None,
                  system_metrics: dict | None = None, objective: str | None = None, options: dict | None = None,
                  storage_filesystem=None, export_to: tuple | None = None, startup: dict | None = None,
                  own_ray: bool = False):
    """A Ray Train V2 trainer running `train_loop` on `train.num_workers` DeepSpeed ranks: TorchTrainer's base class
    with Ray Train's torch backend defined without importing torch (torchconfig.py). `resume_from`: a checkpoint
    folder the loop starts from when Ray has none of its own (Train V2 has no `resume_from_checkpoint`).
    `system_metrics`: {tracking_uri, run_id, interval}, sampled by the first rank of each node. `objective`, `options`:
    what the loop trains on ("module:Class" and its options; default the suite's fine-tuning, see objective.py).
    `storage_filesystem`: a pyarrow filesystem `storage_path` is in (a bucket); `export_to`: (path, filesystem)
    rank 0 copies the run's exports to when it finishes (a study in a bucket). `startup`: the caller's start-up
    marks (startup.py); `fit` is added when this is built. `own_ray`: the caller started a private Ray for this run
    alone, which ends with it (see `_trainer_class`)."""
    import ray.train

    from hpsearch.train.torchconfig import BoundTorchConfig

    resources = {"CPU": cfg.train.cpus_per_worker}
    if cfg.train.use_gpu:
        resources["GPU"] = cfg.train.gpus_per_worker
    # by reference (module hpsearch.train.launch), also when the command runs as __main__
    loop = importlib.import_module("hpsearch.train.launch")._ray_train_loop
    _start_autoscaling_coordinator()
    return _trainer_class(own_ray)(  # TorchTrainer's base: no torch here
        loop,
        train_loop_config=loop_config(cfg, resume_from=resume_from, system_metrics=system_metrics,
                                      objective=objective, options=options, export_to=export_to,
                                      startup={**(startup or {}), "fit": time.time()}),
        backend_config=BoundTorchConfig(backend="nccl" if cfg.train.use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=cfg.train.num_workers, use_gpu=cfg.train.use_gpu,
                                               resources_per_worker=resources),
        run_config=ray.train.RunConfig(
            name=name, storage_path=storage_path, storage_filesystem=storage_filesystem, callbacks=list(callbacks),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1),
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),  # quiet the controller's INFO lines
            failure_config=ray.train.FailureConfig(max_failures=cfg.train.max_failures)),
    )


def _start_autoscaling_coordinator() -> None:
    """Start the actor Ray Train's controller tells its resource requests to (Ray Data's `AutoscalingCoordinator`,
    named, one per cluster) now, while the controller starts. The controller creates it on first use, on its own
    node (that of the process calling `fit`, as here) and waits for it: about 1 s of its start on a private Ray, as
    the coordinator's process started only then. Created here it is the same actor, on the same node, already up
    (`get_if_exists`); an existing one is left as it is. Returns at once. Skipped if this Ray has no such call, and
    without Ray up (a trainer built to be inspected): the call would start a Ray in this process."""
    import ray

    if not ray.is_initialized():
        return
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )
    except ImportError:
        return
    get_or_create_autoscaling_coordinator()


def run_with_ray(cfg: RunConfig, resume_from: str | None, *, objective: str | None = None,
                 options: dict | None = None, callbacks=()) -> dict:
    import ray
    import ray.train

    from hpsearch.train.startup import process_start
    marks = {"process": process_start(), "ray": time.time()}
    started = not ray.is_initialized()
    # a private Ray for this run alone: no placement-group cleaner, so no dashboard (as long as this Ray Train has
    # the cleaner's name to leave it out by)
    own = started and not os.environ.get("RAY_ADDRESS") and _lean_callbacks() is not None
    if started:
        init_ray(cfg, dashboard=not own)
    marks["ray_up"] = time.time()
    storage = str(Path(cfg.train.output_dir, "ray").resolve())
    name = time.strftime("train-%Y%m%d-%H%M%S")  # a new Ray Train run (a same-named one would auto-resume)
    trainer = build_trainer(cfg, name=name, storage_path=storage, resume_from=resume_from, objective=objective,
                            options=options, callbacks=callbacks, startup=marks, own_ray=own)
    try:
        result = trainer.fit()
    except Exception as e:  # Ray wraps a worker's error; surface its reason in one line
        if os.environ.get("HPSEARCH_DEBUG"):
            raise
        raise TrainingFailed(failure_reason(e)) from None
    finally:
        if started:
            shutdown_ray()  # flushes worker logs before the final JSON line
    return dict(result.metrics)


class TrainingFailed(UserError):
    """The run stopped with a reason (non-finite loss, a worker error): one line, exit code 2."""


def failure_reason(e: BaseException) -> str:
    """One line from Ray's wrapped worker error: the non-finite-loss or full-disk reason, else the last error line
    (Train V2's `[Rank 0,1 Error Snippet]:` headers are not errors)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not set(ln.strip()) <= set("=-")
             and not ln.strip().startswith("[Rank ")]
    for key in ("non-finite loss", "no space left on device"):
        for line in reversed(lines):  # the exception's own line comes after the source line that raised it
            if key in line:
                return line[line.index(key):]
    errors = [ln for ln in lines if "Error" in ln.split(":")[0] or "DiskFull" in ln.split(":")[0]]
    return (errors or lines or [type(e).__name__])[-1]

