"""Trials with several workers on ranks kept from trial to trial (`resources.worker_group=pool`): the trial's Tune
actor starts its ranks once, as actors in its own placement group's worker bundles, joins them in one
torch.distributed process group, and Tune reuses the actor, ranks included, for the next trial. A trial then pays
neither Ray Train's controller and worker group nor the workers' imports and rendezvous again.

The ranks run the training loop as a Ray Train worker does; `PoolSession` is what it reports through. Every rank
stores its own checkpoint files into `<study>/train/<trial id>/checkpoint_<step>` (with its manifest, last; rank 0
first clears what an earlier attempt left there), then rank 0 hands the report to the trial's thread in the Tune
actor, which reports it to Tune with a pointer checkpoint (as a one-worker trial does, inprocess.py) and answers
every rank: go on, or stop here (ASHA stopped the trial in that report), so every rank leaves its loop at the same
point and the ranks stay usable. The ranks wait for that answer on a queue, not in a collective, so no
torch.distributed timeout runs while Tune decides. Any other end of a rank (an error, a dead process) ends the pool:
its actors are killed (no rank is left waiting in a collective) and the next trial starts new ones. As with Ray
Train, the study's storage must be one every node reads and writes (a bucket, or a shared file system): the trial's
thread leaves a marker in the trial's folder and every rank looks for it before training (Ray Train's own check),
so a rank on a node that does not see the storage fails the trial with one line instead of storing its part of
each checkpoint where no other rank reads it."""
from __future__ import annotations

import queue
import shutil
import tempfile
import time
from pathlib import Path

from hpsearch.errors import UserError
from hpsearch.train import checkpoints
from hpsearch.tune.inprocess import TuneSession, free_trial_memory, start_reused_trial
from hpsearch.tune.storage import STORAGE_MARKER as MARKER  # every rank must see the trial thread's

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
        self.gpu = False

    def where(self) -> tuple[str, str]:
        import ray
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def bind(self) -> tuple[str, int]:
        from hpsearch.train.rendezvous import bind_store_socket
        return bind_store_socket()

    def gpus(self) -> list[str]:
        import ray
        return [str(g) for g in ray.get_gpu_ids()]

    def join(self, backend: str, rank: int, world: int, addr: str, port: int, local: tuple[int, int, int, int],
             devices: list[str], timeout_s: int) -> int:
        """Join the pool's process group as `rank` of `world`; `local`: (local rank, ranks on this node, node rank,
        nodes); `devices`: the GPUs of every rank on this node, which each rank sees (as Ray Train shares them),
        in the order of their local ranks, so that DeepSpeed's device LOCAL_RANK is this rank's own."""
        import os

        from hpsearch.train.rendezvous import join_process_group
        self.rank, self.world = rank, world
        self.local_rank, self.local_world_size, self.node_rank, self.nodes = local
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(self.local_rank),
                          LOCAL_WORLD_SIZE=str(self.local_world_size), NODE_RANK=str(self.node_rank))
        if devices:  # before anything in this process starts CUDA
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
            self.gpu = True
            self._use_own_device()
        join_process_group(backend, rank, world, addr, port, timeout_s)
        return os.getpid()

    def _use_own_device(self) -> None:
        """This rank's GPU as the current device of the calling thread. CUDA's current device is per thread, and
        the actor is threaded: each trial's loop runs in a thread of its own, which would otherwise train every
        rank of a node on its first GPU (as Ray Train sets it in its training thread)."""
        if self.gpu:
            import torch
            torch.cuda.set_device(self.local_rank)

    def run(self, token: str, loop_config: dict, train_path: str, filesystem, taken) -> str:
        """Train one trial on this rank: "done", or "stopped" when the driver stopped it."""
        from hpsearch.train.loop import train_loop

        self._use_own_device()  # in this call's thread: the loop's
        start_reused_trial()
        try:
            train_loop(loop_config, PoolSession(self, token, train_path, filesystem, taken))
            return "done"
        except PoolStopped:
            return "stopped"
        finally:
            if self.rank == 0:
                self._reports.put((token, None))  # the trial's thread stops waiting for reports
            free_trial_memory()  # nothing held while the pool waits for the next trial

    # the trial's thread, rank 0 and every rank
    def next_report(self, token: str) -> dict | None:
        """The next report of trial `token` (metrics and whether it has a checkpoint); None when its loop ended."""
        return self._take(self._reports, token)

    def answer(self, token: str, go_on: bool) -> None:
        self._answers.put((token, go_on))

    def put_report(self, token: str, item: dict) -> None:
        self._reports.put((token, item))

    def wait_answer(self, token: str) -> bool:
        return self._take(self._answers, token)

    @staticmethod
    def _take(q: queue.Queue, token: str):
        while True:
            got, item = q.get()
            if got == token:  # else left by an earlier trial that was stopped or failed
                return item


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
        check_shared(self.fs, self.path, self.rank)
        self._newest, self.unregistered = checkpoints.resume_choice(self.fs, self.path, self.world_size, taken,
                                                                    self.rank)
        self._resume_dir = None

    def report(self, metrics: dict, checkpoint_dir: str | None) -> None:
        """Every rank stores its files into the checkpoint, then rank 0 removes the older ones and reports; every
        rank waits for the driver's answer (go on, or stop here: PoolStopped)."""
        import torch
        import torch.distributed as dist
        target = f"{self.path}/checkpoint_{int(metrics['step']):06d}"
        # rank 0 decides for all: store (clearing what an earlier attempt left), or not at all (the checkpoint this
        # run resumed from, reported again: complete already)
        store = torch.zeros(1, dtype=torch.int32, device="cuda" if dist.get_backend() == "nccl" else "cpu")
        if self.rank == 0 and checkpoint_dir and checkpoints.complete_step(self.fs, target, self.world_size) is None:
            self._clear(target)
            store += 1
        dist.broadcast(store, src=0)
        if checkpoint_dir and store.item():
            checkpoints.write_manifest(checkpoint_dir, self.rank)
            self._store_mine(Path(checkpoint_dir), target)
        dist.barrier()  # every rank's files are there: the checkpoint is complete
        if self.rank == 0:
            if checkpoint_dir:
                self._remove_all_but(target)
            self._me.put_report(self._token, {"metrics": metrics, "checkpoint": bool(checkpoint_dir)})
        if not self._me.wait_answer(self._token):
            raise PoolStopped()

    def _clear(self, target: str) -> None:
        if self.local:
            shutil.rmtree(target, ignore_errors=True)
        else:
            self.fs.delete_dir_contents(target, missing_dir_ok=True)

    def _store_mine(self, source: Path, target: str) -> None:
        """This rank's files into the shared checkpoint folder (moved when local: written once), its manifest
        last; another rank's files stay."""
        from pyarrow import fs

        from hpsearch.train.sessions import move_into
        if self.local:
            move_into(source, Path(target))
            return
        files = sorted((p for p in source.rglob("*") if p.is_file()), key=lambda p: p.name.startswith("manifest_"))
        for f in files:
            fs.copy_files(str(f), f"{target}/{f.relative_to(source).as_posix()}",
                          source_filesystem=fs.LocalFileSystem(), destination_filesystem=self.fs, use_threads=False)


class Pool:
    """The ranks a Tune actor keeps: started in its placement group's bundles 1..N (bundle 0 is the actor's)."""

    def __init__(self, cfg):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        t = cfg.train
        self.key = _key(cfg)
        group = ray.util.get_current_placement_group()
        options = {"num_cpus": t.cpus_per_worker, "num_gpus": t.gpus_per_worker if t.use_gpu else 0,
                   "max_concurrency": 4}
        self.actors = []
        try:
            for i in range(t.num_workers):
                self.actors.append(ray.remote(Rank).options(**options, scheduling_strategy=(
                    PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i + 1))).remote())
            where = [node for node, _ in ray.get([a.where.remote() for a in self.actors])]
            gpus = ray.get([a.gpus.remote() for a in self.actors])
            nodes = list(dict.fromkeys(where))  # in rank order of first appearance
            addr, port = ray.get(self.actors[0].bind.remote())
            joins = []
            for i, node in enumerate(where):
                # a node's ranks: local ranks in the order of their GPUs, each sees them all (Ray Train's way)
                same = sorted((j for j, n in enumerate(where) if n == node), key=lambda j: (gpus[j], j))
                devices = list(dict.fromkeys(g for j in same for g in gpus[j]))
                joins.append(self.actors[i].join.remote("nccl" if t.use_gpu else "gloo", i, len(self.actors), addr,
                                                        port, (same.index(i), len(same), nodes.index(node),
                                                               len(nodes)), devices, 1800))
            self.pids = ray.get(joins)
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        import ray
        for a in self.actors:
            ray.kill(a, no_restart=True)


def mark_shared(filesystem, train_path: str) -> None:
    """The trial's thread marks the trial's folder before its ranks start (where the Tune actor sees the storage)."""
    filesystem.create_dir(train_path)
    with filesystem.open_output_stream(f"{train_path}/{MARKER}"):
        pass


def check_shared(filesystem, train_path: str, rank: int) -> None:
    """A rank sees the marker of the trial's thread, or the storage is not shared: one line, not retried."""
    import ray
    from pyarrow import fs
    if filesystem.get_file_info(f"{train_path}/{MARKER}").type == fs.FileType.NotFound:
        raise UserError(f"storage: rank {rank} on node {ray.util.get_node_ip_address()} does not see {train_path}, "
                        "which the trial wrote on another node; with ranks on several nodes the study's storage must "
                        "be one every node reads and writes: a bucket (s3://...) or a shared file system mounted at "
                        "the same path on every node")


def _key(cfg) -> tuple:
    """What a pool's ranks are: a trial asking for other ones gets a new pool."""
    t = cfg.train
    return t.num_workers, t.cpus_per_worker, t.use_gpu, t.gpus_per_worker


def train_in_pool(cfg, train_path: str, train_fs, loop_config: dict) -> None:
    """One trial on this Tune actor's ranks (started on its first trial, or after a failure ended them): reports
    reach Tune from here; ASHA's stop (Tune's SystemExit in the report) is passed to every rank."""
    global _pool
    import ray
    import ray.tune
    from pyarrow import fs

    if _pool is not None and _pool.key != _key(cfg):
        _pool.kill()
        _pool = None
    if _pool is None:
        started = time.time()
        _pool = Pool(cfg)
        print(f"[hpsearch.tune] started {len(_pool.actors)} ranks for this actor's trials (pids "
              f"{', '.join(map(str, _pool.pids))}) in {time.time() - started:.1f} s", flush=True)
    pool, token = _pool, ray.tune.get_context().get_trial_id()
    storage = train_fs or fs.LocalFileSystem()
    mark_shared(storage, train_path)
    answer = lambda go_on: [a.answer.remote(token, go_on) for a in pool.actors]
    try:
        live = [a.run.remote(token, loop_config, train_path, train_fs, ray.tune.get_checkpoint())
                for a in pool.actors]
        runs, waiting = list(live), pool.actors[0].next_report.remote(token)
        while live:  # until every rank's loop ended; a rank's error (or death) raises at once
            ready = ray.wait([waiting, *live] if waiting is not None else live, num_returns=1)[0][0]
            if ready != waiting:
                ray.get(ready)
                live.remove(ready)
                continue
            item = ray.get(waiting)
            waiting = None
            if item is None:  # rank 0's loop ended
                continue
            try:
                _report(item)
            except BaseException as stop:  # Tune stopped the trial in its report (ASHA): every rank stops there
                answer(False)
                try:
                    ray.get(runs, timeout=30)  # within Tune's wait for this thread (TUNE_FUNCTION_THREAD_TIMEOUT_S)
                except Exception:
                    pool.kill()
                    _pool = None
                raise stop
            answer(True)
            waiting = pool.actors[0].next_report.remote(token)
    except Exception:
        pool.kill()  # no rank is left waiting in a collective; the next trial starts new ones
        _pool = None
        raise
    finally:  # the ranks read it at their start only; the study's end leaves no file of the trial's under train/
        try:
            storage.delete_file(f"{train_path}/{MARKER}")
        except OSError:
            pass


def _report(item: dict) -> None:
    import ray.tune
    if not item["checkpoint"]:
        ray.tune.report(item["metrics"])
        return
    with tempfile.TemporaryDirectory(prefix="hpsearch-pointer-") as pointer:
        checkpoints.write_report(Path(pointer), item["metrics"])
        ray.tune.report(item["metrics"], checkpoint=ray.tune.Checkpoint.from_directory(pointer))
