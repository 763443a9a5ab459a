"""The torch.distributed set-up of Ray Train's worker group, without torch in the controller
and without ``ray.train.torch`` on the workers.

    TorchTrainer(train_func, torch_config=ProcessGroupConfig(backend="gloo", timeout_s=...))

Ray's ``TorchConfig`` does the same, but its module imports torch at the top, and the Ray
Train controller unpickles the config when it starts: every job's controller process
imports torch only to tell the workers to call ``init_process_group``. That import is on
the path from the command to the first step. Here the controller-side orchestration is
the same as ``ray.train.torch.config._TorchBackend.on_start`` (master address from rank
0, the ``env://`` variables, one ``init_process_group`` per rank), and the functions that
run on a worker do what Ray's do (``_set_torch_distributed_env_vars``,
``_setup_torch_process_group``, ``_shutdown_torch``, ``TorchConfigContextManager``,
``ray.train.torch.get_device``) with torch and Ray's device manager only: importing
``ray.train.torch`` on a worker also imports Ray's ``TorchTrainer`` and the Ray Train v1
worker group, a quarter of a second of CPU in every worker at every start and restart.
What it costs: this code follows Ray's (2.56 to 2.60: override ``process_group_backend``
of ``compat.versions``; on another release the launcher uses Ray's ``TorchConfig``); a
Ray release that changes ``_TorchBackend`` or those functions must be mirrored here
before it is added there (``tests/unit/compat/test_ray_trainer.py`` compares the variables and the
device with what Ray's own functions give). TPU and HCCL set-up are not covered: the
config refuses those backends.
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


def rank_device():
    """This worker's ``torch.device``: the first accelerator Ray assigned to it, else the
    CPU (``ray.train.torch.get_device``: Ray's device manager, ``CUDA_VISIBLE_DEVICES``
    against ``ray.get_gpu_ids()``). On a Ray without that module, Ray's own call.

    A worker given no GPU gets the CPU even where CUDA is visible: Ray's call answers
    ``cuda:0`` there (``scaling.use_gpu`` false, or auto on a cluster without GPUs)."""
    import ray
    import torch

    if not ray.get_gpu_ids():
        return torch.device("cpu")
    try:
        from ray.air._internal import torch_utils
    except ImportError:
        import ray.train.torch

        return ray.train.torch.get_device()
    return torch_utils.get_devices()[0]


class _CudaDevice:
    """Around the train function on each worker: its CUDA device is the current one (what
    ``ray.train.torch.config.TorchConfigContextManager`` does)."""

    def __enter__(self):
        import torch

        if torch.cuda.is_available():
            device = rank_device()
            if device.type == "cuda":
                torch.cuda.set_device(device)

    def __exit__(self, *exc):
        return False


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


#: This worker process's set-up times for its group (seconds since the epoch):
#: ``env_start`` (the controller's first call after the worker's start reached it: Ray's
#: worker process and the RayTrainWorker actor are up), ``torch_imported`` (the worker's
#: first torch import), ``pg_start`` (the process-group call arrived), ``pg_ready``
#: (``init_process_group`` returned, every rank joined the TCP store). The train function,
#: run later in the same process, reports them with the attempt's start marks.
PG_MARKS: Dict[str, float] = {}


def _set_rank_env() -> None:
    """torchrun's variables (https://pytorch.org/docs/stable/elastic/run.html) and
    ``ACCELERATE_TORCH_DEVICE`` (Hugging Face Accelerate's device), as Ray's
    ``_set_torch_distributed_env_vars`` sets them."""
    import time

    import ray.train

    PG_MARKS.clear()
    PG_MARKS["env_start"] = time.time()
    device = rank_device()  # imports torch
    PG_MARKS["torch_imported"] = time.time()
    ctx = ray.train.get_context()
    os.environ.update({"LOCAL_RANK": str(ctx.get_local_rank()), "LOCAL_WORLD_SIZE": str(ctx.get_local_world_size()),
                       "NODE_RANK": str(ctx.get_node_rank()), "RANK": str(ctx.get_world_rank()),
                       "WORLD_SIZE": str(ctx.get_world_size()), "ACCELERATE_TORCH_DEVICE": str(device)})


def _init_process_group(backend: str, world_rank: int, world_size: int, timeout_s: int) -> None:
    """``init_process_group`` over the ``env://`` variables, as Ray's
    ``_setup_torch_process_group`` calls it; with NCCL, a collective that times out fails
    instead of hanging (``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` unless the user set it or
    ``TORCH_NCCL_BLOCKING_WAIT``, Ray's setting)."""
    import time
    from datetime import timedelta

    PG_MARKS["pg_start"] = time.time()
    import torch.distributed as dist

    if backend == "nccl" and not {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT"} & set(os.environ):
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    dist.init_process_group(backend=backend, init_method="env://", rank=world_rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    PG_MARKS["pg_ready"] = time.time()


def _shutdown(destroy_process_group: bool) -> None:
    """Ray's ``_shutdown_torch``: the process group destroyed (when asked and set up),
    the CUDA caching allocator of each of the worker's devices emptied."""
    import torch
    import torch.distributed as dist

    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()
    if torch.cuda.is_available():
        from ray.air._internal import torch_utils

        for device in torch_utils.get_devices():
            if device.type == "cuda":
                with torch.cuda.device(device):
                    torch.cuda.empty_cache()
