"""What failed, where, and whether a restart can help.

Ray Train hands the controller one exception per failed rank. Three kinds reach it:

- a Python error raised on a rank: the worker wraps it in :class:`RankError`, which says
  where the rank was (step, epoch, phase: restore, data read, training step, metrics,
  evaluation, checkpoint) and whether the error is *fatal* (bad data, config or
  checkpoint: no restart can fix it);
- a dead rank (``RayActorError``, usually inside Ray Train's
  ``WorkerHealthCheckFailedError``): a process killed by a signal has no Python error at
  all. Each rank keeps its position in a small file on its node (:class:`Position`,
  ``pwrite`` of one record per phase change); the controller reads the dead process's
  record (:func:`read_position`);
- collateral errors of the survivors (gloo ``Connection closed by peer``, NCCL aborts,
  collective timeouts): consequences, never the cause while another rank has one.

:func:`classify` turns the exceptions into :class:`RankFailure` records, :func:`primary`
picks the cause (the first rank that died, else the first real error), and
:func:`signature` is the fingerprint the controller compares between attempts: the kind,
phase, step, error type and message with addresses, ports, pids and object ids removed.
The same fingerprint on two attempts in a row is a deterministic failure.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

# Error classes (by name: the worker decides, the controller only reads the flag) that no
# restart can fix: the data, the config, the task or the checkpoint is wrong.
FATAL_TYPES = ("DataError", "TransformError", "CheckpointError", "DataChangedError",
               "ConfigError", "BatchConfigError", "TaskError", "NonFiniteError")

# Errors a rank gets because *another* rank failed: its peer vanished mid-collective.
_COLLATERAL = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|ECONNRESET|remote (process|worker) "
    r"(exited|crash)|NCCL communicator was aborted|ProcessGroupNCCL.*(abort|[Tt]imeout)|"
    r"Socket Timeout|Timed out waiting|Connection refused|[Rr]ead error|"
    r"typically caused by a remote worker crashing|Gloo.*(timeout|Timeout)")

PHASES = ("set-up", "restore", "data read", "training step", "metrics", "evaluation",
          "checkpoint")


class RankError(RuntimeError):
    """An exception raised on a rank, with where it happened. ``str()`` reads
    ``step 7 (epoch 0, rank 1, evaluation): ValueError: ...`` (the step the rank was
    computing or had just finished). Survives pickling to the controller."""

    def __init__(self, message: str, *, rank: int, step: Optional[int], epoch: Optional[int],
                 phase: str, error_type: str, fatal: bool, detail: str = ""):
        super().__init__(message)
        self.rank, self.step, self.epoch, self.phase = rank, step, epoch, phase
        self.error_type, self.fatal, self.detail = error_type, fatal, detail

    def __reduce__(self):
        return (_rebuild_rank_error, (str(self), self.rank, self.step, self.epoch, self.phase,
                                      self.error_type, self.fatal, self.detail))


def _rebuild_rank_error(message, rank, step, epoch, phase, error_type, fatal, detail):
    return RankError(message, rank=rank, step=step, epoch=epoch, phase=phase,
                     error_type=error_type, fatal=fatal, detail=detail)


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
    error_type, text = type(orig).__name__, _ANSI.sub("", str(orig)).strip()
    cause = getattr(orig, "cause", None)
    if type(orig).__name__.startswith("RayTaskError") and isinstance(cause, BaseException):
        # A Ray task's error (a Ray Data read or transform task): its own error first,
        # then where it ran (the task's name, pid and node, which differ per attempt).
        # "ray::ReadX->MapBatches(_Transform)() (pid=1, ip=10.0.0.7)": where the task ran.
        task = next((ln.strip() for ln in text.splitlines() if "pid=" in ln),
                    getattr(orig, "function_name", None) or "a Ray Data task")
        error_type = type(cause).__name__
        text = f"{_ANSI.sub('', str(cause)).strip()} [in Ray task {task}]"
        orig = cause
    text = text or error_type
    head = f"step {step if step is not None else '?'} (epoch {epoch if epoch is not None else '?'}, "
    message = f"{head}rank {rank}, {phase}): {error_type}: {text}"
    return RankError(message, rank=rank, step=step, epoch=epoch, phase=phase,
                     error_type=error_type, fatal=is_fatal(orig), detail=text)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


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

    def _write(self) -> None:
        if self._fd is None:
            return
        rec = {**self.record, "rank": self.rank, "run": self.run, "pid": os.getpid(),
               "node": self.node, "t0": self.t0, "t": time.time()}
        data = json.dumps(rec).encode()[: self.SIZE].ljust(self.SIZE)
        try:
            os.pwrite(self._fd, data, 0)
        except OSError:
            pass

    def close(self, remove: bool = True) -> None:
        """A rank that ends normally removes its record (a dead one's stays for the
        controller, which removes it after reading)."""
        if self._fd is not None:
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
                  force_task: bool = False) -> Optional[dict]:
    """The last position record of process ``pid`` on node ``node_id``: read directly
    when that is this node, or when this machine holds a record of that pid written on
    that node (several Ray nodes on one host, as in a local multi-node cluster), else by
    a zero-CPU Ray task pinned to the node: a task may first need a new worker process
    there, which would sit between a failure and its restart. None when the node or the
    record is gone."""
    if not pid:
        return None
    import ray

    here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    if not force_task and (node_id is None or node_id == here):
        return _read_position_file(pid)
    if not force_task and node_id is not None:
        rec = _read_position_file(pid, node=node_id)
        if rec is not None:
            return rec
    if not ray.is_initialized():
        return None
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    fn = ray.remote(num_cpus=0, max_retries=0)(_read_position_file)
    try:
        ref = fn.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(pid)
        return ray.get(ref, timeout=timeout_s)
    except Exception:  # noqa: BLE001 - a lost node: the position is unknown
        return None


# ------------------------------------------------------------------ classification
_ADDR = re.compile(r"\[?(?:\d{1,3}\.){3}\d{1,3}\]?(?::\d+)?|\[[0-9A-Fa-f:]*:[0-9A-Fa-f:]*\](?::\d+)?")
_PID = re.compile(r"\b(pid|PID|port|Port)([=: ]+)\d+")
_HEX = re.compile(r"\b[0-9a-fA-F]{16,}\b")
_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?")
_TMP = re.compile(r"/tmp/[^\s'\"]*")


def normalise(text: str) -> str:
    """``text`` without what changes between attempts of the same failure: IP addresses
    and ports, pids, object/actor/worker ids (long hex), timestamps and temp paths."""
    text = _ANSI.sub("", text)
    text = _TIME.sub("<time>", text)
    text = _ADDR.sub("<addr>", text)
    text = _PID.sub(lambda m: f"{m.group(1)}{m.group(2)}<n>", text)
    text = _HEX.sub("<id>", text)
    text = _TMP.sub("<tmp>", text)
    return re.sub(r"\s+", " ", text).strip()


@dataclass
class RankFailure:
    """One failed rank, as the controller sees it.

    ``kind``: ``died`` (the process is gone), ``error`` (a Python error) or
    ``collateral`` (an error caused by another rank's failure). ``how``: for ``died``,
    what killed it as far as Ray knows; ``signal``: the inferred signal."""

    rank: int
    kind: str
    step: Optional[int] = None
    epoch: Optional[int] = None
    phase: Optional[str] = None
    error_type: str = ""
    message: str = ""
    fatal: bool = False
    node: str = ""
    pid: Optional[int] = None
    signal: str = ""
    how: str = ""
    t: Optional[float] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        where = f"step {self.step}" if self.step is not None else "an unknown step"
        if self.phase and self.phase != "training step":
            where += f" ({self.phase})"
        if self.kind == "died":
            node = f" on node {self.node}" if self.node else ""
            pid = f", pid {self.pid}" if self.pid else ""
            sig = f" [{self.signal}]" if self.signal else ""
            return f"rank {self.rank} died at {where}{node}{pid}: {self.how}{sig}"
        lines = [ln for ln in self.message.strip().splitlines() if ln.strip()]
        text = " ".join(lines[:2]) if len(lines) > 1 and len(lines[0]) < 80 else (lines[0] if lines else "")
        return f"rank {self.rank} failed at {where}: {self.error_type}: {text[:400]}"


def _death(exc: BaseException) -> Optional[BaseException]:
    """The ``RayActorError`` behind a dead rank's failure, or None for a Python error."""
    from ray.exceptions import RayActorError

    if isinstance(exc, RayActorError):
        return exc
    inner = getattr(exc, "health_check_failure", None)
    if isinstance(inner, RayActorError):
        return inner
    if type(exc).__name__ == "WorkerHealthCheckTimeoutError":
        return exc
    return None


def _how_it_died(text: str) -> tuple[str, str]:
    """(what killed the process, the signal) from Ray's death message."""
    if re.search(r"OutOfMemoryError|memory monitor|low on memory", text):
        return "killed by Ray's memory monitor (the node ran low on memory)", "SIGKILL"
    if re.search(r"preempt", text, re.I):
        return "its node was preempted", ""
    if re.search(r"node .*(died|terminated|removed)|NodeDiedError|raylet", text, re.I):
        return "its node was lost", ""
    if "health check has been hanging" in text:
        return "stopped answering Ray's health checks (hung or stopped)", ""
    m = re.search(r"exit(?:ed|s)? with (?:an )?exit code (-?\d+)", text)
    if m and m.group(1) not in ("0", "2"):
        return f"the process exited with code {m.group(1)}", ""
    if re.search(r"connection error code 2|End of file|unexpectedly exits|died unexpectedly", text):
        return ("killed by a signal: the process vanished without a Python error, as SIGKILL "
                "leaves it (the kernel OOM killer, `kill -9`) or a native crash"), "SIGKILL"
    return "the process died", ""


def classify(exceptions: Mapping[int, BaseException],
             positions: Optional[Mapping[int, dict]] = None,
             workers: Optional[Mapping[int, dict]] = None) -> list[RankFailure]:
    """One :class:`RankFailure` per rank in ``exceptions`` (rank -> exception, as Ray
    Train's ``after_exception`` hands them over). ``positions``: rank -> the dead
    process's position record; ``workers``: rank -> ``{node_ip, pid, ...}`` of the group."""
    out = []
    for rank, exc in sorted(exceptions.items()):
        meta = dict((workers or {}).get(rank) or {})
        dead = _death(exc)
        if dead is not None:
            text = str(exc)
            how, sig = _how_it_died(text)
            pos = dict((positions or {}).get(rank) or {})
            m = re.search(r"\bip: (\S+)", text)
            pm = re.search(r"\bpid: (\d+)", text)
            out.append(RankFailure(
                rank=rank, kind="died", step=pos.get("step"), epoch=pos.get("epoch"),
                phase=pos.get("phase"), error_type=type(dead).__name__, message=text,
                node=meta.get("node_ip") or (m.group(1) if m else ""),
                pid=meta.get("pid") or (int(pm.group(1)) if pm else None),
                signal=sig, how=how, t=pos.get("t")))
            continue
        text = str(exc)
        if isinstance(exc, RankError):
            f = RankFailure(rank=rank, kind="error", step=exc.step, epoch=exc.epoch,
                            phase=exc.phase, error_type=exc.error_type, message=exc.detail or text,
                            fatal=exc.fatal, node=meta.get("node_ip", ""), pid=meta.get("pid"))
        else:
            m = re.search(r"\bstep (\d+) \(epoch (\d+), rank \d+(?:, ([^)]*))?\): (\w+): (.*)", text, re.S)
            if m:
                f = RankFailure(rank=rank, kind="error", step=int(m.group(1)), epoch=int(m.group(2)),
                                phase=m.group(3) or "training step", error_type=m.group(4),
                                message=m.group(5), node=meta.get("node_ip", ""), pid=meta.get("pid"))
            else:
                f = RankFailure(rank=rank, kind="error", error_type=type(exc).__name__,
                                message=text, node=meta.get("node_ip", ""), pid=meta.get("pid"))
            f.fatal = is_fatal(exc) or any(re.search(rf"\b{t}\b", text) for t in FATAL_TYPES)
        if not f.fatal and _COLLATERAL.search(f.message):
            f.kind = "collateral"
        out.append(f)
    return out


def primary(failures: list[RankFailure]) -> Optional[RankFailure]:
    """The cause: the first rank that died (by its last position time, then rank), else
    the first fatal error, else the first real error, else the first collateral one.
    A dead rank's unknown step is taken from a peer blocked in the same step."""
    if not failures:
        return None
    dead = [f for f in failures if f.kind == "died"]
    if dead:
        first = min(dead, key=lambda f: (f.t if f.t is not None else float("inf"), f.rank))
        if first.step is None:
            steps = [f.step for f in failures if f.kind == "collateral" and f.step is not None]
            if steps:
                first.step = min(steps)
                first.phase = first.phase or next(f.phase for f in failures if f.step == first.step)
                first.extra["step_from"] = "peers"
        return first
    errors = [f for f in failures if f.kind == "error"]
    if errors:
        return min(errors, key=lambda f: (not f.fatal, f.step if f.step is not None else 1 << 62, f.rank))
    return min(failures, key=lambda f: f.rank)


def signature(f: Optional[RankFailure]) -> Optional[tuple]:
    """The failure's fingerprint across attempts (no rank: a restart may renumber
    ranks); None when its step is unknown (nothing to compare)."""
    if f is None or f.step is None:
        return None
    if f.kind == "died":
        return ("died", f.phase, f.step, f.how)
    first = f.message.strip().splitlines()[0] if f.message.strip() else ""
    return (f.kind, f.phase, f.step, f.error_type, normalise(first)[:500])


def likely_cause(f: RankFailure) -> str:
    """What usually makes this failure repeat, and what to do."""
    if f.kind == "died":
        if f.signal == "SIGKILL":
            return ("likely cause: memory (the kernel OOM killer and Ray's memory monitor kill "
                    "with SIGKILL). Lower batch.micro_batch_size or the data a step reads, or give "
                    "the workers more memory; `dmesg` on that node shows 'Out of memory: Killed "
                    "process'")
        return "check the worker's log on that node (Ray's logs/worker-*.err)"
    if f.phase == "data read":
        return ("likely cause: a Parquet file that the footer scan accepted but whose pages cannot "
                "be read (corrupt or truncated), or a file changed since the scan; re-write or "
                "remove it")
    if f.phase == "evaluation":
        return "likely cause: the task's evaluate() or the validation data (data.val_path)"
    if f.phase == "metrics":
        return "likely cause: the metrics the task returns (names, shapes, finiteness)"
    if f.phase == "restore":
        return "likely cause: the checkpoint or the data it was written on"
    return "likely cause: the task's code or the rows of that step"


def describe_training_error(exc: BaseException) -> str:
    """One line for the user from what ``TorchTrainer.fit`` raised: the deterministic
    stop's message, or the cause of the last worker-group failure."""
    seen = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__name__ == "DeterministicTrainingError":
            return str(e)
        nxt = getattr(e, "controller_failure", None) or e.__cause__
        e = nxt
    failures = getattr(exc, "worker_failures", None)
    if failures:
        p = primary(classify(failures))
        if p is not None:
            tail = f" ({likely_cause(p)})" if p.kind == "died" else ""
            return f"{p.describe()}{tail}; the restart budget (scaling.max_failures) is spent"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
