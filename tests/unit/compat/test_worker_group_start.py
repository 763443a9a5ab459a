"""A worker killed while its group starts leaves nothing behind: Ray Train's own
``WorkerGroup`` (2 real worker actors, a real placement group) started from a Ray actor
standing for the controller, whose start fails in an ``after_worker_group_start``
callback (where the backend sets up the process group) because a worker was SIGKILLed.
Ray Train builds the group's state before those callbacks and cleans a failed start up
only while it is unbuilt; without ``compat.ray_train.shut_down_failed_starts`` the
placement group and the live worker stay, held by no group the controller knows, and
every retry of the job waits for their resources (a SIGKILL while a restart's group
starts, as experiments/soak.py injects: the job never restarts)"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest


def _train_fn():
    return None


class Controller:
    """A Ray actor standing for Ray Train's controller (a worker group needs one); its
    own process, so the clean-up is installed there only when asked."""

    def start(self, storage: str, clean_up: bool) -> dict:
        return _start_and_kill(storage, clean_up)


def _start_and_kill(storage: str, clean_up: bool) -> dict:
    """In the controller's process: start a 2-worker group whose start callback SIGKILLs worker 1 and then calls both workers, as
    the backend's set-up does. ``clean_up``: with ``shut_down_failed_starts``. Returns
    the start's error (its class name), the group's placement group id and worker 0."""
    import ray
    from ray.train.backend import BackendConfig
    from ray.train.v2._internal.execution.callback import WorkerGroupCallback
    from ray.train.v2._internal.execution.context import TrainRunContext
    from ray.train.v2._internal.execution.worker_group.state import WorkerGroupContext
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup
    from ray.train.v2._internal.util import ObjectRefWrapper
    from ray.train.v2.api.config import RunConfig, ScalingConfig

    from elastic_ddp.compat.ray_train import shut_down_failed_starts

    if clean_up:
        shut_down_failed_starts()
    seen: dict = {}

    class KillOne(WorkerGroupCallback):
        def after_worker_group_start(self, worker_group):
            workers = worker_group.get_workers()
            seen["pg"] = worker_group.get_worker_group_state().placement_group_handle.placement_group.id.hex()
            seen["survivor"] = workers[0].actor
            os.kill(workers[1].metadata.pid, signal.SIGKILL)
            ray.get([w.actor.execute.remote(os.getpid) for w in workers])

    ctx = TrainRunContext(run_config=RunConfig(storage_path=storage), train_loop_config={},
                          scaling_config=ScalingConfig(num_workers=2), backend_config=BackendConfig(),
                          dataset_config=None)
    wg_ctx = WorkerGroupContext(run_attempt_id="attempt", train_fn_ref=ObjectRefWrapper(_train_fn),
                                num_workers=2, resources_per_worker={"CPU": 1})
    try:
        WorkerGroup.create(train_run_context=ctx, worker_group_context=wg_ctx, callbacks=[KillOne()])
    except Exception as e:  # noqa: BLE001 - what the test asserts
        seen["error"] = type(e).__name__
    return seen


def _pg_state(pg: str) -> str:
    from ray.util.placement_group import placement_group_table

    return placement_group_table().get(pg, {}).get("state", "?")


# Ray as shipped (the clean-up off: its leak shown) is slow only; the default suite
# proves the clean-up.
@pytest.mark.parametrize("clean_up", [pytest.param(True, id="with_clean_up"),
                                      pytest.param(False, id="ray_as_shipped", marks=pytest.mark.slow)])
def test_a_failed_start_shuts_its_placement_group_and_workers_down(ray_cluster, tmp_path, clean_up):
    """With the clean-up the group's placement group is removed, its other worker gone
    and another group of 2 fits; as Ray ships it, both stay (the case the clean-up is for:
    this test fails on a Ray that fixed it, and the override can go)."""
    import ray
    from ray import cloudpickle

    seen: dict = {}
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/
    host = ray.remote(num_cpus=0)(Controller).remote()
    try:
        seen = ray.get(host.start.remote(str(tmp_path), clean_up), timeout=300)
        assert seen.get("error") == "WorkerGroupStartupFailedError", seen
        if clean_up:
            deadline = time.time() + 30
            while _pg_state(seen["pg"]) != "REMOVED" and time.time() < deadline:
                time.sleep(0.2)
            assert _pg_state(seen["pg"]) == "REMOVED"
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(seen["survivor"].execute.remote(os.getpid), timeout=30)
            bundles = ray.util.placement_group([{"CPU": 1}] * 2)  # its resources are back
            assert bundles.wait(timeout_seconds=30)
            ray.util.remove_placement_group(bundles)
        else:  # the controller lives on: so do the group's placement group and worker 0
            time.sleep(5)
            assert _pg_state(seen["pg"]) == "CREATED"
            assert ray.get(seen["survivor"].execute.remote(os.getpid), timeout=60) > 0
    finally:
        ray.kill(host)
        if not clean_up and "pg" in seen:
            from ray._raylet import PlacementGroupID
            from ray.util.placement_group import PlacementGroup

            ray.util.remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(seen["pg"]))))
