"""A worker pod evicted as Kubernetes evicts it, on a real multi-node local Ray cluster.

Each worker node is a ``ray start --address=... --block`` process in a mount namespace
of its own (``unshare --mount``), as a pod's container is (``cluster_faults.Pod``, which
the soak's ``evict`` fault uses too). An eviction does what the
kubelet does to a pod being deleted: it runs the pod's ``preStop`` hook inside the
container (``nsenter --mount`` into the node's namespace: the shipped hook, ``elastic-ddp
drain-node --self --deadline N``), then sends SIGTERM to the container's main process
(``ray start``), then SIGKILL to whatever is left once the grace period
(``terminationGracePeriodSeconds``) has passed since the hook started.

With the hook, the eviction is a notice: the job commits a checkpoint at the next step
boundary, restarts on the spare node from it and recomputes no step; the preemption is
recorded with the node's id and ``scaling.max_failures: 0`` is not spent. Without the hook
the SIGTERM reaches ``ray start``, which on Ray 2.60 drains its own node as a preemption
for ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S`` seconds (set under the grace period, as
the manifests set it) before it stops its processes: the same notice, later.

Needs root for the mount namespaces (skipped otherwise, saying so). Slow tier: two jobs,
each paying Ray Train's start-up twice.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from conftest import digits_config
from elastic_ddp import train
from elastic_ddp.ledger import audit, format_audit
from elastic_ddp.run_state import Diagnostics
from helpers import _cluster_faults, add_node, max_step, train_ids, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.ray]

EPOCHS = 2
STEPS = 23 * EPOCHS  # ceil(1437 / 64) a epoch
GRACE_S = 45         # the pod's terminationGracePeriodSeconds
DEADLINE_S = 35      # the hook's --deadline: the grace less a margin for Ray's shutdown
# Slower steps (sleep only: the arithmetic is unchanged), so that the eviction lands
# mid-epoch on a loaded machine.
SLOW = {"rank": -1, "at_step": 0, "where": "none", "step_s": 0.3}


@pytest.fixture(scope="module")
def pods(tmp_path_factory):
    """A head (1 CPU: the driver's tasks and Ray Train's controller) and three 2-CPU pods
    (``cluster_faults.Pod``); a worker asks for 2 CPUs, so each pod holds one and the
    2-worker job has a spare. ``new_pod()``: one more."""
    faults = _cluster_faults()
    why = faults._nodisk().namespaces_unavailable()
    if why:
        pytest.skip(f"no mount namespaces here: {why}")
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    c = Cluster()
    logs = tmp_path_factory.mktemp("pod-logs")
    running: list = []

    def new_pod():
        return faults.Pod(c.address, 2, logs / f"pod-{time.time():.3f}.log", GRACE_S, DEADLINE_S)

    c.new_pod = new_pod
    try:
        add_node(c, num_cpus=1, include_dashboard=False,
                 _system_config={"enable_metrics_collection": False})
        running += [new_pod() for _ in range(3)]
        ray.init(address=c.address, logging_level="WARNING")
        wait_until(lambda: sum(n["Alive"] for n in ray.nodes()) == 4, 60)
        yield c, running
    finally:
        faults.end_running_jobs()  # a failed test's job thread first (ray.shutdown under it ends pytest)
        ray.shutdown()
        for p in running:
            p.kill()
        c.shutdown()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from elastic_ddp.data.prepare import prepare_digits

    out = tmp_path_factory.mktemp("digits-evict")
    prepare_digits(out, num_files=1, val_fraction=0.2, seed=0)
    return out


def _job(data: Path, tmp: Path, name: str, max_failures: int):
    from elastic_ddp.config import Config

    return Config.from_dict(digits_config(data, tmp, {
        "model": {"kwargs": {"hidden": 32}},
        "batch": {"global_batch_size": 64, "micro_batch_size": 32, "policy": "uneven"},
        # No periodic checkpoint inside an epoch: only the notice's can save the steps.
        "train": {"epochs": EPOCHS, "checkpoint_every_steps": 1000, "log_every_steps": 2,
                  "keep_checkpoints": 3},
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 2, "torch_threads": 1,
                    "max_failures": max_failures, "use_gpu": False, "collective_timeout_s": 30},
        "run": {"name": name},
    }))


def _worker_nodes() -> list[str]:
    import ray._private.state as state

    return sorted(info["Address"]["NodeID"] for info in state.actors(actor_state_name="ALIVE").values()
                  if info["ActorClassName"] == "RayTrainWorker" and info["Pid"])


def _evict_mid_epoch(pods, data, tmp: Path, name: str, hook: bool, max_failures: int):
    cluster, running = pods
    ledger = tmp / "ledger"
    cfg = _job(data, tmp, name, max_failures)
    result: dict = {}

    def run():
        try:
            result["summary"] = train(cfg, diagnostics=Diagnostics(ledger_dir=str(ledger), fault=SLOW),
                                      progress=False)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            result["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    wait_until(lambda: not th.is_alive() or max_step(ledger) >= 3, 300)
    assert th.is_alive(), result
    node_id = _worker_nodes()[0]
    pod = next(p for p in running if p.node_id == node_id)
    t_evict = time.time()
    evicted = pod.evict(hook=hook)
    running.remove(pod)
    print(json.dumps(evicted, indent=1))
    running.append(cluster.new_pod())  # the next job keeps its spare
    th.join(600)
    assert not th.is_alive(), "training did not finish in 10 minutes"
    if "error" in result:
        raise result["error"]
    s = result["summary"]
    print(json.dumps(s.events, indent=1, default=str))
    report = audit(ledger, train_ids(data), EPOCHS)
    print(format_audit(report))
    assert report["ok"] and s.steps == STEPS
    for ep, e in report["epochs"].items():
        assert (e["repeated"], e["lost"], e["unknown"]) == (0, 0, 0), (ep, e)
    return s, report, node_id, evicted, t_evict


def test_a_pod_evicted_with_the_prestop_hook_is_a_notice_and_costs_no_step(pods, data, tmp_path):
    s, report, node_id, evicted, t_evict = _evict_mid_epoch(pods, data, tmp_path, "evicted", True, 0)
    assert evicted["hook_rc"] == 0, evicted
    assert "no training worker left" in evicted["hook_out"], evicted
    assert evicted["hook_s"] < DEADLINE_S, evicted  # the job left before the deadline
    assert not [e for e in s.events if e["type"] == "failure"], s.events  # max_failures 0 kept
    (ev,) = [e for e in s.events if e["type"] == "preemption"]
    assert ev["node_ids"] == [node_id], ev
    assert ev["steps_recomputed"] == 0 and ev["resumed_at_step"] == ev["checkpoint_step"], ev
    assert ev["t"] < t_evict + DEADLINE_S, ev
    assert 0 < ev["checkpoint_step"] < 23, ev  # mid-epoch: the notice's own checkpoint
    assert [a["recomputed_steps"] for a in report["attempts"]] == [0, 0], report["attempts"]


def test_a_pod_evicted_without_the_hook_is_a_notice_through_rays_sigterm_drain(pods, data, tmp_path):
    """No preStop hook: SIGTERM reaches ``ray start --block``, which on Ray 2.60 drains its
    own node as a preemption for RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S seconds before it
    stops its processes (the manifests set it under the grace period): the same notice,
    0 steps recomputed, max_failures 0 kept."""
    s, report, node_id, evicted, t_evict = _evict_mid_epoch(pods, data, tmp_path, "sigterm", False, 0)
    assert not [e for e in s.events if e["type"] == "failure"], s.events
    (ev,) = [e for e in s.events if e["type"] == "preemption"]
    assert ev["node_ids"] == [node_id] and ev["steps_recomputed"] == 0, ev
    assert [a["recomputed_steps"] for a in report["attempts"]] == [0, 0], report["attempts"]
