"""The driver side of one job: check everything, then build and run the ``TorchTrainer``.

    from elastic_ddp import Config, train
    summary = train(Config.load("experiments/configs/digits_cnn.yaml"))

Steps: load the task -> scan the Parquet footers and dry-run the task on two rows (every
input error surfaces here, before a run is opened or a local Ray started) -> connect to
Ray while the job's MLflow run is opened -> the tracker actor and the Ray Train
controller's process (``compat.ray_controller_host``) -> ``TorchTrainer(ScalingConfig((min,
max)), FailureConfig, CheckpointConfig, callbacks)`` -> fit with a progress display ->
final model, restart events and goodput into the run -> summary. A job that joins a
running cluster (``RAY_ADDRESS``, ``ray job submit``) connects and starts those two
actors first, so that they boot while the driver scans; bad input then kills them.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from elastic_ddp import tracking
from elastic_ddp.background import Background
from elastic_ddp.compat.versions import ray_plan
from elastic_ddp.config import Config
from elastic_ddp.driver.finish import after_failed_fit, finish_job
from elastic_ddp.driver.job import Job, TrainingError  # noqa: F401 - TrainingError: elastic_ddp's
from elastic_ddp.driver.preflight import (report_skipped, check_ray_address, check_tracking_store,
                                          prepare, tracking_uri_field, job_spec, warn_batch_over_rows)
from elastic_ddp.driver.ray_start import (cluster_running, import_ray_train, init_ray,  # noqa: F401
                                          ray_address_answers)
from elastic_ddp.driver.report import ProgressDisplay, Summary
from elastic_ddp.driver.stop import SigtermStop
from elastic_ddp.driver.trainer_spec import build_trainer, cluster_gpus, trainer_spec
from elastic_ddp.run_state import Diagnostics
from elastic_ddp.tracking.history import resume_event
from elastic_ddp.tracking.opener import RunOpener, run_dir_exists


def train(cfg: Config, task=None, progress: bool = True, parent_run_id: Optional[str] = None,
          command_start: Optional[float] = None,
          on_validated: Optional[Callable[[Config], None]] = None,
          diagnostics: Optional[Diagnostics] = None) -> Summary:
    """Run one training job to the end and return its ``Summary``.

    ``task``: an ``elastic_ddp.Task`` object (default: ``task.path`` / ``model.name``).
    ``parent_run_id``: open the MLflow run as a child of this run
    (``elastic_ddp.driver.sweep``). ``command_start``: when the command started (seconds
    since the epoch), so the command-to-first-step profile includes interpreter start
    and imports. ``on_validated(cfg)``: called once every
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
    # The job's life (signals, the MLflow helper, the actors, the lease, the run) and its
    # clean-up on every exit path: elastic_ddp.driver.job.
    with Job(cfg) as job:
        return _run(job, cfg, task, progress, parent_run_id, command_start, on_validated,
                    diagnostics or Diagnostics())


def _run(job: Job, cfg: Config, task, progress: bool, parent_run_id: Optional[str],
         command_start: Optional[float], on_validated, diagnostics: Diagnostics) -> Summary:
    """The job's steps, in ``job`` (whose exit turns an error into what ``train`` raises
    and cleans up)."""
    t0 = time.time()
    marks = {"process_start": command_start or t0, "train_called": t0}
    check_tracking_store(job.uri, tracking_uri_field(cfg))  # seconds, not MLflow's minutes
    # On a running cluster, connect before the checks: the Ray Train controller's
    # process and the tracker's boot while this one scans (compat.ray_controller_host).
    # A local Ray is still started only for a job whose input passed.
    early = cluster_running() and ray_address_answers()
    if early:
        job.start_actors()
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
    fence = job.take_lease()
    marks["scanned"] = time.time()
    storage = job.storage
    job.opener.find(cfg=cfg, storage=storage, uri=job.uri, parent_run_id=parent_run_id, task_params=params,
                    train_info=train_info, val_info=val_info, skipped=skipped, fence=fence)
    # A run with storage may resume: its checkpoints and config are checked before Ray
    # starts and before its MLflow run is touched (exit 2 on bad input).
    resume = _check_resume(cfg, job.opener, storage, prep) if run_dir_exists(storage, cfg.run.name) else None
    job.opener.go()
    # A local ray.init mostly waits for its GCS and raylet processes to come up; Ray
    # Train's import runs beside it.
    side = Background(import_ray_train, name="import-ray-train")
    if job.tracker is None:
        job.start_actors()
        marks["ray_ready"] = time.time()
    side.result()
    opened = job.run_opened()
    run_id, tracker, resumed = opened["run_id"], job.tracker, opened["resumed"]
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
    spec = trainer_spec(cfg, ray_plan(), storage, cluster_gpus(cfg))
    trainer = build_trainer(cfg, job_spec(cfg, prep, tracker, t0, storage, diagnostics, fence=fence),
                            tracker, spec)
    if job.host is not None:
        trainer.controller_host = job.host
    marks["fit_called"] = time.time()
    # SIGTERM: a checkpoint, then exit 143 (restart mode: at the notice agreement; per_step
    # mode: the stop rides in a step's all-reduce, worker.per_step).
    job.stop = SigtermStop(job.host, enabled=spec.preemption)
    job.signals.hand_over()
    try:
        # Without progress lines it still prints the tracker's warnings (data wait).
        with ProgressDisplay(tracker, total, show=progress), job.stop:
            result = trainer.fit()
    except BaseException:
        job.raise_if_fenced()
        after_failed_fit(tracker)
        raise
    job.raise_if_fenced()  # the final model and status are not written
    job.opener.finish()  # the system metrics end with the training
    return finish_job(cfg, job.uri, run_id, tracker, result, t0, diagnostics.ledger_dir, marks, task,
                      prep.sample, train_info.num_rows, storage, model=prep.dry_run.model)


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
