"""Ray Train's torch backend with two changes: the rendezvous store listens on rank 0's node address only
(rendezvous.py says why), and neither the driver nor Ray Train's controller imports torch.

Ray Train's own `TorchConfig` lives in `ray.train.torch`, whose package imports torch (1.4 s here); the driver that
builds the trainer, and the controller that unpickles the config, have no use for it, only the workers do. So the
config, its backend and its context here are defined without torch, and every step that needs torch runs on the
workers as Ray Train's own code (`ray.train.torch.config`), imported there: its per-worker environment variables
(`LOCAL_RANK`, `RANK`, ...), its CUDA device choice around the training function, its process-group shutdown."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ray._common.utils import env_integer
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
from ray.train.v2._internal.util import TrainingFramework

from hpsearch.train.rendezvous import bind_store_socket, join_process_group

logger = logging.getLogger("ray.train.torch.config")  # where Ray Train's own backend logs (its controller's logs)


def _ray_train_torch(name: str, **kwargs):
    """On a worker: Ray Train's own torch step `name` (a function of `ray.train.torch.config`)."""
    from ray.train.torch import config
    return getattr(config, name)(**kwargs)


class _TorchContext:
    """Around the training function on each worker: Ray Train's `TorchConfigContextManager` (the worker's CUDA
    device)."""

    def __enter__(self):
        from ray.train.torch.config import TorchConfigContextManager
        self._inner = TorchConfigContextManager()
        return self._inner.__enter__()

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)


class _BoundTorchBackend(Backend):
    share_cuda_visible_devices = True  # as Ray Train's: a node's ranks see each other's GPUs (NCCL's peer access)

    def on_start(self, worker_group, backend_config: BoundTorchConfig):
        import ray

        addr, port = worker_group.execute_single(0, bind_store_socket)
        worker_group.execute(_ray_train_torch, name="_set_torch_distributed_env_vars")
        ray.get([worker_group.execute_single_async(i, join_process_group, backend=backend_config.backend,
                                                   world_rank=i, world_size=len(worker_group), addr=addr,
                                                   port=port, timeout_s=backend_config.timeout_s)
                 for i in range(len(worker_group))])

    def on_shutdown(self, worker_group, backend_config: BoundTorchConfig):
        import ray
        from ray.exceptions import GetTimeoutError

        futures = worker_group.execute_async(_ray_train_torch, name="_shutdown_torch",
                                             destroy_process_group=len(worker_group) > 1)
        timeout_s = env_integer(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)
        try:
            ray.get(futures, timeout=timeout_s)
        except GetTimeoutError:
            logger.warning(f"Torch process group shutdown timed out after {timeout_s} seconds")


@dataclass
class BoundTorchConfig(BackendConfig):
    """What Ray Train's `TorchConfig` holds (`backend`: "gloo" or "nccl"; `timeout_s`), for `DataParallelTrainer`."""

    backend: str = "gloo"
    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return _BoundTorchBackend

    @property
    def train_func_context(self):
        return _TorchContext

    @property
    def framework(self):
        return TrainingFramework.TORCH

    def to_dict(self) -> dict:  # what Ray Train's state export shows, as for its TorchConfig
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}
