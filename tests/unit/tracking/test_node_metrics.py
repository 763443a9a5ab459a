"""System metrics of every node that hosts workers (``tracking.node_metrics``): the
worker's sampler with MLflow's own monitors, the tracker's per-node series in a real
MLflow store, and (Ray) a two-node job whose run holds both nodes' metrics."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from conftest import digits_config
from helpers import local_cluster


class _Direct:
    """An actor handle stand-in: ``handle.method.remote(...)`` calls the tracker object
    in this process (the tracker's logic and the store are real; only Ray is not)."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        fn = getattr(self.obj, name)
        return type("M", (), {"remote": staticmethod(lambda *a, **k: fn(*a, **k))})()


def _history(uri: str, run_id: str, key: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    return sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, key))


def _new_run(uri: str) -> str:
    from mlflow.tracking import MlflowClient

    c = MlflowClient(uri)
    return c.create_run(c.create_experiment("node-metrics")).info.run_id


def test_a_nodes_samples_are_logged_per_node_and_continue_after_a_resubmission(mlflow_store):
    from elastic_ddp.tracking.node_metrics import NodeSampler
    from elastic_ddp.tracking.tracker import JobTracker

    run_id = _new_run(mlflow_store)
    node_id = "ab12cd34" + "e" * 48
    tracker = JobTracker(mlflow_store, run_id, flush_period_s=0.2)
    s = NodeSampler(_Direct(tracker), node_id, "10.0.0.7", interval=0.2, key=uuid.uuid4().hex)
    deadline = time.time() + 60  # the first sample waits for MLflow's import
    while s.sent < 3 and time.time() < deadline:
        time.sleep(0.1)
    s.stop()
    s.thread.join(5)
    assert s.sent >= 3 and not s.thread.is_alive()
    assert tracker.flush(30)
    key = "system/ab12cd34/cpu_utilization_percentage"
    first = _history(mlflow_store, run_id, key)
    assert first == list(range(len(first))) and len(first) >= 3
    for name in ("system_memory_usage_megabytes", "disk_usage_percentage", "network_receive_megabytes"):
        assert _history(mlflow_store, run_id, f"system/ab12cd34/{name}") == first
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(mlflow_store).get_run(run_id).data.tags
    assert tags["elastic_ddp.node.ab12cd34"] == f"{node_id} 10.0.0.7"

    # Another sender on the same node is ignored while the first one is live; a second
    # node is a series of its own.
    t = time.time()
    tracker.node_metrics("ab12cd34", "other:1", {"cpu_utilization_percentage": 1.0}, t, 0.2)
    tracker.node_metrics("ffff0000", "10.0.0.8:9", {"cpu_utilization_percentage": 2.0}, t, 0.2)
    assert tracker.flush(30)
    assert _history(mlflow_store, run_id, key) == first
    assert _history(mlflow_store, run_id, "system/ffff0000/cpu_utilization_percentage") == [0]

    # A resubmission's tracker continues each node's steps after the run's last one.
    again = JobTracker(mlflow_store, run_id, flush_period_s=0.2)
    again.node_metrics("ab12cd34", "10.0.0.7:2", {"cpu_utilization_percentage": 3.0}, time.time(), 0.2)
    assert again.flush(30)
    assert _history(mlflow_store, run_id, key) == first + [len(first)]


def test_a_sampler_that_cannot_send_stops_with_one_warning(capsys):
    from elastic_ddp.tracking.node_metrics import NodeSampler

    class Broken:
        def __getattr__(self, name):
            raise ConnectionError("tracker gone")

    s = NodeSampler(Broken(), "0123456789", "", interval=0.05, key=uuid.uuid4().hex)
    s.thread.join(60)
    assert not s.thread.is_alive() and s.sent == 0
    out = capsys.readouterr().out
    assert out.count("warning: system metrics of node 01234567 stopped (ConnectionError") == 1


def test_one_worker_of_a_node_samples_and_another_takes_over_when_it_ends():
    """Workers of one node (one process here: a lock per open file) elect one sampler
    through the node's lock file; when it stops, a waiting one takes the node over."""
    from elastic_ddp.tracking.node_metrics import NodeSampler

    class Count:
        def __init__(self):
            self.calls = []

        def node_metrics(self, *a):
            self.calls.append(a)

    key, node = uuid.uuid4().hex, "cafe0123" + "0" * 48
    a, b = Count(), Count()
    first = NodeSampler(_Direct(a), node, interval=0.2, key=key)
    second = NodeSampler(_Direct(b), node, interval=0.2, key=key)
    other = NodeSampler(_Direct(b), "beef" + "0" * 52, interval=0.2, key=key)  # another node
    deadline = time.time() + 60
    while time.time() < deadline and not (
            sum(c[0] == "cafe0123" for c in a.calls + b.calls) >= 2 and any(c[0] == "beef0000" for c in b.calls)):
        time.sleep(0.1)
    owner, waiter = (first, second) if first.lock is not None else (second, first)
    assert owner.lock is not None and waiter.lock is None and waiter.sent == 0
    assert {c[0] for c in a.calls + b.calls} == {"cafe0123", "beef0000"}
    owner.stop()
    owner.thread.join(10)
    while waiter.sent < 1 and time.time() < deadline + 30:
        time.sleep(0.1)
    assert waiter.sent >= 1
    for s in (waiter, other):
        s.stop()


# --------------------------------------------------------------------------- Ray
@pytest.mark.slow
@pytest.mark.ray
def test_a_two_node_run_holds_system_metrics_of_both_worker_nodes(digits_data, mlflow_store, tmp_path,
                                                                   monkeypatch):
    import ray

    from elastic_ddp import train
    from elastic_ddp.config import Config

    # The nodes' processes inherit it (MLflow's own knob, read by the workers' samplers).
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.5")
    if ray.is_initialized():
        ray.shutdown()
    with local_cluster(2, 2, head_cpus=1) as c:
        node_ids = sorted(n.node_id for n in c.worker_nodes)
        cfg = Config.from_dict(digits_config(digits_data, tmp_path, {
            "train": {"epochs": 1, "checkpoint_every_steps": 100, "log_every_steps": 5},
            "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 2, "torch_threads": 1},
            "run": {"name": "node-metrics", "tracking_uri": mlflow_store},
        }))
        summary = train(cfg, progress=False)
    from mlflow.tracking import MlflowClient

    run = MlflowClient(mlflow_store).get_run(summary.run_id)
    cpu = {k.split("/")[1] for k in run.data.metrics
           if k.startswith("system/") and k.endswith("/cpu_utilization_percentage") and k.count("/") == 2}
    assert cpu == {n[:8] for n in node_ids}, (cpu, node_ids)
    for n in node_ids:
        assert run.data.tags[f"elastic_ddp.node.{n[:8]}"].startswith(n)
    # The driver's own machine as before: system/<metric> without a node.
    assert "system/cpu_utilization_percentage" in run.data.metrics
    # The same job's goodput parts (driver.goodput): evaluation and checkpoint blocking
    # timed, the parts sum to the wall time; no fault, no seconds per fault.
    g = summary.goodput_parts
    assert g["eval_s"] > 0 and g["checkpoint_s"] > 0 and g["data_wait_s"] > 0, g
    assert abs(sum(v for k, v in g.items() if k != "data_wait_s") - summary.wall_s) <= 0.01 * summary.wall_s
    assert summary.lost_s_per_fault is None and "lost_s_per_fault" not in run.data.metrics
