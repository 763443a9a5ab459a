"""One job's life on the driver: its signals, the MLflow helper, Ray's two actors, the run's
lease and the MLflow run, and their clean-up, written once.

    with Job(cfg) as job:              # EarlySignals, the MLflow helper started
        job.start_actors()             # controller host + tracker (connects to Ray)
        fence = job.take_lease()       # one live job per run
        opened = job.run_opened()      # from here a failure closes the MLflow run
        ...

Whatever ends the block, the exit stack then finishes (or cancels) the MLflow helper,
kills the two actors and releases the lease, in that order, and puts the signal handlers
back last. Before that, an error that leaves the block is turned into what the caller
gets (:meth:`Job._failed`):

- before the lease is taken (bad input: exit 2): nothing more; no run is opened;
- lease taken, run not yet open (or opened beside ``ray.init``): a run the helper opened
  is closed FAILED (an ``Exception``) or KILLED (Ctrl-C, SIGTERM), the error raised as
  it is;
- run open: ``TrainingError`` (run FAILED), ``JobStopped`` (SIGTERM at a checkpoint, run
  KILLED), ``JobInterrupted`` (Ctrl-C, run KILLED);
- at any point once the lease is taken: ``FencedError`` when another job took the run
  over (the run is neither closed nor marked; ``elastic-ddp train`` exits 4).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

from elastic_ddp import tracking
from elastic_ddp.config import Config
from elastic_ddp.driver.finish import close_failed
from elastic_ddp.driver.lease import RunLease
from elastic_ddp.driver.ray_start import connect_and_start, kill_actors
from elastic_ddp.driver.stop import EarlySignals, JobInterrupted, JobStopped, StoppedBeforeTraining
from elastic_ddp.driver.trainer_spec import storage_root
from elastic_ddp.errors import EXIT_BAD_INPUT, ElasticDDPError
from elastic_ddp.fencing import FencedError
from elastic_ddp.tracking.opener import RunOpener


class TrainingError(ElasticDDPError, RuntimeError):
    """The job failed after its restart budget, or on a deterministic error. The MLflow
    run is closed as FAILED with the error as a tag; the last checkpoint is kept.

    ``exit_code`` is 1, or 2 when no checkpoint of the run verifies (a
    ``CheckpointCorruptError`` on the workers: bad input on storage, refused as such)."""

    def __init__(self, message: str):
        super().__init__(message)
        if "CheckpointCorruptError" in message:
            self.exit_code = EXIT_BAD_INPUT


class Job:
    """The life of one job of ``cfg`` (a context manager; see the module docstring).

    ``uri``: the MLflow tracking URI; ``storage``: the run's storage root
    (``trainer_spec.storage_root``, computed here once); ``opener``: the MLflow helper
    process (``tracking.opener.RunOpener``), started on entry; ``signals``: the
    ``EarlySignals`` in charge until ``fit``; ``host``, ``tracker``: the Ray actors
    (None until :meth:`start_actors`); ``lease``: the run's lease (None until
    :meth:`take_lease`); ``run_id``: the MLflow run (None until :meth:`run_opened`);
    ``stop``: the ``SigtermStop`` of ``fit``, set by the caller."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.storage = storage_root(cfg)
        self.host: Any = None
        self.tracker: Any = None
        self.lease: Optional[RunLease] = None
        self.run_id: Optional[str] = None
        self.stop: Any = None

    def __enter__(self) -> "Job":
        with contextlib.ExitStack() as stack:
            # SIGTERM before fit (checks, scan, MLflow run creation, Ray start-up) stops the
            # job through the clean-up below instead of ending the process mid-write.
            self.signals = stack.enter_context(EarlySignals())
            self.uri = tracking.default_tracking_uri(self.cfg)
            # First, before torch: the MLflow helper imports MLflow on another core while
            # this process imports torch, scans the data and dry-runs the task.
            self.opener = RunOpener(self.uri)
            # Run last to first: the helper, the actors, the lease.
            stack.callback(self._release_lease)
            stack.callback(self._kill_actors)
            stack.callback(self._end_helper)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc is not None:
                self._failed(exc)  # raises what the caller gets, or returns: ``exc`` goes on
        except BaseException as raised:
            if not self._stack.__exit__(type(raised), raised, raised.__traceback__):
                raise
            return True
        return self._stack.__exit__(exc_type, exc, tb)

    # -- the steps of the job's life ---------------------------------------------------
    def start_actors(self) -> None:
        """Connect to Ray and start the controller host and the tracker actor (they boot
        from now on); the SIGTERM handler that ``ray.init`` replaced is put back."""
        self.host, self.tracker = connect_and_start(self.cfg, self.uri)
        self.signals.reinstall()

    def take_lease(self):
        """Take the run's lease (``RunBusyError``: another live job holds it) and return
        its fencing token (``elastic_ddp.fencing.Fence``), which goes with every writer of
        the run; the heartbeat that finds the run taken over interrupts the main thread."""
        self.lease = RunLease(self.storage, self.cfg.run.name).acquire()
        self.lease.on_lost = _interrupt_main
        if self.lease.describe_takeover():
            print(self.lease.describe_takeover(), flush=True)
        return self.lease.fence()

    def run_opened(self) -> dict:
        """The MLflow helper's answer once the run is open (``tracking.opener``): from
        here on a failure closes the run."""
        opened = self.opener.result()
        self.run_id = opened["run_id"]
        return opened

    def raise_if_fenced(self) -> None:
        """Raise :class:`FencedError` (one line naming the job that took the run over) when
        this job lost the run's lease: the MLflow helper and the tracker are stopped before
        they write anything more, and the run is neither closed nor marked. One read of the
        lease record unless the heartbeat found the loss already."""
        from elastic_ddp.fencing import taken_over_line

        taken = self.lease.lost() if self.lease is not None else None
        if taken is None:
            return
        self.opener.fenced()
        if self.tracker is not None:
            kill_actors(self.tracker)
            self.tracker = None
        raise FencedError(taken_over_line(self.lease.name, taken)) from None

    # -- an error that ends the job ----------------------------------------------------
    def _failed(self, e: BaseException) -> None:
        if self.lease is None or isinstance(e, FencedError):
            return  # refused before the run could be touched, or fenced already
        self.raise_if_fenced()
        if self.run_id is None:
            self._failed_before_run(e)
            return
        if isinstance(e, Exception):
            if self.stop is not None and self.stop.stopped(e):
                self._close("stopped on SIGTERM at a checkpoint", "KILLED")
                raise JobStopped(f"stopped on SIGTERM at a checkpoint (MLflow run {self.run_id} "
                                 "KILLED); run the same command to resume") from None
            from elastic_ddp.controller.failures import describe_training_error

            msg = describe_training_error(e)
            self._close(msg, "FAILED")
            raise TrainingError(f"training failed (MLflow run {self.run_id} marked FAILED): {msg}") from e
        # Ctrl-C, SIGTERM before fit or SystemExit: the run must not stay RUNNING in the
        # store; checkpoints are kept, so resubmitting the same run.name resumes it.
        self._close(str(e) if isinstance(e, StoppedBeforeTraining) else "interrupted", "KILLED")
        self._raise_interrupted(e)

    def _failed_before_run(self, e: BaseException) -> None:
        if not self.opener.went:  # refused before the run was opened: nothing to close
            return
        # The run may be open by now (opened beside ray.init): close it, then re-raise.
        # (An open that failed, e.g. a deleted experiment, raises again here: no run.)
        try:
            self.run_id = self.opener.result()["run_id"]
        except BaseException:  # noqa: BLE001 - the open failed too (or was never sent): no run is left open
            raise e from None
        killed = not isinstance(e, Exception)  # Ctrl-C, SIGTERM (JobStopped)
        # The tracker was not bound to the run: nothing of it to flush.
        close_failed(self.uri, self.run_id, None, f"{type(e).__name__}: {e}",
                     "KILLED" if killed else "FAILED", self.opener)
        self._raise_interrupted(e)

    def _close(self, msg: str, status: str) -> None:
        close_failed(self.uri, self.run_id, self.tracker, msg, status, self.opener)

    def _raise_interrupted(self, e: BaseException) -> None:
        """Ctrl-C once the run exists: raised again as :class:`JobInterrupted`, whose message
        names the run and how to resume (the CLI prints it)."""
        if isinstance(e, KeyboardInterrupt) and not isinstance(e, JobInterrupted):
            raise JobInterrupted.of_run(self.run_id, self.cfg.run.resume) from None

    # -- the clean-up, in the exit stack -------------------------------------------------
    def _end_helper(self) -> None:
        if self.run_id is not None:
            self.opener.finish()  # the system metrics end with the job
        else:
            self.opener.cancel()  # no run is opened for a job that fails its checks

    def _kill_actors(self) -> None:
        actors, self.host, self.tracker = (self.host, self.tracker), None, None
        kill_actors(*actors)

    def _release_lease(self) -> None:
        if self.lease is not None:
            self.lease.release()


def _interrupt_main(_record: dict) -> None:
    """The lease's heartbeat found the run taken over: the driver's main thread gets a
    SIGINT, so a ``KeyboardInterrupt`` wherever it waits (``trainer.fit()``), which the job
    turns into :class:`FencedError` (:meth:`Job.raise_if_fenced`) without writing to the run."""
    import signal
    import threading

    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
