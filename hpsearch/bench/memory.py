"""Group `memory`: peak host memory of each of 2 ZeRO-3 ranks building, partitioning and exporting a model.

Two ranks (processes, gloo) run what the training recipe does before and after training: build the model (every
rank, the same weights), `deepspeed.initialize` with the recipe's ZeRO-3 config (partitions it), then export its
full state to rank 0. Each rank samples its resident memory (RSS) every few ms; a phase's figure is the peak rise
above the RSS at the phase's start, over the model's weight bytes. The export runs two ways, each in fresh processes
(freed memory is not always returned to the OS, so a second phase in the same process would read low):
- `one at a time` (`hpsearch.train.objective.gathered_state`, what the recipe does): parameters are gathered one by
  one and rank 0 alone keeps the full CPU copy;
- `all at once` (before, for contrast): every rank gathers every parameter, then rank 0 copies the state.
The shape is t5-large (738 M parameters, ~3 GB of fp32 weights per full copy) unless `--memory-shape` says else.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from hpsearch.bench.timing import Figure

WORLD = 2
GOAL_OTHER_RANKS = 0.1  # a rank other than 0 holds at most about one whole parameter beyond its shard
TIMEOUT_S = 1800


class Peak:
    """The peak RSS of this process per phase, sampled by a thread."""

    def __init__(self):
        import psutil
        self.process, self.phases, self._phase, self._start, self._peak = psutil.Process(), {}, None, 0, 0
        self._lock = threading.Lock()  # a sample taken in one phase must not land in the next
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop.is_set():
            with self._lock:
                self._peak = max(self._peak, self.process.memory_info().rss)
            time.sleep(0.005)

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


def rank_main(shape: str, mode: str, out: str) -> None:
    """One rank (RANK, WORLD_SIZE, MASTER_* in the environment): build, partition, export; write its phases."""
    import deepspeed
    import torch

    from hpsearch.config import load_config
    from hpsearch.model import build_from_config
    from hpsearch.train.dsconfig import deepspeed_config
    from hpsearch.train.objective import gathered_state

    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    cfg = load_config(None, [f"model.backbone={shape}", f"train.num_workers={WORLD}", "train.zero_stage=3"])
    peak = Peak()
    peak.phase("build")
    torch.manual_seed(0)
    model = build_from_config(cfg.model, cfg.data.tasks)
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    peak.phase("partition")
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=1e-4),
                                      config=deepspeed_config(cfg, WORLD, 3))
    del model, params
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


def _spawn(shape: str, mode: str, tmp: Path) -> list[dict]:
    from hpsearch.train.launch import free_port

    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu",
               "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        out = str(tmp / f"{rank}.json")
        code = f"from hpsearch.bench.memory import rank_main; rank_main({shape!r}, {mode!r}, {out!r})"
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
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
        raise RuntimeError(f"memory ({mode}): a rank failed: {failures[0][:300]}")
    return [json.loads((tmp / f"{rank}.json").read_text()) for rank in range(WORLD)]


def run(shape: str, log) -> tuple[list, dict]:
    results = {}
    with tempfile.TemporaryDirectory(prefix="hpsearch-bench-memory-") as tmp:
        for mode in ("one at a time", "all at once"):
            log(f"memory: {WORLD} ZeRO-3 ranks build, partition and export {shape}, export {mode}")
            folder = Path(tmp, mode.replace(" ", "_"))
            folder.mkdir()
            try:
                results[mode] = _spawn(shape, mode, folder)
            except RuntimeError as e:
                return [], {"memory": str(e)}
    weights = results["one at a time"][0]["weights_bytes"]
    rel = lambda mode, rank, phase: results[mode][rank]["phases"][phase] / weights
    parts = {"shape": shape, "weights_bytes": weights, "world": WORLD,
             "phases_x_weights": {mode: [{k: v / weights for k, v in r["phases"].items()} for r in rs]
                                  for mode, rs in results.items()}}
    return [
        Figure("memory/export_other_rank", rel("one at a time", 1, "export"), GOAL_OTHER_RANKS, "lower", "x weights",
               f"peak RSS rise of rank 1 exporting {shape} (parameters gathered one at a time) ÷ weight bytes",
               parts=parts),
        Figure("memory/export_other_rank_all_at_once", rel("all at once", 1, "export"), None, "lower", "x weights",
               "the same with every parameter gathered on every rank at once (before; contrast)", parts=parts),
        Figure("memory/export_rank0", rel("one at a time", 0, "export"), None, "lower", "x weights",
               "peak RSS rise of rank 0 exporting (it keeps the full CPU copy it writes; contrast)", parts=parts),
        Figure("memory/build_each_rank", max(rel("one at a time", r, "build") for r in range(WORLD)), None, "lower",
               "x weights", "peak RSS rise of a rank building the model (a full copy on every rank: no zero.Init "
               "yet; contrast)", parts=parts),
    ], {}
