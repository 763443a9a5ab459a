"""The job's MLflow run, opened by a helper process that starts with the command.

Importing MLflow and its SQLAlchemy store costs the driver more CPU time than anything else
it does before training, and the run must be open (its run id, and whether an earlier
submission is resumed, which picks the Ray Train run directory) before the Ray Train
controller can start. In a thread beside the driver's own imports and the data scan that
import would only take turns with them for the GIL; in a process of its own it runs on
another core. So the driver starts :class:`RunOpener` first; the helper imports MLflow
and then waits; the driver sends the open request only after every input check has
passed, so a job with bad input still creates no run (and no sqlite file) at all.

Once the run is open, the helper stays for the job's lifetime as MLflow's system-metrics
monitor (``system/*``), on the driver's node (with ``ray job submit``, the head node), from
the run's opening on: it has MLflow imported already, while the tracker actor imports it
only after the first step. :meth:`RunOpener.finish` stops it before the run is closed;
it also stops when the driver dies.

A plain ``python -m elastic_ddp.tracking.opener`` child rather than ``multiprocessing``:
the ``spawn`` and ``forkserver`` start methods re-run the parent's ``__main__``, and a
user's script that calls ``elastic_ddp.train`` without a ``__main__`` guard would start
itself again. What it costs: one more interpreter for the job's length (asleep but for a
system sample every few seconds), and the request and the answer pickled through pipes.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Optional

RAY_RUN_NAME_TAG = "elastic_ddp.ray_run_name"


class RunOpener:
    """The helper process: started (MLflow imported in it) on construction.
    :meth:`find` sends the request and the helper looks for the run to resume (reading
    only); :meth:`found` waits for what it found; :meth:`go` lets it open the run (or
    reopen the one found), :meth:`result` waits for that answer; :meth:`finish` stops
    the system-metrics monitor (its last samples written) and the process.
    :meth:`open` is :meth:`find` and :meth:`go` at once.

    The helper ignores SIGINT: a Ctrl-C in the terminal reaches it too, and a run it is
    opening must be finished so that the driver can close it as KILLED. :meth:`cancel`
    kills it before a request, and before :meth:`go` ends it with nothing opened or
    changed; it exits by itself when its stdin closes without a request or the driver
    dies."""

    def __init__(self, uri: str):
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self._p = subprocess.Popen([sys.executable, "-m", "elastic_ddp.tracking.opener", uri],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._sent = False
        #: :meth:`go` was sent: the helper opens (or reopens) the run.
        self.went = False

    def open(self, **request: Any) -> None:
        """:meth:`find` and :meth:`go` at once: the run is opened without waiting."""
        self.find(go=True, **request)

    def find(self, go: bool = False, **request: Any) -> None:
        """Send the request (the keyword arguments of :func:`open_job_run`): the helper
        looks for the run to resume, answers (:meth:`found`) and waits for :meth:`go`
        (``go``: sent with it). Both answers are read in a thread, so that a Ctrl-C in a
        wait loses nothing."""
        from elastic_ddp.background import Background, signals_held

        # All or nothing: a signal raised between the send and the reader's start would
        # leave a run the helper opens that the driver can neither read nor close.
        with signals_held():
            try:
                pickle.dump(request, self._p.stdin)
                self._p.stdin.flush()
            except BrokenPipeError:  # the helper died: result() says so
                pass
            self._sent = True
            self._found = Background(self._read, name="mlflow-helper-find")
            self._answer = Background(self._read_after_found, name="mlflow-helper")
            if go:
                self._go()

    def go(self) -> None:
        """Let the helper open the run (or reopen the one it found)."""
        from elastic_ddp.background import signals_held

        with signals_held():
            self._go()

    def _go(self) -> None:
        try:
            pickle.dump("go", self._p.stdin)
            self._p.stdin.close()
        except (BrokenPipeError, ValueError):  # the helper died: result() says so
            pass
        self.went = True

    def _read(self):
        try:
            return pickle.load(self._p.stdout)
        except Exception:  # noqa: BLE001 - no answer at all: say what happened
            self._p.wait()
            return False, RuntimeError(
                f"the MLflow helper process exited with code {self._p.returncode} without "
                "opening the run (its error is printed above)")

    def _read_after_found(self):
        ok, _ = self._found.result()
        return self._read() if ok else (ok, _)

    def found(self) -> Optional[dict[str, Any]]:
        """The unfinished run this job resumes (:func:`find_job_run`), or None (a new run).

        Raises:
            what the helper's search raised; RuntimeError: it died without an answer.
        """
        ok, value = self._found.result()
        if not ok:
            raise value
        return value

    def result(self) -> dict[str, Any]:
        """:func:`open_job_run`'s answer (the same on every call); its exception is
        raised here, in the driver.

        Raises:
            RuntimeError: the helper died without an answer (its stderr is the driver's).
        """
        ok, value = self._answer.result()
        if not ok:
            raise value
        return value

    def finish(self, timeout_s: float = 30.0) -> None:
        """Stop the system-metrics monitor (SIGTERM: it writes its last samples) and wait
        for the helper to exit, at most ``timeout_s`` seconds; then it is killed."""
        if self._p.poll() is None:
            self._p.terminate()
        self._wait(timeout_s)

    def fenced(self) -> None:
        """The job lost the run's lease (``elastic_ddp.fencing``): the helper is killed at
        once, so that its system-metrics monitor writes no last samples into the run."""
        if self._p.poll() is None:
            self._p.kill()
        self._wait(10)

    def _wait(self, timeout_s: float) -> None:
        try:
            self._p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._p.kill()
            self._p.wait()

    def cancel(self) -> None:
        """No run is wanted (an input check failed): the helper stops without opening.

        Before a request the helper has only imported (no store opened, no file
        written), so it is killed at once: waiting for its MLflow import to finish would
        hold up the exit-2 of a config typo by the seconds that import takes. After
        :meth:`open` it is waited for as before (it may be opening the run)."""
        if not self._sent:
            try:
                self._p.stdin.close()
            except OSError:
                pass
            self._sent = True
            if self._p.poll() is None:
                self._p.kill()
        elif not self.went:
            try:
                self._p.stdin.close()  # no go: the helper exits with nothing opened
            except OSError:
                pass
            self.went = True
        self._wait(10)
        self._p.stdout.close()


def find_job_run(cfg, storage: str, uri: str, **_: Any) -> Optional[dict[str, Any]]:
    """The unfinished run this job would resume (``tracking.runs.find_run``; read only),
    as ``{"run_id", "status", "ray_run_name", "params", "tags"}`` (``ray_run_name``: the
    Ray Train run directory it recorded, None when it recorded none; ``tags``: its
    ``elastic_ddp.*`` tags), or None: a new run."""
    from elastic_ddp.tracking.runs import find_run

    run = find_run(cfg, storage, uri)
    if run is None:
        return None
    tags = run.data.tags
    return {"run_id": run.info.run_id, "status": run.info.status,
            "ray_run_name": tags.get(RAY_RUN_NAME_TAG), "params": dict(run.data.params),
            "tags": {k: v for k, v in tags.items() if k.startswith("elastic_ddp.")}}


def open_job_run(cfg, storage: str, uri: str, parent_run_id: Optional[str], task_params: dict,
                 train_info, val_info, skipped: dict, system_metrics: bool = True,
                 found: Any = "search") -> dict[str, Any]:
    """Open (or reopen) the job's run and log what is known before training: the data
    sets, the task's params, the files the scan skipped, the Ray Train run name
    (:func:`ray_run_name`), and for a resumed run its worker-group starts so far and
    its earlier submissions' records (``tracking.history.earlier_records``). A failure
    after the run is open closes it as FAILED.

    ``system_metrics``: the helper then monitors the system (:func:`start_system_metrics`).
    ``found``: :func:`find_job_run`'s answer (default: the run is looked for here).

    Returns: ``{"run_id", "resumed", "ray_run_name", "attempts", "history",
    "data_wait_given"}``: the Ray Train run name (:func:`ray_run_name`) alone, not a
    config, so that the driver keeps the one ``Config`` it validated; ``history``: the
    earlier submissions' events, attempts and timeline; ``data_wait_given``: the run's
    data-wait warning was given by an earlier submission."""
    import json

    from elastic_ddp import tracking
    from elastic_ddp.tracking.data_wait import DATA_WAIT_TAG
    from elastic_ddp.tracking.history import earlier_records

    if found == "search":
        found = find_job_run(cfg, storage, uri)
    history = earlier_records(uri, found["run_id"]) if found else {}
    run_id, resumed = tracking.open_run(cfg, storage, uri, parent_run_id=parent_run_id,
                                        resume_id=found["run_id"] if found else None)
    try:
        tracking.log_job_inputs(uri, run_id, cfg, task_params, train_info, val_info, resumed)
        ray_name = ray_run_name(cfg, storage, uri, run_id, resumed)
        if skipped:
            tracking.log_text(uri, run_id, json.dumps(skipped, indent=1), "data/skipped.json")
            tracking.set_tags(uri, run_id, {"elastic_ddp.data_skipped": sum(map(len, skipped.values()))})
        attempts = tracking.attempts_so_far(uri, run_id) if resumed else {}
    except BaseException as e:
        tracking.finish_run(uri, run_id, ok=False, error=f"{type(e).__name__}: {e}", status="FAILED")
        raise
    return {"run_id": run_id, "resumed": resumed, "ray_run_name": ray_name, "attempts": attempts,
            "history": history, "data_wait_given": bool(found and DATA_WAIT_TAG in found["tags"])}


def ray_run_name(cfg, storage: str, uri: str, run_id: str, resumed: bool) -> str:
    """The Ray Train run directory for this job. Ray Train restores a run from
    ``storage_path/name`` by itself, so an unfinished job resumes by reusing the name its
    MLflow run recorded, while a new job whose name is already taken by a finished one
    gets ``name-<run id prefix>`` instead of silently "resuming" a completed run with zero
    steps (running ``make train`` twice trains twice)."""
    from elastic_ddp.tracking.store import run_info, set_tags

    ray_name = run_info(uri, run_id).data.tags.get(RAY_RUN_NAME_TAG) if resumed else None
    if ray_name is None:
        ray_name = cfg.run.name
        if not resumed and run_dir_exists(storage, ray_name):
            ray_name = f"{cfg.run.name}-{run_id[:8]}"
        set_tags(uri, run_id, {RAY_RUN_NAME_TAG: ray_name})
    return ray_name


def run_dir_exists(storage: str, name: str) -> bool:
    """Whether the run directory ``storage/name`` exists (a run that may have checkpoints)."""
    import pyarrow.fs

    from elastic_ddp.paths import uri_to_filesystem

    # Never "file://" + path: a space, '#' or '?' in the path would break the URI.
    fs, base = uri_to_filesystem(storage)
    return fs.get_file_info(f"{base.rstrip('/')}/{name}").type != pyarrow.fs.FileType.NotFound


def start_system_metrics(uri: str, run_id: str, interval_s: Optional[float] = None):
    """MLflow's ``SystemMetricsMonitor`` for the run (``system/*``: CPU %, memory, disk,
    network, and GPU utilisation/memory/power when NVML finds a GPU), sampling this
    machine every ``interval_s`` seconds until the run stops RUNNING or ``finish()``.
    A resumed job's samples continue the run's system steps. None when psutil is
    missing or the monitor cannot start (monitoring never stops a job)."""
    import logging

    from elastic_ddp.tracking.store import SYSTEM_METRICS_INTERVAL_S

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

        # Its "Started monitoring"/"Skip logging GPU metrics" INFO lines: not for the
        # console (this process writes to the driver's stderr).
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        mon = SystemMetricsMonitor(run_id, sampling_interval=interval_s or SYSTEM_METRICS_INTERVAL_S,
                                   resume_logging=True, tracking_uri=uri)
        mon.start()
        return mon
    except Exception:  # noqa: BLE001 - psutil missing, store unreachable
        return None


def _answer(out, ok: bool, value: Any) -> None:
    try:
        data = pickle.dumps((ok, value))
        pickle.loads(data)  # an exception that cannot be rebuilt in the driver
    except Exception:  # noqa: BLE001 - send its text instead
        data = pickle.dumps((False, RuntimeError(f"{type(value).__name__}: {value}")))
    out.write(data)
    out.flush()


def _main(uri: str) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    parent = os.getppid()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print (MLflow's, a migration's) must not corrupt the answer
    # The import is the point of the helper: paid while the driver imports torch and
    # scans the data. No store is opened yet (that would create a sqlite file).
    import mlflow.tracking  # noqa: F401

    if uri.split(":", 1)[0].split("+", 1)[0] in ("sqlite", "postgresql", "mysql", "mssql"):
        import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
    try:
        request = pickle.load(sys.stdin.buffer)
    except EOFError:
        return 0  # cancelled: nothing opened
    fence = request.pop("fence", None)  # elastic_ddp.fencing.Fence: the job's lease token
    try:
        found = find_job_run(**request)
    except BaseException as e:  # noqa: BLE001 - raised again in the driver
        _answer(out, False, e)
        return 0
    _answer(out, True, found)
    try:
        pickle.load(sys.stdin.buffer)  # the driver's go
    except EOFError:
        return 0  # the driver's checks refused the job: nothing opened or changed
    try:
        answer = open_job_run(**request, found=found)
    except BaseException as e:  # noqa: BLE001 - raised again in the driver
        _answer(out, False, e)
        return 0
    _answer(out, True, answer)
    out.close()
    if request.get("system_metrics", True):
        from elastic_ddp.tracking.node_metrics import interval_s

        mon = start_system_metrics(uri, answer["run_id"], interval_s())
        # Until the driver's finish() (SIGTERM) or its death, or another job taking the
        # run over (the lease read every few seconds while the monitor runs): then the
        # process ends without the monitor's last samples.
        while mon is not None and not stop.wait(1.0) and os.getppid() == parent:
            if fence is not None and fence.lost(every_s=5.0) is not None:
                os.kill(os.getpid(), signal.SIGKILL)  # no last samples written
        if mon is not None:
            mon.finish()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))
