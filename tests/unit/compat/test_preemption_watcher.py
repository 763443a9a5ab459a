"""Ray Train's preemption watcher run in the controller's process
(``compat.ray_train.host_preemption_watcher``) on a real two-node local Ray cluster: a
drain of the workers' node reaches every rank as Ray's own watcher would tell it, and no
``PreemptionWatcher`` actor process starts at the worker group's start.

Ray tier: one cluster (a head and a 2-CPU node), one Ray Train run of two workers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import local_cluster, wait_until

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    with local_cluster(1, 2, head_cpus=0) as c:  # the head: the controller's node
        yield c


def _wait_for_notice(config):
    """Each rank: says it is up, then waits (at most a minute) for the drain Ray Train's
    watcher reports to it, and writes what it got."""
    import ray.train

    from elastic_ddp.compat.ray_train import local_preemption_info

    out = Path(config["out"])
    rank = ray.train.get_context().get_world_rank()
    (out / f"up-{rank}").write_text(ray.get_runtime_context().get_node_id())
    deadline = time.time() + 60
    while (info := local_preemption_info()) is None:
        if time.time() > deadline:
            raise TimeoutError(f"rank {rank}: no drain reported in 60 s")
        time.sleep(0.05)
    (out / f"notice-{rank}.json").write_text(json.dumps({**info, "seen_t": time.time()}))


def _actor_classes() -> set[str]:
    import ray._private.state as state

    return {a["ActorClassName"] for a in state.actors().values()}


@pytest.mark.slow
def test_a_drain_reaches_every_rank_from_the_watcher_in_the_controllers_process(cluster, tmp_path, monkeypatch):
    from ray import cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from elastic_ddp.compat.ray_backend import ProcessGroupConfig
    from elastic_ddp.compat.ray_trainer import trainer_class
    from elastic_ddp.compat.versions import ray_plan

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "1")
    monkeypatch.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.2")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    trainer = trainer_class(TorchTrainer, ray_plan())(
        _wait_for_notice, train_loop_config={"out": str(tmp_path)},
        torch_config=ProcessGroupConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="watcher", storage_path=str(tmp_path / "ray")))
    result: dict = {}

    def fit():
        try:
            trainer.fit()
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread below
            result["error"] = e

    th = threading.Thread(target=fit, daemon=True)
    th.start()
    wait_until(lambda: not th.is_alive() or all((tmp_path / f"up-{r}").exists() for r in (0, 1)), 180)
    assert th.is_alive(), result
    node_id = (tmp_path / "up-0").read_text()
    assert (tmp_path / "up-1").read_text() == node_id  # both ranks on the 2-CPU node
    t_drain = time.time()
    out = subprocess.run([str(Path(sys.executable).parent / "ray"), "drain-node", "--address", cluster.address,
                          "--node-id", node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                          "--reason-message", "spot reclaim (test)", "--deadline-remaining-seconds", "120"],
                         capture_output=True, text=True, timeout=120, env={**os.environ})
    assert out.returncode == 0, out.stdout + out.stderr
    th.join(120)
    assert not th.is_alive(), "the ranks did not hear of the drain in 2 minutes"
    if "error" in result:
        raise result["error"]
    for r in (0, 1):
        got = json.loads((tmp_path / f"notice-{r}.json").read_text())
        assert got["nodes"] == [node_id] and sorted(got["ranks"]) == [0, 1], got
        assert got["deadline_t"] is not None and abs(got["deadline_t"] - (t_drain + 120)) < 10, got
        assert got["seen_t"] - t_drain < 30, got
    classes = _actor_classes()
    assert "PreemptionWatcher" not in classes and "RayTrainWorker" in classes, classes
