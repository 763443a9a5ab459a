"""A planned grow that checkpoints first: Ray Train's elastic policy decides to restart a
running, healthy worker group onto more workers; here the workers first commit a
checkpoint at the next step boundary (the notice path, ``elastic_ddp.worker.notice``),
and the resize goes ahead once that checkpoint is reported, so the larger group resumes
at the step the smaller one stopped at: no step is recomputed.

    checkpoint_before_grow(policy, controller, timeout_s)   # in the controller's process

Ray Train 2.60's controller asks ``ElasticScalingPolicy.make_decision_for_running_worker_group``
on every poll of a healthy group (at most every ``elastic_resize_monitor_interval_s`` it
looks at the cluster) and, on a ``ResizeDecision``, shuts the group down and starts the
new one from the newest reported checkpoint: the steps since it are computed twice. The
wrapper (:class:`GrowFirst`) holds such a decision back (``NoopDecision`` meanwhile),
sends the running workers a ``grow`` notice (``notice.request_grow`` in each worker's main
thread, handed over by :func:`set_grow_timeout`) and hands the held decision to the
controller when a checkpoint whose report carries ``notice.GROW_METRIC`` has been
registered, or after ``timeout_s`` (one line says
so; the resize then starts from the newest checkpoint as Ray's would). What the decision
cost is kept for the controller's ``resize`` event (:func:`take_grow`).

What it costs: until the checkpoint is reported (about ``scaling.notice_agreement_s`` plus
one step plus one synchronous checkpoint write) the group trains at its old size, and
after it the workers wait for the teardown (one controller poll). It replaces a method
of Ray Train's scaling policy object (override ``grow_checkpoint`` of
``compat.versions``) and reads its controller's ``_checkpoint_manager``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

_released: list = []  # the last grow handed to the controller (take_grow)


@dataclasses.dataclass
class _Held:
    decision: Any  # Ray Train's ResizeDecision
    group: Any  # the group it grows: its WorkerGroupState's start_time
    decided_t: float  # seconds since the epoch
    started: float  # monotonic
    baseline: Any  # the latest checkpoint result when the notice went out
    workers_before: int
    told: int


class GrowFirst:
    """The running-group decision of a scaling policy, with a grow checkpointed first.

    ``decide(worker_group_state, worker_group_status)``: the policy's own decision.
    ``tell()``: send the running group's workers the grow notice; returns how many were
    told (0: none, the decision goes ahead at once). ``latest()``: the newest registered
    checkpoint result (an object with ``metrics``, a dict), or None. ``noop()``: a
    ``NoopDecision``. ``timeout_s``: the longest wait for the checkpoint (seconds).
    ``metric``: the report metric that marks the checkpoint at the notice
    (``notice.GROW_METRIC``). ``log``: where the one line of a timeout goes."""

    def __init__(self, decide: Callable, tell: Callable[[], int], latest: Callable[[], Any],
                 noop: Callable[[], Any], timeout_s: float, metric: str = "grow_checkpoint",
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 log: Callable[[str], None] = print):
        self.decide, self.tell, self.latest, self.noop = decide, tell, latest, noop
        self.timeout_s, self.clock, self.wall, self.log = timeout_s, clock, wall, log
        self.metric = metric
        self.held: Optional[_Held] = None

    def __call__(self, worker_group_state, worker_group_status):
        group = getattr(worker_group_state, "start_time", None)
        h = self.held
        if h is not None and h.group != group:
            self.held = h = None  # that group failed and restarted meanwhile: nothing to grow
        if h is not None:
            return self._release_or_wait(h)
        decision = self.decide(worker_group_state, worker_group_status)
        current = int(worker_group_state.num_workers)
        if int(getattr(decision, "num_workers", 0) or 0) <= current:
            return decision  # a no-op, or not a grow
        baseline = self.latest()
        told = self.tell()
        if not told:
            return decision
        self.held = _Held(decision, group, self.wall(), self.clock(), baseline, current, told)
        return self.noop()

    def _release_or_wait(self, h: _Held):
        latest = self.latest()
        done = latest is not None and latest is not h.baseline and \
            bool((getattr(latest, "metrics", None) or {}).get(self.metric))
        waited = self.clock() - h.started
        if not done and waited < self.timeout_s:
            return self.noop()
        self.held = None
        record = {"decided_t": h.decided_t, "workers_told": h.told,
                  "decision_to_checkpoint_s": round(waited, 3), "checkpoint_first": done}
        if done:
            step = (latest.metrics or {}).get("step")
            record["checkpoint_step"] = int(step) if step is not None else None
        else:
            record["warning"] = (
                f"grow {h.workers_before} -> {h.decision.num_workers} workers: no checkpoint at the "
                f"grow notice within {self.timeout_s:g} s (scaling.grow_checkpoint_timeout_s); "
                "resizing from the newest checkpoint, the steps since it are recomputed")
            self.log(f"elastic-ddp: {record['warning']}")
        _released[:] = [record]
        return h.decision


def take_grow() -> Optional[dict]:
    """The grow the controller is executing now (since the previous call), as
    ``{"decided_t": s, "workers_told": n, "decision_to_checkpoint_s": s,
    "checkpoint_first": bool, "checkpoint_step": step (when checkpointed), "warning":
    line (when not)}``; None when the resize being executed was not held here."""
    return _released.pop() if _released else None


def grow_event(grow: dict) -> dict:
    """The fields a grow that checkpointed first (``compat.ray_grow.take_grow``) adds to its
    ``resize`` event: ``t`` is the decision's time (``recovery_s``, to the first step at the
    new size, is the grow's whole cost: the notice, the checkpoint, the teardown and the
    start), ``checkpoint_first``, ``decision_to_checkpoint_s``, and with the checkpoint
    its step as ``last_step_seen`` and ``last_checkpoint_step`` (nothing after it ran: 0
    steps recomputed); without it (the wait timed out) the ``warning``."""
    out: dict = {"t": grow["decided_t"], "checkpoint_first": grow["checkpoint_first"],
                           "decision_to_checkpoint_s": grow["decision_to_checkpoint_s"],
                           "cause": "grow onto added capacity"}
    if grow["checkpoint_first"] and grow.get("checkpoint_step") is not None:
        out["last_step_seen"] = out["last_checkpoint_step"] = grow["checkpoint_step"]
        out["cause"] += f" (checkpoint of step {grow['checkpoint_step']} at the grow notice first)"
    if grow.get("warning"):
        out["warning"] = grow["warning"]
    return out


def checkpoint_before_grow(policy, controller) -> bool:
    """Wrap ``policy.make_decision_for_running_worker_group`` (Ray Train's elastic
    scaling policy of ``controller``, an ``EnvController``) in :class:`GrowFirst`, as
    :func:`set_grow_timeout` set it for this process; True when wrapped (False: not set,
    no such method, or wrapped already)."""
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision

    from elastic_ddp.compat.ray_train import tell_workers

    running = getattr(policy, "make_decision_for_running_worker_group", None)
    if _grow is None or running is None or isinstance(running, GrowFirst):
        return False
    timeout_s, note, metric = _grow

    def latest():
        return getattr(controller._checkpoint_manager, "latest_checkpoint_result", None)

    def tell() -> int:
        return tell_workers(controller.get_worker_group(), note)

    _released.clear()
    policy.make_decision_for_running_worker_group = GrowFirst(running, tell, latest, NoopDecision, timeout_s,
                                                              metric=metric)
    return True


# What the job's controller callbacks set (controller.lifecycle.ControllerEvents) before the
# controller reads it: (timeout_s, the notice to run in each worker, the report metric).
_grow: Optional[tuple] = None


def set_grow_timeout(timeout_s: Optional[float], note: Optional[Callable[[], None]] = None,
                     metric: str = "grow_checkpoint") -> None:
    """Make :func:`checkpoint_before_grow` wait up to ``timeout_s`` seconds for the
    checkpoint at the notice ``note`` (run in each worker's main thread), marked by the
    report metric ``metric``, in this process's controller; ``timeout_s`` None or 0: off."""
    global _grow
    _grow = (float(timeout_s), note, metric) if timeout_s and note is not None else None


def grow_timeout() -> Optional[float]:
    """The wait set by :func:`set_grow_timeout` (seconds), or None: off."""
    return _grow[0] if _grow is not None else None
