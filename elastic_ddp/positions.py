"""What a rank reports about itself: where it is (:class:`Position`, a small record on
its node that outlives a SIGKILL) and, when it raises, the error with that place attached
(:func:`located` -> :class:`RankError`). Written by the worker, read by the controller
(:mod:`elastic_ddp.controller.failures`): a shared layer, no torch, no Ray at import time.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from elastic_ddp.causes import error_origin
from elastic_ddp.errors import ElasticDDPError

# Error classes (by name: the worker decides, the controller only reads the flag) that no
# restart can fix: the data, the config, the task or the checkpoint is wrong.
FATAL_TYPES = ("DataError", "TransformError", "CheckpointError", "DataChangedError",
               "ConfigError", "BatchConfigError", "TaskError", "NonFiniteError",
               # elastic_ddp.fencing: another job took the run over; this one must stop.
               "FencedError")

PHASES = ("set-up", "restore", "data read", "training step", "metrics", "evaluation",
          "checkpoint")


class RankError(ElasticDDPError, RuntimeError):
    """An exception raised on a rank, with where it happened. ``str()`` reads
    ``step 7 (epoch 0, rank 1, evaluation): ValueError: ...`` (the step the rank was
    computing or had just finished). Survives pickling to the controller."""

    def __init__(self, message: str, *, rank: int, step: Optional[int], epoch: Optional[int],
                 phase: str, error_type: str, fatal: bool, detail: str = "", origin: str = ""):
        super().__init__(message)
        self.rank, self.step, self.epoch, self.phase = rank, step, epoch, phase
        self.error_type, self.fatal, self.detail = error_type, fatal, detail
        self.origin = origin  # "task", "library" or "" (unknown): causes.error_origin

    def __reduce__(self):
        return (_rebuild_rank_error, (str(self), self.rank, self.step, self.epoch, self.phase,
                                      self.error_type, self.fatal, self.detail, self.origin))


def _rebuild_rank_error(message, rank, step, epoch, phase, error_type, fatal, detail, origin=""):
    return RankError(message, rank=rank, step=step, epoch=epoch, phase=phase,
                     error_type=error_type, fatal=fatal, detail=detail, origin=origin)


def is_fatal(exc: BaseException) -> bool:
    """True for errors no restart can fix (see :data:`FATAL_TYPES`), by class, MRO included."""
    return any(c.__name__ in FATAL_TYPES for c in type(exc).__mro__)


def located(exc: BaseException, rank: int, where: Optional[Mapping[str, Any]]) -> RankError:
    """``exc`` raised on ``rank`` while at ``where`` (a :class:`Position` record) as a
    :class:`RankError`. A ``StepError`` (the trainer's own wrapper of a training-step
    error) is unwrapped to the error it carries."""
    if isinstance(exc, RankError):
        return exc
    orig = exc
    if type(exc).__name__ == "StepError" and exc.__cause__ is not None:
        orig = exc.__cause__
    where = dict(where or {})
    step, epoch = where.get("step"), where.get("epoch")
    phase = where.get("phase", "set-up")
    error_type, text = type(orig).__name__, ANSI_ESCAPE.sub("", str(orig)).strip()
    cause = getattr(orig, "cause", None)
    if type(orig).__name__.startswith("RayTaskError") and isinstance(cause, BaseException):
        # A Ray task's error (a Ray Data read or transform task): its own error first,
        # then where it ran (the task's name, pid and node, which differ per attempt).
        # "ray::ReadX->MapBatches(TaskTransform)() (pid=1, ip=10.0.0.7)": where the task ran.
        task = next((ln.strip() for ln in text.splitlines() if "pid=" in ln),
                    getattr(orig, "function_name", None) or "a Ray Data task")
        error_type = type(cause).__name__
        text = f"{ANSI_ESCAPE.sub('', str(cause)).strip()} [in Ray task {task}]"
        orig = cause
    text = text or error_type
    head = f"step {step if step is not None else '?'} (epoch {epoch if epoch is not None else '?'}, "
    message = f"{head}rank {rank}, {phase}): {error_type}: {text}"
    return RankError(message, rank=rank, step=step, epoch=epoch, phase=phase,
                     error_type=error_type, fatal=is_fatal(orig), detail=text,
                     origin=error_origin(orig))


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


# ------------------------------------------------------------------ rank positions
def position_dir() -> Optional[Path]:
    """This user's private directory of rank positions on this node (0700, refused when
    it is a symlink or another user's); None when it cannot be had."""
    d = Path(tempfile.gettempdir()) / f"elastic-ddp-positions-{os.getuid()}"
    try:
        d.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(d)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return d


class Position:
    """Where this rank is: one fixed-size JSON record in ``position_dir()/pid<pid>.json``,
    rewritten in place (``os.pwrite``, no fsync: the page cache outlives a SIGKILLed
    process) each time the phase or the step changes. A few microseconds per write."""

    SIZE = 512

    def __init__(self, rank: int, run: str, attempt_t: Optional[float] = None,
                 node: Optional[str] = None):
        self.rank, self.run, self.node = rank, run, node
        self.t0 = attempt_t or time.time()
        self.record: Dict[str, Any] = {"phase": "set-up", "step": None, "epoch": None}
        # Notices this process got (kind -> seconds since the epoch): a rank killed soon
        # after its SIGTERM leaves it here, for the controller's preemption event.
        self.notices: Dict[str, float] = {}
        # The training thread and a signal handler (the main thread) both write.
        self._lock = threading.Lock()
        self._fd: Optional[int] = None
        d = position_dir()
        if d is not None:
            self.path = d / f"pid{os.getpid()}.json"
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            except OSError:
                self._fd = None
        self._write()

    def at(self, phase: str, step: Optional[int], epoch: Optional[int]) -> None:
        if (phase, step, epoch) == (self.record["phase"], self.record["step"], self.record["epoch"]):
            return
        self.record = {"phase": phase, "step": step, "epoch": epoch}
        self._write()

    def noticed(self, kind: str, t: float) -> None:
        """Record a notice of ``kind`` (``elastic_ddp.notice.SOURCES``) received at ``t``
        (seconds since the epoch), written at once: the process may be killed next."""
        if kind not in self.notices:
            self.notices[kind] = t
            self._write()

    def _write(self) -> None:
        with self._lock:
            if self._fd is None:
                return
            rec = {**self.record, "rank": self.rank, "run": self.run, "pid": os.getpid(),
                   "node": self.node, "t0": self.t0, "t": time.time(),
                   **({"notices": dict(self.notices)} if self.notices else {})}
            data = json.dumps(rec).encode()[: self.SIZE].ljust(self.SIZE)
            try:
                os.pwrite(self._fd, data, 0)
            except OSError:
                pass

    def close(self, remove: bool = True) -> None:
        """A rank that ends normally removes its record (a dead one's stays for the
        controller, which removes it after reading)."""
        with self._lock:
            if self._fd is None:
                return
            os.close(self._fd)
            self._fd = None
            if remove:
                try:
                    self.path.unlink()
                except OSError:
                    pass


def _read_position_file(pid: int, remove: bool = True, node: Optional[str] = None) -> Optional[dict]:
    """The record of ``pid`` in this machine's position directory (removed once read);
    with ``node``, only one written on that Ray node (else None, and it stays)."""
    d = position_dir()
    if d is None:
        return None
    p = d / f"pid{int(pid)}.json"
    try:
        rec = json.loads(p.read_bytes().decode(errors="replace").strip())
    except (OSError, ValueError):
        rec = None
    if node is not None and (rec is None or rec.get("node") != node):
        return None
    if remove:
        try:
            p.unlink()
        except OSError:
            pass
    return rec


def read_position(node_id: Optional[str], pid: Optional[int], timeout_s: float = 20.0,
                  force_task: bool = False, remove: bool = True) -> Optional[dict]:
    """The last position record of process ``pid`` on node ``node_id``: read directly
    when that is this node, or when this machine holds a record of that pid written on
    that node (several Ray nodes on one host, as in a local multi-node cluster), else by
    a zero-CPU Ray task pinned to the node: a task may first need a new worker process
    there, which would sit between a failure and its restart. None when the node or the
    record is gone. ``remove=False``: the record stays (a live rank's)."""
    if not pid:
        return None
    import ray

    here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    if not force_task and (node_id is None or node_id == here):
        return _read_position_file(pid, remove)
    if not force_task and node_id is not None:
        rec = _read_position_file(pid, remove, node=node_id)
        if rec is not None:
            return rec
    if not ray.is_initialized():
        return None
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    fn = ray.remote(num_cpus=0, max_retries=0)(_read_position_file)
    try:
        ref = fn.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(pid, remove)
        return ray.get(ref, timeout=timeout_s)
    except Exception:  # noqa: BLE001 - a lost node: the position is unknown
        return None


