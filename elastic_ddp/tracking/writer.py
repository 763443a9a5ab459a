"""The tracker's writer thread: what the job's tracker actor records is buffered and
written to the job's MLflow run in batches by one thread, so that no caller ever waits on
the store. A store that is down is retried with backoff (everything stays buffered, up to
``MAX_BUFFERED_METRICS`` metric values); what the store refuses is dropped item by item
and counted; a run deleted under the job, or a run whose lease another job took, ends the
writes (each counted as dropped).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

from elastic_ddp.background import start_deferring_signals
from elastic_ddp.tracking.run_lost import lost_record, lost_state, notice_text
from elastic_ddp.tracking.store import MAX_BUFFERED_METRICS, client, display_rank, is_transient

# How long the writer may hold everything back before a first step (see RunWriter).
STORE_DEFER_S = 30.0


class RunWriter:
    """The buffer of metric values, tags and artifacts bound for one MLflow run, and the
    thread that writes it (``uri``: the tracking store; the run is set by the subclass's
    ``bind``: ``run_id`` and ``_bound``).

    Counters: ``delayed`` (values written late, after an outage), ``dropped`` (values
    the store refused, or past the buffer's bound, or after the run was lost or fenced),
    ``unavailable_s`` (seconds the store was down), ``last_error``. ``run_lost``: the
    record of a run deleted under the job (:mod:`elastic_ddp.tracking.run_lost`);
    ``fenced``: the lease record of the job that took the run over
    (:mod:`elastic_ddp.fencing`, the ``_fence`` read before each batch). ``notices``:
    warnings for the driver's console.

    MLflow is imported only once ``go()`` is called (the first step is done, or a flush
    is asked for) or ``STORE_DEFER_S`` passed: at a job's start that import would take
    turns for the CPUs with the controller and the workers, which start at the same time.
    Until then everything is buffered. (MLflow's system-metrics monitor runs in the
    driver's helper process, ``tracking.opener``, from the run's opening.)
    """

    def __init__(self, uri: str, flush_period_s: float = 1.0):
        self.uri, self.run_id = uri, None
        self._bound = threading.Event()
        self._go = threading.Event()
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._period = flush_period_s
        self._client = None
        self._written = self._requested = 0
        self._metrics: list[tuple[str, float, int, int]] = []
        self._tags: dict[str, str] = {}
        self._artifacts: dict[str, str] = {}
        self._outage_since: Optional[float] = None
        self.unavailable_s = 0.0
        self.delayed = self.dropped = 0
        self.last_error: Optional[str] = None
        self.run_lost: Optional[dict[str, Any]] = None
        self.fenced: Optional[dict[str, Any]] = None
        self._fence = None
        self.notices: list[dict[str, Any]] = []

    def start_writer(self) -> None:
        """Start the writer thread (once, at the end of the subclass's ``__init__``)."""
        start_deferring_signals(threading.Thread(target=self._loop, name="mlflow-writer", daemon=True))

    def _buffer(self, rows: list[tuple[str, float, int, int]]) -> None:
        """Queue metric rows ``(key, value, ms, step)`` (under the lock); the oldest past
        ``MAX_BUFFERED_METRICS`` are dropped and counted."""
        self._metrics.extend(rows)
        if len(self._metrics) > MAX_BUFFERED_METRICS:
            extra = len(self._metrics) - MAX_BUFFERED_METRICS
            del self._metrics[:extra]
            self.dropped += extra

    def _step_seen(self) -> int:
        """The newest step logged (the run-lost record's step); the subclass knows it."""
        return 0

    def _before_write(self, metrics: list[tuple]) -> list[tuple]:
        """The metric rows of a batch as they are written (the subclass may move them)."""
        return metrics

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
            self.run_lost = lost_record(state, self._step_seen())
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
        metrics = self._before_write(metrics)
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self.run_id, metrics=[Metric(*m) for m in metrics[i:i + 1000]])
        if tags:
            self._client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        for path, text in arts.items():
            self._client.log_text(self.run_id, text, path)

