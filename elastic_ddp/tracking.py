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

from elastic_ddp.config import Config, ConfigError

RUN_KEY_TAG = "elastic_ddp.run_key"
STATE_TAG = "elastic_ddp.state"
ATTEMPTS_TAG = "elastic_ddp.attempts"            # worker-group starts of the job so far
WORLD_SIZES_TAG = "elastic_ddp.world_sizes_seen"
# Metrics held for a store that is down, at most (the oldest are dropped past this).
MAX_BUFFERED_METRICS = 200_000
# How long a driver-side MLflow call keeps retrying a store that is down or locked
# (sqlite "database is locked" after MLflow's own 20 s busy timeout, a server's 5xx).
STORE_RETRY_S = 180.0


class TrackingSetupError(ConfigError):
    """The tracking store refuses the job before any run is created (e.g. its experiment
    is deleted); the message says what to do (the CLI's exit 2)."""


def _transient(e: BaseException) -> bool:
    """A store error worth retrying: locked, unreachable, overloaded. Requests MLflow
    itself rejects (a bad name, a deleted experiment, a missing run) are not."""
    code = getattr(e, "error_code", None)
    if code in ("INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE",
                "RESOURCE_ALREADY_EXISTS", "PERMISSION_DENIED", "UNAUTHENTICATED"):
        return False
    text = f"{type(e).__name__}: {e}"
    return code in ("TEMPORARILY_UNAVAILABLE", "INTERNAL_ERROR", "REQUEST_LIMIT_EXCEEDED") or any(
        w in text for w in ("database is locked", "database table is locked", "OperationalError",
                            "ConnectionError", "Connection refused", "Connection reset",
                            "timed out", "Timeout", "Max retries exceeded", " 502", " 503",
                            " 504", "Service Unavailable", "Bad Gateway"))


def retrying(fn, *args, budget_s: Optional[float] = None, what: str = "", **kwargs):
    """``fn(*args, **kwargs)``, retried with back-off (1 s doubling to 10 s) while the
    store's errors are transient, for ``budget_s`` (default :data:`STORE_RETRY_S`).
    Each retry is one line on stderr, so a wait is never silent.

    Raises:
        the last error when it is not transient or the budget is spent.
    """
    import sys

    budget = STORE_RETRY_S if budget_s is None else budget_s
    end = time.monotonic() + budget
    delay = 1.0
    while True:
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - classified below
            if not _transient(e) or time.monotonic() + delay > end:
                raise
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            print(f"elastic-ddp: warning: MLflow store unavailable ({what or getattr(fn, '__name__', 'call')}: "
                  f"{type(e).__name__}: {first}); retrying in {delay:.0f} s", file=sys.stderr, flush=True)
            time.sleep(delay)
            delay = min(10.0, delay * 2)


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
    """The id of experiment ``name``, created when missing.

    Raises:
        TrackingSetupError: the experiment exists but is deleted (MLflow keeps its name
            and refuses new runs in it).
    """
    c = client(uri)
    exp = retrying(c.get_experiment_by_name, name, what="get experiment")
    if exp is not None and exp.lifecycle_stage == "deleted":
        raise TrackingSetupError(
            f"run.experiment_name={name!r}: MLflow experiment {exp.experiment_id} of that name is "
            f"deleted in the tracking store {uri}, and MLflow creates no run in a deleted "
            f"experiment (its name stays taken until `mlflow gc` purges it). Restore it: "
            f"MLFLOW_TRACKING_URI='{uri}' mlflow experiments restore --experiment-id "
            f"{exp.experiment_id}; or set run.experiment_name to another name")
    return exp.experiment_id if exp else retrying(c.create_experiment, name, what="create experiment")


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
        runs = retrying(c.search_runs, [exp_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{key}'",
                        order_by=["attributes.start_time DESC"], max_results=1, what="search runs")
        if runs and runs[0].info.status != "FINISHED":
            retrying(c.update_run, runs[0].info.run_id, status="RUNNING", what="reopen run")
            return runs[0].info.run_id, True
    all_tags = {RUN_KEY_TAG: key, STATE_TAG: "running", **(tags or {})}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    run = retrying(c.create_run, exp_id, run_name=run_name or cfg.run.name, tags=all_tags,
                   what="create run")
    log_params(uri, run.info.run_id, cfg.to_flat_dict() if params is None else params)
    return run.info.run_id, False


def log_params(uri: str, run_id: str, params: dict[str, Any]) -> None:
    """Params in batches of 100 (MLflow's limit per request)."""
    from mlflow.entities import Param

    items = [Param(k, str(v)[:6000]) for k, v in params.items()]
    c = client(uri)
    for i in range(0, len(items), 100):
        retrying(c.log_batch, run_id, params=items[i:i + 100], what="log params")


def finish_run(uri: str, run_id: str, ok: bool, error: str | None = None,
               status: str | None = None) -> None:
    """Close the run as FINISHED or FAILED; a failed run keeps the error as a tag so the
    store never holds a run that looks alive but is not."""
    from mlflow.entities import RunTag

    c = client(uri)
    tags = [RunTag(STATE_TAG, "finished" if ok else "failed")]
    if error:
        tags.append(RunTag("elastic_ddp.error", error[:5000]))
    retrying(c.log_batch, run_id, tags=tags, what="close run")
    retrying(c.set_terminated, run_id, status=status or ("FINISHED" if ok else "FAILED"),
             what="close run")


def run_info(uri: str, run_id: str):
    """The run's ``mlflow.entities.Run``."""
    return retrying(client(uri).get_run, run_id, what="get run")


def set_tags(uri: str, run_id: str, tags: dict[str, Any]) -> None:
    from mlflow.entities import RunTag

    retrying(client(uri).log_batch, run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()],
             what="set tags")


def log_metrics(uri: str, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    from mlflow.entities import Metric

    ts = int(time.time() * 1000)
    retrying(client(uri).log_batch, run_id,
             metrics=[Metric(k, float(v), ts, int(step)) for k, v in metrics.items()],
             what="log metrics")


def log_text(uri: str, run_id: str, text: str, artifact_file: str) -> None:
    retrying(client(uri).log_text, run_id, text, artifact_file, what="log artifact")


def log_artifact(uri: str, run_id: str, local_path: str, artifact_path: Optional[str] = None) -> None:
    retrying(client(uri).log_artifact, run_id, local_path, artifact_path, what="log artifact")


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

    def __init__(self, uri: str, run_id: str, flush_period_s: float = 1.0,
                 attempts_before: int = 0, world_sizes_before: Optional[list] = None):
        self.uri, self.run_id = uri, run_id
        # Worker-group starts of this job in earlier submissions (the run's tags), so the
        # restart count holds across resubmissions.
        self._attempts = int(attempts_before)
        self._world_sizes = [int(w) for w in (world_sizes_before or [])]
        self._outage_since: Optional[float] = None
        self.unavailable_s = 0.0
        self._early_updates: dict[int, dict[str, Any]] = {}
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

    def start_attempt(self, world_size: int) -> dict[str, Any]:
        """A worker group's rank 0 starts (restored its checkpoint): count it. Returns
        ``{"attempts": starts of this job so far, this one included, "world_sizes": their
        world sizes}``; also kept as the run's tags for a resubmission."""
        with self._lock:
            self._attempts += 1
            self._world_sizes.append(int(world_size))
            self._tags[ATTEMPTS_TAG] = str(self._attempts)
            self._tags[WORLD_SIZES_TAG] = json.dumps(self._world_sizes)
            return {"attempts": self._attempts, "world_sizes": list(self._world_sizes)}

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
                # A threaded actor may run the controller's calls out of order: an update
                # can arrive before its event, and events before earlier ones.
                event.update(self._early_updates.pop(event.get("index"), {}))
                self.events.append(event)
                self.events.sort(key=lambda e: e.get("index", 0))
            if timeline is not None:
                self.timeline.append(timeline)
            self._artifacts["events/events.json"] = json.dumps(self.events, indent=1)
            self._artifacts["events/timeline.json"] = json.dumps(self.timeline, indent=1)

    def update_event(self, index: int, fields: dict[str, Any]) -> None:
        with self._lock:
            ev = next((e for e in self.events if e.get("index") == index), None)
            if ev is None:
                self._early_updates.setdefault(index, {}).update(fields)
                return
            ev.update(fields)
            self._artifacts["events/events.json"] = json.dumps(self.events, indent=1)

    def progress(self) -> dict[str, float]:
        with self._lock:
            return dict(self.latest)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"latest": dict(self.latest), "attempts": [dict(a) for a in self.attempts],
                    "events": [dict(e) for e in self.events], "timeline": list(self.timeline),
                    "delayed": self.delayed, "dropped": self.dropped,
                    "pending": len(self._metrics), "last_error": self.last_error,
                    "unavailable_s": round(self.unavailable_s + (
                        time.time() - self._outage_since if self._outage_since else 0.0), 1)}

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
                if not _transient(e):
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
                if _transient(e):
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
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self.run_id, metrics=[Metric(*m) for m in metrics[i:i + 1000]])
        if tags:
            self._client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        for path, text in arts.items():
            self._client.log_text(self.run_id, text, path)


def start_tracker(uri: str, run_id: str, resumed: bool = False):
    """The job's :class:`JobTracker` actor on this node (no CPU reserved), named after the
    run so a restarted controller finds the same one. ``resumed``: the run is an earlier
    submission's; its worker-group starts so far are read from the run's tags."""
    import ray

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cls = ray.remote(num_cpus=0, max_concurrency=8)(JobTracker)
    return cls.options(
        name=f"elastic-ddp-tracker-{run_id}", get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                           soft=True),
    ).remote(uri, run_id, **(_attempts_so_far(uri, run_id) if resumed else {}))


def _attempts_so_far(uri: str, run_id: str) -> dict[str, Any]:
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
