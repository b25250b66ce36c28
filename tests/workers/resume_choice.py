"""Run under torchrun (2 ranks, gloo): kept ranks agree on the checkpoint a restarted trial resumes from.

The trial's storage holds two complete checkpoints (steps 10 and 20); rank 1 lists the folder as a network file
system's cached directory can, without the newer one. Each rank builds its `PoolSession` (rankpool.py) as a kept rank
does, and writes the checkpoint it would resume from and whether it would report it again to argv[1]/rank<r>.json.
"""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist
from pyarrow import fs

from hpsearch.train import checkpoints
from hpsearch.tune import rankpool
from hpsearch.tune.storage import STORAGE_MARKER

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
out = Path(sys.argv[1])
train = out / "train"
if rank == 0:
    for step in (10, 20):
        folder = train / f"checkpoint_{step:06d}"
        folder.mkdir(parents=True)
        (folder / "state.bin").write_bytes(b"x" * step)
        checkpoints.write_report(folder, {"step": step})
        for r in range(world):
            checkpoints.write_manifest(folder, r)
    (train / STORAGE_MARKER).write_text("")
dist.barrier()
if rank == 1:  # a stale listing: the newest checkpoint not seen yet
    checkpoints.newest_complete = lambda filesystem, path, n: (10, f"{path}/checkpoint_000010")
me = SimpleNamespace(rank=rank, world=world, local_rank=rank, local_world_size=world, node_rank=0, nodes=1)
session = rankpool.PoolSession(me, "token", str(train), None, None)
own = checkpoints.newest_complete(fs.LocalFileSystem(), str(train), world)
(out / f"rank{rank}.json").write_text(json.dumps({"newest": session._newest, "unregistered": session.unregistered,
                                                  "own": own}))
dist.destroy_process_group()
