"""The job's tracker actor (:class:`JobTracker`, one per job, holding the MLflow client
across worker-group restarts) and the workers' fire-and-forget :class:`TrackerClient`."""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Optional

from elastic_ddp.tracking.data_wait import DATA_WAIT_TAG, DataWaitWatch
from elastic_ddp.tracking.history import FILES, with_earlier
from elastic_ddp.tracking.node_metrics import NodeSeries
from elastic_ddp.tracking.totals import SecondsTotals
from elastic_ddp.tracking.nonfinite import NONFINITE_METRIC, NONFINITE_TAG, NonFiniteRows
from elastic_ddp.tracking.run_lost import lost_record, lost_state, notice_text
from elastic_ddp.tracking.store import (ATTEMPTS_TAG, MAX_BUFFERED_METRICS,
                                        WORLD_SIZES_TAG, display_rank, is_transient, client,
                                        metric_key, run_info)
from elastic_ddp.background import start_deferring_signals

# How long the tracker may hold everything back before a first step (see JobTracker).
STORE_DEFER_S = 30.0


class JobTracker:
    """The job's MLflow writer and in-memory record; run as a Ray actor (``num_cpus=0``)
    by :func:`start_tracker`. Methods are called by workers (rank 0), the controller's
    callbacks and the driver.

    Kept for the driver: ``latest`` metrics (progress), ``notices`` (warnings for the
    console, each once: the data-wait warning of :mod:`elastic_ddp.tracking.data_wait`,
    also the run's tag ``elastic_ddp.warning.data_wait`` and ``warnings/data_wait.txt``;
    an event's ``warning``, such as a preemption whose notice was too short; the first
    row of each kind with a non-finite loss, :mod:`elastic_ddp.tracking.nonfinite`),
    ``attempts`` (per worker-group
    start: world size and the start-up marks ``enter``/``ready``/``first_step`` in
    seconds since the epoch, and the first step), ``events`` (failures, resizes) and the
    controller ``timeline``, and the write counters ``delayed``/``dropped``.

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
        self.uri, self.run_id = uri, None
        self._bound = threading.Event()
        self._attempts, self._world_sizes = 0, []
        self._outage_since: Optional[float] = None
        self.unavailable_s = 0.0
        self._early_updates: dict[int, dict[str, Any]] = {}
        self.latest: dict[str, float] = {}
        self.notices: list[dict[str, Any]] = []
        self._data_wait = DataWaitWatch()
        self._nonfinite = NonFiniteRows()
        self.seconds = SecondsTotals()  # evaluation, checkpoint blocking, data wait (totals)
        self._nodes = NodeSeries()  # system/<node>/* of the worker nodes (tracking.node_metrics)
        self.nonfinite = self._nonfinite.rows  # warnings/nonfinite_rows.json
        self.attempts: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.timeline: list[dict[str, Any]] = []
        self.delayed = self.dropped = 0
        self.last_error: Optional[str] = None
        self.run_lost: Optional[dict[str, Any]] = None
        self.fenced: Optional[dict[str, Any]] = None
        self._fence = None
        self._metrics: list[tuple[str, float, int, int]] = []
        self._tags: dict[str, str] = {}
        self._artifacts: dict[str, str] = {}
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._period = flush_period_s
        self._client = None
        self._written = self._requested = 0
        # MLflow is imported only once the first step is done (or a flush is asked for,
        # or STORE_DEFER_S passed): at a job's start that import would take turns for the
        # CPUs with the controller and the workers, which start at the same time. Until
        # then everything is buffered. (MLflow's system-metrics monitor runs in the
        # driver's helper process, elastic_ddp.tracking.opener, from the run's opening.)
        self._go = threading.Event()
        # A resumed run's earlier submissions' events, attempts and timeline: written
        # before this submission's own (tracking.history).
        self._earlier: dict[str, list] = {}
        if run_id is not None:
            self.bind(run_id, attempts_before, world_sizes_before, history, data_wait_given)
        start_deferring_signals(threading.Thread(target=self._loop, name="mlflow-writer", daemon=True))

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
            for k, v in metrics.items():
                key = metric_key(k)
                if key is not None:
                    self._metrics.append((key, float(v), ts, int(step)))
                self.latest[k] = float(v)
            self.seconds.add(metrics, step)
            warning = self._data_wait.add(metrics, step)
            if warning is not None:
                self.notices.append(dict(self._data_wait.fired))
                self._tags[DATA_WAIT_TAG] = warning
                self._artifacts["warnings/data_wait.txt"] = warning + "\n"
            if len(self._metrics) > MAX_BUFFERED_METRICS:
                extra = len(self._metrics) - MAX_BUFFERED_METRICS
                del self._metrics[:extra]
                self.dropped += extra

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
            self._metrics.extend(rows)
            if rows and new and info:
                self._tags[f"elastic_ddp.node.{node}"] = f"{info.get('node_id', '')} {info.get('ip', '')}".strip()
            if len(self._metrics) > MAX_BUFFERED_METRICS:
                extra = len(self._metrics) - MAX_BUFFERED_METRICS
                del self._metrics[:extra]
                self.dropped += extra

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

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything sent so far is written; False when the store is still
        failing after ``timeout_s`` (the rest stays buffered)."""
        self._go.set()
        with self._cv:
            self._requested += 1
            target = self._requested
            self._cv.notify_all()
            return self._cv.wait_for(lambda: self._written >= target, timeout=timeout_s)

    # -- the writer thread ------------------------------------------------------------
    def _loop(self) -> None:
        self._go.wait(STORE_DEFER_S)
        self._bound.wait()  # nothing is written before the run is open
        backoff = self._period
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._requested > self._written, timeout=backoff)
                target = self._requested
                metrics, tags, arts = self._metrics, self._tags, self._artifacts
                self._metrics, self._tags, self._artifacts = [], {}, {}
            if self.run_lost is not None or self._fenced():  # no more writes
                self._done(target, dropped=len(metrics))
                continue
            t_try = time.time()
            try:
                self._write(metrics, tags, arts)
                backoff = self._period
                with self._cv:
                    self._written = max(self._written, target)
                    if self._outage_since is not None:
                        # Everything in the batch that ends an outage waited for it (the
                        # failed batches are re-queued into it): each value counts once.
                        self.delayed += len(metrics)
                        self.unavailable_s += time.time() - self._outage_since
                        print(f"elastic-ddp tracker: MLflow store back after "
                              f"{time.time() - self._outage_since:.0f} s; {len(metrics)} delayed "
                              "metric values written", flush=True)
                        self._outage_since = None
                    self._cv.notify_all()
            except Exception as e:  # noqa: BLE001 - the store is down or locked: retry later
                if self._found_lost(e, target, len(metrics)):
                    continue
                if not is_transient(e):
                    # The store refuses something in the batch (a metric name it does not
                    # allow, a value too long): retrying would block every later metric.
                    metrics, tags, arts = self._drop_refused(metrics, tags, arts)
                    if not (metrics or tags or arts):
                        with self._cv:
                            self._written = max(self._written, target)
                            self._cv.notify_all()
                        continue
                with self._cv:
                    self._metrics[:0] = metrics
                    self._tags = {**tags, **self._tags}
                    self._artifacts = {**arts, **self._artifacts}
                    self.last_error = f"{type(e).__name__}: {str(e)[:300]}"
                    if self._outage_since is None:
                        self._outage_since = t_try
                        print(f"elastic-ddp tracker: warning: MLflow store unavailable "
                              f"({self.last_error[:200]}); buffering metrics and retrying", flush=True)
                backoff = min(10.0, backoff * 2)

    def _fenced(self) -> bool:
        """Whether another job took the run over (one read of its lease, until it did)."""
        if self.fenced is None and self._fence is not None:
            self.fenced = self._fence.lost()
        return self.fenced is not None

    def _done(self, target: int, dropped: int = 0) -> None:
        with self._cv:
            self.dropped += dropped
            self._written = max(self._written, target)
            self._cv.notify_all()

    def _found_lost(self, e: Exception, target: int, n_metrics: int) -> bool:
        """The write failed because the run was deleted or removed: record it, give the
        notice, drop the batch. False for any other failure (one ``get_run`` asked only
        for a refusal of that kind)."""
        state = lost_state(self._client, self.run_id, e) if self._client is not None else None
        if state is None:
            return False
        with self._lock:
            self.run_lost = lost_record(state, int(self.latest.get("step", 0)))
            self.last_error = f"{type(e).__name__}: {str(e)[:300]}"
            self.notices.append({"kind": "run_lost", "step": self.run_lost["step"],
                                 "message": notice_text(self.run_id, self.run_lost)})
        self._done(target, dropped=n_metrics)
        return True

    def _drop_refused(self, metrics, tags, arts):
        """Write each metric key, tag and artifact on its own; drop (count, warn) what the
        store refuses. Returns what is left when a transient error interrupts."""
        items = ([("metric", k, [m for m in metrics if m[0] == k]) for k in dict.fromkeys(m[0] for m in metrics)]
                 + [("tag", k, v) for k, v in tags.items()] + [("artifact", k, v) for k, v in arts.items()])
        for i, (kind, key, value) in enumerate(items):
            try:
                if kind == "metric":
                    self._write(value, {}, {})
                else:
                    self._write([], {key: value} if kind == "tag" else {}, {key: value} if kind == "artifact" else {})
            except Exception as e:  # noqa: BLE001 - sorted out below
                if is_transient(e):
                    rest = items[i:]
                    return ([m for kd, _, v in rest if kd == "metric" for m in v],
                            {k: v for kd, k, v in rest if kd == "tag"},
                            {k: v for kd, k, v in rest if kd == "artifact"})
                n = len(value) if kind == "metric" else 1
                with self._lock:
                    self.dropped += n if kind == "metric" else 0
                    self.last_error = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"elastic-ddp tracker: warning: MLflow refused {kind} {key!r} ({n} value(s) "
                      f"dropped): {str(e).splitlines()[0][:300]}", flush=True)
        return [], {}, {}

    def _write(self, metrics, tags, arts) -> None:
        if not (metrics or tags or arts):
            return
        from mlflow.entities import Metric, RunTag

        if self._client is None:
            self._client = client(self.uri)
        # train/ and val/ first: the Overview's metrics table lists keys in the order the
        # store first saw them.
        metrics = sorted(metrics, key=lambda m: (display_rank(m[0]), m[3], m[2]))
        if self._nodes.steps:
            metrics = self._nodes.shifted(metrics, self._client, self.run_id)
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self.run_id, metrics=[Metric(*m) for m in metrics[i:i + 1000]])
        if tags:
            self._client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        for path, text in arts.items():
            self._client.log_text(self.run_id, text, path)


def start_tracker(uri: str, run_id: Optional[str] = None, attempts: Optional[dict[str, Any]] = None):
    """The job's :class:`JobTracker` actor on the head node (no CPU reserved). Started by
    the driver as soon as Ray is up, before the run is open, so that its process starts
    while the driver waits for the MLflow helper rather than beside the Ray Train
    controller; ``tracker.bind.remote(run_id, **attempts)`` then names the run. With
    ``run_id`` it is bound at once. ``attempts``: a resumed run's worker-group starts so
    far (:func:`attempts_so_far`, read from the run's tags)."""
    import uuid

    import ray

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from elastic_ddp.compat.ray_nodes import head_node_id

    # On the head node: its loss ends the cluster anyway, while any worker node may be
    # removed mid-job. The driver's own node is not enough: a driver connected to a
    # multi-node cluster on one machine (``ray.cluster_utils``, ``ray start`` several
    # times) may be attached to a worker node's raylet.
    cls = ray.remote(num_cpus=0, max_concurrency=8)(JobTracker)
    return cls.options(
        name=f"elastic-ddp-tracker-{run_id or uuid.uuid4().hex}", get_if_exists=True,
        # Hard affinity: with soft=True Ray placed it on a worker node when the head's
        # worker processes were busy, and removing that node failed the job.
        scheduling_strategy=NodeAffinitySchedulingStrategy(head_node_id(), soft=False),
    ).remote(uri, run_id, **(attempts or {}) if run_id else {})


def attempts_so_far(uri: str, run_id: str) -> dict[str, Any]:
    tags = run_info(uri, run_id).data.tags
    try:
        return {"attempts_before": int(tags.get(ATTEMPTS_TAG, 0)),
                "world_sizes_before": [int(w) for w in json.loads(tags.get(WORLD_SIZES_TAG, "[]"))]}
    except (ValueError, TypeError):
        return {}


class TrackerClient:
    """What a worker holds: fire-and-forget calls to the tracker actor; every method is a
    no-op when ``enabled`` is False (all ranks but 0), so callers never branch on rank."""

    def __init__(self, actor, enabled: bool = True):
        self.actor = actor if enabled else None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.actor is not None:
            self.actor.log_metrics.remote({k: float(v) for k, v in metrics.items()}, int(step))

    def set_tags(self, tags: dict[str, Any]) -> None:
        if self.actor is not None:
            self.actor.set_tags.remote(tags)

    def attempt(self, **marks: Any) -> None:
        if self.actor is not None:
            self.actor.attempt.remote(**marks)

    def event(self, event: dict[str, Any]) -> None:
        """An event the run keeps (``events/events.json``), e.g. a rejected checkpoint."""
        if self.actor is not None:
            self.actor.event.remote(event)

    def nonfinite_rows(self, report: dict[str, Any]) -> None:
        """This rank's rows with a non-finite loss (``JobTracker.nonfinite_rows``)."""
        if self.actor is not None:
            self.actor.nonfinite_rows.remote(report)

    def start_attempt(self, world_size: int) -> Optional[dict[str, Any]]:
        """Rank 0: count this worker-group start (``JobTracker.start_attempt``); None on
        other ranks or when the tracker does not answer in 30 s."""
        if self.actor is None:
            return None
        import ray

        try:
            return ray.get(self.actor.start_attempt.remote(int(world_size)), timeout=30)
        except Exception:  # noqa: BLE001 - tracking never fails training
            return None

