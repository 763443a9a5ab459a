"""What the driver checks before Ray or MLflow starts (every input error surfaces here,
exit 2): the task and its dry run, both splits' footers, storage, ``RAY_ADDRESS``, the
tracking store's address (and that an HTTP one is an MLflow server)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from elastic_ddp.config import Config

if TYPE_CHECKING:
    from elastic_ddp.run_state import Diagnostics, JobSpec
    from elastic_ddp.tasks.dry_run import DryRun


def check_ray_address() -> None:
    """Refuse a ``RAY_ADDRESS`` that does not answer, before anything starts: ``ray.init``
    would wait for its GCS for minutes without saying why.

    Raises:
        ConfigError: ``host:port`` (or ``ray://host:port``) refuses a connection, or
            accepts it and sends nothing, within ``ELASTIC_DDP_CONNECT_TIMEOUT_S``
            (:func:`elastic_ddp.driver.network_checks.check_ray_gcs`).
    """
    from elastic_ddp.driver.network_checks import check_ray_gcs

    addr = os.environ.get("RAY_ADDRESS", "").strip()
    if addr and addr not in ("auto", "local"):
        check_ray_gcs(addr)


# A tracking server's scheme -> its default port, for the reachability check.
_STORE_PORTS = {"http": 80, "https": 443, "postgresql": 5432, "mysql": 3306, "mssql": 1433}
STORE_CONNECT_TIMEOUT_S = 5.0


def tracking_scheme(uri: str) -> str:
    """The store kind of a tracking URI as MLflow reads it: the URL's scheme, lower
    case, without a database driver (``postgresql+psycopg2`` -> ``postgresql``); ""
    for a path."""
    from urllib.parse import urlsplit

    if uri.strip() == "databricks":
        return "databricks"
    try:
        scheme = urlsplit(uri).scheme
    except ValueError:
        scheme = uri.split(":", 1)[0] if ":" in uri else ""
    return scheme.split("+", 1)[0].lower()


def accepted_schemes() -> Optional[list[str]]:
    """MLflow's tracking store schemes and those of installed plugins; None where the
    installed MLflow is not a release the list was tested on (every scheme passes)
    (:func:`elastic_ddp.compat.mlflow_store.tracking_store_schemes`)."""
    from elastic_ddp.compat.mlflow_store import tracking_store_schemes

    return tracking_store_schemes()


def check_tracking_scheme(uri: str, field: str = "run.tracking_uri") -> None:
    """Refuse a tracking URI whose scheme no MLflow store registers (a typo such as
    ``htp://``): MLflow would fail only when the run is opened.

    Raises:
        ConfigError: naming ``field`` and the accepted schemes.
    """
    from elastic_ddp.config import ConfigError

    scheme, accepted = tracking_scheme(uri), accepted_schemes()
    if scheme and accepted is not None and scheme not in accepted:
        raise ConfigError(
            f"{field}={uri!r}: MLflow has no tracking store for the scheme {scheme!r}; use "
            f"one of {', '.join(s + ':' for s in accepted)} (e.g. "
            "http://127.0.0.1:5000, sqlite:////abs/path/mlflow.db), or a directory path")


def check_tracking_uri(uri: str, field: str = "run.tracking_uri") -> None:
    """Refuse a tracking URI MLflow cannot open, before anything starts: a scheme no
    store registers (:func:`check_tracking_scheme`), and a ``sqlite:///`` file whose
    directory does not exist or cannot be written (MLflow would create the directories;
    a missing directory is a typo as often as a missing data path is).

    Raises:
        ConfigError: naming ``field``, the accepted schemes or the directory.
    """
    from elastic_ddp.config import ConfigError
    from elastic_ddp.tracking.store import sqlite_path

    check_tracking_scheme(uri, field)
    db = sqlite_path(uri)
    if db is None or db.exists():
        return
    d = db.parent
    why = (f"the directory {d} does not exist" if not d.exists() else
           f"{d} is not a directory" if not d.is_dir() else
           f"the directory {d} is not writable by this user" if not os.access(d, os.W_OK | os.X_OK)
           else None)
    if why:
        raise ConfigError(f"{field}={uri}: cannot create the MLflow database {db.name} ({why}); "
                          f"create the directory first (mkdir -p {d}), or point {field} at a "
                          "directory you can write")


def check_tracking_store(uri: str, field: str = "run.tracking_uri") -> None:
    """Refuse a tracking URI MLflow cannot use (:func:`check_tracking_uri`) and a
    tracking server nothing answers at, before Ray starts: MLflow's client would retry
    each request for minutes (and the job's own retries on top of that) before failing
    with a traceback. One TCP connection, at most :data:`STORE_CONNECT_TIMEOUT_S`
    seconds, then for ``http(s)://`` one request (:func:`check_mlflow_answers`); a local
    store (``sqlite:``, ``file:``, a path) gets no connection.
    ``field``: where the URI came from, for the message.

    Raises:
        ConfigError: see :func:`check_tracking_uri`; ``http(s)://``, ``postgresql://``,
            ``mysql://`` or ``mssql://`` host:port refuses or does not answer a TCP
            connection in time; an ``http(s)://`` server answers, but not as MLflow.
    """
    import socket
    from urllib.parse import urlsplit

    from elastic_ddp.config import ConfigError

    check_tracking_uri(uri, field)
    scheme = tracking_scheme(uri) if "://" in uri else ""
    if scheme not in _STORE_PORTS:
        return
    try:
        parts = urlsplit(uri)
        host, port = parts.hostname, parts.port or _STORE_PORTS[scheme]
    except ValueError as e:
        raise ConfigError(f"{field}={uri!r}: {e}") from None
    if not host:
        return
    from elastic_ddp.driver.network_checks import bound_mlflow_requests, connect_timeout_s

    timeout = connect_timeout_s()
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        why = "no answer" if isinstance(e, socket.timeout) else (e.strerror or str(e))
        raise ConfigError(
            f"{field}={uri}: the MLflow tracking store does not answer at {host}:{port} "
            f"({why} within {timeout:g} s); start it (mlflow server --host "
            f"{host} --port {port}), point {field} at a running one, or leave run.tracking_uri "
            "and MLFLOW_TRACKING_URI unset for a local sqlite store (mlflow.db)") from None
    if scheme in ("http", "https"):
        check_mlflow_answers(uri, field, host, port, timeout)
        bound_mlflow_requests()  # the job's own requests: MLflow's knobs, bounded


# A request of the kind MLflow's client makes first (an experiment looked up by name),
# relative to the tracking URI; a real server answers it with JSON: the experiment, or
# an MLflow error (RESOURCE_DOES_NOT_EXIST).
_PROBE_PATH = "/api/2.0/mlflow/experiments/get-by-name?experiment_name=Default"
# Answers that do not tell a non-MLflow server apart: authentication (the probe sends no
# credentials), rate limits, a proxy's or the server's own failure (MLflow retries those).
_PROBE_INCONCLUSIVE = (401, 403, 407, 429)


def check_mlflow_answers(uri: str, field: str, host: str, port: int,
                         timeout: float = STORE_CONNECT_TIMEOUT_S) -> None:
    """Refuse an HTTP server that answers but is not MLflow's (a web page, a static file
    server, a wrong path prefix): MLflow's client would fail on its first request after
    the data scan, with a traceback; and one that accepts the connection but does not
    answer (or answers slower than ``timeout`` seconds): MLflow's client would wait
    ``MLFLOW_HTTP_REQUEST_TIMEOUT`` on each of its retries. One GET of MLflow's
    experiment look-up; an answer that is MLflow's JSON (the experiment, or an
    ``error_code``) passes, and so does anything the probe cannot judge: a TLS failure,
    a dropped connection, 401/403/407/429, a 5xx.

    Raises:
        ConfigError: naming ``field``, the URI, the HTTP status and content type that
            answered (or that no answer came in time), and the fix.
    """
    import json
    import urllib.error
    import urllib.request

    from elastic_ddp.config import ConfigError

    url = uri.rstrip("/") + _PROBE_PATH
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, ctype, body = r.status, r.headers.get_content_type(), r.read(1 << 16)
    except urllib.error.HTTPError as e:
        status, ctype = e.code, e.headers.get_content_type() if e.headers else None
        try:
            body = e.read(1 << 16)
        except OSError:
            body = b""
    except (OSError, ValueError) as e:  # no answer in time, TLS, a dropped connection
        if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
            raise ConfigError(
                f"{field}={uri}: the server at {host}:{port} accepted the connection but did not "
                f"answer GET {url.split('?', 1)[0]} within {timeout:g} s; check that the MLflow "
                f"server there is running and not overloaded (mlflow server --host {host} --port "
                f"{port}), point {field} at one that answers, or raise ELASTIC_DDP_CONNECT_TIMEOUT_S "
                "(a slow network)") from None
        return
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    if isinstance(answer, dict) and ("error_code" in answer or "experiment" in answer):
        return
    if status in _PROBE_INCONCLUSIVE or status >= 500:
        return
    raise ConfigError(
        f"{field}={uri}: the server at {host}:{port} is not an MLflow tracking server (GET "
        f"{url.split('?', 1)[0]} answered HTTP {status}, {ctype or 'no content type'}, not "
        f"MLflow's JSON); point {field} at an MLflow tracking server (mlflow server --host "
        f"{host} --port {port}, with its path prefix if it has one) or at a local store (a "
        "directory, file: or sqlite: URI), or leave run.tracking_uri and MLFLOW_TRACKING_URI "
        "unset for a local sqlite store (mlflow.db)")


def tracking_uri_field(cfg: Config) -> str:
    """Where the job's tracking URI comes from: the config field or the variable."""
    return "run.tracking_uri" if cfg.run.tracking_uri else "MLFLOW_TRACKING_URI"


@dataclass
class Prepared:
    """What :func:`prepare` found: the loaded task, both splits' scans
    (``data.scan.DatasetInfo``; ``val_info`` None without ``data.val_path``) and the dry
    run (``tasks.dry_run.DryRun``: the sample rows, the parameter count, the CPU-built
    model)."""

    task: Any
    train_info: Any
    val_info: Any
    dry_run: DryRun

    @property
    def sample(self) -> dict:
        """``{"train": row, "val": row}``: one transformed row of each split."""
        return self.dry_run.sample


def prepare(cfg: Config, task=None) -> Prepared:
    """Everything that can be checked before Ray or MLflow starts: the task (and that
    every job input pickles: ``tasks.pickling``), both
    splits' footers against the task's columns, and a dry run of the task on two rows.

    Raises:
        TaskError, DataError, ConfigError: see :func:`train`.
    """
    from elastic_ddp.data.ingest import epoch_order
    from elastic_ddp.data.scan import DataError, scan_parquet
    from elastic_ddp.driver.storage_checks import check_object_storage
    from elastic_ddp.tasks.dry_run import preflight
    from elastic_ddp.tasks.loading import load_task, model_factory
    from elastic_ddp.tasks.pickling import check_picklable

    task = load_task(cfg, task)
    check_picklable(cfg, task, model_factory(cfg, task))
    cols = task.input_columns()
    d = cfg.data
    check_object_storage(cfg)  # s3:// and gs:// data and storage paths: one line, exit 2
    train_info = scan_parquet(d.train_path, cols, d.id_column, field="data.train_path")
    val_info = scan_parquet(d.val_path, cols, d.id_column, field="data.val_path") if d.val_path else None
    try:
        epoch_order(train_info, cfg, 0)
    except ValueError as e:
        raise DataError(f"{d.train_path}: {e}") from None
    dry = preflight(cfg, task, train_info, val_info)
    check_storage(cfg)
    return Prepared(task, train_info, val_info, dry)


def check_storage(cfg: Config) -> None:
    """A local ``run.storage_path`` must be a directory this process can create and write
    (Ray Train's controller would otherwise die creating it, after the MLflow run opened).
    URIs are left to their file system (credentials may live on the cluster only).

    Raises:
        ConfigError: the directory cannot be created or written, naming it and why.
    """
    from elastic_ddp.config import ConfigError
    from elastic_ddp.paths import is_uri, local_path, uri_to_filesystem

    path = cfg.run.storage_path
    if is_uri(path):
        if not path.lower().startswith("file:"):
            return
        try:  # a file:// URI with a raw '?' or '#', a host, a bad escape
            path = uri_to_filesystem(path)[1]
        except ValueError as e:
            raise ConfigError(f"run.storage_path: {e}") from None
    d = Path(local_path(path))
    # Nothing is created here: the nearest existing ancestor must be a writable directory.
    near = d
    while not near.exists() and near != near.parent:
        near = near.parent
    why = None
    if not near.is_dir():
        why = f"{near} is not a directory"
    elif not os.access(near, os.W_OK | os.X_OK):
        why = f"{near} is not writable by this user"
    if why:
        raise ConfigError(f"run.storage_path={cfg.run.storage_path!r}: cannot create or write {d} "
                          f"({why}); choose a directory you can write, or a URI such as "
                          "s3://bucket/runs")


def process_start_time(pid: Optional[int] = None) -> Optional[float]:
    """When a process (default: this one) started, in seconds since the epoch, from
    /proc (Linux), so that the interpreter's start and the imports count in
    command-to-first-step; None elsewhere.

    /proc gives the start in clock ticks since boot; the boot's epoch time is taken as
    now minus ``CLOCK_BOOTTIME`` (nanoseconds), not from ``btime`` in /proc/stat, which
    is whole seconds and would put the start up to a second early."""
    try:
        stat = Path(f"/proc/{pid or 'self'}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def warn_batch_over_rows(cfg: Config, train_rows: int) -> None:
    """One warning line when a step's global batch (at ``scaling.max_workers``, where
    ``scale_lr`` makes it largest) holds more rows than the training split: every epoch
    is then a single step of all the rows, and nothing said so."""
    import sys

    from elastic_ddp.batching import run_length

    g = run_length(cfg, train_rows, cfg.scaling.max_workers)[1].global_batch_size
    if g <= train_rows:
        return
    size = f"batch.global_batch_size={cfg.batch.global_batch_size}"
    if g != cfg.batch.global_batch_size:
        size += f" ({g} rows a step at {cfg.scaling.max_workers} workers, batch.policy=scale_lr)"
    print(f"elastic-ddp: warning: {size} is more than the {train_rows} training rows: every "
          f"epoch is one step of all {train_rows} rows; set batch.global_batch_size to at most "
          f"{max(1, train_rows * cfg.batch.global_batch_size // g)}, or train on more data",
          file=sys.stderr, flush=True)


def report_skipped(train_info, val_info) -> dict[str, list[str]]:
    """Print once what the scan did not read (hidden entries, non-Parquet files, a
    directory reached twice through symlinks), and return it for the MLflow run."""
    out = {}
    for split, info in (("train", train_info), ("val", val_info)):
        if info is not None and info.skipped:
            out[split] = list(info.skipped)
            shown = "\n".join(f"  {s}" for s in info.skipped[:20])
            more = f"\n  ... and {len(info.skipped) - 20} more" if len(info.skipped) > 20 else ""
            print(f"elastic-ddp: {split} data {info.path}: {len(info.files)} Parquet file(s) read; "
                  f"{len(info.skipped)} entr{'y' if len(info.skipped) == 1 else 'ies'} not read:\n"
                  f"{shown}{more}", flush=True)
    return out


def job_spec(cfg: Config, prep: "Prepared", tracker, t0: float, storage: str,
             diagnostics: Optional[Diagnostics] = None, fence=None) -> JobSpec:
    """What every worker receives (``worker.entry.load_job``): ``cfg`` itself, as the driver
    validated it (the workers use it as it is), the task, both scans and the dry run's
    sample rows from ``prep``, the tracker actor, the job's start ``t0`` (seconds since the
    epoch), the Ray storage root, the ``diagnostics`` and the job's lease token ``fence``
    (``elastic_ddp.fencing.Fence``)."""
    from elastic_ddp.run_state import Diagnostics, JobSpec

    return JobSpec(config=cfg, task=prep.task, train=prep.train_info, val=prep.val_info,
                   tracker=tracker, t0=t0, sample=prep.sample, storage=storage,
                   diagnostics=diagnostics or Diagnostics(), fence=fence)
