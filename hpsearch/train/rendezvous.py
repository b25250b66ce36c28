"""torch.distributed rendezvous on the address Ray advertises for rank 0's node, never the wildcard.

Ray Train's own torch backend lets `init_process_group("env://")` create rank 0's TCPStore, and torch's store
server listens on every interface (`::`), whatever `MASTER_ADDR` says: on a private local Ray that put an
unauthenticated key-value store on the machine's network while everything else listened on 127.0.0.1. Here
rank 0 binds the listening socket itself, on its node's Ray address (127.0.0.1 on a private local Ray; the
node's IP on a cluster, which the other nodes need), and hands it to the store (`master_listen_fd`); the other
ranks connect to it. Ray Train's backend that does this is in torchconfig.py (the rest of it runs Ray Train's
own torch steps on the workers); the search's rank pool (tune/rankpool.py) joins its ranks the same way, without
importing Ray Train (0.7 s of each rank's start)."""
from __future__ import annotations

import os
import socket
from datetime import timedelta

_listener: socket.socket | None = None  # rank 0's bound socket: lives as long as the worker process and its store


def bind_store_socket() -> tuple[str, int]:
    """Rank 0: a listening socket on this node's Ray address; returns that address and the port."""
    import ray

    global _listener
    addr = ray.util.get_node_ip_address()
    _listener = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    _listener.bind((addr, 0))
    _listener.listen(128)
    return addr, _listener.getsockname()[1]


def join_process_group(backend: str, world_rank: int, world_size: int, addr: str, port: int,
                       timeout_s: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    if backend == "nccl" and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ:
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # fail on a timed-out collective, as Ray does
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(addr, port, world_size, world_rank == 0, timeout=timeout, multi_tenant=True,
                          master_listen_fd=_listener.fileno() if world_rank == 0 else None)
    dist.init_process_group(backend, store=store, rank=world_rank, world_size=world_size, timeout=timeout)
