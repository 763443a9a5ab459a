"""The driver side of one job: check everything, then build and run the ``TorchTrainer``.

    from elastic_ddp import Config, train
    summary = train(Config.load("experiments/configs/digits_cnn.yaml"))

Steps: load the task -> scan the Parquet footers and dry-run the task on two rows (every
input error surfaces here, before a run is opened or a local Ray started) -> connect to
Ray while the job's MLflow run is opened -> the tracker actor and the Ray Train
controller's process (``ray_trainer.ControllerHost``) -> ``TorchTrainer(ScalingConfig((min,
max)), FailureConfig, CheckpointConfig, callbacks)`` -> fit with a progress display ->
final model, restart events and goodput into the run -> summary. A job that joins a
running cluster (``RAY_ADDRESS``, ``ray job submit``) connects and starts those two
actors first, so that they boot while the driver scans; bad input then kills them.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

from elastic_ddp import tracking
from elastic_ddp.background import Background
from elastic_ddp.compat.versions import preemption_notice_line, preemption_supported, ray_plan, warn_skipped
from elastic_ddp.config import Config
from elastic_ddp.driver.finish import after_failed_fit, close_failed, finish_job as _finish
from elastic_ddp.driver.lease import RunLease
from elastic_ddp.fencing import FencedError
from elastic_ddp.driver.preflight import (report_skipped, check_ray_address, check_storage,  # noqa: F401
                                          check_tracking_store, prepare, process_start_time,
                                          tracking_uri_field, job_spec, warn_batch_over_rows)
from elastic_ddp.driver.report import ProgressDisplay, Summary
from elastic_ddp.driver.stop import (EarlySignals, JobInterrupted, JobStopped,  # noqa: F401 - JobStopped re-exported
                                     SigtermStop, StoppedBeforeTraining)
from elastic_ddp.run_state import Diagnostics

from elastic_ddp.tracking.history import resume_event
from elastic_ddp.tracking.opener import RAY_RUN_NAME_TAG, RunOpener, run_dir_exists  # noqa: F401 - re-exported
from elastic_ddp.errors import EXIT_BAD_INPUT, ElasticDDPError


class TrainingError(ElasticDDPError, RuntimeError):
    """The job failed after its restart budget, or on a deterministic error. The MLflow
    run is closed as FAILED with the error as a tag; the last checkpoint is kept.

    ``exit_code`` is 1, or 2 when no checkpoint of the run verifies (a
    ``CheckpointCorruptError`` on the workers: bad input on storage, refused as such)."""

    def __init__(self, message: str):
        super().__init__(message)
        if "CheckpointCorruptError" in message:
            self.exit_code = EXIT_BAD_INPUT


_env_written: dict[str, str] = {}


def _env_default(name: str, value: str) -> None:
    """``os.environ[name] = value`` unless someone else set it: a value this process's
    jobs wrote is theirs to change (a restart-mode job after a per-step one in the same
    process gets its watcher back), one a person set is kept."""
    if os.environ.get(name) in (None, _env_written.get(name)):
        os.environ[name] = _env_written[name] = value


def _storage_path(cfg: Config) -> str:
    from elastic_ddp.paths import is_uri, local_path

    p = cfg.run.storage_path
    return p if is_uri(p) else local_path(p)


def init_ray(cfg: Config) -> None:
    """Connect to Ray: the cluster ``RAY_ADDRESS`` names, else a private local one.

    Ray's own log lines stay off the console (``local_ray.RayDriverLog``: the driver's
    into the session's ``logs/elastic-ddp-driver.log``; the workers', the controller's
    and Ray Data's stay in their files there, ``log_to_driver=False``) unless
    ``ELASTIC_DDP_RAY_LOGS=1`` (``elastic-ddp train --ray-logs``)."""
    import ray

    from elastic_ddp.driver import network_checks
    from elastic_ddp.driver.local_ray import RayDriverLog, init_local_ray, ray_logs_on_console

    if ray.is_initialized():
        return
    verbose = ray_logs_on_console()
    routing = None if verbose else RayDriverLog()
    if routing is not None:
        routing.start()
    # configure_logging=False: ray.init would put its console handler back.
    log_kw = ({"configure_logging": True, "logging_level": "INFO", "log_to_driver": True}
              if verbose else {"configure_logging": False, "log_to_driver": False})
    if os.environ.get("RAY_ADDRESS"):
        network_checks.connect_ray(log_kw)  # bounded; a loopback-only cluster on 127.0.0.1
    else:
        # A laptop/CI run: a local cluster with enough logical CPUs for max_workers plus
        # Ray Data's read and transform tasks; the workers set their own torch thread
        # counts. address="local": without it ray.init auto-attaches to any Ray instance
        # running on this machine (another user's `ray start`) and then refuses num_cpus.
        # Every listener on 127.0.0.1 (elastic_ddp.driver.local_ray).
        need = int(cfg.scaling.max_workers * cfg.scaling.cpus_per_worker) + 2
        init_local_ray(num_cpus=max(need, os.cpu_count() or 1), **log_kw)
    if routing is not None:
        routing.attach()


def _cluster_running() -> bool:
    """This driver joins a Ray that is already up: ``RAY_ADDRESS`` names a cluster (as
    ``ray job submit`` sets it), or this process is connected already."""
    import ray

    return ray.is_initialized() or os.environ.get("RAY_ADDRESS", "").strip() not in ("", "local")


def _answers() -> bool:
    """``RAY_ADDRESS`` answers (``check_ray_address``); when it does not, that error is
    raised after the input checks, which print what the scan skipped first."""
    from elastic_ddp.config import ConfigError

    try:
        check_ray_address()
    except ConfigError:
        return False
    return True


def _connect_and_start(cfg: Config, uri: str) -> tuple:
    """Connect to Ray, then start the Ray Train controller's process
    (``compat.ray_trainer.ControllerHost``, where the installed Ray is one it was tested
    on; else None: Ray Train starts its own controller in ``fit``) and the tracker actor;
    both boot from now on."""
    init_ray(cfg)
    host = None
    if ray_plan().applies("controller_host"):
        from elastic_ddp.compat.ray_trainer import start_controller_host

        host = start_controller_host()
    return host, tracking.start_tracker(uri)


def _kill(*actors) -> None:
    import ray

    for a in actors:
        if a is not None:
            ray.kill(a)


def _import_ray_train() -> None:
    import ray.train.torch  # noqa: F401 - the import cost, paid while Ray starts


def build_trainer(cfg: Config, job, tracker):
    """The ``TorchTrainer`` for ``cfg`` and a ``trainer.JobSpec`` (not yet fitted): with
    the compat overrides on a Ray release they were tested on, else stock Ray Train for
    each part they skip, after one warning line (``compat.versions``)."""
    import ray
    from ray import cloudpickle
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from elastic_ddp.controller.events import ElasticEvents
    from elastic_ddp.controller.lifecycle import ControllerEvents
    from elastic_ddp.worker.entry import train_func

    plan = ray_plan()
    warn_skipped(plan)

    s = cfg.scaling
    # Read by the Ray Train controller when it starts (propagated from this process).
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(s.health_check_interval_s)
    elastic = s.min_workers < s.max_workers
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(
        s.placement_timeout_s or (25.0 if elastic else 600.0))
    # A frozen worker (alive, not polling) is declared dead after this (Ray's default
    # 600 s would leave a per-step job short of a replica for ten minutes).
    os.environ.setdefault("RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S", "60")
    # A notice becomes a checkpoint (restart mode) or a replica leaving its quorum
    # (per_step mode), charged to the preemption budget (worker.notice). Ray Train's
    # preemption watcher (a thread of the controller's process here; Ray's own: one more
    # actor process per worker-group start) tells restart mode's workers of a node drain,
    # polling the GCS every second; Ray Train runs none for replica groups, whose
    # replicas poll for their own node. Off where notices are handled as crashes.
    preempt = preemption_supported(plan) and s.preemption_checkpoint
    if job is not None:  # the workers' JobSpec (None: a trainer built only to be inspected)
        job.preemption = preempt
    _env_default("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER",
                 "1" if preempt and s.fault_tolerance == "restart" else "0")
    os.environ.setdefault("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "1")
    if s.preemption_checkpoint and preemption_notice_line(plan):
        print(preemption_notice_line(plan), flush=True)
    use_gpu = s.use_gpu if s.use_gpu != "auto" else ray.cluster_resources().get("GPU", 0) > 0
    num_workers: Any = s.min_workers if s.min_workers == s.max_workers else (s.min_workers, s.max_workers)
    # NCCL on GPUs, gloo on CPUs; the timeout bounds how long a rank waits in a
    # collective for a dead peer before Ray Train tears the group down.
    # Ray's TorchConfig makes the controller import torch (elastic_ddp.compat.ray_backend).
    if plan.applies("process_group_backend"):
        from elastic_ddp.compat.ray_backend import ProcessGroupConfig as torch_config_class
    else:
        from ray.train.torch import TorchConfig as torch_config_class
    torch_config = torch_config_class(backend="nccl" if use_gpu else "gloo", timeout_s=s.collective_timeout_s)
    if s.fault_tolerance == "per_step":
        # Every supported Ray has it (compat.versions.TORCHFT_RAY).
        from ray.train.v2.torch.torchft_config import TorchftConfig

        from elastic_ddp.worker.per_step import LIGHTHOUSE

        # max_workers replica groups of one worker; a quorum below it still commits, and
        # Ray replaces a dead replica alone (a different worker count would restart all).
        num_workers = s.max_workers
        torch_config = TorchftConfig(lighthouse_kwargs=dict(LIGHTHOUSE), backend=torch_config.backend,
                                     timeout_s=s.collective_timeout_s)
    sink = ElasticEvents(tracker, run_name=cfg.run.name, storage=_storage_path(cfg),
                         collective_timeout_s=s.collective_timeout_s, preemption=preempt,
                         grow_checkpoint_timeout_s=(s.grow_checkpoint_timeout_s
                                                    if elastic and s.fault_tolerance == "restart" else None))
    callbacks = [sink]
    if plan.applies("controller_events"):
        callbacks.append(ControllerEvents(sink))
    from elastic_ddp.compat.ray_trainer import trainer_class
    from elastic_ddp.paths import uri_to_filesystem

    # Ray Train gets the file system and the path, never a string to parse as a URI.
    storage_fs, storage_fs_path = uri_to_filesystem(_storage_path(cfg))
    return trainer_class(TorchTrainer, plan)(
        train_func,
        # Pickled here: the controller unpickles train_loop_config when it starts, and the
        # job's task and data classes would make it import torch and the task's modules.
        train_loop_config={"job": cloudpickle.dumps(job)},
        torch_config=torch_config,
        scaling_config=ScalingConfig(
            num_workers=num_workers, use_gpu=use_gpu,
            elastic_resize_monitor_interval_s=s.resize_monitor_interval_s,
            resources_per_worker={"CPU": s.cpus_per_worker, **({"GPU": s.gpus_per_worker} if use_gpu else {})},
        ),
        run_config=RunConfig(
            name=cfg.run.name,
            storage_path=storage_fs_path, storage_filesystem=storage_fs,
            # Controller errors (a placement that timed out, a worker dead before its train
            # function ran: compat.ray_train.retry_worker_deaths_at_start) are retried too, but not
            # forever: Ray's default is unbounded, and a death that repeats at start-up
            # (out of memory on import) would loop.
            # Preemptions have their own budget where Ray Train counts them (2.60).
            failure_config=FailureConfig(
                max_failures=s.max_failures,
                controller_failure_limit=-1 if s.max_failures == -1 else max(10, 3 * s.max_failures),
                **({"max_preemption_failures": s.max_preemptions}
                   if "max_preemption_failures" in FailureConfig.__dataclass_fields__ else {})),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.train.keep_checkpoints),
            callbacks=callbacks,
        ),
        # Each rank reads its own rows through its own Ray Data pipeline
        # (elastic_ddp.data.ingest): no dataset is split by Ray Train.
    )



def train(cfg: Config, task=None, progress: bool = True, parent_run_id: Optional[str] = None,
          command_start: Optional[float] = None,
          on_validated: Optional[Callable[[Config], None]] = None,
          diagnostics: Optional[Diagnostics] = None) -> Summary:
    """Run one training job to the end and return its ``Summary``.

    ``task``: an ``elastic_ddp.Task`` object (default: ``task.path`` / ``model.name``).
    ``parent_run_id``: open the MLflow run as a child of this run (``elastic_ddp.driver.sweep``). ``command_start``: when the
    command started (seconds since the epoch), so the command-to-first-step profile
    includes interpreter start and imports. ``on_validated(cfg)``: called once every
    input check passed, before MLflow starts, and before Ray starts unless the job joins
    a running cluster (the CLI prints the config there). ``diagnostics``: the sample
    ledger and fault injection of tests and experiments (:class:`~elastic_ddp.run_state.Diagnostics`).

    Raises:
        TaskError: the task cannot run (import path, hooks, kwargs, loss shape, inputs
            that cannot be pickled).
        RunBusyError: another live job holds this run (``elastic_ddp.driver.lease``).
        DataError: the Parquet data fails the scan (nothing is left running, no run).
        TrainingError: training failed beyond its restart budget or deterministically;
            the MLflow run is closed as FAILED.
        JobStopped: SIGTERM stopped the job at a committed checkpoint (run KILLED), or
            before training started (``StoppedBeforeTraining``). A ``BaseException``, as
            ``KeyboardInterrupt`` is.
        KeyboardInterrupt: Ctrl-C; ``JobInterrupted``, naming the run, once the run exists
            (run KILLED, checkpoints kept).
    """
    # First, before torch: the MLflow helper imports MLflow on another core while this
    # process imports torch, scans the data and dry-runs the task (elastic_ddp.tracking.opener).
    diagnostics = diagnostics or Diagnostics()
    # SIGTERM before fit (checks, scan, MLflow run creation, Ray start-up) stops the job
    # through the clean-up paths below instead of ending the process mid-write; a Ctrl-C
    # or SIGTERM whose exception a fork in ray.init swallowed is raised again before fit.
    with EarlySignals() as early_term:
        return _train(cfg, task, progress, parent_run_id, command_start, on_validated,
                      diagnostics, early_term)


def _train(cfg: Config, task, progress: bool, parent_run_id: Optional[str],
           command_start: Optional[float], on_validated, diagnostics: Diagnostics,
           early_term: EarlySignals) -> Summary:
    uri = tracking.default_tracking_uri(cfg)
    opener = RunOpener(uri)
    host = tracker = stop = None
    try:

        t0 = time.time()
        marks = {"process_start": command_start or t0, "train_called": t0}
        check_tracking_store(uri, tracking_uri_field(cfg))  # seconds, not MLflow's minutes
        # On a running cluster, connect before the checks: the Ray Train controller's
        # process and the tracker's boot while this one scans (ray_trainer.ControllerHost).
        # A local Ray is still started only for a job whose input passed.
        early = _cluster_running() and _answers()
        if early:
            host, tracker = _connect_and_start(cfg, uri)
            early_term.reinstall()  # ray.init installed its own SIGTERM handler
            marks["ray_ready"] = time.time()
        prep = prepare(cfg, task)
        task, train_info, val_info = prep.task, prep.train_info, prep.val_info
        if on_validated is not None:
            on_validated(cfg)
        skipped = report_skipped(train_info, val_info)
        warn_batch_over_rows(cfg, train_info.num_rows)
        if not early:
            check_ray_address()
        params = tracking.task_params(task, prep.dry_run.n_params)
        # One live job per run: taken before the MLflow run is opened or resumed.
        lease = RunLease(_storage_path(cfg), cfg.run.name).acquire()
    except BaseException:
        opener.cancel()  # no run is opened for a job that fails its checks
        _kill(host, tracker)
        raise
    # The lease's fencing token goes with every writer of the run (elastic_ddp.fencing);
    # the heartbeat that finds the run taken over interrupts this thread.
    fence = lease.fence()
    lease.on_lost = _interrupt_main
    try:
        if lease.describe_takeover():
            print(lease.describe_takeover(), flush=True)
        marks["scanned"] = time.time()
        storage = _storage_path(cfg)
        opener.find(cfg=cfg, storage=storage, uri=uri, parent_run_id=parent_run_id, task_params=params,
                    train_info=train_info, val_info=val_info, skipped=skipped, fence=fence)
        # A run with storage may resume: its checkpoints and config are checked before Ray
        # starts and before its MLflow run is touched (exit 2 on bad input).
        resume = _check_resume(cfg, opener, storage, prep) if run_dir_exists(storage, cfg.run.name) else None
        opener.go()
        # A local ray.init mostly waits for its GCS and raylet processes to come up; Ray
        # Train's import runs beside it.
        side = Background(_import_ray_train, name="import-ray-train")
        if tracker is None:
            host, tracker = _connect_and_start(cfg, uri)
            early_term.reinstall()  # ray.init installed its own SIGTERM handler
            marks["ray_ready"] = time.time()
        side.result()
        opened = opener.result()
        run_id = opened["run_id"]
    except BaseException as e:
        try:
            _kill(host, tracker)
            _raise_if_fenced(lease, opener)
            if not opener.went:  # refused before the run was opened: nothing to close
                opener.cancel()
                raise
            # The run may be open by now (opened beside ray.init): close it, then re-raise.
            # (An open that failed, e.g. a deleted experiment, raises again here: no run.)
            try:
                run_id = opener.result()["run_id"]
            except BaseException:  # noqa: BLE001 - the open failed too (or was never sent): no run is left open
                opener.cancel()
                raise e from None
            killed = not isinstance(e, Exception)  # Ctrl-C, SIGTERM (JobStopped)
            close_failed(uri, run_id, None, f"{type(e).__name__}: {e}",
                         "KILLED" if killed else "FAILED", opener)
            _raise_interrupted(e, run_id, cfg)
            raise
        finally:
            lease.release()
    try:
        resumed = opened["resumed"]
        cfg = cfg.with_run_name(opened["ray_run_name"])  # the helper's choice (tracking.opener)
        _drop_missing_checkpoints(storage, cfg.run.name, tracker)
        tracker.bind.remote(run_id, **opened["attempts"], history=opened["history"],
                            data_wait_given=opened["data_wait_given"], fence=fence)
        if resumed:  # its recovery: seconds to this submission's first step, steps recomputed
            tracker.event.remote(resume_event(opened["history"], marks["process_start"]))
        if resume is not None and resume.tags:
            tracker.set_tags.remote(resume.tags)
        for ev in resume.events if resume is not None else ():
            tracker.event.remote(ev)
        from elastic_ddp.batching import run_length

        total = run_length(cfg, train_info.num_rows, cfg.scaling.max_workers)[1].total_steps
        print(f"elastic-ddp: run {cfg.run.name!r} -> MLflow run {run_id} "
              f"({'resumed' if resumed else 'new'}); {train_info.num_rows} train rows in "
              f"{len(train_info.files)} file{'s' * (len(train_info.files) != 1)}; {total} steps", flush=True)
        job = job_spec(cfg, prep, tracker, t0, storage, diagnostics, fence=fence)
        trainer = build_trainer(cfg, job, tracker)
        if host is not None:
            trainer.controller_host = host
        marks["fit_called"] = time.time()
        # SIGTERM: a checkpoint, then exit 143 (restart mode: at the notice agreement; per_step
        # mode: the stop rides in a step's all-reduce, worker.per_step).
        stop = SigtermStop(host, enabled=job.preemption)
        early_term.hand_over()
        try:
            # Without progress lines it still prints the tracker's warnings (data wait).
            with ProgressDisplay(tracker, total, show=progress), stop:
                result = trainer.fit()
        except BaseException:
            _raise_if_fenced(lease, opener, tracker)
            after_failed_fit(tracker)
            raise
        _raise_if_fenced(lease, opener, tracker)  # the final model and status are not written
        opener.finish()  # the system metrics end with the training
        return _finish(cfg, uri, run_id, tracker, result, t0, diagnostics.ledger_dir, marks, task,
                       prep.sample, train_info.num_rows, storage, model=prep.dry_run.model)
    except FencedError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised as TrainingError with the cause
        from elastic_ddp.controller.failures import describe_training_error

        _raise_if_fenced(lease, opener, tracker)
        if stop is not None and stop.stopped(e):
            close_failed(uri, run_id, tracker, "stopped on SIGTERM at a checkpoint", "KILLED", opener)
            raise JobStopped(f"stopped on SIGTERM at a checkpoint (MLflow run {run_id} KILLED); "
                             "run the same command to resume") from None

        msg = describe_training_error(e)
        close_failed(uri, run_id, tracker, msg, "FAILED", opener)
        raise TrainingError(f"training failed (MLflow run {run_id} marked FAILED): {msg}") from e
    except BaseException as e:
        # Ctrl-C, SIGTERM before fit or SystemExit: the run must not stay RUNNING in the
        # store; checkpoints are kept, so resubmitting the same run.name resumes it.
        _raise_if_fenced(lease, opener, tracker)
        close_failed(uri, run_id, tracker, str(e) if isinstance(e, StoppedBeforeTraining)
                     else "interrupted", "KILLED", opener)
        _raise_interrupted(e, run_id, cfg)
        raise
    finally:
        opener.finish()
        _kill(host, tracker)
        lease.release()


def _interrupt_main(_record: dict) -> None:
    """The lease's heartbeat found the run taken over: the driver's main thread gets a
    SIGINT, so a ``KeyboardInterrupt`` wherever it waits (``trainer.fit()``), which the launcher turns
    into :class:`FencedError` (:func:`_raise_if_fenced`) without writing to the run."""
    import signal
    import threading

    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def _raise_if_fenced(lease: RunLease, opener: RunOpener, tracker=None) -> None:
    """Raise :class:`FencedError` (one line naming the job that took the run over) when
    this job lost the run's lease: the MLflow helper and the tracker are stopped before
    they write anything more, and the run is neither closed nor marked. One read of the
    lease record unless the heartbeat found the loss already."""
    from elastic_ddp.fencing import taken_over_line

    taken = lease.lost()
    if taken is None:
        return
    opener.fenced()
    if tracker is not None:
        _kill(None, tracker)
    raise FencedError(taken_over_line(lease.name, taken)) from None


def _drop_missing_checkpoints(storage: str, ray_run_name: str, tracker) -> None:
    """A resumed run whose Ray Train snapshot lists checkpoints that are gone or
    incomplete (``compat.ray_snapshot``): they are taken off the list, so that Ray Train's
    controller neither fails on them at its start nor prunes them; one line and a
    ``checkpoints_unlisted`` event name them."""
    from elastic_ddp.checkpoint.layout import run_dir
    from elastic_ddp.compat.ray_snapshot import drop_missing_checkpoints

    try:
        fs, base = run_dir(storage, ray_run_name)
        gone = drop_missing_checkpoints(fs, base)
    except OSError as e:  # the snapshot is Ray Train's to judge then
        print(f"elastic-ddp: warning: Ray Train's checkpoint list of run {ray_run_name!r} "
              f"could not be checked: {e}", flush=True)
        return
    if gone:
        print(f"elastic-ddp: run {ray_run_name!r}: checkpoint{'s' * (len(gone) != 1)} "
              f"{', '.join(gone)} listed by Ray Train but gone or incomplete: taken off its "
              "list (the newest complete one is resumed from)", flush=True)
        tracker.event.remote({"type": "checkpoints_unlisted", "t": time.time(), "checkpoints": gone})


def _raise_interrupted(e: BaseException, run_id: str, cfg: Config) -> None:
    """Ctrl-C once the run exists: raised again as :class:`JobInterrupted`, whose message
    names the run and how to resume (the CLI prints it)."""
    if isinstance(e, KeyboardInterrupt) and not isinstance(e, JobInterrupted):
        raise JobInterrupted.of_run(run_id, cfg.run.resume) from None


def _check_resume(cfg: Config, opener: RunOpener, storage: str, prep):
    """``driver.resume.check_resume`` of the unfinished run the MLflow helper found (None:
    a new run). Raises ResumeError (exit 2)."""
    found = opener.found()
    if found is None:
        return None
    from elastic_ddp.driver.resume import check_resume

    def model():
        if prep.dry_run.model is not None:
            return prep.dry_run.model
        import torch

        from elastic_ddp.tasks.loading import build_model

        with torch.device("meta"):
            return build_model(cfg, prep.task)

    return check_resume(cfg, found, storage, prep.train_info.fingerprint, model)
