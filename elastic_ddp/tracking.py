"""MLflow, in one place: one run per training job, kept across restarts, resizes and
resubmissions. Every MLflow call of the package is in this module.

- The driver opens (or reopens) the job's run (:func:`open_run`), starts one
  :class:`JobTracker` actor for the job, and closes the run (:func:`finish_run`).
- Workers and the Ray Train controller never import MLflow: they send metrics, tags,
  start-up marks and events to the tracker actor (fire-and-forget calls through
  :class:`TrackerClient`, a no-op on every rank but 0). The actor holds the MLflow client
  for the whole job, across worker-group restarts, and keeps what the driver needs
  (latest metrics for the progress line, per-attempt marks, events) in memory, so the
  driver never reads metric histories back out of MLflow.
- Tracking never fails training: the actor buffers metrics and retries a store that is
  down or locked (e.g. sqlite ``database is locked``) with back-off; what is delayed or
  dropped is counted and reported in the summary.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Optional

from elastic_ddp.config import Config

RUN_KEY_TAG = "elastic_ddp.run_key"
STATE_TAG = "elastic_ddp.state"
# Metrics held for a store that is down, at most (the oldest are dropped past this).
MAX_BUFFERED_METRICS = 200_000


def default_tracking_uri(cfg: Optional[Config] = None) -> str:
    """The MLflow tracking URI: the config's, else $MLFLOW_TRACKING_URI, else a sqlite
    store at an absolute path in the working directory (Ray workers change their working
    directory, so a relative URI would open a different store on each of them)."""
    if cfg is not None and cfg.run.tracking_uri:
        uri = cfg.run.tracking_uri
    else:
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = f"sqlite:///{Path(uri[len('sqlite:///'):]).resolve()}"
    return uri


def run_key(cfg: Config, storage_path: str) -> str:
    """Identity of a job across resubmissions: its Ray run name and storage path."""
    return hashlib.sha1(f"{cfg.run.name}|{storage_path}".encode()).hexdigest()[:16]


def client(uri: str):
    """An ``MlflowClient`` for ``uri``."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def experiment_id(uri: str, name: str) -> str:
    """The id of experiment ``name``, created when missing."""
    c = client(uri)
    exp = c.get_experiment_by_name(name)
    return exp.experiment_id if exp else c.create_experiment(name)


def open_run(cfg: Config, storage_path: str, uri: str, parent_run_id: Optional[str] = None,
             params: Optional[dict[str, Any]] = None, tags: Optional[dict[str, str]] = None,
             run_name: Optional[str] = None) -> tuple[str, bool]:
    """Create the job's MLflow run, or reopen the unfinished one with the same run key.

    ``parent_run_id`` makes a new run a child of that run (MLflow's ``mlflow.parentRunId``
    tag; the UI nests it). ``params`` default to the config's flattened fields.

    Returns:
        (run_id, resumed): resumed is True when an earlier submission's run was reopened.
    """
    c = client(uri)
    exp_id = experiment_id(uri, cfg.run.experiment_name)
    key = run_key(cfg, storage_path)
    if cfg.run.resume:
        runs = c.search_runs([exp_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{key}'",
                             order_by=["attributes.start_time DESC"], max_results=1)
        if runs and runs[0].info.status != "FINISHED":
            c.update_run(runs[0].info.run_id, status="RUNNING")
            return runs[0].info.run_id, True
    all_tags = {RUN_KEY_TAG: key, STATE_TAG: "running", **(tags or {})}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    run = c.create_run(exp_id, run_name=run_name or cfg.run.name, tags=all_tags)
    log_params(uri, run.info.run_id, cfg.to_flat_dict() if params is None else params)
    return run.info.run_id, False


def log_params(uri: str, run_id: str, params: dict[str, Any]) -> None:
    """Params in batches of 100 (MLflow's limit per request)."""
    from mlflow.entities import Param

    items = [Param(k, str(v)[:6000]) for k, v in params.items()]
    c = client(uri)
    for i in range(0, len(items), 100):
        c.log_batch(run_id, params=items[i:i + 100])


def finish_run(uri: str, run_id: str, ok: bool, error: str | None = None,
               status: str | None = None) -> None:
    """Close the run as FINISHED or FAILED; a failed run keeps the error as a tag so the
    store never holds a run that looks alive but is not."""
    c = client(uri)
    if error:
        c.set_tag(run_id, "elastic_ddp.error", error[:5000])
    c.set_tag(run_id, STATE_TAG, "finished" if ok else "failed")
    c.set_terminated(run_id, status=status or ("FINISHED" if ok else "FAILED"))


def run_info(uri: str, run_id: str):
    """The run's ``mlflow.entities.Run``."""
    return client(uri).get_run(run_id)


def set_tags(uri: str, run_id: str, tags: dict[str, Any]) -> None:
    from mlflow.entities import RunTag

    client(uri).log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


def log_metrics(uri: str, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    from mlflow.entities import Metric

    ts = int(time.time() * 1000)
    client(uri).log_batch(run_id, metrics=[Metric(k, float(v), ts, int(step)) for k, v in metrics.items()])


def log_text(uri: str, run_id: str, text: str, artifact_file: str) -> None:
    client(uri).log_text(run_id, text, artifact_file)


def log_artifact(uri: str, run_id: str, local_path: str, artifact_path: Optional[str] = None) -> None:
    client(uri).log_artifact(run_id, local_path, artifact_path)


def download_artifact(uri: str, run_id: str, path: str, dst: str) -> str:
    return client(uri).download_artifacts(run_id, path, dst)


def metric_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of every logged value of ``key``, sorted by step (reports, tests)."""
    return sorted((int(m.step), m.value) for m in client(uri).get_metric_history(run_id, key))


# ------------------------------------------------------------------------ the actor
class JobTracker:
    """The job's MLflow writer and in-memory record; run as a Ray actor (``num_cpus=0``)
    by :func:`start_tracker`. Methods are called by workers (rank 0), the controller's
    callbacks and the driver.

    Kept for the driver: ``latest`` metrics (progress), ``attempts`` (per worker-group
    start: world size and the start-up marks ``enter``/``ready``/``first_step`` in
    seconds since the epoch, and the first step), ``events`` (failures, resizes) and the
    controller ``timeline``, and the write counters ``delayed``/``dropped``.
    """

    def __init__(self, uri: str, run_id: str, flush_period_s: float = 1.0):
        self.uri, self.run_id = uri, run_id
        self.latest: dict[str, float] = {}
        self.attempts: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.timeline: list[dict[str, Any]] = []
        self.delayed = self.dropped = 0
        self.last_error: Optional[str] = None
        self._metrics: list[tuple[str, float, int, int]] = []
        self._tags: dict[str, str] = {}
        self._artifacts: dict[str, str] = {}
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._period = flush_period_s
        self._client = None
        self._written = self._requested = 0
        threading.Thread(target=self._loop, name="mlflow-writer", daemon=True).start()

    # -- calls from workers, controller and driver -----------------------------------
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        ts = int(time.time() * 1000)
        with self._lock:
            for k, v in metrics.items():
                self._metrics.append((k, float(v), ts, int(step)))
                self.latest[k] = float(v)
            if len(self._metrics) > MAX_BUFFERED_METRICS:
                extra = len(self._metrics) - MAX_BUFFERED_METRICS
                del self._metrics[:extra]
                self.dropped += extra

    def set_tags(self, tags: dict[str, Any]) -> None:
        with self._lock:
            self._tags.update({k: str(v) for k, v in tags.items()})

    def attempt(self, **marks: Any) -> None:
        """A worker group (re)started: rank 0 reports its world size and ``enter``/``ready``
        marks; ``first_step`` marks (with ``step``) update the newest attempt."""
        with self._lock:
            if "enter" in marks or not self.attempts:
                self.attempts.append(dict(marks))
            else:
                self.attempts[-1].update(marks)

    def event(self, event: Optional[dict[str, Any]] = None, timeline: Optional[dict] = None) -> None:
        """Record a controller event (failure, resize) or a timeline mark; both lists are
        written as artifacts (``events/events.json``, ``events/timeline.json``)."""
        with self._lock:
            if event is not None:
                # The newest step logged before the event: a lower bound of how far the
                # failed attempt got (recomputed steps; exact from the ledger).
                event.setdefault("last_step_seen", int(self.latest.get("step", 0)))
                self.events.append(event)
            if timeline is not None:
                self.timeline.append(timeline)
            self._artifacts["events/events.json"] = json.dumps(self.events, indent=1)
            self._artifacts["events/timeline.json"] = json.dumps(self.timeline, indent=1)

    def update_event(self, index: int, fields: dict[str, Any]) -> None:
        with self._lock:
            self.events[index].update(fields)
            self._artifacts["events/events.json"] = json.dumps(self.events, indent=1)

    def progress(self) -> dict[str, float]:
        with self._lock:
            return dict(self.latest)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"latest": dict(self.latest), "attempts": [dict(a) for a in self.attempts],
                    "events": [dict(e) for e in self.events], "timeline": list(self.timeline),
                    "delayed": self.delayed, "dropped": self.dropped,
                    "pending": len(self._metrics), "last_error": self.last_error}

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything sent so far is written; False when the store is still
        failing after ``timeout_s`` (the rest stays buffered)."""
        with self._cv:
            self._requested += 1
            target = self._requested
            self._cv.notify_all()
            return self._cv.wait_for(lambda: self._written >= target, timeout=timeout_s)

    # -- the writer thread ------------------------------------------------------------
    def _loop(self) -> None:
        backoff = self._period
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._requested > self._written, timeout=backoff)
                target = self._requested
                metrics, tags, arts = self._metrics, self._tags, self._artifacts
                self._metrics, self._tags, self._artifacts = [], {}, {}
            try:
                self._write(metrics, tags, arts)
                backoff = self._period
                with self._cv:
                    self._written = max(self._written, target)
                    self._cv.notify_all()
            except Exception as e:  # noqa: BLE001 - the store is down or locked: retry later
                with self._cv:
                    self._metrics[:0] = metrics
                    self._tags = {**tags, **self._tags}
                    self._artifacts = {**arts, **self._artifacts}
                    self.delayed += len(metrics)
                    self.last_error = f"{type(e).__name__}: {str(e)[:300]}"
                backoff = min(30.0, backoff * 2)

    def _write(self, metrics, tags, arts) -> None:
        if not (metrics or tags or arts):
            return
        from mlflow.entities import Metric, RunTag

        if self._client is None:
            self._client = client(self.uri)
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self.run_id, metrics=[Metric(*m) for m in metrics[i:i + 1000]])
        if tags:
            self._client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        for path, text in arts.items():
            self._client.log_text(self.run_id, text, path)


def start_tracker(uri: str, run_id: str):
    """The job's :class:`JobTracker` actor on this node (no CPU reserved), named after the
    run so a restarted controller finds the same one."""
    import ray

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cls = ray.remote(num_cpus=0, max_concurrency=8)(JobTracker)
    return cls.options(
        name=f"elastic-ddp-tracker-{run_id}", get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                           soft=True),
    ).remote(uri, run_id)


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
