"""``elastic_ddp.compat.ray_trainer`` on a real local Ray cluster: the controller gets its
``RAY_TRAIN_*`` settings while neither it nor the workers start with a runtime environment
(which would make Ray start each through ``setup_worker.py``, importing Ray twice); the
controller's process (``ControllerHost``) serves every worker group's barrier, across a
restart, with no ``SynchronizationActor`` process; a job joining a running cluster starts
that process before its input checks and leaves nothing behind when they fail; and a dead
controller's placement group is removed by the driver.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest


class _ControllerProbe:
    """Runs in the controller's process (a Ray Train controller callback): what it sees."""

    def __init__(self, out: str):
        self.out = out

    def after_controller_start(self, train_run_context) -> None:
        import ray

        with open(self.out, "w") as f:
            json.dump({"interval": os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"),
                       "runtime_env": dict(ray.get_runtime_context().runtime_env)}, f)


TORCHRUN_VARS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "RANK", "WORLD_SIZE", "ACCELERATE_TORCH_DEVICE")


def _train_fn(config):
    import ray
    import ray.train
    import torch.distributed as dist

    import elastic_ddp.worker.entry  # noqa: F401 - what the job's train function imports
    from elastic_ddp.compat.ray_backend import rank_device

    rank = ray.train.get_context().get_world_rank()
    # Before anything here imports it: the process-group set-up and the job's train
    # function's module did not.
    ray_train_torch = "ray.train.torch" in sys.modules
    ours = {k: os.environ.get(k) for k in TORCHRUN_VARS}
    from ray.train.torch import get_device
    from ray.train.torch.config import _set_torch_distributed_env_vars

    _set_torch_distributed_env_vars()  # Ray's own: sets the same values
    with open(os.path.join(config["out"], f"worker-{rank}.json"), "w") as f:
        json.dump({"interval": os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"),
                   "warn": os.environ.get("RAY_TRAIN_COLLECTIVE_WARN_INTERVAL_S"),
                   "runtime_env": dict(ray.get_runtime_context().runtime_env),
                   "ray_train_torch": ray_train_torch, "ours": ours,
                   "rays": {k: os.environ.get(k) for k in TORCHRUN_VARS},
                   "device": [str(rank_device()), str(get_device())],
                   "pg": [dist.is_initialized() and dist.get_rank(), dist.is_initialized() and dist.get_world_size()],
                   "rank": rank}, f)


def _barrier_fn(config):
    """Attempt 1: a barrier, then rank 1 fails. Attempt 2 (a new worker group): a
    broadcast from rank 0 and a barrier, each rank writes what it got."""
    import ray.train
    import ray.train.collective

    rank = ray.train.get_context().get_world_rank()
    first = not os.path.exists(os.path.join(config["out"], "failed"))
    ray.train.collective.barrier()
    if first:
        if rank == 1:
            open(os.path.join(config["out"], "failed"), "w").close()
            raise RuntimeError("injected: rank 1 fails after the first barrier")
        time.sleep(60)  # torn down with the group
    got = ray.train.collective.broadcast_from_rank_zero({"from": rank, "pid": os.getpid()})
    ray.train.collective.barrier()
    with open(os.path.join(config["out"], f"worker-{rank}.json"), "w") as f:
        json.dump(got, f)


def _actor_classes() -> dict[str, list[str]]:
    """Every actor this cluster has had (alive or dead): class name -> states."""
    import ray._private.state as state

    out: dict[str, list[str]] = {}
    for a in state.actors().values():
        out.setdefault(a["ActorClassName"], []).append(a["State"])
    return out


def _until_alive(expected: tuple[str, int], timeout_s: float = 10) -> None:
    """Wait until as many actors of a class as expected are alive (a kill is async)."""
    cls, n = expected
    deadline = time.time() + timeout_s
    while time.time() < deadline and _actor_classes().get(cls, []).count("ALIVE") > n:
        time.sleep(0.2)
    assert _actor_classes().get(cls, []).count("ALIVE") == n, (cls, _actor_classes())


def test_each_worker_groups_barrier_is_served_by_the_controller_across_a_restart(ray_cluster, tmp_path):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from elastic_ddp.compat.ray_backend import ProcessGroupConfig
    from elastic_ddp.compat.ray_trainer import trainer_class
    from elastic_ddp.compat.versions import ray_plan

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    trainer = trainer_class(TorchTrainer, ray_plan())(
        _barrier_fn, train_loop_config={"out": str(tmp_path)},
        torch_config=ProcessGroupConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="barrier", storage_path=str(tmp_path / "ray"),
                             failure_config=FailureConfig(max_failures=1)))
    trainer.fit()
    assert (tmp_path / "failed").exists()  # the first group did fail: this is the second
    got = [json.loads((tmp_path / f"worker-{r}.json").read_text()) for r in range(2)]
    assert got[0] == got[1] and got[0]["from"] == 0, got
    classes = _actor_classes()
    assert "SynchronizationActor" not in classes, classes
    assert "ControllerHost" in classes and classes["RayTrainWorker"].count("DEAD") >= 2, classes
    _until_alive(("ControllerHost", 0))  # fit's own controller host ends with it


def test_a_job_joining_a_running_cluster_starts_its_controller_early_and_kills_it_on_bad_input(
        ray_cluster, digits_data, tmp_path):
    import ray

    from conftest import digits_config

    from elastic_ddp.config import Config
    from elastic_ddp.data.scan import DataError
    from elastic_ddp import train

    before = _actor_classes()
    raw = digits_config(digits_data, tmp_path)
    raw["data"]["id_column"] = "no_such_column"
    with pytest.raises(DataError, match="no_such_column"):
        train(Config.from_dict(raw), progress=False)
    after = _actor_classes()
    for cls in ("ControllerHost", "JobTracker"):
        started = len(after.get(cls, [])) - len(before.get(cls, []))
        assert started == 1, (cls, before, after)  # started before the scan failed ...
        _until_alive((cls, before.get(cls, []).count("ALIVE")))  # ... and killed
    assert ray.is_initialized()
    assert not (tmp_path / "mlflow.db").exists()  # and no MLflow run: none was opened


def _run(tmp_path, monkeypatch, env: dict) -> tuple[dict, list[dict]]:
    from ray import cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.execution.callback import ControllerCallback

    from elastic_ddp.compat.ray_backend import ProcessGroupConfig
    from elastic_ddp.compat.ray_trainer import trainer_class
    from elastic_ddp.compat.versions import ray_plan

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # This module is not importable in the controller's process: its classes travel by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    probe = type("Probe", (_ControllerProbe, ControllerCallback), {})(str(tmp_path / "controller.json"))
    trainer = trainer_class(TorchTrainer, ray_plan())(
        _train_fn, train_loop_config={"out": str(tmp_path)},
        torch_config=ProcessGroupConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="probe", storage_path=str(tmp_path / "ray"), callbacks=[probe]))
    trainer.fit()
    workers = [json.loads((tmp_path / f"worker-{r}.json").read_text()) for r in range(2)]
    return json.loads((tmp_path / "controller.json").read_text()), workers


def test_the_controller_keeps_its_settings_and_nothing_starts_with_a_runtime_env(ray_cluster, tmp_path, monkeypatch):
    controller, workers = _run(tmp_path, monkeypatch, {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25"})
    assert controller == {"interval": "0.25", "runtime_env": {}}, controller
    for w in workers:
        # (A worker may still inherit the variable from its raylet's own environment,
        # e.g. a local Ray started by a process that had set it: never this value.)
        assert w["interval"] != "0.25" and not w["runtime_env"].get("env_vars"), w


def test_the_workers_process_group_is_rays_without_importing_ray_train_torch(ray_cluster, tmp_path, monkeypatch):
    """``compat.ray_backend`` on the workers: torchrun's variables and the device are those
    Ray's own functions set, the process group spans the two ranks, and neither the set-up
    nor the job's train function module imported ``ray.train.torch``."""
    _, workers = _run(tmp_path, monkeypatch, {})
    assert sorted(w["rank"] for w in workers) == [0, 1]
    for w in workers:
        assert w["ray_train_torch"] is False, w
        assert w["ours"] == w["rays"] and w["ours"]["RANK"] == str(w["rank"]), w
        assert w["ours"]["WORLD_SIZE"] == "2" and w["ours"]["ACCELERATE_TORCH_DEVICE"] == "cpu", w
        assert w["device"] == ["cpu", "cpu"] and w["pg"] == [w["rank"], 2], w


def test_a_users_own_ray_train_setting_still_reaches_the_workers(ray_cluster, tmp_path, monkeypatch):
    # Not a controller-only variable: Ray Train's own propagation, runtime env and all.
    controller, workers = _run(tmp_path, monkeypatch, {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25",
                                                       "RAY_TRAIN_COLLECTIVE_WARN_INTERVAL_S": "30"})
    assert controller["interval"] == "0.25"
    for w in workers:
        assert w["warn"] == "30" and w["interval"] != "0.25", w
        assert w["runtime_env"]["env_vars"] == {"RAY_TRAIN_COLLECTIVE_WARN_INTERVAL_S": "30"}, w


def test_a_dead_controllers_placement_group_is_removed_by_the_driver(ray_cluster):
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    from elastic_ddp.compat.ray_placement_groups import remove_leftover_placement_groups

    pg = placement_group([{"CPU": 1}])
    ray.get(pg.ready(), timeout=60)
    timeline = [{"what": "controller_started"}, {"what": "worker_group_started", "placement_group": pg.id.hex()}]
    assert remove_leftover_placement_groups(timeline) == [pg.id.hex()]
    deadline = time.time() + 10
    while time.time() < deadline and placement_group_table(pg)["state"] != "REMOVED":
        time.sleep(0.1)
    assert placement_group_table(pg)["state"] == "REMOVED"
    assert remove_leftover_placement_groups(timeline) == []  # already gone: nothing to do


@pytest.fixture(autouse=True)
def _no_ray_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
