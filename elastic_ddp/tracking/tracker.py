"""The job's tracker actor (:class:`JobTracker`, one per job, holding the MLflow client
across worker-group restarts): its record of the job (metrics, notices, worker-group
starts, events, the controller's timeline, node series) kept for the driver and written
to the run by its writer thread (``tracking.writer``). The actor's start and the
workers' client: ``tracking.tracker_client``."""

from __future__ import annotations

import json
import time
from typing import Any, Optional

from elastic_ddp.tracking.data_wait import DATA_WAIT_TAG, DataWaitWatch
from elastic_ddp.tracking.history import FILES, with_earlier
from elastic_ddp.tracking.node_metrics import NodeSeries
from elastic_ddp.tracking.totals import SecondsTotals
from elastic_ddp.tracking.nonfinite import NONFINITE_METRIC, NONFINITE_TAG, NonFiniteRows
from elastic_ddp.tracking.store import ATTEMPTS_TAG, WORLD_SIZES_TAG, metric_key
from elastic_ddp.tracking.writer import RunWriter


class JobTracker(RunWriter):
    """The job's in-memory record and its MLflow writer (:class:`RunWriter`); run as a
    Ray actor (``num_cpus=0``) by ``tracking.tracker_client.start_tracker``. Methods are
    called by workers (rank 0), the controller's callbacks and the driver.

    Kept for the driver: ``latest`` metrics (progress), ``notices`` (warnings for the
    console, each once: the data-wait warning of :mod:`elastic_ddp.tracking.data_wait`,
    also the run's tag ``elastic_ddp.warning.data_wait`` and ``warnings/data_wait.txt``;
    an event's ``warning``, such as a preemption whose notice was too short; the first
    row of each kind with a non-finite loss, :mod:`elastic_ddp.tracking.nonfinite`),
    ``attempts`` (per worker-group start: world size and the start-up marks
    ``enter``/``ready``/``first_step`` in seconds since the epoch, and the first step),
    ``events`` (failures, resizes) and the controller ``timeline``, the node series
    (``tracking.node_metrics``), and the writer's counters ``delayed``/``dropped``.

    A run deleted under the job (:mod:`elastic_ddp.tracking.run_lost`) is found at the
    first write it refuses: ``run_lost`` is set, one notice given, and nothing more is
    written (every later metric counts as dropped); training is not disturbed.

    A job that lost the run's lease to another job (:mod:`elastic_ddp.fencing`; the
    ``fence`` given to :meth:`bind`) writes nothing more: the lease is read before each
    batch written (at most one small read per flush period), and once it is another
    job's, ``fenced`` holds that job's record and every later write is dropped.
    """

    def __init__(self, uri: str, run_id: Optional[str] = None, flush_period_s: float = 1.0,
                 attempts_before: int = 0, world_sizes_before: Optional[list] = None,
                 history: Optional[dict[str, list]] = None, data_wait_given: bool = False):
        super().__init__(uri, flush_period_s)
        self._attempts, self._world_sizes = 0, []
        self._early_updates: dict[int, dict[str, Any]] = {}
        self.latest: dict[str, float] = {}
        self._data_wait = DataWaitWatch()
        self._nonfinite = NonFiniteRows()
        self.seconds = SecondsTotals()  # evaluation, checkpoint blocking, data wait (totals)
        self._nodes = NodeSeries()  # system/<node>/* of the worker nodes (tracking.node_metrics)
        self.nonfinite = self._nonfinite.rows  # warnings/nonfinite_rows.json
        self.attempts: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.timeline: list[dict[str, Any]] = []
        # A resumed run's earlier submissions' events, attempts and timeline: written
        # before this submission's own (tracking.history).
        self._earlier: dict[str, list] = {}
        if run_id is not None:
            self.bind(run_id, attempts_before, world_sizes_before, history, data_wait_given)
        self.start_writer()

    def bind(self, run_id: str, attempts_before: int = 0, world_sizes_before: Optional[list] = None,
             history: Optional[dict[str, list]] = None, data_wait_given: bool = False,
             fence=None) -> None:
        """The run to write to, once it is open (the driver starts the tracker before).
        ``attempts_before``/``world_sizes_before``: worker-group starts of this job in
        earlier submissions (the run's tags), so the restart count holds across
        resubmissions. ``history``: the earlier submissions' ``events``, ``attempts`` and
        ``timeline`` (``tracking.history.earlier_records``), kept first in the artifacts.
        ``data_wait_given``: an earlier submission gave the run's data-wait warning.
        ``fence``: the job's :class:`elastic_ddp.fencing.Fence`, checked before every write."""
        with self._lock:
            self.run_id = run_id
            self._fence = fence
            self._attempts = int(attempts_before) + self._attempts
            self._world_sizes = [int(w) for w in (world_sizes_before or [])] + self._world_sizes
            self._earlier = {k: list(v) for k, v in (history or {}).items()}
            if data_wait_given:
                self._data_wait.given()
        self._bound.set()

    def _artifact(self, key: str) -> None:
        """Queue list ``key``'s artifact (under the lock): the earlier submissions'
        entries, then this one's."""
        self._artifacts[FILES[key]] = with_earlier(self._earlier, key, getattr(self, key))

    # -- calls from workers, controller and driver -----------------------------------
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Raw names (``train_loss``, ``step``...) in ``latest``; written to MLflow under
        :func:`metric_key`."""
        ts = int(time.time() * 1000)
        with self._lock:
            rows = []
            for k, v in metrics.items():
                key = metric_key(k)
                if key is not None:
                    rows.append((key, float(v), ts, int(step)))
                self.latest[k] = float(v)
            self.seconds.add(metrics, step)
            warning = self._data_wait.add(metrics, step)
            if warning is not None:
                self.notices.append(dict(self._data_wait.fired))
                self._tags[DATA_WAIT_TAG] = warning
                self._artifacts["warnings/data_wait.txt"] = warning + "\n"
            self._buffer(rows)

    def nonfinite_rows(self, report: dict[str, Any]) -> None:
        """A rank's rows with a non-finite loss in a skipped step
        (``tracking.nonfinite.row_report``): a console notice for the first of each kind,
        the count metric, the tag and ``warnings/nonfinite_rows.json``."""
        with self._lock:
            self.notices.extend(self._nonfinite.add(report))
            key = metric_key(NONFINITE_METRIC)
            so_far = len(self._earlier.get("nonfinite") or []) + len(self.nonfinite)
            self._metrics.append((key, float(so_far), int(time.time() * 1000), int(report["step"])))
            self._tags[NONFINITE_TAG] = self._nonfinite.tag()
            self._artifact("nonfinite")

    def node_metrics(self, node: str, sender: str, metrics: dict[str, float], t: float,
                     interval: float, info: Optional[dict[str, Any]] = None) -> None:
        """One system-metrics sample of a worker node (``tracking.node_metrics``), logged
        as ``system/<node>/<metric>`` at the node's next step; the node's Ray id and IP
        as the tag ``elastic_ddp.node.<node>``."""
        with self._lock:
            new = node not in self._nodes.steps
            rows = self._nodes.add(node, sender, metrics, t, interval, info)
            self._buffer(rows)
            if rows and new and info:
                self._tags[f"elastic_ddp.node.{node}"] = f"{info.get('node_id', '')} {info.get('ip', '')}".strip()

    def set_tags(self, tags: dict[str, Any]) -> None:
        with self._lock:
            self._tags.update({k: str(v) for k, v in tags.items()})

    def start_attempt(self, world_size: int) -> dict[str, Any]:
        """A worker group's rank 0 starts (restored its checkpoint): count it. Returns
        ``{"attempts": starts of this job so far, this one included, "world_sizes": their
        world sizes}``; also kept as the run's tags for a resubmission."""
        self._bound.wait(30)  # the earlier submissions' count first
        with self._lock:
            self._attempts += 1
            self._world_sizes.append(int(world_size))
            self._tags[ATTEMPTS_TAG] = str(self._attempts)
            self._tags[WORLD_SIZES_TAG] = json.dumps(self._world_sizes)
            return {"attempts": self._attempts, "world_sizes": list(self._world_sizes)}

    def attempt(self, **marks: Any) -> None:
        """A worker group (re)started: rank 0 reports its world size and ``enter``/``ready``
        marks (and the finer start marks of ``worker.entry.start_marks``); ``first_step``
        marks (with ``step``) update the newest attempt. Per-step mode: every replica
        reports its own, with its ``rank``; a ``first_step`` mark updates the newest of
        that rank. All of them are written as the artifact ``events/attempts.json``
        (seconds since the epoch)."""
        with self._lock:
            mine = [a for a in self.attempts if a.get("rank") == marks.get("rank")]
            if "enter" in marks or not mine:
                self.attempts.append(dict(marks))
            else:
                mine[-1].update(marks)
            self._artifact("attempts")
        if "first_step" in marks:
            self._go.set()

    def event(self, event: Optional[dict[str, Any]] = None, timeline: Optional[dict] = None) -> None:
        """Record a controller event (failure, resize) or a timeline mark; both lists are
        written as artifacts (``events/events.json``, ``events/timeline.json``)."""
        with self._lock:
            if event is not None:
                # The newest step logged before the event: a lower bound of how far the
                # failed attempt got (recomputed steps; exact from the ledger).
                event.setdefault("last_step_seen", int(self.latest.get("step", 0)))
                # A threaded actor may run the controller's calls out of order: an update
                # can arrive before its event, and events before earlier ones.
                event.update(self._early_updates.pop(event.get("index"), {}))
                if event.get("warning"):  # e.g. a notice too short for its checkpoint
                    self.notices.append({"kind": event.get("type"), "step": event.get("last_step_seen"),
                                         "message": event["warning"]})
                self.events.append(event)
                self.events.sort(key=lambda e: e.get("index", 0))
            if timeline is not None:
                self.timeline.append(timeline)
            self._artifact("events")
            self._artifact("timeline")

    def update_event(self, index: int, fields: dict[str, Any]) -> None:
        with self._lock:
            ev = next((e for e in self.events if e.get("index") == index), None)
            if ev is None:
                self._early_updates.setdefault(index, {}).update(fields)
                return
            ev.update(fields)
            self._artifact("events")

    def progress(self) -> dict[str, float]:
        with self._lock:
            return dict(self.latest)

    def get_notices(self, since: int = 0) -> list[dict[str, Any]]:
        """The notices from index ``since`` on (``{"kind", "step", "message", ...}``)."""
        with self._lock:
            return [dict(n) for n in self.notices[since:]]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"latest": dict(self.latest), "notices": [dict(n) for n in self.notices],
                    "attempts": [dict(a) for a in self.attempts],
                    "events": [dict(e) for e in self.events], "timeline": list(self.timeline),
                    "nonfinite": [dict(r) for r in self.nonfinite],
                    "delayed": self.delayed, "dropped": self.dropped,
                    "seconds": self.seconds.snapshot(),
                    "pending": len(self._metrics), "last_error": self.last_error,
                    "run_lost": dict(self.run_lost) if self.run_lost else None,
                    "unavailable_s": round(self.unavailable_s + (
                        time.time() - self._outage_since if self._outage_since else 0.0), 1)}


    # -- the writer's hooks (tracking.writer) ------------------------------------------
    def _step_seen(self) -> int:
        return int(self.latest.get("step", 0))

    def _before_write(self, metrics: list[tuple]) -> list[tuple]:
        """Node series' rows moved to their node's steps (``NodeSeries.shifted``)."""
        if self._nodes.steps:
            return self._nodes.shifted(metrics, self._client, self.run_id)
        return metrics
