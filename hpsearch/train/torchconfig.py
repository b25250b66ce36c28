"""Ray Train's TorchConfig whose rendezvous store listens on rank 0's node address only (rendezvous.py says why)."""
from __future__ import annotations

from ray.train.torch.config import TorchConfig, _set_torch_distributed_env_vars, _TorchBackend

from hpsearch.train.rendezvous import bind_store_socket, join_process_group


class _BoundTorchBackend(_TorchBackend):
    def on_start(self, worker_group, backend_config: TorchConfig):
        import ray

        addr, port = worker_group.execute_single(0, bind_store_socket)
        worker_group.execute(_set_torch_distributed_env_vars)
        ray.get([worker_group.execute_single_async(i, join_process_group, backend=backend_config.backend,
                                                   world_rank=i, world_size=len(worker_group), addr=addr,
                                                   port=port, timeout_s=backend_config.timeout_s)
                 for i in range(len(worker_group))])


class BoundTorchConfig(TorchConfig):
    """Ray Train's TorchConfig whose rendezvous store listens on rank 0's node address only."""

    @property
    def backend_cls(self):
        return _BoundTorchBackend
