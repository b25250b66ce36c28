"""Trials with several workers on ranks kept from trial to trial (`resources.worker_group=pool`): the trial's Tune
actor starts its ranks once, as actors in its own placement group's worker bundles, joins them in one
torch.distributed process group, and Tune reuses the actor, ranks included, for the next trial. A trial then pays
neither Ray Train's controller and worker group nor the workers' imports and rendezvous again.

The ranks run the training loop as a Ray Train worker does; `PoolSession` is what it reports through. Every rank
stores its own checkpoint files into `<study>/train/<trial id>/checkpoint_<step>` (with its manifest, last), then
rank 0 hands the report to the trial's thread in the Tune actor, which reports it to Tune with a pointer checkpoint
(as a one-worker trial does, inprocess.py) and answers whether the trial goes on; rank 0 broadcasts the answer, so
when ASHA stops the trial inside that report every rank leaves its loop at the same point and the ranks stay
usable. Any other end of a rank (an error, a dead process) ends the pool: its actors are killed (no rank is left
waiting in a collective) and the next trial starts new ones."""
from __future__ import annotations

import queue
import shutil
import tempfile
import time
from pathlib import Path

from hpsearch.train import checkpoints
from hpsearch.tune.inprocess import TuneSession, free_trial_memory

_pool = None  # this Tune actor's ranks, kept for its next trial


class PoolStopped(BaseException):
    """Raised on every rank when the trial's driver says stop (ASHA stopped the trial in its report): the loop ends
    there, as a one-worker trial's does on Tune's SystemExit; not an error, so the loop's handlers let it pass."""


class Rank:
    """One rank of the pool: a Ray actor (threaded: the trial's thread asks for reports while the loop runs)."""

    def __init__(self):
        self._reports: queue.Queue = queue.Queue()
        self._answers: queue.Queue = queue.Queue()
        self.rank = self.world = None

    def where(self) -> tuple[str, str]:
        import ray
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def bind(self) -> tuple[str, int]:
        from hpsearch.train.rendezvous import bind_store_socket
        return bind_store_socket()

    def join(self, backend: str, rank: int, world: int, addr: str, port: int, local: tuple[int, int, int, int],
             timeout_s: int) -> int:
        """Join the pool's process group as `rank` of `world`; `local`: (local rank, ranks on this node, node rank,
        nodes)."""
        import os

        from hpsearch.train.rendezvous import join_process_group
        self.rank, self.world = rank, world
        self.local_rank, self.local_world_size, self.node_rank, self.nodes = local
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(self.local_rank),
                          LOCAL_WORLD_SIZE=str(self.local_world_size), NODE_RANK=str(self.node_rank))
        join_process_group(backend, rank, world, addr, port, timeout_s)
        return os.getpid()

    def run(self, token: str, loop_config: dict, train_path: str, filesystem, taken) -> str:
        """Train one trial on this rank: "done", or "stopped" when the driver stopped it."""
        from hpsearch.train.loop import train_loop

        free_trial_memory()
        try:
            train_loop(loop_config, PoolSession(self, token, train_path, filesystem, taken))
            return "done"
        except PoolStopped:
            return "stopped"
        finally:
            if self.rank == 0:
                self._reports.put((token, None))  # the trial's thread stops waiting for reports
            free_trial_memory()  # nothing held while the pool waits for the next trial

    # rank 0 and the trial's thread
    def next_report(self, token: str) -> dict | None:
        """The next report of trial `token` (metrics and whether it has a checkpoint); None when its loop ended."""
        while True:
            got, item = self._reports.get()
            if got == token:  # else a report of an earlier trial nobody read (it was stopped)
                return item

    def answer(self, token: str, go_on: bool) -> None:
        self._answers.put((token, go_on))

    def report(self, token: str, item: dict) -> bool:
        self._reports.put((token, item))
        while True:
            got, go_on = self._answers.get()
            if got == token:
                return go_on


class PoolSession(TuneSession):
    """A rank of the pool: its place in the process group, the trial's checkpoints as a one-worker trial keeps
    them (TuneSession) with every rank's files in each, and reports through rank 0 to the trial's thread."""

    def __init__(self, rank: Rank, token: str, train_path: str, filesystem, taken):
        from pyarrow import fs
        self._me, self._token = rank, token
        self.rank, self.world_size = rank.rank, rank.world
        self.local_rank, self.local_world_size = rank.local_rank, rank.local_world_size
        self.node_rank, self.nodes = rank.node_rank, rank.nodes
        self.fs, self.path = filesystem or fs.LocalFileSystem(), train_path
        self.local = filesystem is None
        self._newest, self.unregistered = checkpoints.newest_unreported(self.fs, self.path, self.world_size, taken)
        self._resume_dir = None

    def report(self, metrics: dict, checkpoint_dir: str | None) -> None:
        """Every rank stores its files into the checkpoint, then rank 0 removes the older ones and reports; every
        rank learns the driver's answer (go on, or stop here: PoolStopped)."""
        import torch
        import torch.distributed as dist
        target = f"{self.path}/checkpoint_{int(metrics['step']):06d}"
        if checkpoint_dir:
            checkpoints.write_manifest(checkpoint_dir, self.rank)
            if checkpoints.complete_step(self.fs, target, self.world_size) is None:  # else: resumed from it
                self._store_mine(Path(checkpoint_dir), target)
        dist.barrier()  # every rank's files are there: the checkpoint is complete
        go_on = True
        if self.rank == 0:
            if checkpoint_dir:
                self._remove_all_but(target)
            go_on = self._me.report(self._token, {"metrics": metrics, "checkpoint": bool(checkpoint_dir)})
        flag = torch.tensor([int(go_on)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.broadcast(flag, src=0)
        if not flag.item():
            raise PoolStopped()

    def _store_mine(self, source: Path, target: str) -> None:
        """This rank's files into the shared checkpoint folder (moved when local: written once), its manifest
        last; another rank's files stay."""
        from pyarrow import fs
        files = sorted((p for p in source.rglob("*") if p.is_file()), key=lambda p: p.name.startswith("manifest_"))
        for f in files:
            rel = f.relative_to(source).as_posix()
            if self.local:
                Path(target, rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(f), f"{target}/{rel}")
            else:
                fs.copy_files(str(f), f"{target}/{rel}", source_filesystem=fs.LocalFileSystem(),
                              destination_filesystem=self.fs, use_threads=False)


class Pool:
    """The ranks a Tune actor keeps: started in its placement group's bundles 1..N (bundle 0 is the actor's)."""

    def __init__(self, cfg):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        t = cfg.train
        self.key = (t.num_workers, t.cpus_per_worker, t.use_gpu, t.gpus_per_worker)
        group = ray.util.get_current_placement_group()
        options = {"num_cpus": t.cpus_per_worker, "num_gpus": t.gpus_per_worker if t.use_gpu else 0,
                   "max_concurrency": 4}
        self.actors = [ray.remote(Rank).options(**options, scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=i + 1)).remote() for i in range(t.num_workers)]
        try:
            where = ray.get([a.where.remote() for a in self.actors])
            nodes = list(dict.fromkeys(node for node, _ in where))  # in rank order of first appearance
            addr, port = ray.get(self.actors[0].bind.remote())
            local = []
            for i, (node, _) in enumerate(where):
                same = [j for j, (n, _) in enumerate(where) if n == node]
                local.append((same.index(i), len(same), nodes.index(node), len(nodes)))
            self.pids = ray.get([a.join.remote("nccl" if t.use_gpu else "gloo", i, len(self.actors), addr, port,
                                               local[i], 1800) for i, a in enumerate(self.actors)])
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        import ray
        for a in self.actors:
            ray.kill(a, no_restart=True)


def train_in_pool(cfg, train_path: str, train_fs, loop_config: dict) -> None:
    """One trial on this Tune actor's ranks (started on its first trial, or after a failure ended them): reports
    reach Tune from here; ASHA's stop (Tune's SystemExit in the report) is passed to every rank."""
    global _pool
    import ray
    import ray.tune

    t = cfg.train
    key = (t.num_workers, t.cpus_per_worker, t.use_gpu, t.gpus_per_worker)
    if _pool is not None and _pool.key != key:
        _pool.kill()
        _pool = None
    if _pool is None:
        started = time.time()
        _pool = Pool(cfg)
        print(f"[hpsearch.tune] started {len(_pool.actors)} ranks for this actor's trials (pids "
              f"{', '.join(map(str, _pool.pids))}) in {time.time() - started:.1f} s", flush=True)
    pool, token = _pool, ray.tune.get_context().get_trial_id()
    lead = pool.actors[0]
    try:
        runs = [a.run.remote(token, loop_config, train_path, train_fs, ray.tune.get_checkpoint())
                for a in pool.actors]
        waiting, live = lead.next_report.remote(token), list(runs)
        while True:
            ready, _ = ray.wait([waiting, *live], num_returns=1)
            if waiting not in ready:  # a rank's loop ended: an error raises here, else wait for rank 0's end
                ray.get(ready[0])
                live.remove(ready[0])
                continue
            item = ray.get(waiting)
            if item is None:
                break
            try:
                _report(item)
            except BaseException:  # Tune stopped the trial in its report (ASHA): every rank stops there
                lead.answer.remote(token, False)
                ray.get(runs, timeout=600)
                raise
            lead.answer.remote(token, True)
            waiting = lead.next_report.remote(token)
        ray.get(runs)
    except Exception:
        _pool.kill()  # no rank is left waiting in a collective; the next trial starts new ones
        _pool = None
        raise


def _report(item: dict) -> None:
    import ray.tune
    if not item["checkpoint"]:
        ray.tune.report(item["metrics"])
        return
    with tempfile.TemporaryDirectory(prefix="hpsearch-pointer-") as pointer:
        checkpoints.write_report(Path(pointer), item["metrics"])
        ray.tune.report(item["metrics"], checkpoint=ray.tune.Checkpoint.from_directory(pointer))
