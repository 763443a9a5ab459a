"""A notice becomes a checkpoint, end to end, on a real multi-node local Ray cluster:
a node drained with a 20 s deadline (Ray's own ``ray drain-node --reason
DRAIN_NODE_REASON_PREEMPTION``, what the autoscaler and KubeRay call), SIGTERM to one
worker process, and SIGTERM to the ``elastic-ddp train`` driver process, each mid-epoch.

One ``ray.cluster_utils.Cluster`` per module: a head (1 CPU) and three 2-CPU worker
nodes; a worker asks for 2 CPUs, so a node holds one worker and the 2-worker job has a
spare node to restart on after a drain. Every job writes the sample ledger; each must
finish with 0 samples lost or repeated, its preemption in the recovery table with 0 steps
recomputed, ``scaling.max_failures: 0`` (a preemption does not spend it), and the
uninterrupted job's final model (``baseline``) to float tolerance.

The ``per_step`` jobs (2 torchft replicas, a step commits with 1) get SIGTERM to one
worker and a drain of one worker's node: that replica leaves its quorum after a
committed step, the other commits every step on without redoing one (the per-step audit:
no uncommitted share), and Ray replaces the one that left.

Slow tier (``-m slow``): each job pays Ray Train's start-up twice on this cluster.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import _deep_update, digits_config, mlflow_runs
from elastic_ddp.checkpoint.export import model_state
from elastic_ddp import train
from elastic_ddp.ledger import audit, format_audit
from elastic_ddp.run_state import Diagnostics
from helpers import add_node, local_cluster, ledger_files as _ledger_files, max_step, replicas_together, train_ids, wait_until

pytestmark = pytest.mark.slow

EPOCHS = 2
STEPS = 23 * EPOCHS  # ceil(1437 / 64) a epoch
# Slower steps (sleep only: the arithmetic is unchanged), so that the notice lands
# mid-epoch: the watcher polls the GCS every second.
SLOW = {"rank": -1, "at_step": 0, "where": "none", "step_s": 0.15}


def _raw(data: Path, tmp: Path, name: str) -> dict:
    return digits_config(data, tmp, {
        "model": {"kwargs": {"hidden": 32}},
        "batch": {"global_batch_size": 64, "micro_batch_size": 32, "policy": "uneven"},
        # No periodic checkpoint inside an epoch: without the one at the notice, a
        # preemption mid-epoch would recompute every step since the epoch's start.
        "train": {"epochs": EPOCHS, "checkpoint_every_steps": 1000, "log_every_steps": 2,
                  "keep_checkpoints": 3},
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 2, "torch_threads": 1,
                    "max_failures": 0, "use_gpu": False, "collective_timeout_s": 30},
        "run": {"name": name},
    })


def _job(data: Path, tmp: Path, name: str):
    from elastic_ddp.config import Config

    return Config.from_dict(_raw(data, tmp, name))


@pytest.fixture(scope="module")
def cluster():
    """Head (1 CPU) + three 2-CPU worker nodes (``helpers.local_cluster``); the driver
    connects to it. Torn down with the module so no raylet outlives it."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    with local_cluster(3, 2, head_cpus=1) as c:
        yield c


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from elastic_ddp.data.prepare import prepare_digits

    out = tmp_path_factory.mktemp("digits-preempt")
    prepare_digits(out, num_files=1, val_fraction=0.2, seed=0)
    return out


@pytest.fixture(scope="module")
def baseline(cluster, data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("baseline")
    s = train(_job(data, tmp, "baseline"), diagnostics=Diagnostics(ledger_dir=str(tmp / "ledger")),
              progress=False)
    assert s.restarts == 0 and s.steps == STEPS
    return s


def _workers() -> list[dict]:
    """This cluster's live Ray Train workers: pid and node id (GCS actor table)."""
    import ray._private.state as state

    out = []
    for info in state.actors(actor_state_name="ALIVE").values():
        if info["ActorClassName"] == "RayTrainWorker" and info["Pid"]:
            out.append({"pid": int(info["Pid"]), "node_id": info["Address"]["NodeID"]})
    return out


def _check(summary, baseline, ledger: Path, data: Path, source: str) -> dict:
    """The job finished exactly: the ledger clean, one preemption of ``source`` with 0
    steps recomputed (in the summary and the MLflow run's recovery table), the restart
    resumed from the checkpoint at the notice, the baseline's final model."""
    report = audit(ledger, train_ids(data), EPOCHS)
    print(format_audit(report))
    for ep, e in report["epochs"].items():
        assert (e["repeated"], e["lost"], e["unknown"]) == (0, 0, 0), (ep, e)
    assert report["ok"] and summary.steps == STEPS
    (ev,) = [e for e in summary.events if e["type"] == "preemption"]
    print(json.dumps(ev, indent=1, default=str))
    assert not [e for e in summary.events if e["type"] == "failure"], summary.events
    assert ev["source"] == source and ev["decision"] == "RETRY", ev
    assert ev["steps_recomputed"] == 0 and ev["resumed_at_step"] == ev["checkpoint_step"], ev
    assert 0 < ev["checkpoint_step"] < 23, ev  # mid-epoch 0
    attempts = report["attempts"]
    assert [a["resumed_from"] for a in attempts] == [0, ev["checkpoint_step"]], attempts
    assert attempts[0]["recomputed_steps"] == 0, attempts
    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory() as d:
        rows = json.loads(Path(MlflowClient(summary.tracking_uri).download_artifacts(
            summary.run_id, "events/recovery.json", d)).read_text())
    rows = rows if isinstance(rows, list) else [dict(zip(rows["columns"], r)) for r in rows["data"]]
    assert [(r["type"], r["steps_recomputed"]) for r in rows] == [("preemption", 0)], rows
    got, ref = model_state(summary.checkpoint_path), model_state(baseline.checkpoint_path)
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.allclose(got[k].float(), ref[k].float(), rtol=1e-5, atol=1e-6), k
    return ev


def _in_thread(fn):
    result: dict = {}

    def run():
        try:
            result["summary"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            result["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, result


def _finished(th, result):
    """The summary of the job running in ``th`` (``_in_thread``), once it ends (10
    minutes at most); its error re-raised here. Prints its events."""
    th.join(600)
    assert not th.is_alive(), "training did not finish in 10 minutes"
    if "error" in result:
        raise result["error"]
    s = result["summary"]
    print(json.dumps(s.events, indent=1, default=str))
    return s


def _drain(cluster, node_id: str, deadline_s: int) -> None:
    """``ray drain-node`` of ``node_id`` with a ``deadline_s`` deadline, as the autoscaler
    and KubeRay drain a node before a preemption."""
    out = subprocess.run([str(Path(sys.executable).parent / "ray"), "drain-node", "--address", cluster.address,
                          "--node-id", node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                          "--reason-message", "spot reclaim (test)", "--deadline-remaining-seconds",
                          str(deadline_s)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_node_drained_with_a_20s_deadline_mid_epoch_costs_no_step(cluster, data, baseline, tmp_path):
    """The node of one worker is drained with a 20 s deadline (and removed when it
    passes, as a cloud would): every rank learns it at a step boundary, the checkpoint
    there is committed, and the job restarts on the spare node from it."""
    ledger = tmp_path / "ledger"
    cfg = _job(data, tmp_path, "drained")
    th, result = _in_thread(lambda: train(cfg, diagnostics=Diagnostics(ledger_dir=str(ledger), fault=SLOW),
                                          progress=False))
    wait_until(lambda: not th.is_alive() or max_step(ledger) >= 5, 300)
    assert th.is_alive(), result
    node_id = sorted(w["node_id"] for w in _workers())[0]
    t_drain = time.time()
    _drain(cluster, node_id, 20)
    # The reclaim: the node goes when its deadline passes.
    wait_until(lambda: time.time() > t_drain + 20, 60)
    node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
    cluster.remove_node(node)
    th.join(600)
    assert not th.is_alive(), "training did not finish in 10 minutes"
    if "error" in result:
        raise result["error"]
    ev = _check(result["summary"], baseline, ledger, data, "drain")
    assert ev["notice_lead_s"] is not None and 0 < ev["notice_lead_s"] <= 20, ev
    assert ev["node_ids"] == [node_id], ev
    assert ev["t"] < t_drain + 20, ev  # committed before the deadline
    add_node(cluster, num_cpus=2)  # the module's next jobs keep their spare node


def test_an_elastic_job_without_a_spare_node_shrinks_before_the_drained_node_goes(
        cluster, data, baseline, tmp_path):
    """Two worker nodes, an elastic job (1 to 2 workers): one worker's node is drained
    with a 60 s deadline. The checkpoint at the notice is committed and the job restarts
    at world size 1 on the other node at once, not once the drained node is gone: Ray
    Train's view of the nodes still lists it, so a restart sized by that view asks for a
    worker there and waits (``compat.ray_scaling.count_usable_nodes_only``)."""
    spare = next(n for n in cluster.worker_nodes)
    cluster.remove_node(spare)
    ledger = tmp_path / "ledger"
    raw = _raw(data, tmp_path, "drained-elastic")
    raw["scaling"].update(min_workers=1, resize_monitor_interval_s=5)
    from elastic_ddp.config import Config

    cfg = Config.from_dict(raw)
    node = None
    try:
        th, result = _in_thread(lambda: train(cfg, diagnostics=Diagnostics(ledger_dir=str(ledger), fault=SLOW),
                                              progress=False))
        wait_until(lambda: not th.is_alive() or max_step(ledger) >= 5, 300)
        assert th.is_alive(), result
        node_id = sorted(w["node_id"] for w in _workers())[0]
        node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
        t_drain = time.time()
        _drain(cluster, node_id, 60)
        th.join(max(0.0, t_drain + 60 - time.time()))
        cluster.remove_node(node)  # the deadline: the node goes
        node = None
        s = _finished(th, result)
        ev = _check(s, baseline, ledger, data, "drain")
        assert ev["node_ids"] == [node_id] and ev["world_size_after"] == 1, ev
        # At once, not after the deadline (60 s) and a placement timeout (25 s).
        assert ev["recovery_s"] < 30, ev
    finally:
        if node is not None:
            cluster.remove_node(node)
        while len(cluster.worker_nodes) < 3:  # the module's next jobs keep their spare node
            add_node(cluster, num_cpus=2)


def test_sigterm_to_one_worker_is_checkpointed_before_it_exits(cluster, data, baseline, tmp_path):
    """One worker process gets SIGTERM (a Kubernetes eviction): it lives until the
    checkpoint at the next boundaries is committed, then the job restarts from it."""
    ledger = tmp_path / "ledger"
    cfg = _job(data, tmp_path, "sigterm")
    th, result = _in_thread(lambda: train(cfg, diagnostics=Diagnostics(ledger_dir=str(ledger), fault=SLOW),
                                          progress=False))
    wait_until(lambda: not th.is_alive() or max_step(ledger) >= 5, 300)
    assert th.is_alive(), result
    pid = sorted(w["pid"] for w in _workers())[-1]
    os.kill(pid, signal.SIGTERM)
    t_term = time.time()
    gone = None
    while gone is None and time.time() < t_term + 120:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            gone = time.time()
        time.sleep(0.05)
    assert gone is not None, "the SIGTERMed worker never exited"
    th.join(600)
    assert not th.is_alive(), "training did not finish in 10 minutes"
    if "error" in result:
        raise result["error"]
    ev = _check(result["summary"], baseline, ledger, data, "sigterm")
    # It stayed alive until the checkpoint at the notice was complete on storage.
    manifest = Path(cfg.run.storage_path) / "sigterm" / f"checkpoint_step{ev['checkpoint_step']:08d}" / "manifest.json"
    assert manifest.is_file() and manifest.stat().st_mtime <= gone, (manifest, gone)
    assert ev["notice_lead_s"] is None and len(ev["noticed_ranks"]) == 1, ev


# ---------------------------------------------------------------------- per-step mode
PER_STEP = {"scaling": {"fault_tolerance": "per_step", "min_workers": 1, "max_workers": 2,
                        "health_check_interval_s": 0.2}}


def _per_step_job(data: Path, tmp: Path, name: str):
    from elastic_ddp.config import Config

    return Config.from_dict(_deep_update(_raw(data, tmp, name), PER_STEP))


def _check_per_step(summary, baseline, ledger: Path, data: Path, source: str) -> dict:
    """A per-step job that one replica left on a notice finished exactly: the per-step
    audit clean with no step redone, one preemption of ``source`` (RETRY, left the
    quorum, 0 steps recomputed, in the summary and the MLflow run's recovery table), the
    leaver's last commit the step it left after, the survivor committing every step
    through the leave, the baseline's final model. Returns the event, with the
    survivor's gap around the leave as ``survivor_gap_s``."""
    report = audit(ledger, train_ids(data), EPOCHS)
    print(format_audit(report))
    for ep, e in report["epochs"].items():
        assert (e["repeated"], e["lost"], e["unknown"], e["steps"]) == (0, 0, 0, STEPS // EPOCHS), (ep, e)
    assert report["ok"] and not report["problems"], report["problems"]
    assert report["uncommitted_attempts"] == 0, report["uncommitted_attempts"]  # no step redone
    assert summary.steps == STEPS
    (ev,) = [e for e in summary.events if e["type"] == "preemption"]
    print(json.dumps(ev, indent=1, default=str))
    assert not [e for e in summary.events if e["type"] == "failure"], summary.events
    assert ev["source"] == source and ev["decision"] == "RETRY" and ev["left_quorum"], ev
    step = ev["left_after_step"]
    assert 0 < step < STEPS and (ev["resumed_at_step"], ev["steps_recomputed"]) == (step, 0), ev
    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory() as d:
        rows = json.loads(Path(MlflowClient(summary.tracking_uri).download_artifacts(
            summary.run_id, "events/recovery.json", d)).read_text())
    rows = rows if isinstance(rows, list) else [dict(zip(rows["columns"], r)) for r in rows["data"]]
    assert [(r["type"], r["steps_recomputed"]) for r in rows] == [("preemption", 0)], rows
    # Three replica processes: the one that left, its replacement, and the survivor.
    files = _ledger_files(ledger)
    (rank,) = ev["noticed_ranks"]
    commits = [(h, [r for r in recs if "commit" in r]) for h, recs in files]
    left_t = ev["noticed_t"] + ev["notice_to_leave_s"]
    (leaver,) = [c for h, c in commits if h["rank"] == rank and h["t"] < left_t]
    assert leaver[-1]["commit"] == step, leaver[-3:]
    (survivor,) = [c for h, c in commits if h["rank"] != rank]
    mine = [c["commit"] for c in survivor]
    assert mine == list(range(mine[0], STEPS + 1)) and mine[0] < step, mine[:5]
    before = max(c["t"] for c in survivor if c["commit"] <= step)
    after = min(c["t"] for c in survivor if c["commit"] > step)
    ev["survivor_gap_s"] = after - before
    (replacement,) = [c for h, c in commits if h["rank"] == rank and h["t"] > left_t]
    assert replacement and replacement[-1]["commit"] == STEPS, replacement[-2:]
    got, ref = model_state(summary.checkpoint_path), model_state(baseline.checkpoint_path)
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.allclose(got[k].float(), ref[k].float(), rtol=1e-5, atol=1e-6), \
            (k, float((got[k].float() - ref[k].float()).abs().max()))
    return ev


def test_per_step_sigterm_to_one_worker_leaves_the_quorum_after_a_committed_step(cluster, data, baseline, tmp_path):
    """Per-step mode: one worker process gets SIGTERM: its replica takes part in one more
    step and leaves the quorum after it; the other replica commits every step through it
    without redoing one, and Ray replaces the one that left, which heals and joins."""
    ledger = tmp_path / "ledger"
    cfg = _per_step_job(data, tmp_path, "ps-sigterm")
    # 1 s steps: the survivor still trains when the replacement has started, healed and
    # joined (8-10 s after the leave). With 0.15 s steps on a quiet machine the survivor
    # trained the job's last 37 steps in 9 s, and no replacement joined before the end.
    slow = {**SLOW, "step_s": 1.0}
    th, result = _in_thread(lambda: train(cfg, diagnostics=Diagnostics(ledger_dir=str(ledger), fault=slow),
                                          progress=False))
    wait_until(lambda: not th.is_alive() or replicas_together(ledger), 300)
    assert th.is_alive(), result
    pid = sorted(w["pid"] for w in _workers())[-1]
    os.kill(pid, signal.SIGTERM)
    th.join(600)
    assert not th.is_alive(), "training did not finish in 10 minutes"
    if "error" in result:
        raise result["error"]
    ev = _check_per_step(result["summary"], baseline, ledger, data, "sigterm")
    assert ev["notice_lead_s"] is None and ev["notice_to_leave_s"] < 5, ev
    print(f"[per_step sigterm] the survivor's gap around the leave: {ev['survivor_gap_s']:.2f} s "
          f"(a step: >= {slow['step_s']} s)")


def test_per_step_a_node_drained_with_a_20s_deadline_loses_its_replica_at_a_step_boundary(
        cluster, data, baseline, tmp_path):
    """Per-step mode: the node of one worker is drained with a 20 s deadline (and removed
    when it passes): that replica sees the drain (its own poll of the GCS), leaves the
    quorum after a committed step well before the deadline, the other trains on alone,
    and the replacement starts on the spare node once the drained node is gone, heals
    and joins."""
    ledger = tmp_path / "ledger"
    cfg = _per_step_job(data, tmp_path, "ps-drained")
    # 1 s steps: the survivor still trains when the replacement starts, after the deadline
    # (the drained node holds the replica's placement-group bundle until it is gone).
    slow = {**SLOW, "step_s": 1.0}
    th, result = _in_thread(lambda: train(cfg, diagnostics=Diagnostics(ledger_dir=str(ledger), fault=slow),
                                          progress=False))
    wait_until(lambda: not th.is_alive() or replicas_together(ledger), 300)
    assert th.is_alive(), result
    node_id = sorted(w["node_id"] for w in _workers())[0]
    t_drain = time.time()
    _drain(cluster, node_id, 20)
    wait_until(lambda: time.time() > t_drain + 20, 60)
    node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
    cluster.remove_node(node)
    th.join(600)
    assert not th.is_alive(), "training did not finish in 10 minutes"
    if "error" in result:
        raise result["error"]
    ev = _check_per_step(result["summary"], baseline, ledger, data, "drain")
    assert ev["notice_lead_s"] is not None and 0 < ev["notice_lead_s"] <= 20, ev
    assert ev["node_ids"] == [node_id], ev
    assert ev["noticed_t"] + ev["notice_to_leave_s"] < t_drain + 20, ev  # left before the deadline
    print(f"[per_step drain] the survivor's gap around the leave: {ev['survivor_gap_s']:.2f} s; "
          f"left {ev['notice_to_leave_s']:.1f} s after the notice, {ev['notice_lead_s']:.1f} s before the deadline")
    add_node(cluster, num_cpus=2)  # the module's next jobs keep their spare node


DRIVER = textwrap.dedent("""
    import functools, sys
    from elastic_ddp.driver import launcher
    from elastic_ddp.run_state import Diagnostics

    # The CLI as it is, with the sample ledger of the tests (a production job has none).
    launcher.train = functools.partial(launcher.train, diagnostics=Diagnostics(
        ledger_dir=sys.argv[2], fault={"rank": -1, "at_step": 0, "where": "none", "step_s": 0.15}))
    from elastic_ddp.driver.cli import main
    sys.exit(main(["train", sys.argv[1], "--no-progress"]))
""")


def _stopped_driver(cluster, raw: dict, tmp: Path, ledger: Path, ready) -> tuple[list, dict]:
    """``elastic-ddp train`` on ``raw`` (the CLI in a subprocess, with the test ledger),
    SIGTERMed once ``ready()``: exit 143 after a checkpoint, the MLflow run KILLED.
    Returns the command and environment that run it again."""
    cfg_file = tmp / "job.yaml"
    cfg_file.write_text(yaml.safe_dump(raw))
    script = tmp / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "RAY_ADDRESS": cluster.address, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, str(script), str(cfg_file), str(ledger)]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: p.poll() is not None or ready(), 300)
    assert p.poll() is None, p.communicate()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=300)
    print(out[-3000:], err[-3000:])
    assert p.returncode == 143, (p.returncode, err[-3000:])
    assert "stopped on SIGTERM at a checkpoint" in err and "run the same command to resume" in err, err
    (run,) = mlflow_runs(tmp)
    assert run.info.status == "KILLED"
    return cmd, env


def _resumed_driver(cmd: list, env: dict, tmp: Path, ledger: Path, data: Path, baseline, name: str) -> dict:
    """The same command again: exit 0, the same MLflow run FINISHED, every sample once
    per epoch, the newest checkpoint the baseline's model. Returns the ledger audit."""
    (run,) = mlflow_runs(tmp)
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    print(again.stdout[-3000:], again.stderr[-3000:])
    assert again.returncode == 0, again.stderr[-3000:]
    (run2,) = mlflow_runs(tmp)
    assert run2.info.run_id == run.info.run_id and run2.info.status == "FINISHED"
    report = audit(ledger, train_ids(data), EPOCHS)
    print(format_audit(report))
    assert report["ok"] and all((e["repeated"], e["lost"]) == (0, 0) for e in report["epochs"].values()), \
        report["epochs"]
    ckpts = sorted((tmp / "ray_results" / name).glob("checkpoint_step*"))
    got, ref = model_state(ckpts[-1]), model_state(baseline.checkpoint_path)
    for k in ref:
        assert torch.allclose(got[k].float(), ref[k].float(), rtol=1e-5, atol=1e-6), k
    return report


def test_sigterm_to_the_driver_stops_at_a_checkpoint_and_the_same_command_resumes(
        cluster, data, baseline, tmp_path):
    """SIGTERM to ``elastic-ddp train`` (a Ray job being stopped): exit 143 after the
    checkpoint at the next step boundaries, the MLflow run KILLED; the same command then
    resumes it in the same run with no step recomputed and finishes exactly."""
    ledger = tmp_path / "ledger"
    cmd, env = _stopped_driver(cluster, _raw(data, tmp_path, "driver"), tmp_path, ledger,
                               lambda: max_step(ledger) >= 5)
    stopped_at = max_step(ledger)
    assert 0 < stopped_at < 23, stopped_at
    report = _resumed_driver(cmd, env, tmp_path, ledger, data, baseline, "driver")
    attempts = report["attempts"]
    assert [a["resumed_from"] for a in attempts] == [0, stopped_at], attempts
    assert attempts[0]["recomputed_steps"] == 0, attempts


def test_per_step_sigterm_to_the_driver_stops_every_replica_at_one_step_and_resumes(
        cluster, data, baseline, tmp_path):
    """Per-step mode: SIGTERM to ``elastic-ddp train``: the stop rides in a step's
    all-reduce, both replicas commit the checkpoint of that same step and stop; exit 143,
    the MLflow run KILLED; the same command resumes in the same run from that step,
    recomputing none, and ends on the baseline's model with a clean per-step audit."""
    ledger = tmp_path / "ledger"
    cmd, env = _stopped_driver(cluster, _deep_update(_raw(data, tmp_path, "ps-driver"), PER_STEP), tmp_path,
                               ledger, lambda: replicas_together(ledger) and max_step(ledger) >= 5)
    # Both replicas' last commit is the step the stop rode in, the newest checkpoint's.
    last = {h["rank"]: max(r["commit"] for r in recs if "commit" in r) for h, recs in _ledger_files(ledger)}
    assert len(last) == 2 and len(set(last.values())) == 1, last
    stopped_at = next(iter(last.values()))
    assert 0 < stopped_at < STEPS, stopped_at
    ckpts = sorted((tmp_path / "ray_results" / "ps-driver").glob("checkpoint_step*"))
    assert ckpts and ckpts[-1].name == f"checkpoint_step{stopped_at:08d}", ckpts
    report = _resumed_driver(cmd, env, tmp_path, ledger, data, baseline, "ps-driver")
    assert not report["problems"] and not report["recomputed_steps"], report


def test_per_step_a_fault_after_a_replacement_names_the_replacement(cluster, data, tmp_path):
    """Per-step mode, two faults in a row: one worker gets SIGTERM (its replica leaves and
    Ray replaces it alone, no worker-group restart), then the replacement is SIGKILLed.
    The second fault's event names the replacement (its pid and node), not the worker it
    replaced: the controller's worker list follows a replica replaced alone."""
    ledger = tmp_path / "ledger"
    raw = _deep_update(_raw(data, tmp_path, "ps-twice"), PER_STEP)
    cfg = __import__("elastic_ddp.config", fromlist=["Config"]).Config.from_dict(
        _deep_update(raw, {"train": {"epochs": 4}, "scaling": {"max_failures": 3}}))
    slow = {**SLOW, "step_s": 0.5}
    th, result = _in_thread(lambda: train(cfg, diagnostics=Diagnostics(ledger_dir=str(ledger), fault=slow),
                                          progress=False))
    wait_until(lambda: not th.is_alive() or replicas_together(ledger), 300)
    assert th.is_alive(), result
    first = {w["pid"]: w["node_id"] for w in _workers()}
    pid = sorted(first)[-1]
    os.kill(pid, signal.SIGTERM)
    t_term = time.time()

    # The replacement has committed 3 steps with the survivor.
    wait_until(lambda: not th.is_alive() or replicas_together(ledger, k=3, files=1, since=t_term), 300)
    assert th.is_alive(), result
    (new_pid, new_node), = [(p, n) for p, n in ((w["pid"], w["node_id"]) for w in _workers()) if p not in first]
    os.kill(new_pid, signal.SIGKILL)
    s = _finished(th, result)
    (pre,) = [e for e in s.events if e["type"] == "preemption"]
    assert pre["node_ids"] == [first[pid]], pre
    (fail,) = [e for e in s.events if e["type"] == "failure"]
    assert fail.get("pid") == new_pid, fail
    assert fail.get("cause_kind") == "died" and fail.get("signal") == "SIGKILL", fail
    assert fail.get("cause_rank") == pre["noticed_ranks"][0], (fail, pre)
    report = audit(ledger, train_ids(data), 4)
    print(format_audit(report))
    assert report["ok"] and not report["problems"], report["problems"]


def test_per_step_sigterm_to_the_last_live_replica_checkpoints_before_it_leaves(cluster, data, baseline, tmp_path):
    """Per-step mode: one replica is SIGKILLed and the survivor, alone in its quorum while
    Ray starts the replacement, gets SIGTERM. The live state would leave with it, so it
    commits a checkpoint of its last step before it leaves (a partial quorum's: written
    to storage unreported); the new replicas resume there, no step after it redone."""
    from elastic_ddp.checkpoint import MANIFEST, checkpoint_name
    from elastic_ddp.config import Config

    ledger = tmp_path / "ledger"
    cfg = Config.from_dict(_deep_update(_deep_update(_raw(data, tmp_path, "ps-last"), PER_STEP),
                                        {"scaling": {"max_failures": 3}}))
    th, result = _in_thread(lambda: train(cfg, diagnostics=Diagnostics(ledger_dir=str(ledger), fault=SLOW),
                                          progress=False))
    wait_until(lambda: not th.is_alive() or replicas_together(ledger), 300)
    assert th.is_alive(), result
    victim, last = sorted(w["pid"] for w in _workers())
    os.kill(victim, signal.SIGKILL)
    t_kill = time.time()

    def alone() -> bool:  # the survivor committed a step in a quorum of itself alone
        return any(r.get("n") == 1 and r.get("t", 0) > t_kill for h, recs in _ledger_files(ledger)
                   for r in recs if "commit" in r)

    wait_until(lambda: not th.is_alive() or alone(), 120)
    assert th.is_alive(), result
    os.kill(last, signal.SIGTERM)
    s = _finished(th, result)
    (pre,) = [e for e in s.events if e["type"] == "preemption"]
    step = pre["left_after_step"]
    assert pre["source"] == "sigterm" and 0 < step < STEPS, pre
    assert (pre["resumed_at_step"], pre["steps_recomputed"]) == (step, 0), pre
    manifest = json.loads((Path(cfg.run.storage_path) / cfg.run.name / checkpoint_name(step) / MANIFEST).read_text())
    assert manifest["step"] == step and manifest["reported"] is False, manifest
    report = audit(ledger, train_ids(data), EPOCHS)
    print(format_audit(report))
    for ep, e in report["epochs"].items():
        assert (e["repeated"], e["lost"], e["unknown"], e["steps"]) == (0, 0, 0, STEPS // EPOCHS), (ep, e)
    assert report["ok"] and not report["problems"], report["problems"]
    # No commit of a step at or before the leave after it: the new replicas began past it.
    after = [r["commit"] for h, recs in _ledger_files(ledger) if h["t"] > t_kill for r in recs
             if "commit" in r and r["t"] > pre["noticed_t"] + pre["notice_to_leave_s"]]
    assert after and min(after) == step + 1, sorted(after)[:5]
    assert s.steps == STEPS
    got, ref = model_state(s.checkpoint_path), model_state(baseline.checkpoint_path)
    for k in ref:
        assert torch.allclose(got[k].float(), ref[k].float(), rtol=1e-5, atol=1e-6), k
