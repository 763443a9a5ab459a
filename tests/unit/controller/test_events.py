"""The controller-side event log, driven with Ray Train's own decision objects in the
order its controller calls them, into the job's tracker writing a real sqlite MLflow store
(no Ray cluster: the tracker object is called in-process instead of as an actor; the
cluster-level behaviour is covered by tests/e2e/restart/test_elastic.py)."""

from __future__ import annotations

import json

import pytest
from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
from ray.train.v2._internal.execution.scaling_policy.scaling_policy import ResizeDecision

from conftest import InProcess
from elastic_ddp.controller.events import EVENTS_ARTIFACT, DeterministicTrainingError, ElasticEvents
from elastic_ddp.controller.lifecycle import ControllerEvents


@pytest.fixture()
def sink(tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    from elastic_ddp.tracking import JobTracker

    uri = mlflow_store
    client = MlflowClient(uri)
    exp = client.create_experiment("events", artifact_location=str(tmp_path / "artifacts"))
    run = client.create_run(exp)
    tracker = JobTracker(uri, run.info.run_id)
    events = ElasticEvents(InProcess(tracker))
    events.run_id, events.store = run.info.run_id, tracker
    return events, ControllerEvents(events), client


def _report(events: ElasticEvents, world_size: int, step: int) -> None:
    events.after_report(None, [{"step": step}] * world_size, None)


def _resize(ctrl: ControllerEvents, n: int) -> None:
    ctrl.before_controller_execute_resize_decision(ResizeDecision(num_workers=n, resources_per_worker={"CPU": 1}))


def _stored(client, run_id) -> list:
    with open(client.download_artifacts(run_id, EVENTS_ARTIFACT)) as f:
        return json.load(f)


def test_world_size_after_is_the_size_that_ran_not_the_first_request(sink):
    """Seen in CI: after a node removal the controller first asked for 2 workers (the
    node's resources were still listed), that group never started, and the retry ran at
    1. The failure must say 1."""
    events, ctrl, client = sink
    _resize(ctrl, 2)                       # first group of the run: not an event
    _report(events, 2, 3)
    events.after_exception(None, {1: RuntimeError("the actor's node was terminated")})
    ctrl.before_controller_execute_failure_decision(FailureDecision.RETRY)
    _resize(ctrl, 2)                       # provisional request
    events.after_exception(None, {0: RuntimeError("WorkerGroupStartupTimeoutError")})
    ctrl.before_controller_execute_failure_decision(FailureDecision.RETRY)
    _resize(ctrl, 1)
    _report(events, 1, 4)
    _resize(ctrl, 2)                       # elastic grow while healthy
    _report(events, 2, 10)
    kinds = [(e["type"], e["world_size_before"], e["world_size_after"]) for e in events.events]
    assert kinds == [("failure", 2, 1), ("failure", 2, 1), ("resize", 1, 2)], kinds
    assert events.events[0]["world_size_requested"] == 2
    assert events.events[0]["last_checkpoint_step"] == 3
    # What the tracker writes to MLflow (in the background) is the settled list.
    assert events.store.flush(30)
    stored = _stored(client, events.run_id)
    assert [{k: e[k] for k in ev} for e, ev in zip(stored, events.events)] == \
        json.loads(json.dumps(events.events))


def test_same_step_error_twice_stops_with_the_original_text(sink):
    events, ctrl, _ = sink
    _resize(ctrl, 2)
    _report(events, 2, 1)
    err = "StepError: step 7 (epoch 0, rank 1): ValueError: bad pixel"
    events.after_exception(None, {1: RuntimeError(err)})
    ctrl.before_controller_execute_failure_decision(FailureDecision.RETRY)  # first time: retry
    _resize(ctrl, 2)
    events.after_exception(None, {1: RuntimeError(err)})
    with pytest.raises(DeterministicTrainingError, match="step 7: ValueError: bad pixel"):
        ctrl.before_controller_execute_failure_decision(FailureDecision.RETRY)


def test_data_error_is_not_retried(sink):
    events, ctrl, _ = sink
    _resize(ctrl, 1)
    events.after_exception(None, {0: RuntimeError("DataError: /d/part-0.parquet: column 'x' missing")})
    with pytest.raises(DeterministicTrainingError, match="data/config error"):
        ctrl.before_controller_execute_failure_decision(FailureDecision.RETRY)


def test_a_worker_death_at_group_start_is_retried_not_fatal():
    """Ray Train 2.60 wraps a RayActorError raised while it launches the train function in
    a ControllerError that its default policy does not retry; once the controller callback
    ran, the same error is a retry (bounded by controller_failure_limit)."""
    from ray.exceptions import ActorDiedError
    from ray.train.v2._internal.execution.failure_handling.default import DefaultFailurePolicy
    from ray.train.v2.api.config import FailureConfig
    from ray.train.v2.api.exceptions import ControllerError

    from elastic_ddp.compat.ray_train import retry_worker_deaths_at_start

    policy = DefaultFailurePolicy(FailureConfig(max_failures=3, controller_failure_limit=2))
    died = ControllerError(ActorDiedError())
    assert policy.make_decision(died) == FailureDecision.RAISE  # Ray's own behaviour
    retry_worker_deaths_at_start()
    assert policy.make_decision(died) == FailureDecision.RETRY
    assert policy.make_decision(died) == FailureDecision.RETRY
    assert policy.make_decision(died) == FailureDecision.RAISE  # the limit still holds
    assert policy.make_decision(ControllerError(ValueError("a bug"))) == FailureDecision.RAISE


def test_a_position_written_on_another_ray_node_of_this_machine_is_read_without_a_task():
    # Several Ray nodes on one host (a local multi-node cluster): the controller reads the
    # dead rank's record from the file, but only if that node wrote it (a pid of another
    # machine's node must not match a record here).
    import os

    import ray

    from elastic_ddp.positions import Position, position_dir, read_position

    assert not ray.is_initialized()
    pos = Position(rank=1, run="r", node="node-a")
    pos.at("training step", 7, 0)
    assert read_position("node-b", os.getpid()) is None  # not that node's: no Ray, no task
    assert (position_dir() / f"pid{os.getpid()}.json").exists()
    rec = read_position("node-a", os.getpid())
    assert rec["node"] == "node-a" and rec["step"] == 7 and rec["rank"] == 1
    assert not (position_dir() / f"pid{os.getpid()}.json").exists()  # read once, removed
    pos.close()


def test_the_startup_phases_follow_the_marks_in_time_and_sum_to_the_total():
    from elastic_ddp.driver.report import startup_breakdown

    snap = {"timeline": [{"what": "controller_started", "t": 4.2}, {"what": "worker_group_starting", "t": 4.3},
                         {"what": "worker_group_started", "t": 6.3}],
            "attempts": [{"enter": 6.4, "ready": 7.4, "first_step": 7.7}]}
    # A local Ray: connected after the scan.
    late = startup_breakdown(snap, {"process_start": 0.0, "train_called": 0.4, "scanned": 2.0,
                                    "ray_ready": 3.5, "fit_called": 4.0})
    assert late["scan_s"] == 1.6 and late["ray_init_s"] == 1.5 and late["driver_setup_s"] == 0.5
    # Joining a running cluster: connected (controller host and tracker started) before it.
    early = startup_breakdown(snap, {"process_start": 0.0, "train_called": 0.4, "ray_ready": 0.6,
                                     "scanned": 2.0, "fit_called": 4.0})
    assert early["ray_init_s"] == 0.2 and early["scan_s"] == 1.4 and early["driver_setup_s"] == 2.0
    for out in (late, early):
        assert min(out.values()) >= 0 and list(out)[0] == "imports_s"
        assert abs(sum(v for k, v in out.items() if k != "total_s") - out["total_s"]) < 1e-6, out
        assert out["total_s"] == 7.7


def test_a_process_start_is_timed_to_the_clock_tick_not_the_boot_seconds():
    # /proc/stat's btime is whole seconds: a start taken from it was up to 1 s early.
    import subprocess
    import sys
    import time

    from elastic_ddp.driver.preflight import process_start_time

    for _ in range(3):
        t0 = time.time()
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])
        try:
            start = process_start_time(p.pid)
        finally:
            p.kill()
            p.wait()
        assert start is not None and -0.05 < start - t0 < 0.5, start - t0


def _summary(wall_s: float, committed_s: float, parts: dict):
    from elastic_ddp.driver.report import Summary, goodput

    return Summary(run_id="r", tracking_uri="sqlite:///x.db", experiment_id="1", metrics={}, steps=10,
                   epochs=1, wall_s=wall_s, world_sizes_seen=[2], restarts=1,
                   goodput=goodput(committed_s, wall_s), goodput_parts=parts)


def test_goodput_says_where_the_wall_time_went():
    """Goodput's line names its committed training seconds, and the next line splits the
    rest into start-up (to the end of the first step), restarts (overlapping recoveries
    once) and the rest; the parts sum to the wall time."""
    from elastic_ddp.driver.report import format_summary, goodput_parts

    marks = {"process_start": 0.0, "train_called": 0.4, "scanned": 2.0, "ray_ready": 3.5, "fit_called": 4.0}
    snap = {"attempts": [{"enter": 6.4, "ready": 7.4, "first_step": 7.7, "committed_s": 0.0},
                         {"enter": 25.0, "ready": 26.0, "first_step": 28.0, "committed_s": 2.0}]}
    # A failure whose restart was cut short by a resize: 20-26 and 23-28 are 8 s.
    events = [{"type": "failure", "t": 20.0, "recovery_s": 6.0},
              {"type": "resize", "t": 23.0, "recovery_s": 5.0},
              {"type": "config_change", "t": 1.0}]
    parts = goodput_parts(snap, marks, wall_start=0.4, wall_s=50.0, committed_s=5.0, events=events)
    assert parts == {"training_s": 5.0, "earlier_s": 0.0, "startup_s": 7.3, "restarts_s": 8.0,
                     "recomputed_s": 0.0, "eval_s": 0.0, "checkpoint_s": 0.0,
                     "other_s": 29.7, "data_wait_s": 0.0}, parts
    assert abs(sum(parts.values()) - 50.0) < 1e-9
    out = format_summary(_summary(50.0, 5.0, parts)).splitlines()
    at = next(i for i, ln in enumerate(out) if ln.startswith("wall time:"))
    assert out[at] == "wall time:        50.0 s   goodput 10.00% (committed training steps 5.0 s / wall time)"
    assert out[at + 1] == ("  not training:   45.0 s = start-up 7.3 s (command to first step) + restarts "
                           "8.0 s + other 29.7 s (lost steps not recomputed, the job's end)")


def test_goodput_of_a_resumed_run_counts_the_earlier_submissions_apart():
    """A resumed run's wall time starts at its first submission: the time before this one
    less the committed training it restored is the earlier submissions' part; this
    submission's start-up starts at its command. A per-step replica's replacement is no
    restart (the other replicas trained meanwhile)."""
    from elastic_ddp.driver.report import format_summary, goodput_parts

    marks = {"process_start": 1000.0, "train_called": 1000.4, "fit_called": 1004.0}
    snap = {"attempts": [{"rank": 0, "enter": 1006.0, "first_step": 1010.0, "committed_s": 30.0},
                         {"rank": 1, "enter": 1006.0, "first_step": 1010.5, "committed_s": 30.0}]}
    events = [{"type": "failure", "t": 1050.0, "recovery_s": 9.0, "failed_ranks": [1]}]
    parts = goodput_parts(snap, marks, wall_start=0.0, wall_s=1200.0, committed_s=150.0, events=events)
    assert parts == {"training_s": 150.0, "earlier_s": 970.0, "startup_s": 10.0, "restarts_s": 0.0,
                     "recomputed_s": 0.0, "eval_s": 0.0, "checkpoint_s": 0.0,
                     "other_s": 70.0, "data_wait_s": 0.0}, parts
    line = format_summary(_summary(1200.0, 150.0, parts)).splitlines()
    assert ("  not training:   1050.0 s = earlier submissions 970.0 s (and the time between them) + "
            "start-up 10.0 s (command to first step) + restarts 0.0 s + other 70.0 s") in "\n".join(line)
    assert goodput_parts({"attempts": []}, marks, 0.0, 1200.0, 150.0, events) == {}


def test_lost_seconds_per_fault_and_the_parts_of_a_faulty_run():
    """A run with two faults: the recomputed steps at the committed steps' mean time, the
    tracker's evaluation, checkpoint-blocking and data-wait totals; the parts but data
    wait sum to the wall time; ``lost_s_per_fault`` = (wall - training - start-up -
    evaluation) / faults, printed, in summary.json's dict; None without a fault."""
    from dataclasses import asdict

    from elastic_ddp.driver.report import format_summary, goodput_parts, lost_s_per_fault
    from elastic_ddp.tracking.totals import SecondsTotals

    totals = SecondsTotals()
    for step, m in ((10, {"data_wait_s_max": 0.1}), (20, {"data_wait_s_max": 0.2}), (20, {"eval_time_s": 3.0}),
                    (20, {"checkpoint_block_s": 1.5}), (10, {"data_wait_s_max": 5.0}),  # recomputed: once
                    (30, {"data_wait_s_max": 0.1, "checkpoint_block_s": 0.5}), (30, {"eval_time_s": 2.0})):
        totals.add(m, step)
    assert totals.snapshot() == {"eval_s": 5.0, "checkpoint_s": 2.0, "data_wait_s": 4.0}
    marks = {"process_start": 0.0, "fit_called": 2.0}
    snap = {"attempts": [{"enter": 3.0, "first_step": 10.0, "committed_s": 0.0},
                         {"enter": 40.0, "first_step": 45.0, "committed_s": 20.0}],
            "seconds": totals.snapshot()}
    events = [{"type": "failure", "t": 38.0, "recovery_s": 7.0, "steps_recomputed": 8},
              {"type": "preemption", "t": 70.0, "recovery_s": 5.0, "steps_recomputed": 0},
              {"type": "checkpoint_rejected", "t": 50.0}]
    parts = goodput_parts(snap, marks, wall_start=0.0, wall_s=110.0, committed_s=60.0, events=events, steps=30)
    assert parts == {"training_s": 60.0, "earlier_s": 0.0, "startup_s": 10.0, "restarts_s": 12.0,
                     "recomputed_s": 16.0, "eval_s": 5.0, "checkpoint_s": 2.0, "other_s": 5.0,
                     "data_wait_s": 4.0}, parts
    assert abs(sum(v for k, v in parts.items() if k != "data_wait_s") - 110.0) <= 1.1
    # (110 - 60 - 10 - 5) / 2 faults: restarts 12 + recomputed 16 + checkpoints 2 + other 5.
    assert lost_s_per_fault(parts, 110.0, events) == 17.5
    assert lost_s_per_fault(parts, 110.0, [events[2]]) is None
    assert lost_s_per_fault({}, 110.0, events) is None
    s = _summary(110.0, 60.0, parts)
    s.events, s.lost_s_per_fault = events, 17.5
    assert asdict(s)["lost_s_per_fault"] == 17.5
    text = format_summary(s)
    assert "(committed training steps 60.0 s / wall time; of it data wait 4.0 s)" in text
    assert ("restarts 12.0 s + recomputed steps 16.0 s + checkpoint blocking 2.0 s + evaluation 5.0 s + "
            "other 5.0 s") in text
    assert ("  lost per fault: 17.5 s (not training, less start-up and evaluation, over 2 fault(s))"
            in text.splitlines())
