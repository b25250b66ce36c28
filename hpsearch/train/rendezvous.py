"""torch.distributed rendezvous on the address Ray advertises for rank 0's node, never the wildcard.

Ray Train's own torch backend lets `init_process_group("env://")` create rank 0's TCPStore, and torch's store
server listens on every interface (`::`), whatever `MASTER_ADDR` says: on a private local Ray that put an
unauthenticated key-value store on the machine's network while everything else listened on 127.0.0.1. Here
rank 0 binds the listening socket itself, on its node's Ray address (127.0.0.1 on a private local Ray; the
node's IP on a cluster, which the other nodes need), and hands it to the store (`master_listen_fd`); the other
ranks connect to it. Ray Train's backend that does this is in torchconfig.py (the rest of it runs Ray Train's
own torch steps on the workers); the search's rank pool (tune/rankpool.py) joins its ranks the same way, without
importing Ray Train (0.7 s of each rank's start).

Gloo's own sockets (the connections between ranks) listen on the address the machine's hostname resolves to,
whatever `MASTER_ADDR` says: on a machine whose hostname names its network address, a private Ray's ranks (and a
single `--local` rank) listened there. When the ranks meet on a loopback address, gloo is bound to the loopback
interface too (`GLOO_SOCKET_IFNAME`, unless the user set it)."""
from __future__ import annotations

import ipaddress
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


def loopback_interface() -> str | None:
    """The name of the interface that holds 127.0.0.1 (`lo` on Linux), None if none does."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            return name
    return None


def bind_gloo_to_loopback(addr: str) -> None:
    """Ranks that meet on a loopback address: gloo's sockets on the loopback interface too (see the docstring)."""
    try:
        loopback = ipaddress.ip_address(addr).is_loopback
    except ValueError:  # a host name: a cluster's
        loopback = False
    if loopback and "GLOO_SOCKET_IFNAME" not in os.environ and (name := loopback_interface()):
        os.environ["GLOO_SOCKET_IFNAME"] = name


def join_process_group(backend: str, world_rank: int, world_size: int, addr: str, port: int,
                       timeout_s: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    if backend == "gloo":
        bind_gloo_to_loopback(addr)
    if backend == "nccl" and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ:
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # fail on a timed-out collective, as Ray does
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(addr, port, world_size, world_rank == 0, timeout=timeout, multi_tenant=True,
                          master_listen_fd=_listener.fileno() if world_rank == 0 else None)
    dist.init_process_group(backend, store=store, rank=world_rank, world_size=world_size, timeout=timeout)
