"""MLflow, in one place: one run per training job, kept across restarts, resizes and
resubmissions. Every MLflow call of the package is in this package:
``store`` (the store, the run, retries, metric names), ``content`` (params, tags, data
sets, the logged model), ``tracker`` (the job's tracker actor and the workers' client).

- The driver opens (or reopens) the job's run (:func:`open_run`), starts one
  :class:`JobTracker` actor for the job, and closes the run (:func:`finish_run`).
- Workers and the Ray Train controller never import MLflow (but for MLflow's system
  monitor classes in one worker per node, ``node_metrics``): they send metrics, tags,
  start-up marks and events to the tracker actor (fire-and-forget calls through
  :class:`TrackerClient`, a no-op on every rank but 0). The actor holds the MLflow client
  for the whole job, across worker-group restarts, and keeps what the driver needs
  (latest metrics for the progress line, per-attempt marks, events) in memory, so the
  driver never reads metric histories back out of MLflow.
- Tracking never fails training: the actor buffers metrics and retries a store that is
  down or locked (e.g. sqlite ``database is locked``) with back-off; what is delayed or
  dropped is counted and reported in the summary.

What a run holds (so that the MLflow 3 UI reads like a published run):

- Metrics, named for the UI's chart sections (:func:`metric_key`): ``train/<m>`` and
  ``val/<m>`` first (the UI lists sections with a ``/`` prefix in ASCII order, and the
  unprefixed "Model metrics" section last), then ``worker/*`` (per-step time
  breakdown, memory, all-reduce), then the unprefixed ``lr``, ``epoch``,
  ``samples_per_s``, ``world_size``, ``goodput``, ``wall_s``, ``startup_s``,
  ``lost_s_per_fault`` and ``recovery_s`` (at the step training resumed at). MLflow's own ``system/*`` metrics
  (CPU, memory, disk, network, GPU when present) of the driver's machine come from a
  ``SystemMetricsMonitor`` in the MLflow helper process (``opener``), for the job's
  lifetime; every node that hosts workers adds ``system/<node>/*`` (``node_metrics``).
  No timestamps among metrics: times are tags or table artifacts.
- Params: the config fields the job uses (:func:`job_params`: no nulls, no PowerSGD
  fields without ``comm_hook=powersgd``, ...), plus ``world_size``, the task and the
  model's parameter count.
- Tags: MLflow's source and user tags (``mlflow.source.name/type``,
  ``mlflow.source.git.commit`` in a git checkout, ``mlflow.user``), the package
  version, a description (``mlflow.note.content``).
- The training and validation sets as dataset inputs (source = the Parquet path,
  digest = the scan's fingerprint, profile = rows/files/row groups).
- The final model as an MLflow model (``mlflow.pytorch.load_model``-able) and its plain
  ``model/model.pt``; tables (``mlflow.log_table`` JSON) of restart events and the
  start-up profile.
"""

from __future__ import annotations

import hashlib
import json
import os
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


def is_transient(e: BaseException) -> bool:
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
            if not is_transient(e) or time.monotonic() + delay > end:
                raise
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            print(f"elastic-ddp: warning: MLflow store unavailable ({what or getattr(fn, '__name__', 'call')}: "
                  f"{type(e).__name__}: {first}); retrying in {delay:.0f} s", file=sys.stderr, flush=True)
            time.sleep(delay)
            delay = min(10.0, delay * 2)

ARTIFACT_ROOT_TAG = "elastic_ddp.artifact_root"
# MLflow system metrics: seconds between samples (MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL
# overrides). 5 s: a dozen points on the minute-long digits job, 720 an hour.
SYSTEM_METRICS_INTERVAL_S = 5.0

# Raw metric names (as the trainer sends them) kept unprefixed: the "Model metrics"
# section, after the train/ and val/ sections. ``step`` is the x axis, not a metric.
_TOP_LEVEL = {"lr", "epoch", "samples_per_s", "tokens_per_s", "world_size",
              # the driver's job scalars (finish.finish_job)
              "goodput", "wall_s", "startup_s", "recovery_s", "lost_s_per_fault"}
_DROPPED = {"step"}


def metric_key(name: str) -> Optional[str]:
    """The MLflow key of a metric the trainer reports (None: not logged).

    ``train_loss`` -> ``train/loss``, ``val_acc`` -> ``val/acc`` (the task's metrics);
    ``lr``, ``epoch``, ``samples_per_s``, ``tokens_per_s``, ``world_size`` and the
    driver's ``goodput``, ``wall_s``, ``startup_s``, ``recovery_s`` unchanged;
    ``step`` dropped (it is every metric's step already); the per-step time breakdown
    and the rest (``step_time_s_mean``, ``allreduce_s_min``, ``peak_mem_mib_max``...)
    -> ``worker/<name>``. The MLflow 3 UI shows one chart section per ``/`` prefix, in
    ASCII order, so train/ and val/ sort before worker/; a name that already has a
    ``/`` is kept."""
    if name in _DROPPED:
        return None
    if "/" in name or name in _TOP_LEVEL:
        return name
    for raw, section in (("train_", "train/"), ("val_", "val/")):
        if name.startswith(raw):
            return section + name[len(raw):]
    return "worker/" + name


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


def display_rank(key: str) -> int:
    """Where a metric sorts in a write: train/, val/, unprefixed, the rest (worker/)."""
    return (0 if key.startswith("train/") else 1 if key.startswith("val/")
            else 2 if "/" not in key else 3)


def sqlite_path(uri: str) -> Optional[Path]:
    """The database file of a local ``sqlite:///`` URI (None for any other store)."""
    if not uri.startswith("sqlite:///"):
        return None
    from urllib.parse import unquote

    return Path(unquote(uri[len("sqlite:///"):].split("?", 1)[0]))


def experiment_id(uri: str, name: str) -> str:
    """The id of experiment ``name``, created when missing.

    Raises:
        TrackingSetupError: the experiment exists but is deleted (MLflow keeps its name
            and refuses new runs in it).

    In a local sqlite store the experiment's artifacts go to ``mlruns/<id>`` beside the
    database file (not the working directory's ``mlruns``), and the experiment is tagged
    with that relative root (``elastic_ddp.artifact_root``). MLflow itself can only store
    absolute artifact locations for a local store: ``create_experiment`` resolves a
    relative one against the *process's* working directory (``resolve_uri_if_local``),
    and every reader (the Ray tracker actor, ``mlflow ui``, a notebook) would resolve it
    against its own; ``mlflow-artifacts:`` URIs, the relocatable kind, need a tracking
    server. So the location is kept absolute and re-anchored instead: when the store has
    been moved or copied together with its ``mlruns/``, :func:`~elastic_ddp.compat.mlflow_store.anchor_artifacts` points
    the experiment, its runs and its logged models at the new ``mlruns/`` the next time
    a job opens the store.
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
    from elastic_ddp.compat import mlflow_store as compat_mlflow

    db = sqlite_path(uri)
    if exp is None:
        if db is None:
            return retrying(c.create_experiment, name, what="create experiment")
        exp_id = retrying(c.create_experiment, name, tags={ARTIFACT_ROOT_TAG: "mlruns"},
                          what="create experiment")
        compat_mlflow.anchor_artifacts(db, exp_id, c.get_experiment(exp_id).artifact_location)
        return exp_id
    if db is not None and exp.tags.get(ARTIFACT_ROOT_TAG):
        compat_mlflow.anchor_artifacts(db, exp.experiment_id, exp.artifact_location, exp.tags[ARTIFACT_ROOT_TAG])
    return exp.experiment_id


def param_text(value: Any) -> str:
    """A param value as text: strings as they are, anything else as JSON (``true``,
    ``[1, 8, 8]``, ``0.01``), the way ``--set`` takes it back."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def log_params(uri: str, run_id: str, params: dict[str, Any]) -> None:
    """Params in batches of 100 (MLflow's limit per request); values as
    :func:`param_text`, None left out (never the string "None")."""
    from mlflow.entities import Param

    items = [Param(k, param_text(v)[:6000]) for k, v in params.items() if v is not None]
    c = client(uri)
    for i in range(0, len(items), 100):
        retrying(c.log_batch, run_id, params=items[i:i + 100], what="log params")


def finish_run(uri: str, run_id: str, ok: bool, error: str | None = None,
               status: str | None = None, tags: dict[str, Any] | None = None) -> None:
    """Close the run as FINISHED or FAILED; a failed run keeps the error as a tag so the
    store never holds a run that looks alive but is not. ``tags``: more tags, written
    with those."""
    from mlflow.entities import RunTag

    c = client(uri)
    extra = tags or {}
    tags = [RunTag(STATE_TAG, "finished" if ok else "failed")]
    tags += [RunTag(k, str(v)) for k, v in extra.items()]
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



def log_table(uri: str, run_id: str, rows: list[dict[str, Any]], artifact_file: str) -> None:
    """``rows`` as an MLflow table artifact (``MlflowClient.log_table``: JSON with
    ``columns`` and ``data``, shown as a table in the UI's artifact view). Rows logged
    again to the same file are appended (a resumed job adds its submission's rows)."""
    if not rows:
        return
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    client(uri).log_table(run_id, {k: [_cell(r.get(k)) for r in rows] for k in cols}, artifact_file)


def _cell(v: Any) -> Any:
    # Table cells: numbers and text; lists and dicts as JSON text, None as an empty cell.
    if v is None:
        return ""
    return v if isinstance(v, (int, float, str, bool)) else json.dumps(v, default=str)


def log_image(uri: str, run_id: str, png_path: str, key: str, step: int = 0) -> None:
    """A PNG as an MLflow image under ``key`` (``MlflowClient.log_image``): the run's
    "Model metrics" tab shows it as an image chart, not only in the artifact tree."""
    from PIL import Image

    with Image.open(png_path) as im:
        client(uri).log_image(run_id, im.convert("RGB"), key=key, step=step)


def iso_time(t: float) -> str:
    """Seconds since the epoch as local ISO-8601 text with offset (tags, tables: a time
    is never a metric)."""
    from datetime import datetime

    return datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")



def download_artifact(uri: str, run_id: str, path: str, dst: str) -> str:
    return client(uri).download_artifacts(run_id, path, dst)


def metric_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of every logged value of ``key``, sorted by step (reports, tests)."""
    return sorted((int(m.step), m.value) for m in client(uri).get_metric_history(run_id, key))


# ------------------------------------------------------------------------ the actor
