"""The CUDA/NCCL path: a short digits run with ``scaling.use_gpu: true``.

Skipped where ``torch.cuda.is_available()`` is False (CI, laptops). One worker per GPU
(NCCL refuses two ranks on one device), so the world size is the GPU count, capped at 2.
The run proves: the worker group got GPUs, torch.distributed ran on NCCL (the
``elastic_ddp.backend`` tag each attempt's rank 0 writes), tensors lived on CUDA, the
job trained to a useful accuracy, and the model artifact loads on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import digits_config, mlflow_runs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL path)"),
]


@pytest.fixture(scope="module")
def gpu_ray_cluster():
    """A local Ray cluster that sees this machine's GPUs, shut down afterwards."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    n_gpu = torch.cuda.device_count()
    ray.init(address="local", num_cpus=4, num_gpus=n_gpu, include_dashboard=False,
             logging_level="WARNING")
    try:
        yield n_gpu
    finally:
        ray.shutdown()


def test_digits_on_gpu_uses_nccl(gpu_ray_cluster, digits_data, tmp_path):
    from elastic_ddp.config import Config
    from elastic_ddp import train
    from elastic_ddp.tasks.loading import build_model, load_task

    ws = min(2, gpu_ray_cluster)
    cfg = Config.from_dict(digits_config(digits_data, tmp_path, {
        "model": {"kwargs": {"hidden": 64}},
        "optim": {"lr": 0.01, "warmup_steps": 20},
        "batch": {"global_batch_size": 32, "micro_batch_size": 16},
        "train": {"epochs": 3, "checkpoint_every_steps": 50},
        "scaling": {"min_workers": ws, "max_workers": ws, "use_gpu": True},
        "run": {"name": "test-gpu"},
    }))
    summary = train(cfg, progress=False)
    print(f"\n[gpu] world_size {ws} metrics {summary.metrics} wall {summary.wall_s:.1f}s")

    runs = mlflow_runs(tmp_path)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    tags, metrics = runs[0].data.tags, runs[0].data.metrics
    assert tags["elastic_ddp.backend"] == "nccl"
    assert tags["elastic_ddp.device"].startswith("cuda")
    assert metrics["world_size"] == ws
    assert summary.restarts == 0 and summary.world_sizes_seen == [ws]
    assert summary.metrics["val_acc"] >= 0.9

    # The checkpoint written from CUDA tensors loads into a CPU model.
    from mlflow.tracking import MlflowClient

    local = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").download_artifacts(
        summary.run_id, "model/model.pt", str(tmp_path / "dl"))
    weights = torch.load(Path(local), weights_only=True)  # no map_location: saved on the CPU
    assert all(t.device.type == "cpu" for t in weights.values())
    build_model(cfg, load_task(cfg)).load_state_dict(weights)


def test_use_gpu_false_trains_on_the_cpu_of_a_gpu_machine(gpu_ray_cluster, digits_data, tmp_path):
    """``scaling.use_gpu: false`` on a machine with CUDA: the workers are given no GPU, and
    Ray Train's ``get_device()`` still answers ``cuda:0`` there; the job must train on the
    CPU over gloo (a task that builds a tensor on the CPU would otherwise meet its batch
    on the GPU)."""
    from elastic_ddp.config import Config
    from elastic_ddp import train

    cfg = Config.from_dict(digits_config(digits_data, tmp_path, {
        "train": {"epochs": 1, "checkpoint_every_steps": 50},
        "scaling": {"min_workers": 1, "max_workers": 1, "use_gpu": False},
        "run": {"name": "test-gpu-off"},
    }))
    train(cfg, progress=False)
    tags = mlflow_runs(tmp_path)[0].data.tags
    assert tags["elastic_ddp.backend"] == "gloo"
    assert tags["elastic_ddp.device"] == "cpu"
