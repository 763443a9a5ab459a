"""SIGTERM to the driver (``elastic-ddp train`` as a Ray job being stopped, a CI runner
cancelled, a pod deleted): the job commits a checkpoint at the next step boundary and
ends; the driver exits with :data:`EXIT_STOPPED`, and the same command resumes.

    with SigtermStop(host) as stop:      # host: the controller host (compat.ray_controller_host)
        result = trainer.fit()
    ...
    if stop.stopped(error): ...          # raise JobStopped

Where the Ray release has no preemption support (``compat.versions.preemption_supported``)
or the controller host is not used, nothing is installed: SIGTERM ends the driver as it
would without elastic-ddp, and the job resumes from its newest checkpoint.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Optional

from elastic_ddp.background import start_deferring_signals

#: The exit code of a job stopped by SIGTERM at a checkpoint (128 + SIGTERM, as a shell
#: reports a process ended by that signal).
EXIT_STOPPED = 143
#: The exit code of a job interrupted by Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 130


class JobStopped(BaseException):
    """The job stopped on SIGTERM at a committed checkpoint; its MLflow run is KILLED
    and running the same command resumes it.

    A ``BaseException``, as ``KeyboardInterrupt`` is: raised in the main thread wherever
    it is (:class:`EarlySignals`), it must pass every ``except Exception`` on its way out
    (the user's task module being imported, the task's dry run, a library call) instead
    of being reported as that code's error. Not an
    :class:`~elastic_ddp.errors.ElasticDDPError` for that reason."""

    exit_code = EXIT_STOPPED


class SigtermStop:
    """Within the block, the first SIGTERM asks the job to stop at the next step
    boundary (``host.request_stop``: the controller tells every worker); a second one
    interrupts the driver as Ctrl-C does (the run is aborted, exit 130). ``enabled``:
    False installs nothing. Only the main thread may install a handler; elsewhere
    (a job run from a thread) nothing is installed either."""

    def __init__(self, host, enabled: bool = True):
        self.host = host
        self.enabled = enabled and host is not None
        self.requested: Optional[float] = None
        self._before = None
        self._installed = False

    def __enter__(self) -> "SigtermStop":
        if self.enabled and threading.current_thread() is threading.main_thread():
            self._before = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._before if self._before is not None else signal.SIG_DFL)
            self._installed = False

    def _on_sigterm(self, signum, frame) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = time.time()
        # Not from inside the handler: it may run in the middle of a Ray call of this thread.
        start_deferring_signals(threading.Thread(target=self._ask, name="elastic-ddp-stop", daemon=True))

    def _ask(self) -> None:
        import sys

        print("elastic-ddp: SIGTERM: committing a checkpoint at the next step boundary, then "
              "stopping (a second SIGTERM stops at once)", file=sys.stderr, flush=True)
        from elastic_ddp.notice import request_stop

        try:
            self.host.request_stop.remote(request_stop)
        except Exception as e:  # noqa: BLE001 - the job then runs on; a second SIGTERM ends it
            print(f"elastic-ddp: warning: the stop request did not reach the controller "
                  f"({type(e).__name__}: {e})", file=sys.stderr, flush=True)

    def stopped(self, error: BaseException) -> bool:
        """Whether ``error`` (what ``fit`` raised) is the job ending on this stop: the
        controller's ``StopRequested`` (``controller.events``), as the run's error."""
        if self.requested is None:
            return False
        seen = set()
        e: Optional[BaseException] = error
        while e is not None and id(e) not in seen:
            seen.add(id(e))
            if type(e).__name__ == "StopRequested":
                return True
            e = getattr(e, "controller_failure", None) or e.__cause__
        return "StopRequested" in str(error)


class JobInterrupted(KeyboardInterrupt):
    """Ctrl-C (or a second SIGTERM) after the job's MLflow run was opened: the run is
    KILLED, its checkpoints are kept; the message names the run and how to resume. A
    ``KeyboardInterrupt``, not an :class:`~elastic_ddp.errors.ElasticDDPError`, so that
    it passes every ``except Exception``."""

    exit_code = EXIT_INTERRUPTED

    @classmethod
    def of_run(cls, run_id: str, resume: bool) -> "JobInterrupted":
        again = ("run the same command to resume it" if resume else
                 "run.resume is false: the same command starts a new run")
        return cls(f"interrupted (MLflow run {run_id} KILLED, checkpoints kept); {again}")


#: Ctrl-C of ``train`` before its MLflow run was opened (the checks, the data scan).
INTERRUPTED_BEFORE_RUN = ("interrupted before the job started: no MLflow run was opened and "
                          "no checkpoint written; run the same command to start the job")


STOPPED_BEFORE_TRAINING = ("stopped on SIGTERM before training started (nothing to checkpoint); "
                           "run the same command to start the job")


class StoppedBeforeTraining(JobStopped):
    """SIGTERM arrived before training started (preflight, data scan, MLflow run
    creation, Ray start-up): there is nothing to checkpoint; an MLflow run opened by then
    is closed as KILLED, and running the same command starts the job."""


class EarlySignals:
    """Until :meth:`hand_over` (or the block's end), SIGTERM raises
    :class:`StoppedBeforeTraining` in the main thread, the way Ctrl-C raises
    KeyboardInterrupt: the launcher's clean-up paths run (no MLflow run left RUNNING, the
    run's lease released) and the CLI exits with :data:`EXIT_STOPPED`. Installed only in
    the main thread (only it may install a handler).

    ``ray.init`` installs a SIGTERM handler of its own, ``sys.exit(15)``, as it starts:
    :meth:`reinstall` puts this one back after it, and a ``SystemExit(15)`` that ends the
    block while this handler is in charge (a SIGTERM during ``ray.init``, which the
    clean-up paths have handled as an interruption) leaves it as
    :class:`StoppedBeforeTraining`, so the exit code and the message are the same
    whenever the signal lands.

    A signal whose exception was swallowed is raised again: ``ray.init`` forks, and an
    exception raised in an at-fork callback (``logging`` releases its locks in one) is
    printed as "Exception ignored" and dropped, so a Ctrl-C or SIGTERM landing there
    would let the job run on. Both handlers here record the signal; :meth:`reinstall`
    (after ``ray.init``) and :meth:`hand_over` (before ``fit``), reached only when no
    exception left the block, raise it if one was recorded. (Only while Python's own
    Ctrl-C handler is in charge is SIGINT's handler replaced.)"""

    def __init__(self):
        self._before: dict[int, object] = {}
        self.pending: Optional[BaseException] = None

    def __enter__(self) -> "EarlySignals":
        if threading.current_thread() is threading.main_thread():
            self._before[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_sigterm)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._before[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        ours = signal.SIGTERM in self._before
        self.release()
        if ours and exc_type is SystemExit and exc.code == signal.SIGTERM:
            raise StoppedBeforeTraining(STOPPED_BEFORE_TRAINING) from None

    def reinstall(self) -> None:
        """This SIGTERM handler again, after a call that installed its own (``ray.init``);
        raises a signal that arrived during that call and was swallowed there."""
        if signal.SIGTERM in self._before:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        self._raise_pending()

    def hand_over(self) -> None:
        """Raise a swallowed signal, else put the handlers found at entry back
        (``SigtermStop`` then takes over during fit)."""
        self._raise_pending()
        self.release()

    def release(self) -> None:
        """Put the handlers found at entry back."""
        for signum, before in self._before.items():
            signal.signal(signum, before if before is not None else signal.SIG_DFL)
        self._before.clear()

    def _raise_pending(self) -> None:
        if self.pending is not None:
            e, self.pending = self.pending, None
            raise e

    def _on_sigterm(self, signum, frame) -> None:
        self._record(StoppedBeforeTraining(STOPPED_BEFORE_TRAINING))

    def _on_sigint(self, signum, frame) -> None:
        self._record(KeyboardInterrupt())

    def _record(self, e: BaseException) -> None:
        """Raise ``e`` here and keep it, for :meth:`_raise_pending` should it be swallowed."""
        self.pending = e
        raise e
