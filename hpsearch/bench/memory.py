"""Group `memory`: peak host memory of each of N ZeRO-3 ranks building, partitioning and exporting a model.

`--memory-world` ranks (2 by default; processes, gloo) run what the training recipe does before and after training:
build the model, `deepspeed.initialize` with the recipe's ZeRO-3 config, then export its full state to rank 0. Each
rank samples its resident memory (RSS) every few ms; a phase's figure is the peak rise above the RSS at the phase's
start, over the model's weight bytes. Two runs, each in fresh processes (freed memory is not always returned to the
OS, so a second phase in the same process would read low):
- `recipe`: the build of `hpsearch.train.build` (rank 0 builds the whole model, every rank its partitions under
  `deepspeed.zero.Init`, filled from rank 0 one parameter at a time) and the export of
  `hpsearch.train.objective.gathered_state` (parameters gathered one by one, rank 0 alone keeps the full CPU copy);
- `before` (for contrast): every rank builds the whole model, `deepspeed.initialize` partitions it; every rank
  gathers every parameter at once to export.
The shape is t5-large (738 M parameters, ~3 GB of fp32 weights per full copy) unless `--memory-shape` says else.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from hpsearch.bench import children
from hpsearch.bench.timing import Figure

WORLD = 2  # ranks, unless --memory-world says else
RANK_IMPORTS = 1 << 30  # a rank's resident memory before it builds (torch, transformers, DeepSpeed): ~0.8 GiB here
GOAL_OTHER_RANKS = 0.1  # a rank other than 0 holds at most about one whole parameter beyond its shard
TIMEOUT_S = 1800


class Peak:
    """The peak RSS of this process per phase, sampled by a thread."""

    def __init__(self):
        import psutil
        self.process, self.phases, self._phase, self._start, self._peak = psutil.Process(), {}, None, 0, 0
        self._span, self._span_start, self._span_peak = None, 0, 0
        self._lock = threading.Lock()  # a sample taken in one phase must not land in the next
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop.is_set():
            with self._lock:
                rss = self.process.memory_info().rss
                self._peak = max(self._peak, rss)
                self._span_peak = max(self._span_peak, rss)
            time.sleep(0.005)

    def span(self, name: str | None):
        """End the current span (its peak rise over phases, recorded as a phase) and start `name`."""
        with self._lock:
            rss = self.process.memory_info().rss
            if self._span:
                self.phases[self._span] = max(self._span_peak, rss) - self._span_start
            self._span, self._span_start, self._span_peak = name, rss, rss

    def phase(self, name: str | None):
        """End the current phase (record its peak rise) and start `name`."""
        with self._lock:
            rss = self.process.memory_info().rss
            self._peak = max(self._peak, rss)
            if self._phase:
                self.phases[self._phase] = self._peak - self._start
            self._phase, self._start, self._peak = name, rss, rss
        if name is None:
            self._stop.set()


def rank_main(shape: str, build: str, mode: str, out: str) -> None:
    """One rank (RANK, WORLD_SIZE, MASTER_* in the environment): build (`build`: "partitioned" as the recipe does,
    or "whole"), partition, export (`mode`); write its phases."""
    import torch

    from hpsearch.config import load_config
    from hpsearch.model import build_from_config, build_skeleton
    from hpsearch.train.build import ModelBuilder
    from hpsearch.train.dsconfig import deepspeed_config
    from hpsearch.train.objective import gathered_state
    from hpsearch.train.ops import import_deepspeed, load_ops
    from hpsearch.train.startup import freeze_imports

    deepspeed = import_deepspeed()
    freeze_imports()  # as the recipe does: DeepSpeed's full collections (ZeRO-3's set-up) skip the imports
    load_ops()  # as the recipe does: built by DeepSpeed itself, with another ninja, the op was rebuilt (ops.py)

    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = load_config(None, [f"model.backbone={shape}", f"train.num_workers={world}", "train.zero_stage=3"])
    peak = Peak()
    peak.phase("build")
    peak.span("setup")  # build and deepspeed.initialize: what a rank holds at most before training starts

    def make():
        torch.manual_seed(0)
        return build_from_config(cfg.model, cfg.data.tasks)
    if build == "whole":  # before: every rank builds the whole model; deepspeed.initialize partitions it
        model = make()
    else:  # the recipe: rank 0 builds it whole, every rank its partitions under zero.Init
        model = ModelBuilder(lambda n: 3, lambda stage, hidden: deepspeed_config(cfg, world, stage, hidden), rank)(
            make, lambda: build_skeleton(cfg.model, cfg.data.tasks))
    weights, hidden = weights_bytes([f"model.backbone={shape}"]), model.config.d_model
    peak.phase("partition")
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=1e-4),
                                      config=deepspeed_config(cfg, world, 3, hidden))
    del model, params
    peak.span(None)
    peak.phase("export")
    if mode == "one at a time":
        gathered_state(engine, rank, lambda state: None)
    else:  # before: every rank gathers every parameter at once
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
            if rank == 0:
                state = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
                del state
    torch.distributed.barrier()
    peak.phase(None)
    Path(out).write_text(json.dumps({"rank": rank, "weights_bytes": weights, "phases": peak.phases}))
    torch.distributed.destroy_process_group()  # left to the interpreter's exit, gloo's threads can abort it


def weights_bytes(overrides: list[str]) -> int:
    """The bytes of the weights (parameters and buffers, each once: tied embeddings count once) of the model of a
    run config with these overrides (its `model.` and `data.` ones), from a build on the meta device: no memory,
    no checkpoint read."""
    import torch

    from hpsearch.config import load_config
    from hpsearch.model import build_skeleton

    cfg = load_config(None, [o for o in overrides if o.startswith(("model.", "data."))])
    with torch.device("meta"):
        model = build_skeleton(cfg.model, cfg.data.tasks)
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    return sum(t.numel() * t.element_size() for t in tensors)


def need_bytes(shape: str, world: int) -> int:
    """Host memory the group's `world` ranks need at once, estimated: at t5-large with 2 ranks the machine's free
    memory (MemAvailable) fell by at most 18.8 GiB while the group ran alone, 6.8x the 2.76 GiB of weights with the
    ranks' imports (2026-11-27); a further rank holds about 0.9x more (4 ranks at t5-base). (4.5 + world)x the
    weights plus each rank's imports: 20.0 GiB there. What psutil reports is the host's memory: a container's lower
    limit (a Kubernetes pod's) is not seen, and a rank can still be killed there."""
    return int((4.5 + world) * weights_bytes([f"model.backbone={shape}"])) + world * RANK_IMPORTS


def too_big(shape: str, world: int, memory: int, of: str) -> str | None:
    """Why the group cannot run in `memory` bytes (`of`: whose memory that is), or None when it fits."""
    need = need_bytes(shape, world)
    if need <= memory:
        return None
    return (f"{world} ranks of {shape} need about {need / 2**30:.1f} GiB of host memory, {of} "
            f"{memory / 2**30:.1f} GiB; expected a smaller --memory-shape (t5-base), fewer --memory-world ranks, "
            f"or --skip memory")


RUNS = {"recipe": ("partitioned", "one at a time"), "before": ("whole", "all at once")}  # name: (build, export)


def _spawn(shape: str, run: str, tmp: Path, world: int) -> list[dict]:
    from hpsearch.train.launch import free_port

    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu",
               "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        out = str(tmp / f"{rank}.json")
        build, mode = RUNS[run]
        code = f"from hpsearch.bench.memory import rank_main; rank_main({shape!r}, {build!r}, {mode!r}, {out!r})"
        procs.append(subprocess.Popen(children.command(code=code), env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    failures = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if proc.returncode != 0:
            failures.append(next((ln for ln in reversed(err.splitlines()) if ln.strip()), "(no output)"))
    if failures:
        raise RuntimeError(f"memory ({run}): a rank failed: {failures[0][:300]}")
    return [json.loads((tmp / f"{rank}.json").read_text()) for rank in range(world)]


def run(shape: str, log, world: int = WORLD) -> tuple[list, dict]:
    import psutil

    why = too_big(shape, world, psutil.virtual_memory().available, "available now")
    if why:  # the kernel would kill a rank, or this process, part-way (each run's ranks exit before the next's start)
        return [], {"memory": why}
    results = {}
    with tempfile.TemporaryDirectory(prefix="hpsearch-bench-memory-") as tmp:
        for run, (build, mode) in RUNS.items():
            log(f"memory: {world} ZeRO-3 ranks build ({build}), partition and export ({mode}) {shape}")
            folder = Path(tmp, run)
            folder.mkdir()
            try:
                results[run] = _spawn(shape, run, folder, world)
            except RuntimeError as e:
                return [], {"memory": str(e)}
    weights = results["recipe"][0]["weights_bytes"]
    rel = lambda run, rank, phase: results[run][rank]["phases"][phase] / weights
    parts = {"shape": shape, "weights_bytes": weights, "world": world, "runs": RUNS,
             "phases_x_weights": {run: [{k: v / weights for k, v in r["phases"].items()} for r in rs]
                                  for run, rs in results.items()}}
    node = lambda run: sum(results[run][r]["phases"]["setup"] for r in range(world)) / weights
    return [
        Figure("memory/setup_node", node("recipe"), None, "lower", "x weights",
               f"peak RSS rise of the {world} ranks together (one node) building {shape} and initialising DeepSpeed "
               "(the recipe: only rank 0 builds it whole, zero.Init partitions it as it is built) ÷ weight bytes",
               parts=parts),
        Figure("memory/setup_node_whole", node("before"), None, "lower", "x weights",
               "the same with the whole model built on every rank (before; contrast)", parts=parts),
        Figure("memory/setup_other_rank", rel("recipe", 1, "setup"), None, "lower", "x weights",
               "rank 1 alone: its shard, DeepSpeed's partitioned state, one whole parameter at a time", parts=parts),
        Figure("memory/setup_other_rank_whole", rel("before", 1, "setup"), None, "lower", "x weights",
               "the same, whole model built on every rank (before; contrast)", parts=parts),
        Figure("memory/setup_rank0", rel("recipe", 0, "setup"), None, "lower", "x weights",
               "rank 0 alone: the whole model it builds and sends, beside its shard and state", parts=parts),
        Figure("memory/export_other_rank", rel("recipe", 1, "export"), GOAL_OTHER_RANKS, "lower", "x weights",
               f"peak RSS rise of rank 1 exporting {shape} (parameters gathered one at a time) ÷ weight bytes",
               parts=parts),
        Figure("memory/export_other_rank_all_at_once", rel("before", 1, "export"), None, "lower", "x weights",
               "the same with every parameter gathered on every rank at once (before; contrast)", parts=parts),
        Figure("memory/export_rank0", rel("recipe", 0, "export"), None, "lower", "x weights",
               "peak RSS rise of rank 0 exporting (it keeps the full CPU copy it writes; contrast)", parts=parts),
    ], {}
