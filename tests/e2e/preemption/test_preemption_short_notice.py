"""A notice too short for its checkpoint: SIGTERM to a worker, then SIGKILL 0.2 s later
(a Kubernetes eviction with a short grace period), before the step boundary and the
checkpoint at the notice can complete. The job falls back to the newest checkpoint,
recomputes the steps after it, and says so: a ``preemption`` event marked ``fell_back``
(the steps recomputed in the recovery table, the notice-to-kill time), charged to the
preemption budget (``scaling.max_failures: 0`` does not stop it), and a console warning.

Without Ray: a real process gets the two signals and leaves its notice in its position
record; Ray Train's own failure policy and the controller's events decide on it. With a
real multi-node local Ray cluster: the whole job (``slow``: it pays Ray Train's start-up
twice).
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

from conftest import digits_config
from elastic_ddp import notice
from helpers import local_cluster, max_step, train_ids, wait_until

NODE = "a" * 56

RANK = textwrap.dedent("""
    import sys, time
    from types import SimpleNamespace
    import torch
    from elastic_ddp.positions import Position
    from elastic_ddp.worker.notice import NoticeListener, install_sigterm_handler

    position = Position(1, "job", node=sys.argv[1])
    position.at("training step", 12, 0)       # computing step 12
    NoticeListener(SimpleNamespace(rank=1, world_size=2, device=torch.device("cpu"),
                                   position=position), install=False)
    install_sigterm_handler()                 # this process's main thread, as in a Ray worker
    print("ready", flush=True)
    time.sleep(60)
""")


def _sigterm_then_sigkill(tmp_path: Path, grace_s: float = 0.2) -> tuple[int, float, float]:
    """A real rank process (position record on node ``NODE``, the SIGTERM handler of a
    worker) given SIGTERM and, ``grace_s`` later, SIGKILL: (pid, t_term, t_kill)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    p = subprocess.Popen([sys.executable, str(script), NODE], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.stdout.readline().strip() == "ready"
    t_term = time.time()
    p.send_signal(signal.SIGTERM)
    time.sleep(grace_s)
    t_kill = time.time()
    p.send_signal(signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL  # the first SIGTERM did not end it
    return p.pid, t_term, t_kill


def test_a_sigterm_is_in_the_position_record_of_a_rank_killed_right_after(tmp_path):
    from elastic_ddp.positions import read_position

    pid, t_term, t_kill = _sigterm_then_sigkill(tmp_path)
    rec = read_position(NODE, pid, remove=False)
    assert rec is not None and (rec["rank"], rec["step"], rec["phase"]) == (1, 12, "training step"), rec
    assert t_term <= rec["notices"]["sigterm"] <= t_kill, (rec, t_term, t_kill)
    assert read_position(NODE, pid) is not None and read_position(NODE, pid) is None  # read, removed


@pytest.fixture()
def policy_rule():
    """Ray Train's failure-policy rule as the controller installs it, put back to the
    notices-only rule afterwards (it is process-wide)."""
    from elastic_ddp.compat.ray_train import count_notices_as_preemptions

    yield
    count_notices_as_preemptions(lambda e: notice.preempted_in(e) is not None)


def test_a_rank_killed_after_its_notice_is_a_preemption_that_fell_back(tmp_path, policy_rule):
    """Ray Train's failure policy charges it to the preemption budget (max_failures=0
    retries it); the controller records a ``fell_back`` preemption naming the rank, the
    notice-to-kill time and the step the rank had reached, and a console warning."""
    from ray.exceptions import ActorDiedError
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
    from ray.train.v2._internal.execution.failure_handling.default import DefaultFailurePolicy
    from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
    from ray.train.v2.api.config import FailureConfig
    from ray.train.v2.api.exceptions import WorkerGroupError

    from conftest import InProcess
    from elastic_ddp.compat.ray_train import count_notices_as_preemptions
    from elastic_ddp.controller.events import ElasticEvents
    from elastic_ddp.controller.lifecycle import ControllerEvents
    from elastic_ddp.tracking import JobTracker

    pid, t_term, t_kill = _sigterm_then_sigkill(tmp_path)
    tracker = JobTracker(f"sqlite:///{tmp_path / 'mlflow.db'}")  # unbound: in memory only
    events = ElasticEvents(InProcess(tracker), preemption=True)
    events.workers = {0: {"node_id": "b" * 56, "node_ip": "10.0.0.1", "pid": 11},
                      1: {"node_id": NODE, "node_ip": "10.0.0.2", "pid": pid}}
    ctrl = ControllerEvents(events)
    # The preemption rule ControllerEvents.after_controller_start installs (not the call
    # itself: its other patches are process-wide, and tests/unit/controller/test_events.py checks Ray's
    # behaviour without them).
    count_notices_as_preemptions(lambda e: notice.preempted_in(e) is not None, events.died_after_notice)
    events.after_report(None, [{"step": 10}] * 2, None)
    errors = {1: ActorDiedError(),   # the killed rank; its peer's collateral error
              0: UserExceptionWithTraceback(RuntimeError("Connection closed by peer"), "tb")}
    got = DefaultFailurePolicy(FailureConfig(max_failures=0, max_preemption_failures=-1)
                               ).make_decision(WorkerGroupError("x", errors))
    assert got == FailureDecision.RETRY  # the preemption budget, not max_failures
    events.after_exception(None, errors)
    ctrl.before_controller_execute_failure_decision(got)
    (ev,) = tracker.events
    assert ev["type"] == "preemption" and ev["source"] == "sigterm" and ev["fell_back"], ev
    assert ev["noticed_ranks"] == [1] and ev["nodes"] == ["10.0.0.2"], ev
    assert t_term <= ev["noticed_t"] <= t_kill and ev["last_step_seen"] == 11, ev
    assert "too little notice" in ev["cause"] and "sigterm notice on rank(s) [1]" in ev["cause"], ev
    (warning,) = tracker.get_notices()
    assert "too little notice" in warning["message"] and "recomputed" in warning["message"], warning
    # Another death without a notice stays a failure: max_failures=0 stops it.
    events.workers[1]["pid"] = 999_999_999
    plain = {1: ActorDiedError()}
    assert DefaultFailurePolicy(FailureConfig(max_failures=0)).make_decision(
        WorkerGroupError("y", plain)) == FailureDecision.RAISE


# ------------------------------------------------------------- a real job on a cluster
STEP_S = 0.3  # a step's boundary and the checkpoint at a notice need more than the 0.2 s
EPOCHS, STEPS, EVERY = 2, 46, 5  # ceil(1437 / 64) = 23 steps an epoch; a checkpoint every 5


@pytest.fixture(scope="module")
def cluster():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    with local_cluster(2, 2) as c:  # a worker asks for 2 CPUs: one per node
        yield c


@pytest.mark.slow
def test_sigterm_then_sigkill_falls_back_to_the_newest_checkpoint_and_says_so(
        cluster, digits_data, tmp_path, capsys):
    import ray._private.state as state
    from mlflow.tracking import MlflowClient

    from elastic_ddp.config import Config
    from elastic_ddp import train
    from elastic_ddp.ledger import audit, format_audit
    from elastic_ddp.run_state import Diagnostics

    notice.clear()
    ledger = tmp_path / "ledger"
    cfg = Config.from_dict(digits_config(digits_data, tmp_path, {
        "model": {"kwargs": {"hidden": 32}},
        "batch": {"global_batch_size": 64, "micro_batch_size": 32, "policy": "uneven"},
        "train": {"epochs": EPOCHS, "checkpoint_every_steps": EVERY, "log_every_steps": 2},
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 2, "torch_threads": 1,
                    "max_failures": 0, "use_gpu": False, "collective_timeout_s": 30},
        "run": {"name": "short-notice"}}))
    sent: dict = {}

    def evict():
        """Two steps or more past a checkpoint: SIGTERM one worker, SIGKILL it 0.2 s later."""
        try:
            wait_until(lambda: (s := max_step(ledger)) >= EVERY + 2 and s % EVERY in (2, 3), 300)
            pid = max(int(a["Pid"]) for a in state.actors(actor_state_name="ALIVE").values()
                      if a["ActorClassName"] == "RayTrainWorker" and a["Pid"])
            sent.update(pid=pid, step=max_step(ledger), t_term=time.time())
            os.kill(pid, signal.SIGTERM)
            time.sleep(0.2)
            sent["t_kill"] = time.time()
            os.kill(pid, signal.SIGKILL)
        except BaseException as e:  # noqa: BLE001 - asserted in the test's thread
            sent["error"] = e

    th = threading.Thread(target=evict, daemon=True)
    th.start()
    summary = train(cfg, diagnostics=Diagnostics(ledger_dir=str(ledger), fault={
        "rank": -1, "at_step": 0, "where": "none", "step_s": STEP_S}), progress=False)
    th.join(30)
    err = capsys.readouterr().err
    assert "error" not in sent and "t_kill" in sent, sent
    report = audit(ledger, train_ids(digits_data), EPOCHS)
    print(format_audit(report))
    assert report["ok"] and summary.steps == STEPS
    for ep, e in report["epochs"].items():
        assert (e["repeated"], e["lost"], e["unknown"]) == (0, 0, 0), (ep, e)
    assert not [e for e in summary.events if e["type"] == "failure"], summary.events
    (ev,) = [e for e in summary.events if e["type"] == "preemption"]
    print(json.dumps(ev, indent=1, default=str))
    assert ev["source"] == "sigterm" and ev["fell_back"] and ev["decision"] == "RETRY", ev
    assert len(ev["noticed_ranks"]) == 1 and 0 < ev["notice_to_death_s"] < 5, ev
    # The newest checkpoint, not one at the notice: the steps after it were recomputed.
    assert ev["resumed_at_step"] % EVERY == 0 and ev["resumed_at_step"] <= sent["step"], (ev, sent)
    assert ev["steps_recomputed"] > 0, ev
    attempts = report["attempts"]
    assert [a["resumed_from"] for a in attempts] == [0, ev["resumed_at_step"]], attempts
    assert attempts[0]["recomputed_steps"] == ev["steps_recomputed"], attempts
    # Said on the console and in the run's recovery table.
    assert "elastic-ddp: warning: sigterm notice on rank(s)" in err and "too little notice" in err, err[-3000:]
    with tempfile.TemporaryDirectory() as d:
        rows = json.loads(Path(MlflowClient(summary.tracking_uri).download_artifacts(
            summary.run_id, "events/recovery.json", d)).read_text())
    rows = rows if isinstance(rows, list) else [dict(zip(rows["columns"], r)) for r in rows["data"]]
    (row,) = rows
    assert row["type"] == "preemption" and row["steps_recomputed"] == ev["steps_recomputed"], row
    assert row["fell_back"] and "too little notice" in row["cause"], row
