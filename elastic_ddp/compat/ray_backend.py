"""The torch.distributed set-up of Ray Train's worker group, without torch in the controller.

    TorchTrainer(train_func, torch_config=ProcessGroupConfig(backend="gloo", timeout_s=...))

Ray's ``TorchConfig`` does the same, but its module imports torch at the top, and the Ray
Train controller unpickles the config when it starts: every job's controller process
imports torch only to tell the workers to call ``init_process_group``. That import is on
the path from the command to the first step. Here the controller-side orchestration is
the same as ``ray.train.torch.config._TorchBackend.on_start`` (master address from rank
0, the ``env://`` variables, one ``init_process_group`` per rank) and every function
that runs on a worker is Ray's own, imported there, where torch is needed anyway.
What it costs: this orchestration follows Ray's (2.56 to 2.60: override
``process_group_backend`` of ``compat.versions``; on another release the launcher uses
Ray's ``TorchConfig``); a Ray release that changes ``_TorchBackend`` must be mirrored here
before it is added there. TPU and HCCL set-up are not covered: the config refuses those
backends.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict

from ray.train.backend import Backend, BackendConfig

BACKENDS = ("gloo", "nccl")


@dataclass
class ProcessGroupConfig(BackendConfig):
    """``init_process_group(backend, init_method="env://", timeout=timeout_s)`` on every
    worker of the group, as Ray's ``TorchConfig`` does. ``backend``: ``gloo`` or ``nccl``;
    ``timeout_s``: seconds a collective may wait for a peer (PyTorch's process-group
    timeout).

    Raises:
        ValueError: another backend.
    """

    backend: str = "gloo"
    timeout_s: int = 1800
    init_method: str = "env"

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: choose one of {', '.join(BACKENDS)}")

    @property
    def backend_cls(self):
        return _ProcessGroupBackend

    @property
    def train_func_context(self):
        return _CudaDevice

    @property
    def framework(self):
        from ray.train.v2._internal.util import TrainingFramework

        return TrainingFramework.TORCH

    def to_dict(self) -> Dict[str, Any]:
        return {"backend": self.backend, "init_method": self.init_method, "timeout_s": self.timeout_s}


class _CudaDevice:
    """Around the train function on each worker: its CUDA device is the current one (what
    ``ray.train.torch.config.TorchConfigContextManager`` does)."""

    def __enter__(self):
        from ray.train.torch.config import TorchConfigContextManager

        self._inner = TorchConfigContextManager()
        return self._inner.__enter__()

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)


class _ProcessGroupBackend(Backend):
    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group, backend_config: ProcessGroupConfig) -> None:
        import ray
        from ray.train._internal.utils import get_address_and_port

        addr, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(_set_master, addr=addr, port=port)
        worker_group.execute(_set_rank_env)
        n = len(worker_group)
        ray.get([worker_group.execute_single_async(
            i, _init_process_group, backend=backend_config.backend, world_rank=i, world_size=n,
            timeout_s=backend_config.timeout_s) for i in range(n)])

    def on_shutdown(self, worker_group, backend_config) -> None:
        import ray
        from ray.exceptions import GetTimeoutError

        futures = worker_group.execute_async(_shutdown, destroy_process_group=len(worker_group) > 1)
        try:
            ray.get(futures, timeout=float(os.environ.get("TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S", 30)))
        except GetTimeoutError:
            pass  # a wedged group: the workers are killed next anyway


def _set_master(addr: str, port: int) -> None:
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)


def _set_rank_env() -> None:
    from ray.train.torch.config import _set_torch_distributed_env_vars

    _set_torch_distributed_env_vars()


#: This worker process's process-group set-up times (seconds since the epoch):
#: ``pg_start`` (the call arrived), ``pg_imported`` (torch and Ray's torch config
#: imported: the first torch import of a fresh worker process), ``pg_ready``
#: (``init_process_group`` returned, every rank joined the TCP store). The train function,
#: run later in the same process, reports them with the attempt's start marks.
PG_MARKS: Dict[str, float] = {}


def _init_process_group(backend: str, world_rank: int, world_size: int, timeout_s: int) -> None:
    import time

    PG_MARKS.clear()
    PG_MARKS["pg_start"] = time.time()
    from ray.train.torch.config import _setup_torch_process_group

    PG_MARKS["pg_imported"] = time.time()
    _setup_torch_process_group(backend=backend, world_rank=world_rank, world_size=world_size,
                               init_method="env://", timeout_s=timeout_s)
    PG_MARKS["pg_ready"] = time.time()


def _shutdown(destroy_process_group: bool) -> None:
    from ray.train.torch.config import _shutdown_torch

    _shutdown_torch(destroy_process_group=destroy_process_group)
