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

What a run holds (so that the MLflow 3 UI reads like a published run):

- Metrics, named for the UI's chart sections (:func:`metric_key`): ``train/<m>`` and
  ``val/<m>`` first (the UI lists sections with a ``/`` prefix in ASCII order, and the
  unprefixed "Model metrics" section last), then ``worker/*`` (per-step time
  breakdown, memory, all-reduce), then the unprefixed ``lr``, ``epoch``,
  ``samples_per_s``, ``world_size``, ``goodput``, ``wall_s``, ``startup_s`` and
  ``recovery_s`` (at the step training resumed at). MLflow's own ``system/*`` metrics
  (CPU, memory, disk, network, GPU when present) come from a ``SystemMetricsMonitor``
  in the tracker actor, for the job's lifetime. No timestamps among metrics: times are
  tags or table artifacts.
- Params: the config fields the job uses (:func:`job_params`: no nulls, no PowerSGD
  fields without ``comm_hook=powersgd``, ...), plus ``world_size``, the task and the
  model's parameter count.
- Tags: MLflow's source and user tags (``mlflow.source.name/type``,
  ``mlflow.source.git.commit`` in a git checkout, ``mlflow.user``), the package
  version, a description (``mlflow.note.content``).
- The training and validation sets as dataset inputs (source = the Parquet path,
  digest = the scan's fingerprint, profile = rows/files/row groups).
- The final model as an MLflow model (``mlflow.pytorch.load_model``-able) and its plain
  ``model/state.pt``; tables (``mlflow.log_table`` JSON) of restart events and the
  start-up profile.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit, urlunsplit

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

ARTIFACT_ROOT_TAG = "elastic_ddp.artifact_root"
# MLflow system metrics: seconds between samples (MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL
# overrides). 5 s: a dozen points on the minute-long digits job, 720 an hour.
SYSTEM_METRICS_INTERVAL_S = 5.0

# Raw metric names (as the trainer sends them) kept unprefixed: the "Model metrics"
# section, after the train/ and val/ sections. ``step`` is the x axis, not a metric.
_TOP_LEVEL = {"lr", "epoch", "samples_per_s", "tokens_per_s", "world_size",
              # the driver's job scalars (launcher._finish)
              "goodput", "wall_s", "startup_s", "recovery_s"}
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


def _display_rank(key: str) -> int:
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
    been moved or copied together with its ``mlruns/``, :func:`anchor_artifacts` points
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
    db = sqlite_path(uri)
    if exp is None:
        if db is None:
            return retrying(c.create_experiment, name, what="create experiment")
        exp_id = retrying(c.create_experiment, name, tags={ARTIFACT_ROOT_TAG: "mlruns"},
                          what="create experiment")
        anchor_artifacts(db, exp_id, c.get_experiment(exp_id).artifact_location)
        return exp_id
    if db is not None and exp.tags.get(ARTIFACT_ROOT_TAG):
        anchor_artifacts(db, exp.experiment_id, exp.artifact_location, exp.tags[ARTIFACT_ROOT_TAG])
    return exp.experiment_id


def anchor_artifacts(db: Path, exp_id: str, current: str, root: str = "mlruns") -> bool:
    """Point experiment ``exp_id`` of the sqlite store ``db`` (and its runs' and logged
    models' artifact locations) at ``<db's folder>/<root>/<exp_id>`` when it points
    elsewhere (the store was moved or copied with its ``mlruns/``, or the experiment was
    just created with MLflow's working-directory default). Returns True when it changed
    anything. MLflow has no API to change an experiment's artifact location, hence the
    three UPDATEs of the tables MLflow's own ORM maps (``experiments``, ``runs``,
    ``logged_models``), in one transaction."""
    import sqlite3

    want = str(db.resolve().parent / root / str(exp_id))
    old = current[len("file://"):] if current.startswith("file://") else current
    if old.rstrip("/") == want:
        return False
    con = sqlite3.connect(str(db), timeout=30)
    try:
        with con:
            con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?",
                        (want, int(exp_id)))
            for table, col in (("runs", "artifact_uri"), ("logged_models", "artifact_location")):
                try:
                    con.execute(f"UPDATE {table} SET {col} = ? || substr({col}, ?) "
                                f"WHERE experiment_id = ? AND substr({col}, 1, ?) = ?",
                                (want, len(current) + 1, int(exp_id), len(current), current))
                except sqlite3.OperationalError:  # an older schema without the table
                    pass
    finally:
        con.close()
    try:  # this process's clients keep each run's artifact repository (old location)
        from mlflow.tracking._tracking_service import utils as _svc

        _svc._artifact_repos_cache.clear()
    except (ImportError, AttributeError):
        pass
    return True


def open_run(cfg: Config, storage_path: str, uri: str, parent_run_id: Optional[str] = None,
             params: Optional[dict[str, Any]] = None, tags: Optional[dict[str, str]] = None,
             run_name: Optional[str] = None) -> tuple[str, bool]:
    """Create the job's MLflow run, or reopen the unfinished one with the same run key.

    ``parent_run_id`` makes a new run a child of that run (MLflow's ``mlflow.parentRunId``
    tag; the UI nests it). ``params`` default to :func:`job_params`. A new run gets
    :func:`source_tags` (user, source, git commit) and a description.

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
    all_tags = {**source_tags(), "mlflow.note.content": describe(cfg), RUN_KEY_TAG: key,
                STATE_TAG: "running", **(tags or {})}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    run = retrying(c.create_run, exp_id, run_name=run_name or cfg.run.name, tags=all_tags,
                   what="create run")
    log_params(uri, run.info.run_id, job_params(cfg) if params is None else params)
    return run.info.run_id, False


def param_text(value: Any) -> str:
    """A param value as text: strings as they are, anything else as JSON (``true``,
    ``[1, 8, 8]``, ``0.01``), the way ``--set`` takes it back."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def job_params(cfg: Config) -> dict[str, str]:
    """The config fields this job uses, as MLflow params (dotted keys, :func:`param_text`
    values). Left out: unset (null) fields; settings of a mode the job does not run
    (PowerSGD fields without ``comm_hook=powersgd``, DDP knobs under fsdp, FSDP's under
    ddp/zero1, ``lr_scaling`` without ``policy=scale_lr``, the windowed order's knobs
    under ``permutation``, ``momentum`` for adamw/lamb, ``betas`` for sgd/lars); where
    things go (``run.tracking_uri``, which may carry credentials, ``run.storage_path``).
    ``model.kwargs``/``task.kwargs`` hold only what the config gives. Added: ``world_size``
    (``2``, or ``1-4`` for an elastic job) and ``parallel.strategy`` always."""
    flat = cfg.to_flat_dict()
    p, o, s = cfg.parallel, cfg.optim, cfg.scaling
    drop = {"run.tracking_uri", "run.storage_path", "run.resume", "run.experiment_name"}
    if p.comm_hook != "powersgd":
        drop |= {"parallel.powersgd_rank", "parallel.powersgd_start_iter"}
    if p.strategy == "fsdp":
        drop |= {"parallel.bucket_cap_mb", "parallel.gradient_as_bucket_view",
                 "parallel.static_graph", "parallel.find_unused_parameters", "parallel.comm_hook"}
    else:
        drop.add("parallel.fsdp_keep_params_between_fwd_bwd")
    if cfg.batch.policy != "scale_lr":
        drop.add("batch.lr_scaling")
    if cfg.data.order == "permutation":
        drop |= {"data.partitions", "data.shuffle_window_rows", "data.block_rows"}
    if o.name in ("adamw", "lamb"):
        drop.add("optim.momentum")
    else:
        drop.add("optim.betas")
    if s.min_workers == s.max_workers:
        drop.add("scaling.resize_monitor_interval_s")  # elastic jobs only
    out = {"world_size": str(s.max_workers) if s.min_workers == s.max_workers
           else f"{s.min_workers}-{s.max_workers}"}
    for k, v in flat.items():
        if v is None or k in drop or v == {} or v == []:
            continue
        out[k] = param_text(v)
    if cfg.data.order == "windowed" and cfg.data.partitions is None:
        out["data.partitions"] = str(cfg.partitions)  # the default it resolved to
    return out


def describe(cfg: Config) -> str:
    """The run's description (``mlflow.note.content``, the Overview's "Description"):
    what was trained on what, and the command that runs it again."""
    s = cfg.scaling
    ws = str(s.max_workers) if s.min_workers == s.max_workers else f"{s.min_workers}-{s.max_workers}"
    task = cfg.task.path or cfg.model.name
    lines = [f"`{task}` on `{cfg.data.train_path}`, {ws} workers "
             f"({cfg.parallel.strategy}), global batch {cfg.batch.global_batch_size}, "
             f"{cfg.train.epochs} epochs" + (f" (at most {cfg.train.max_steps} steps)"
                                            if cfg.train.max_steps else "") + "."]
    cmd = command_line()
    if cmd:
        lines += ["", f"Command: `{cmd}`"]
    return "\n".join(lines)


def command_line() -> Optional[str]:
    """The ``elastic-ddp ...`` command this process runs, or None (Python API, tests)."""
    if Path(sys.argv[0]).name in ("elastic-ddp", "cli.py") and len(sys.argv) > 1:
        return shlex.join(["elastic-ddp", *sys.argv[1:]])
    return None


def git_info(path: Optional[Path] = None) -> dict[str, str]:
    """Commit, branch, remote URL (without any user:password) and dirty flag of the git
    checkout holding ``path`` (default: this package); {} outside a checkout or without
    git."""
    where = str(path or Path(__file__).resolve().parent)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", where, *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        out = {"commit": git("rev-parse", "HEAD")}
    except (OSError, subprocess.SubprocessError):
        return {}
    for key, args in (("branch", ("rev-parse", "--abbrev-ref", "HEAD")),
                      ("repo_url", ("config", "--get", "remote.origin.url")),
                      ("dirty", ("status", "--porcelain", "--untracked-files=no"))):
        try:
            out[key] = git(*args)
        except (OSError, subprocess.SubprocessError):
            pass
    if out.get("repo_url"):
        u = urlsplit(out["repo_url"])
        if u.scheme and "@" in u.netloc:  # https://user:token@host/... -> https://host/...
            out["repo_url"] = urlunsplit((u.scheme, u.netloc.rsplit("@", 1)[1], u.path, "", ""))
    out["dirty"] = "true" if out.get("dirty") else "false"
    return out


def _script_name() -> str:
    """What runs this process when it is not the CLI: the script's name, or the package of
    a ``python -m pkg`` (``pytest``, not ``__main__.py``)."""
    p = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path("python")
    return p.parent.name if p.name == "__main__.py" and p.parent.name else p.name


def source_tags() -> dict[str, str]:
    """MLflow's "Created by" and "Source" tags, which ``MlflowClient.create_run`` (unlike
    ``mlflow.start_run``) does not set: ``mlflow.user``, ``mlflow.source.type`` (JOB
    inside a Ray job, else LOCAL), ``mlflow.source.name`` (the command), and in a git
    checkout ``mlflow.source.git.commit``/``.branch``/``.repoURL`` and
    ``elastic_ddp.git_dirty`` (uncommitted changes to tracked files); plus
    ``elastic_ddp.version``."""
    from elastic_ddp import __version__

    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no login name in some containers
        user = str(os.getuid())
    tags = {"mlflow.user": user,
            "mlflow.source.type": "JOB" if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") else "LOCAL",
            "mlflow.source.name": command_line() or _script_name(),
            "elastic_ddp.version": __version__}
    g = git_info()
    if g:
        tags["mlflow.source.git.commit"] = g["commit"]
        tags["elastic_ddp.git_dirty"] = g["dirty"]
        if g.get("branch") and g["branch"] != "HEAD":
            tags["mlflow.source.git.branch"] = g["branch"]
        if g.get("repo_url"):
            tags["mlflow.source.git.repoURL"] = g["repo_url"]
    return tags


def log_params(uri: str, run_id: str, params: dict[str, Any]) -> None:
    """Params in batches of 100 (MLflow's limit per request); values as
    :func:`param_text`, None left out (never the string "None")."""
    from mlflow.entities import Param

    items = [Param(k, param_text(v)[:6000]) for k, v in params.items() if v is not None]
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


def log_job_inputs(uri: str, run_id: str, cfg: Config, task, train_info, val_info,
                   resumed: bool) -> None:
    """What the job reads, in its run: the training (and validation) set as dataset
    inputs (:func:`log_dataset`) and, for a new run, the params known only once the task
    and the data are loaded: ``task`` (its class), ``model.parameters`` (count, built on
    the meta device: no memory), ``data.train_rows``/``data.val_rows``."""
    log_dataset(uri, run_id, train_info, "training")
    if val_info is not None:
        log_dataset(uri, run_id, val_info, "validation")
    if resumed:
        return  # params are write-once; the first submission logged them
    extra: dict[str, Any] = {"data.train_rows": train_info.num_rows}
    if val_info is not None:
        extra["data.val_rows"] = val_info.num_rows
    if task is not None:
        extra["task"] = f"{type(task).__module__}.{type(task).__qualname__}"
        try:
            import torch

            from elastic_ddp.tasks.loading import build_model

            with torch.device("meta"):
                model = build_model(cfg, task)
            extra["model.parameters"] = sum(p.numel() for p in model.parameters())
        except Exception:  # noqa: BLE001 - a model the meta device cannot build
            pass
    log_params(uri, run_id, extra)


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


def log_dataset(uri: str, run_id: str, info, context: str) -> None:
    """A data set the job read (``data.scan.DatasetInfo``) as an MLflow dataset input
    (the run's "Datasets" and the experiment's dataset filter): name ``<folder>/<split>``,
    source the Parquet path (``local``), digest the scan's fingerprint (changes when rows
    are added, removed or renumbered), the Arrow schema of the columns read, and a profile
    (rows, files, row groups, compressed bytes read). ``context``: ``training`` or
    ``validation`` (the ``mlflow.data.context`` tag)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    p = Path(info.path)
    path = str(p if "://" in info.path else p.resolve())
    source = json.dumps({"uri": path if "://" in path else Path(path).as_uri()})
    profile = {"num_rows": info.num_rows, "num_files": len(info.files),
               "num_row_groups": len(info.row_groups),
               "compressed_bytes_read": int(sum(g.nbytes for g in info.row_groups)),
               "id_column": info.id_column}
    ds = Dataset(name=f"{p.parent.name}/{p.name}" if p.parent.name else p.name,
                 digest=info.fingerprint[:16], source_type="local", source=source,
                 schema=json.dumps({"mlflow_colspec": _colspec(info.schema)}),
                 profile=json.dumps(profile))
    client(uri).log_inputs(run_id, datasets=[DatasetInput(ds, [InputTag("mlflow.data.context", context)])])


def _colspec(schema) -> list[dict[str, Any]]:
    """An Arrow schema as MLflow ColSpec JSON (``{"type", "name", "required"}``; a list
    column as an ``array`` of its element type)."""
    import pyarrow as pa

    def kind(t) -> dict[str, Any]:
        if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            return {"type": "array", "items": kind(t.value_type)}
        if pa.types.is_boolean(t):
            return {"type": "boolean"}
        if pa.types.is_integer(t):
            return {"type": "long" if t.bit_width > 32 else "integer"}
        if pa.types.is_floating(t):
            return {"type": "double" if t.bit_width > 32 else "float"}
        if pa.types.is_binary(t) or pa.types.is_large_binary(t):
            return {"type": "binary"}
        return {"type": "string"}

    return [{"name": f.name, "required": not f.nullable, **kind(f.type)} for f in schema]


def log_model(uri: str, run_id: str, model, example: Optional[tuple] = None, step: int = 0,
              name: str = "model") -> Optional[str]:
    """``model`` (a plain ``nn.Module`` on the CPU) as an MLflow PyTorch model of the run,
    loadable with ``mlflow.pytorch.load_model(f"runs:/{run_id}/{name}")`` or
    ``models:/<model id>``; returns the model id.

    The model is pickled by reference to its classes: elastic_ddp is shipped inside the
    model (``code_paths``) so it loads where elastic_ddp is not installed; a user's task
    module loaded from a file is pickled by value (``tasks.loading``). ``example``:
    (input, output) of one forward call, for the model's signature (tensor specs). The
    pip requirements are given (torch, mlflow) rather than inferred: inference imports the
    model in a subprocess, several seconds for nothing new."""
    import mlflow
    import mlflow.pytorch
    import torch

    signature = None
    if example is not None:
        from mlflow.models import infer_signature

        x, y = example
        if torch.is_tensor(x) and torch.is_tensor(y):
            signature = infer_signature(x.detach().cpu().numpy(), y.detach().cpu().float().numpy())
    import logging

    pkg = Path(__file__).resolve().parent
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    # Its warning that pickled models run code when loaded: true of any full-model pickle,
    # and said once in the README; the weights-only model/state.pt is the safe copy.
    pt_logger = logging.getLogger("mlflow.pytorch")
    pt_level = pt_logger.level
    pt_logger.setLevel(logging.ERROR)
    try:
        # Created here, in the run's experiment: Model.log alone would create it in the
        # process's active (fluent) experiment, "Default", away from its run.
        c = client(uri)
        run = c.get_run(run_id)
        logged = c.create_logged_model(run.info.experiment_id, name=name, source_run_id=run_id,
                                       params=dict(run.data.params))
        info = mlflow.pytorch.log_model(
            model, name=name, run_id=run_id, model_id=logged.model_id, step=step, signature=signature,
            # pickle, not MLflow 3's default pt2 (torch.export): an exported program is
            # traced at the example's batch size; the pickled module takes any batch.
            serialization_format="pickle", code_paths=[str(pkg)],
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}",
                              f"mlflow=={mlflow.__version__}"])
    finally:
        mlflow.set_tracking_uri(previous)
        pt_logger.setLevel(pt_level)
    return info.model_id


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
                 attempts_before: int = 0, world_sizes_before: Optional[list] = None,
                 system_metrics: bool = True):
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
        self._sysmon = start_system_metrics(uri, run_id) if system_metrics else None

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

    def close(self, timeout_s: float = 30.0) -> bool:
        """Stop the system-metrics monitor (its last samples written) and flush; the
        driver calls it before it closes the run."""
        if self._sysmon is not None:
            try:
                self._sysmon.finish()
            except Exception:  # noqa: BLE001 - monitoring must never fail the job
                pass
            self._sysmon = None
        return self.flush(timeout_s)

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
        # train/ and val/ first: the Overview's metrics table lists keys in the order the
        # store first saw them.
        metrics = sorted(metrics, key=lambda m: (_display_rank(m[0]), m[3], m[2]))
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self.run_id, metrics=[Metric(*m) for m in metrics[i:i + 1000]])
        if tags:
            self._client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        for path, text in arts.items():
            self._client.log_text(self.run_id, text, path)


def start_system_metrics(uri: str, run_id: str, interval_s: float = SYSTEM_METRICS_INTERVAL_S):
    """MLflow's ``SystemMetricsMonitor`` for the run (``system/*``: CPU %, memory, disk,
    network, and GPU utilisation/memory/power when NVML finds a GPU), sampling this
    machine every ``interval_s`` seconds until the run stops RUNNING or ``finish()``.
    A resumed job's samples continue the run's system steps. None when psutil is
    missing or the monitor cannot start (monitoring never stops a job)."""
    import logging

    try:
        import psutil  # noqa: F401 - what MLflow's CPU, memory, disk and network monitors read
    except ImportError:
        return None
    try:
        import pynvml  # noqa: F401 - nvidia-ml-py: MLflow's GPU monitor (NVML), where a GPU is
    except ImportError:
        pass
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        # Its "Started monitoring"/"Skip logging GPU metrics" INFO lines: the actor's log.
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        mon = SystemMetricsMonitor(run_id, sampling_interval=interval_s, resume_logging=True,
                                   tracking_uri=uri)
        mon.start()
        return mon
    except Exception:  # noqa: BLE001 - psutil missing, store unreachable
        return None


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
