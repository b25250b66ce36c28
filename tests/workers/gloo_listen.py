"""Run inside a network namespace whose hostname resolves to a network address (see the test): ranks join as
hpsearch joins them on a private one-machine Ray (rank 0's store on 127.0.0.1), and one rank alone as `--local`
does; prints every address their processes listen on, one per line ("LISTEN <ip>"), then "done"."""
import multiprocessing as mp
import os
import socket
import sys
import time

import psutil


def rank(r: int, ready, addresses, pids) -> None:
    import ray.util
    ray.util.get_node_ip_address = lambda: "127.0.0.1"  # what a private Ray advertises
    import torch
    import torch.distributed as dist

    from hpsearch.train import rendezvous
    if r == 0:
        addr, port = rendezvous.bind_store_socket()
        addresses.put((addr, port))  # for rank 1
    else:
        addr, port = addresses.get(timeout=60)
    rendezvous.join_process_group("gloo", r, 2, addr, port, 60)
    dist.all_reduce(torch.ones(1))
    pids.put(os.getpid())
    ready.wait(30)


def alone(ready, pids) -> None:
    from hpsearch.train.loop import _init_single_process_group
    _init_single_process_group("gloo")
    pids.put(os.getpid())
    ready.wait(30)


if __name__ == "__main__":
    print("hostname", socket.gethostname(), socket.gethostbyname(socket.gethostname()), flush=True)
    ready, addresses, pids = mp.Event(), mp.Queue(), mp.Queue()
    procs = [mp.Process(target=rank, args=(r, ready, addresses, pids)) for r in (0, 1)]
    procs.append(mp.Process(target=alone, args=(ready, pids)))
    for p in procs:
        p.start()
    mine = {pids.get(timeout=120) for _ in procs}
    time.sleep(0.5)
    for c in psutil.net_connections("inet"):
        if c.status == "LISTEN" and c.pid in mine:
            print("LISTEN", c.laddr.ip, flush=True)
    ready.set()
    for p in procs:
        p.join(60)
    print("done", all(p.exitcode == 0 for p in procs))
    sys.exit(0)
