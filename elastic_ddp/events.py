"""Controller-side view of the run: failures, resizes, restarts, and deterministic errors.

Ray Train calls these callbacks in its controller actor (``RunConfig(callbacks=...)``),
not on the workers. They send every event and start-up mark to the job's tracker actor
(``elastic_ddp.tracking.JobTracker``), which writes them into the job's one MLflow run
(``events/events.json``, ``events/timeline.json``) and keeps them for the driver's
summary; the controller never imports MLflow.
"""

from __future__ import annotations

import re
import time
from typing import Any, Dict, List, Optional

from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
from ray.train.v2.api.callback import UserCallback

EVENTS_ARTIFACT = "events/events.json"
TIMELINE_ARTIFACT = "events/timeline.json"

# Errors that no restart can fix: bad data or config surfacing on a worker.
_FATAL_PATTERNS = ("DataError", "CheckpointError", "ConfigError", "BatchConfigError", "TaskError",
                   "TransformError")
_STEP_RE = re.compile(r"StepError: (step \d+) \(epoch \d+, rank \d+\): (.*)")


class DeterministicTrainingError(RuntimeError):
    """The same error at the same step on two attempts in a row (or a data/config error):
    restarting would only spend the failure budget. Carries the original error text."""


def _summarise(exc: Exception) -> str:
    text = str(exc)
    m = _STEP_RE.search(text)
    if m:
        return f"{m.group(1)}: {m.group(2).strip().splitlines()[0]}"
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:500] if lines else type(exc).__name__


class ElasticEvents(UserCallback):
    """Records failures and stops the job on deterministic errors (raising from a
    callback makes Ray Train fail the run without retrying: a ControllerError)."""

    def __init__(self, tracker):
        self.tracker = tracker
        self.events: List[Dict[str, Any]] = []
        self._last_signature: Optional[str] = None
        self._last_world_size: Optional[int] = None
        self._last_step: int = 0
        self._pending: Dict[int, Exception] = {}
        # Failure/resize events since the last report: their world_size_after is only
        # known once a group reports.
        self._unsettled: List[Dict[str, Any]] = []
        # Controller-side start-up marks (seconds since the epoch): where a start or a
        # restart spends its time before the workers' own marks take over.
        self.timeline: List[Dict[str, Any]] = []

    # -- hooks -----------------------------------------------------------------------
    def after_report(self, run_context, metrics, checkpoint) -> None:
        self._last_world_size = len(metrics)
        if self._unsettled:
            # The world size a decision asked for is not always the one that ran: a
            # restart may first ask for a node that is gone (its placement group never
            # schedules) and then retry smaller. The first report settles it.
            for ev in self._unsettled:
                ev["world_size_after"] = self._last_world_size
            self._unsettled = []
            self.record(None)
        steps = [m.get("step", 0) for m in metrics if isinstance(m, dict)]
        if steps:
            self._last_step = int(max(steps))

    def after_exception(self, run_context, worker_exceptions: Dict[int, Exception]) -> None:
        # Called on every poll that sees errors; the decision hook below records once.
        self._pending = dict(worker_exceptions)

    def on_failure_decision(self, decision) -> None:
        """Record the failure once; raise to stop retrying a deterministic error."""
        pending, self._pending = self._pending, {}
        summaries = {rank: _summarise(e) for rank, e in pending.items()}
        texts = "\n".join(str(e) for e in pending.values())
        step_sigs = sorted({s for s in summaries.values() if s.startswith("step ")})
        cause = step_sigs[0] if step_sigs else next(iter(summaries.values()), "worker group failure")
        self.record({"type": "failure", "t": time.time(), "cause": cause,
                     "decision": getattr(decision, "value", str(decision)),
                     "failed_ranks": sorted(summaries), "world_size_before": self._last_world_size,
                     "last_checkpoint_step": self._last_step})
        if getattr(decision, "value", "") != "RETRY":
            return
        if any(p in texts for p in _FATAL_PATTERNS):
            self.flush()
            raise DeterministicTrainingError(f"not retried (data/config error): {cause}")
        signature = step_sigs[0] if step_sigs else None
        if signature is not None and signature == self._last_signature:
            self.flush()
            raise DeterministicTrainingError(
                f"the same error at the same step on two attempts, not retried: {cause}")
        self._last_signature = signature

    @property
    def open_failure(self) -> Optional[Dict[str, Any]]:
        """The latest failure no group has reported after (None: all settled)."""
        return next((e for e in reversed(self._unsettled) if e["type"] == "failure"), None)

    # -- shared ----------------------------------------------------------------------
    def mark(self, what: str, **extra: Any) -> None:
        """A controller timeline mark (``events/timeline.json``)."""
        mark = {"what": what, "t": time.time(), **extra}
        self.timeline.append(mark)
        self.tracker.event.remote(None, mark)

    def record(self, event: Optional[Dict[str, Any]]) -> None:
        """Append ``event`` (None: re-send the unsettled ones' updates) to the tracker."""
        if event is not None:
            event["index"] = len(self.events)
            self.events.append(event)
            if event["type"] in ("failure", "resize"):
                self._unsettled.append(event)
            self.tracker.event.remote(dict(event))
        else:
            for ev in self.events:
                self.tracker.update_event.remote(ev["index"], dict(ev))

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until the tracker has everything sent so far (the controller calls it
        before it finishes, so the driver reads complete lists)."""
        import ray

        try:
            ray.get(self.tracker.snapshot.remote(), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - tracking must never fail the run
            pass


def retry_worker_deaths_at_start() -> None:
    """Make a worker that dies while its group starts a retryable failure (run in the
    controller's process, by ``ControllerEvents.after_controller_start``).

    Ray Train 2.60 turns a ``RayActorError`` raised while it launches the train function
    (``WorkerGroup._start_impl``: ``ray.get(run_train_fn)`` is outside the block that
    wraps actor deaths as ``WorkerGroupStartupFailedError``) into a ``ControllerError``,
    which its failure policy retries only for the startup errors listed in
    ``failure_handling.default.RETRYABLE_CONTROLLER_ERRORS``: a kill in that window ended
    the job. The same death a moment later is an ordinary, retried worker failure.
    Retries of controller errors are bounded by ``FailureConfig.controller_failure_limit``
    (the launcher sets it). Private Ray API, pinned by the ``ray==2.60.0`` requirement;
    ``tests/test_events.py`` fails if it moves."""
    from ray.exceptions import RayActorError
    from ray.train.v2._internal.execution.failure_handling import default

    if RayActorError not in default.RETRYABLE_CONTROLLER_ERRORS:
        default.RETRYABLE_CONTROLLER_ERRORS = (*default.RETRYABLE_CONTROLLER_ERRORS, RayActorError)


class ControllerEvents(ControllerCallback, WorkerGroupCallback):
    """Feeds Ray Train's failure and resize decisions (elastic grow/shrink) and its
    worker-group start marks to the ``ElasticEvents`` sink. A separate object because Ray
    Train routes a callback that is a ``UserCallback`` only to the user hooks."""

    def __init__(self, sink: ElasticEvents):
        self.sink = sink

    def after_controller_start(self, train_run_context) -> None:
        retry_worker_deaths_at_start()
        self.sink.mark("controller_started")

    def before_worker_group_start(self, worker_group_context) -> None:
        # Next: placement group, worker actors, then the torch process group.
        self.sink.mark("worker_group_starting", world_size=int(worker_group_context.num_workers))

    def after_worker_group_start(self, worker_group) -> None:
        self.sink.mark("worker_group_started")

    def after_controller_finish(self, result) -> None:
        self.sink.flush()

    def before_controller_abort(self) -> None:
        self.sink.flush(timeout_s=5.0)

    def before_controller_execute_failure_decision(self, failure_decision) -> None:
        self.sink.on_failure_decision(failure_decision)

    def before_controller_execute_resize_decision(self, resize_decision) -> None:
        if self.sink._last_world_size is None:
            return  # the first worker group of this controller, not a resize
        failure = self.sink.open_failure
        new_size = int(resize_decision.num_workers)
        if failure is not None:
            # Restarting after a failure is executed as a resize: annotate, not a new event.
            # Provisional: the first report after it sets the size that actually ran.
            failure["world_size_requested"] = new_size
            failure["world_size_after"] = new_size
            self.sink.record(None)
        else:
            self.sink.record({"type": "resize", "t": time.time(),
                              "world_size_before": self.sink._last_world_size,
                              "world_size_after": new_size,
                              "world_size_requested": new_size,
                              "last_checkpoint_step": self.sink._last_step})
        # The group being started has this size even if it dies before its first
        # report (else the next failure would name the size of the group before it).
        self.sink._last_world_size = new_size

