"""Build and run the ``TorchTrainer`` for a config: the driver side of one job.

    from elastic_ddp import Config, train
    summary = train(Config.load("experiments/configs/digits_cnn.yaml"))

Steps: scan the Parquet footers (errors before anything starts) -> connect to Ray ->
open (or reopen) the job's MLflow run -> TorchTrainer(ScalingConfig((min, max)),
FailureConfig, CheckpointConfig, callbacks) -> fit with a progress display -> final model
artifact, restart events and goodput into the run -> summary.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from elastic_ddp.config import Config
from elastic_ddp.tracking import default_tracking_uri, finish_run, latest_metrics, open_run


class TrainingError(RuntimeError):
    """The job failed after its restart budget, or on a deterministic error. The MLflow
    run is closed as FAILED with the error as a tag; the last checkpoint is kept."""


@dataclass
class Summary:
    """What a finished job reports (also logged to MLflow as ``summary.json``)."""

    run_id: str
    tracking_uri: str
    experiment_id: str
    metrics: dict[str, float]
    steps: int
    epochs: int
    wall_s: float
    world_sizes_seen: list[int]
    restarts: int
    goodput: float
    events: list[dict] = field(default_factory=list)
    startup: dict[str, float] = field(default_factory=dict)
    checkpoint_path: Optional[str] = None
    mlflow_ui_command: str = ""


def _storage_path(cfg: Config) -> str:
    p = cfg.run.storage_path
    return p if "://" in p else str(Path(p).expanduser().resolve())


# Parquet bytes on disk up to which a materialized data set is read on the driver.
_DRIVER_READ_MAX_BYTES = 64 * 2**20


def _init_ray(cfg: Config) -> None:
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True)
        return
    # A laptop/CI run: a local cluster with enough logical CPUs for max_workers plus
    # Ray Data's read tasks; the workers set their own torch thread counts.
    # address="local": without it ray.init auto-attaches to any Ray instance running on
    # this machine (another user's `ray start`) and then refuses num_cpus.
    need = int(cfg.scaling.max_workers * cfg.scaling.cpus_per_worker) + 2
    ray.init(address="local", num_cpus=max(need, os.cpu_count() or 1), include_dashboard=False,
             configure_logging=True, logging_level="WARNING")


class _Background:
    """``fn(*args)`` in a daemon thread; ``result()`` joins it and returns its value or
    re-raises its exception in the caller's thread."""

    def __init__(self, fn, *args):
        self._out: list = []
        self._err: list = []

        def run():
            try:
                self._out.append(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to result()
                self._err.append(e)

        self._thread = threading.Thread(target=run, name="driver-setup", daemon=True)
        self._thread.start()

    def result(self):
        self._thread.join()
        if self._err:
            raise self._err[0]
        return self._out[0]


def _driver_setup(cfg: Config, storage: str, uri: str, parent_run_id: Optional[str],
                  train_info, val_info):
    """What the driver needs besides Ray: the job's MLflow run (opened or reopened), the
    Ray run name, torch and Ray Train imported, and small data sets read into memory.
    Returns (run_id, resumed, cfg, tables)."""
    run_id, resumed = open_run(cfg, storage, uri, parent_run_id=parent_run_id)
    cfg = _with_ray_run_name(cfg, storage, uri, run_id, resumed)
    import ray.train.torch  # noqa: F401 - the import cost, paid while Ray starts

    tables = {"train": _read_small(cfg, train_info.files)}
    if val_info is not None:
        tables["val"] = _read_small(cfg, val_info.files)
    return run_id, resumed, cfg, tables


def _read_small(cfg: Config, files: list[str]):
    """A small materialized data set as one pyarrow table (None: leave it to Ray Data).

    Read here and handed to Ray Data with ``from_arrow``: no read tasks to schedule. A
    ``read_parquet`` execution costs ~8 s of fixed overhead on an idle 2-core machine
    (over a minute under load), ``from_arrow`` ~0.2 s for digits. Costs a transient
    driver copy, hence the size cap; larger sets keep the parallel reader."""
    if not cfg.data.materialize or sum(os.path.getsize(f) for f in files) > _DRIVER_READ_MAX_BYTES:
        return None
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = cfg.data
    cols = [d.id_column, d.feature_column] + ([d.label_column] if d.label_column else [])
    return pa.concat_tables([pq.read_table(f, columns=cols) for f in files])


def build_trainer(cfg: Config, run_id: str, tracking_uri: str, train_info, val_info,
                  ledger_dir: Optional[str] = None, t0: Optional[float] = None,
                  fault: Optional[dict] = None, tables: Optional[dict] = None):
    """The ``TorchTrainer`` for ``cfg`` (not yet fitted). Exposed for tests and experiments.

    ``fault`` is a test hook passed to the workers as ``job["fault"]`` (see
    ``worker._Fault``): a worker kills itself or raises at a chosen step. ``tables``:
    data sets already read by ``_read_small`` ({"train": table or None, "val": ...}).
    """
    import ray
    import ray.data
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from elastic_ddp.events import ControllerEvents, ElasticEvents
    from elastic_ddp.worker import train_func

    s = cfg.scaling
    # Read by the Ray Train controller when it starts (propagated from this process).
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(s.health_check_interval_s)
    use_gpu = s.use_gpu if s.use_gpu != "auto" else ray.cluster_resources().get("GPU", 0) > 0
    num_workers: Any = s.min_workers if s.min_workers == s.max_workers else (s.min_workers, s.max_workers)
    cols = [cfg.data.id_column, cfg.data.feature_column] + ([cfg.data.label_column] if cfg.data.label_column else [])
    ray.data.DataContext.get_current().enable_progress_bars = False

    tables = tables or {}

    def read(name: str, files):
        table = tables[name] if name in tables else _read_small(cfg, files)
        if table is not None:
            return ray.data.from_arrow(table)
        ds = ray.data.read_parquet(files, columns=cols)
        return ds.materialize() if cfg.data.materialize else ds

    datasets = {"train": read("train", train_info.files)}
    if val_info is not None:
        datasets["val"] = read("val", val_info.files)
    sink = ElasticEvents(tracking_uri, run_id)
    loop_config = {
        "config": cfg.model_dump(mode="json"),
        "job": {
            "run_id": run_id, "tracking_uri": tracking_uri, "t0": t0 or time.time(),
            "train_ids": train_info.sample_ids,
            "val_ids": val_info.sample_ids if val_info is not None else None,
            "ledger_dir": ledger_dir,
            "fault": fault,
        },
    }
    return TorchTrainer(
        train_func,
        train_loop_config=loop_config,
        # NCCL on GPUs, gloo on CPUs; the timeout bounds how long a rank waits in a
        # collective for a dead peer before Ray Train tears the group down.
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo",
                                 timeout_s=s.collective_timeout_s),
        scaling_config=ScalingConfig(
            num_workers=num_workers, use_gpu=use_gpu,
            elastic_resize_monitor_interval_s=s.resize_monitor_interval_s,
            resources_per_worker={"CPU": s.cpus_per_worker, **({"GPU": 1} if use_gpu else {})},
        ),
        run_config=RunConfig(
            name=cfg.run.name,
            storage_path=_storage_path(cfg),
            failure_config=FailureConfig(max_failures=s.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.train.keep_checkpoints),
            callbacks=[sink, ControllerEvents(sink)],
        ),
        datasets=datasets,
        # Every rank reads the whole data set and keeps its own rows (see worker.read_rows):
        # the split is by sample_id, decided by the batch plan, not by Ray Data.
        dataset_config=DataConfig(datasets_to_split=[]),
    )


class _Progress:
    """Driver-side progress: polls the run's latest metrics in MLflow every ``period``
    seconds. A rich live line on a terminal, plain log lines otherwise."""

    def __init__(self, uri: str, run_id: str, total_steps: int, period: float = 2.0):
        self.uri, self.run_id, self.total, self.period = uri, run_id, total_steps, period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._last = -1

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        tty = sys.stdout.isatty()
        bar = None
        if tty:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                           TimeElapsedColumn(), transient=False)
            task = bar.add_task("training", total=self.total)
            bar.start()
        try:
            while not self._stop.wait(self.period):
                try:
                    m = latest_metrics(self.uri, self.run_id)
                except Exception:  # noqa: BLE001 - display only
                    continue
                step = int(m.get("step", 0))
                if step == 0:
                    continue  # nothing trained yet: no line of nan and zeros
                desc = (f"epoch {int(m.get('epoch', 0))} step {step} loss {m.get('train_loss', float('nan')):.4f} "
                        f"{m.get('samples_per_s', 0):.0f} samples/s world_size {int(m.get('world_size', 0))}")
                if bar is not None:
                    bar.update(task, completed=step, description=desc)
                elif step != self._last:
                    print(f"[progress] {desc}", flush=True)
                self._last = step
        finally:
            if bar is not None:
                bar.stop()


def train(cfg: Config, ledger_dir: Optional[str] = None, progress: bool = True,
          fault: Optional[dict] = None, parent_run_id: Optional[str] = None,
          command_start: Optional[float] = None) -> Summary:
    """Run one training job to the end and return its ``Summary``.

    ``ledger_dir``: write the per-step sample-id ledger there (``elastic_ddp.ledger``
    audits it). ``fault``: TEST HOOK, a worker kills itself or raises at a chosen step
    (``worker._Fault``); never set it in a real job. ``parent_run_id``: open the MLflow
    run as a child of this run (``elastic_ddp.sweep``). ``command_start``: when the
    command started (seconds since the epoch; the CLI passes its process start), so the
    command-to-first-step profile (``Summary.startup``) includes interpreter start and
    imports; default: from this call.

    Raises:
        DataError: the Parquet data fails the footer scan (nothing was started).
        TrainingError: training failed beyond its restart budget or deterministically;
            the MLflow run is closed as FAILED.
    """
    from elastic_ddp.batching import steps_in_epoch
    from elastic_ddp.data.scan import scan_parquet

    t0 = time.time()
    marks = {"process_start": command_start or t0, "train_called": t0}
    d = cfg.data
    train_info = scan_parquet(d.train_path, d.feature_column, d.id_column, d.label_column)
    val_info = scan_parquet(d.val_path, d.feature_column, d.id_column, d.label_column) if d.val_path else None
    _check_model_fits_data(cfg, train_info)

    t_scan = time.time()
    uri = default_tracking_uri(cfg)
    storage = _storage_path(cfg)
    # ray.init mostly waits for its GCS and raylet processes to come up (~6 s here); the
    # driver's own set-up runs beside it in a thread: opening the MLflow run (importing
    # mlflow, the sqlite store), importing ray.train.torch (torch itself, ~2.5 s) and the
    # pyarrow read of small data sets. Measured on the 2-core dev box: ~5 s less
    # command-to-first-step. Errors in the thread are re-raised here, after ray.init.
    side = _Background(_driver_setup, cfg, storage, uri, parent_run_id, train_info, val_info)
    _init_ray(cfg)
    t_ray = time.time()
    run_id, resumed, cfg, tables = side.result()
    marks.update(scanned=t_scan, ray_ready=t_ray)
    total_steps = steps_in_epoch(train_info.num_rows, cfg.batch.global_batch_size) * cfg.train.epochs
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)
    print(f"elastic-ddp: run {cfg.run.name!r} -> MLflow run {run_id} ({'resumed' if resumed else 'new'}) "
          f"at {uri}; {train_info.num_rows} train rows in {len(train_info.files)} files; "
          f"{total_steps} steps", flush=True)

    try:
        trainer = build_trainer(cfg, run_id, uri, train_info, val_info, ledger_dir, t0,
                                fault, tables=tables)
        marks["fit_called"] = time.time()
        if progress:
            with _Progress(uri, run_id, total_steps):
                result = trainer.fit()
        else:
            result = trainer.fit()
    except Exception as e:  # noqa: BLE001 - re-raised as TrainingError with the cause
        msg = f"{type(e).__name__}: {e}"
        _log_events(uri, run_id, t0, ledger_dir)
        finish_run(uri, run_id, ok=False, error=msg)
        raise TrainingError(f"training failed (MLflow run {run_id} marked FAILED): {msg}") from e
    except BaseException:
        # Ctrl-C or SystemExit: the run must not stay RUNNING in the store; checkpoints
        # are kept, so resubmitting the same run.name resumes it.
        finish_run(uri, run_id, ok=False, error="interrupted", status="KILLED")
        raise
    return _finish(cfg, uri, run_id, result, t0, ledger_dir, marks)


RAY_RUN_NAME_TAG = "elastic_ddp.ray_run_name"


def _with_ray_run_name(cfg: Config, storage: str, uri: str, run_id: str, resumed: bool) -> Config:
    """The Ray Train run directory for this job. Ray Train restores a run from
    ``storage_path/name`` by itself, so an unfinished job resumes by reusing the name its
    MLflow run recorded, while a new job whose name is already taken by a finished one
    gets ``name-<run id prefix>`` instead of silently "resuming" a completed run with zero
    steps (running ``make train`` twice trains twice)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    ray_name = client.get_run(run_id).data.tags.get(RAY_RUN_NAME_TAG) if resumed else None
    if ray_name is None:
        ray_name = cfg.run.name
        if not resumed and _run_dir_exists(storage, ray_name):
            ray_name = f"{cfg.run.name}-{run_id[:8]}"
        client.set_tag(run_id, RAY_RUN_NAME_TAG, ray_name)
    if ray_name == cfg.run.name:
        return cfg
    out = cfg.model_copy(deep=True)
    out.run.name = ray_name
    return out


def _run_dir_exists(storage: str, name: str) -> bool:
    import pyarrow.fs

    fs, base = pyarrow.fs.FileSystem.from_uri(storage if "://" in storage else f"file://{storage}")
    return fs.get_file_info(f"{base.rstrip('/')}/{name}").type != pyarrow.fs.FileType.NotFound


def _check_model_fits_data(cfg: Config, info) -> None:
    from math import prod

    from elastic_ddp.data.scan import DataError

    m = cfg.model
    if info.feature_len is None:
        return
    if m.name in ("mlp", "cnn") and prod(m.input_shape) != info.feature_len:
        raise DataError(f"{info.files[0]}: column {cfg.data.feature_column!r} has {info.feature_len} "
                        f"values per row but model.input_shape={m.input_shape} needs {prod(m.input_shape)}; "
                        f"fix model.input_shape")
    if m.name == "gpt" and info.feature_len - 1 > m.block_size:
        raise DataError(f"{info.files[0]}: column {cfg.data.feature_column!r} windows of {info.feature_len} "
                        f"tokens exceed model.block_size+1={m.block_size + 1}; raise model.block_size")
    if m.name != "gpt" and not cfg.data.label_column:
        raise DataError(f"data.label_column is null but model {m.name!r} is a classifier; name the label column")
    if m.name != "gpt" and info.num_classes_seen and info.num_classes_seen > m.num_classes:
        raise DataError(f"{info.path}: column {cfg.data.label_column!r} has labels up to "
                        f"{info.num_classes_seen - 1} but model.num_classes={m.num_classes}; raise it")


def _log_events(uri: str, run_id: str, t0: float, ledger_dir: Optional[str] = None) -> list[dict]:
    """Join the controller's events with the workers' first-step times into recovery
    seconds, and log them (metric ``recovery_s`` per event, ``events/recovery.json``).

    Per event: ``recovery_s`` = first step of the next attempt (rank 0's
    ``attempt_first_step_ts``) - the controller's event time, so it includes worker
    start, checkpoint load and the data read; ``resumed_at_step``; ``steps_recomputed``
    = steps the failed attempt had run past its last checkpoint. Without a ledger the
    last is a lower bound (the driver only sees steps flushed every
    ``train.log_every_steps``); with ``ledger_dir`` it is exact.
    """
    from mlflow.tracking import MlflowClient

    from elastic_ddp.events import EVENTS_ARTIFACT

    client = MlflowClient(uri)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = client.download_artifacts(run_id, EVENTS_ARTIFACT, tmp)
            events = json.loads(Path(path).read_text())
    except Exception:  # noqa: BLE001 - no events artifact: no failure or resize happened
        return []
    starts = sorted((m.value, int(m.step)) for m in client.get_metric_history(run_id, "attempt_first_step_ts"))
    attempts = []
    if ledger_dir:
        from elastic_ddp.ledger import LedgerError, read_attempts, recomputed_after

        try:
            attempts = read_attempts(ledger_dir)
        except LedgerError:
            attempts = []
    steps = sorted((m.timestamp / 1000.0, int(m.value)) for m in client.get_metric_history(run_id, "step"))
    prev_t, prev_attempt = float("-inf"), None
    for i, ev in enumerate(events):
        nxt = [(ts, s) for ts, s in starts if ts > ev["t"]]
        if nxt:
            ev["recovery_s"] = round(nxt[0][0] - ev["t"], 3)
            ev["resumed_at_step"] = nxt[0][1] - 1
            # Only steps of the attempt this event ended: a group that failed to start
            # (no steps since the previous event) recomputes nothing.
            before = [s for ts, s in steps if prev_t < ts <= ev["t"]]
            ev["steps_recomputed"] = max(0, (max(before) if before else 0) - ev["resumed_at_step"])
            if attempts:
                exact = recomputed_after(attempts, ev["t"])
                if exact is not None and exact["resumed_from"] == ev["resumed_at_step"]:
                    same = exact["attempt"] == prev_attempt
                    ev["steps_recomputed"] = 0 if same else exact["steps_recomputed"]
                    prev_attempt = exact["attempt"]
            client.log_metric(run_id, "recovery_s", ev["recovery_s"], step=i)
        prev_t = ev["t"]
    client.log_text(run_id, json.dumps(events, indent=1), "events/recovery.json")
    return events


def _finish(cfg: Config, uri: str, run_id: str, result, t0: float,
            ledger_dir: Optional[str] = None, marks: Optional[dict] = None) -> Summary:
    from mlflow.tracking import MlflowClient

    from elastic_ddp.checkpoint import load_state

    client = MlflowClient(uri)
    # The job's wall time runs from its MLflow run's first start: a resubmitted job's
    # committed seconds span every submission, and so must the time they are divided by
    # (the gap between submissions counts as lost time).
    first_start = client.get_run(run_id).info.start_time / 1000.0
    wall = time.time() - min(t0, first_start)
    events = _log_events(uri, run_id, t0, ledger_dir)
    startup = startup_breakdown(uri, run_id, marks or {})
    for k, v in startup.items():  # the CLI's summary prints them
        client.log_metric(run_id, f"startup/{k}", v)
    ckpt = result.checkpoint
    state: dict = {}
    ckpt_path = None
    if ckpt is not None:
        ckpt_path = ckpt.path
        with ckpt.as_directory() as d:
            state = load_state(d)
            # The final model, loadable in plain PyTorch (no DDP "module." prefix).
            client.log_artifact(run_id, str(Path(d) / "state.pt"), "model")
            client.log_artifact(run_id, str(Path(d) / "config.json"), "model")
    counters = json.loads(state.get("counters", "{}")) if state else {}
    goodput = counters.get("committed_train_s", 0.0) / max(1e-9, wall)
    client.log_metric(run_id, "goodput", goodput, step=int(state.get("step", 0)))
    client.log_metric(run_id, "wall_s", wall, step=int(state.get("step", 0)))
    metrics = {k: v for k, v in latest_metrics(uri, run_id).items()}
    run = client.get_run(run_id)
    summary = Summary(
        run_id=run_id, tracking_uri=uri, experiment_id=run.info.experiment_id,
        metrics={k: metrics[k] for k in sorted(metrics) if k.startswith("val_")},
        steps=int(state.get("step", 0)), epochs=int(state.get("epoch", 0)), wall_s=wall,
        world_sizes_seen=counters.get("world_sizes_seen", []),
        restarts=int(counters.get("restarts", 0)), goodput=goodput, events=events,
        startup=startup, checkpoint_path=ckpt_path,
        mlflow_ui_command=mlflow_ui_command(uri, run.info.experiment_id, run_id),
    )
    client.log_text(run_id, json.dumps(asdict(summary), indent=1, default=str), "summary.json")
    finish_run(uri, run_id, ok=True)
    return summary


def process_start_time() -> Optional[float]:
    """This process's start (seconds since the epoch) from /proc (Linux), so that the
    interpreter's start and the imports count in command-to-first-step; None elsewhere."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = next(int(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines()
                     if ln.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


# (phase, from mark, to mark): consecutive, so the phases add up to the total.
_STARTUP_PHASES = (
    ("imports_s", "process_start", "train_called"),      # interpreter + torch/ray/mlflow
    ("scan_s", "train_called", "scanned"),               # Parquet footers
    ("ray_init_s", "scanned", "ray_ready"),             # MLflow run, imports, reads beside it
    ("driver_setup_s", "ray_ready", "fit_called"),      # the rest of those + trainer build
    ("controller_s", "fit_called", "controller_started"),  # controller actor + imports
    ("scheduling_s", "controller_started", "worker_group_starting"),
    ("worker_group_s", "worker_group_starting", "worker_group_started"),  # actors + process group
    ("train_fn_launch_s", "worker_group_started", "attempt_enter_ts"),
    ("model_data_s", "attempt_enter_ts", "attempt_ready_ts"),  # model, checkpoint, rows
    ("first_step_s", "attempt_ready_ts", "attempt_first_step_ts"),
)


def startup_breakdown(uri: str, run_id: str, marks: dict) -> dict[str, float]:
    """Seconds from this process's start to the end of the first optimizer step of the
    first attempt this process launched, split into ``_STARTUP_PHASES`` (a profile of
    command-to-first-step: driver marks, the controller's ``events/timeline.json``, rank
    0's ``attempt_*_ts`` metrics). Phases whose marks are missing are left out; ``total_s``
    is always the whole span. {} when no step ran."""
    from mlflow.tracking import MlflowClient

    from elastic_ddp.events import TIMELINE_ARTIFACT

    if "fit_called" not in marks:
        return {}
    client = MlflowClient(uri)
    t = dict(marks)
    fit = marks["fit_called"]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            timeline = json.loads(Path(client.download_artifacts(run_id, TIMELINE_ARTIFACT, tmp)).read_text())
    except Exception:  # noqa: BLE001 - an older run or a failed upload: driver marks only
        timeline = []
    firsts = sorted((m.value, int(m.step)) for m in client.get_metric_history(run_id, "attempt_first_step_ts")
                    if m.value >= fit)
    if not firsts:
        return {}
    # The first attempt of this launch that reached a step; an attempt that died before
    # its first step only lengthens the phases (the marks taken are the ones it used).
    t["attempt_first_step_ts"], k = firsts[0]
    for key in ("attempt_ready_ts", "attempt_enter_ts"):
        vals = [m.value for m in client.get_metric_history(run_id, key)
                if int(m.step) == k and fit <= m.value <= t["attempt_first_step_ts"]]
        if vals:
            t[key] = max(vals)
    until = t.get("attempt_enter_ts", t["attempt_first_step_ts"])
    for what in ("worker_group_started", "worker_group_starting", "controller_started"):
        ts = [m["t"] for m in timeline if m["what"] == what and fit <= m["t"] <= until]
        if ts:
            t[what] = max(ts) if what != "controller_started" else min(ts)
            until = t[what]
    out = {name: round(t[b] - t[a], 3) for name, a, b in _STARTUP_PHASES if a in t and b in t}
    out["total_s"] = round(t["attempt_first_step_ts"] - t["process_start"], 3)
    return out


def mlflow_ui_command(uri: str, experiment_id: str, run_id: str) -> str:
    """The shell command that opens the MLflow UI on this store, and the run's URL."""
    store = shlex.quote(uri)
    # The mlflow script beside this interpreter: it is on PATH only in an activated venv.
    exe = Path(sys.executable).with_name("mlflow")
    mlflow_cmd = shlex.quote(str(exe)) if exe.exists() else "mlflow"
    return (f"{mlflow_cmd} ui --backend-store-uri {store} --host 127.0.0.1 --port 5000  "
            f"# then open http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{run_id}")
