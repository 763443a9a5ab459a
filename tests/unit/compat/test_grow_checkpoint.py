"""A planned grow checkpoints first (``compat.ray_grow.GrowFirst``), driven with Ray
Train's own decision objects in the order its controller asks for them, a clock the test
moves, and the ``resize`` event it leaves in the controller's event log (no Ray cluster:
the grow of a running group on a real cluster is tests/e2e/restart/test_grow_e2e.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from ray.train.v2._internal.execution.scaling_policy.scaling_policy import NoopDecision, ResizeDecision

from conftest import InProcess
from elastic_ddp import notice
from elastic_ddp.compat import ray_grow
from elastic_ddp.compat.ray_grow import GrowFirst, grow_event, take_grow


class Controller:
    """What GrowFirst sees of Ray Train's controller and policy: the policy's next
    decision, the registered checkpoint results, the workers told, a clock."""

    def __init__(self, workers: int = 1):
        self.next = NoopDecision()
        self.latest = None
        self.told = 0
        self.now = 100.0
        self.lines: list[str] = []
        self.state = SimpleNamespace(num_workers=workers, start_time=1.0)
        self.grow = GrowFirst(lambda state, status: self.next, self.tell, lambda: self.latest, NoopDecision,
                              timeout_s=30.0, clock=lambda: self.now, wall=lambda: 1000.0 + self.now,
                              log=self.lines.append)

    def tell(self) -> int:
        self.told += 1
        return self.state.num_workers

    def decide(self):
        return self.grow(self.state, None)

    def report(self, step: int, grow: bool) -> None:
        self.latest = SimpleNamespace(metrics={"step": step, "epoch": 0, **({notice.GROW_METRIC: 1.0} if grow else {})})


def _grow_to(n: int) -> ResizeDecision:
    return ResizeDecision(num_workers=n, resources_per_worker={"CPU": 1})


@pytest.fixture(autouse=True)
def _no_record():
    take_grow()
    yield
    take_grow()


def test_a_grow_waits_for_the_checkpoint_at_its_notice_then_resizes():
    c = Controller(workers=1)
    c.report(5, grow=False)                  # a periodic checkpoint before the decision
    assert isinstance(c.decide(), NoopDecision) and c.told == 0
    c.next = _grow_to(2)
    assert isinstance(c.decide(), NoopDecision) and c.told == 1   # held; the workers told
    c.next = NoopDecision()  # (the policy is not asked while a grow is held)
    c.now += 2.0
    assert isinstance(c.decide(), NoopDecision) and take_grow() is None
    c.report(9, grow=False)                  # a periodic one reported meanwhile: not it
    assert isinstance(c.decide(), NoopDecision)
    c.now += 1.5
    c.report(11, grow=True)                  # the checkpoint at the grow notice
    out = c.decide()
    assert isinstance(out, ResizeDecision) and out.num_workers == 2 and c.told == 1
    rec = take_grow()
    assert rec == {"decided_t": 1100.0, "workers_told": 1, "decision_to_checkpoint_s": 3.5,
                   "checkpoint_first": True, "checkpoint_step": 11}, rec
    ev = grow_event(rec)
    assert ev["t"] == 1100.0 and ev["last_step_seen"] == ev["last_checkpoint_step"] == 11
    assert "warning" not in ev and not c.lines
    assert isinstance(c.decide(), NoopDecision)  # released once


def test_a_grow_whose_checkpoint_does_not_come_resizes_after_the_timeout_and_says_so():
    c = Controller(workers=2)
    c.next = _grow_to(3)
    assert isinstance(c.decide(), NoopDecision)
    c.now += 29.9
    assert isinstance(c.decide(), NoopDecision)
    c.now += 0.2
    out = c.decide()
    assert isinstance(out, ResizeDecision) and out.num_workers == 3
    rec = take_grow()
    assert rec["checkpoint_first"] is False and "checkpoint_step" not in rec
    assert len(c.lines) == 1 and "within 30 s" in c.lines[0] and "2 -> 3" in c.lines[0], c.lines
    ev = grow_event(rec)
    assert "last_step_seen" not in ev and ev["warning"] in c.lines[0]


def test_only_a_grow_of_the_running_group_is_held():
    c = Controller(workers=2)
    c.next = _grow_to(2)  # the same size
    assert c.decide() is c.next
    c.next = _grow_to(1)  # smaller
    assert c.decide() is c.next and c.told == 0
    # No worker to tell: Ray's resize at once.
    c.next, c.tell = _grow_to(3), (lambda: 0)
    c.grow.tell = c.tell
    assert c.decide() is c.next and take_grow() is None


def test_a_held_grow_is_dropped_when_its_group_restarted_meanwhile():
    c = Controller(workers=1)
    c.next = _grow_to(2)
    assert isinstance(c.decide(), NoopDecision)
    # The group failed and Ray Train restarted it (a failure decision, not this one).
    c.state = SimpleNamespace(num_workers=2, start_time=7.0)
    c.next = NoopDecision()
    c.report(3, grow=True)
    assert isinstance(c.decide(), NoopDecision) and take_grow() is None and c.grow.held is None


def test_the_resize_event_of_a_grow_names_its_checkpoint_and_starts_at_the_decision(tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    from elastic_ddp.controller.events import ElasticEvents

    from elastic_ddp.controller.lifecycle import ControllerEvents
    from elastic_ddp.tracking import JobTracker

    client = MlflowClient(mlflow_store)
    exp = client.create_experiment("grow", artifact_location=str(tmp_path / "artifacts"))
    run = client.create_run(exp)
    sink = ElasticEvents(InProcess(JobTracker(mlflow_store, run.info.run_id)), preemption=True,
                         grow_checkpoint_timeout_s=30.0)
    ctrl = ControllerEvents(sink)
    ctrl.before_controller_execute_resize_decision(_grow_to(1))  # the first group
    sink.after_report(None, [{"step": 11}], None)
    c = Controller(workers=1)
    c.next = _grow_to(2)
    c.decide()
    c.report(14, grow=True)
    ctrl.before_controller_execute_resize_decision(c.decide())
    (ev,) = sink.events
    assert ev["type"] == "resize" and ev["world_size_after"] == 2 and ev["t"] == 1100.0, ev
    assert ev["checkpoint_first"] and ev["last_step_seen"] == ev["last_checkpoint_step"] == 14, ev
    # A resize Ray decided without a held grow has none of it.
    ctrl.before_controller_execute_resize_decision(_grow_to(3))
    assert "checkpoint_first" not in sink.events[-1]


def test_the_controller_reads_the_timeout_its_callbacks_set(monkeypatch):
    from elastic_ddp.controller import lifecycle as events
    from elastic_ddp.controller.events import ElasticEvents
    from elastic_ddp.controller.lifecycle import ControllerEvents

    # The hook's other work patches Ray Train's modules: not in this test's process.
    for name in ("retry_worker_deaths_at_start", "shut_down_failed_starts", "count_notices_as_preemptions"):
        monkeypatch.setattr(events, name, lambda *a, **k: None)

    for preemption, timeout, want in ((True, 45.0, 45.0), (False, 45.0, None), (True, None, None)):
        sink = ElasticEvents(InProcess(SimpleNamespace(event=lambda *a, **k: None)), preemption=preemption,
                             grow_checkpoint_timeout_s=timeout)
        sink.mark = lambda *a, **k: None
        ControllerEvents(sink).after_controller_start(None)
        assert ray_grow.grow_timeout() == want, (preemption, timeout)
    ray_grow.set_grow_timeout(None)


def test_the_marker_of_the_checkpoint_at_a_grow_notice_is_the_notices():
    assert GrowFirst.__init__.__defaults__[0] == notice.GROW_METRIC


def test_a_rank_waits_after_a_grows_checkpoint_until_torn_down_or_another_notice():
    from elastic_ddp.worker.notice import NoticeListener

    notice.clear()
    try:
        t = time.monotonic()
        assert NoticeListener.wait_for_teardown(0.3, poll_s=0.05) == "grow"  # never torn down
        assert time.monotonic() - t >= 0.3
        notice.note("sigterm")  # the checkpoint at the grow is the one a SIGTERM needs
        assert NoticeListener.wait_for_teardown(30.0, poll_s=0.05) == "sigterm"
        notice.note("stop")
        assert NoticeListener.wait_for_teardown(30.0, poll_s=0.05) == "stop"
    finally:
        notice.clear()
