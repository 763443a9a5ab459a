"""What failed, where, and whether a restart can help.

Ray Train hands the controller one exception per failed rank. Three kinds reach it:

- a Python error raised on a rank: the worker wraps it in :class:`RankError`, which says
  where the rank was (step, epoch, phase: restore, data read, training step, metrics,
  evaluation, checkpoint) and whether the error is *fatal* (bad data, config or
  checkpoint: no restart can fix it);
- a dead rank (``RayActorError``, usually inside Ray Train's
  ``WorkerHealthCheckFailedError``; how it died is read from Ray's message in
  :mod:`elastic_ddp.compat.ray_errors`): a process killed by a signal has no Python error at
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

import re
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

from elastic_ddp.causes import SHAPE_OR_DTYPE, clip, first_line, says_so, storage_problem
from elastic_ddp.compat.ray_errors import death_of, how_it_died, where_it_died
from elastic_ddp.notice import preempted_in
from elastic_ddp.positions import ANSI_ESCAPE, FATAL_TYPES, RankError, is_fatal

# Errors a rank gets because *another* rank failed: its peer vanished mid-collective.
_COLLATERAL = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|ECONNRESET|remote (process|worker) "
    r"(exited|crash)|NCCL communicator was aborted|ProcessGroupNCCL.*(abort|[Tt]imeout)|"
    r"Socket Timeout|Timed out waiting|Connection refused|[Rr]ead error|"
    r"typically caused by a remote worker crashing|Gloo.*(timeout|Timeout)")

# ------------------------------------------------------------------ classification
_ADDR = re.compile(r"\[?(?:\d{1,3}\.){3}\d{1,3}\]?(?::\d+)?|\[[0-9A-Fa-f:]*:[0-9A-Fa-f:]*\](?::\d+)?")
_PID = re.compile(r"\b(pid|PID|port|Port)([=: ]+)\d+")
_HEX = re.compile(r"\b[0-9a-fA-F]{16,}\b")
_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?")
_TMP = re.compile(r"/tmp/[^\s'\"]*")


def normalise(text: str) -> str:
    """``text`` without what changes between attempts of the same failure: IP addresses
    and ports, pids, object/actor/worker ids (long hex), timestamps and temp paths."""
    text = ANSI_ESCAPE.sub("", text)
    text = _TIME.sub("<time>", text)
    text = _ADDR.sub("<addr>", text)
    text = _PID.sub(lambda m: f"{m.group(1)}{m.group(2)}<n>", text)
    text = _HEX.sub("<id>", text)
    text = _TMP.sub("<tmp>", text)
    return re.sub(r"\s+", " ", text).strip()


@dataclass
class RankFailure:
    """One failed rank, as the controller sees it.

    ``kind``: ``died`` (the process is gone), ``error`` (a Python error),
    ``collateral`` (an error caused by another rank's failure) or ``hung`` (alive, but
    its peers timed out waiting for it in a collective: :func:`stragglers`). ``how``: for ``died``,
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
    origin: str = ""  # of an error: "task", "library", "" (causes.error_origin)
    extra: Dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        where = f"step {self.step}" if self.step is not None else "an unknown step"
        if self.phase and self.phase != "training step":
            where += f" ({self.phase})"
        if self.kind in ("died", "hung"):
            node = f" on node {self.node}" if self.node else ""
            pid = f", pid {self.pid}" if self.pid else ""
            sig = f" [{self.signal}]" if self.signal else ""
            verb = "died at" if self.kind == "died" else "did not arrive in the collective of"
            return f"rank {self.rank} {verb} {where}{node}{pid}: {self.how}{sig}"
        lines = [ln for ln in self.message.strip().splitlines() if ln.strip()]
        text = " ".join(lines[:2]) if len(lines) > 1 and len(lines[0]) < 80 else (lines[0] if lines else "")
        return f"rank {self.rank} failed at {where}: {self.error_type}: {clip(text, 600)}"


def classify(exceptions: Mapping[int, BaseException],
             positions: Optional[Mapping[int, dict]] = None,
             workers: Optional[Mapping[int, dict]] = None) -> list[RankFailure]:
    """One :class:`RankFailure` per rank in ``exceptions`` (rank -> exception, as Ray
    Train's ``after_exception`` hands them over). ``positions``: rank -> the dead
    process's position record; ``workers``: rank -> ``{node_ip, pid, ...}`` of the group."""
    out = []
    for rank, exc in sorted(exceptions.items()):
        meta = dict((workers or {}).get(rank) or {})
        dead = death_of(exc)
        if dead is not None:
            text = str(exc)
            how, sig = how_it_died(text)
            pos = dict((positions or {}).get(rank) or {})
            ip, pid = where_it_died(text)
            out.append(RankFailure(
                rank=rank, kind="died", step=pos.get("step"), epoch=pos.get("epoch"),
                phase=pos.get("phase"), error_type=type(dead).__name__, message=text,
                node=meta.get("node_ip") or ip, pid=meta.get("pid") or pid,
                signal=sig, how=how, t=pos.get("t")))
            continue
        text = str(exc)
        if isinstance(exc, RankError):
            f = RankFailure(rank=rank, kind="error", step=exc.step, epoch=exc.epoch,
                            phase=exc.phase, error_type=exc.error_type, message=exc.detail or text,
                            fatal=exc.fatal, node=meta.get("node_ip", ""), pid=meta.get("pid"),
                            origin=getattr(exc, "origin", ""))
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


_TIMEOUT = re.compile(r"[Tt]imed out|[Tt]imeout")


def stragglers(failures: list[RankFailure], workers: Mapping[int, dict],
               positions: Mapping[int, dict], timeout_s: Optional[float] = None) -> list[RankFailure]:
    """The ranks a collective timed out waiting for: when the failures are only peers'
    timeouts (collateral), every rank of the group (``workers``) that raised nothing, as
    a ``hung`` failure at its last recorded position (``positions``: rank -> record).
    [] when any rank died or raised a real error (that one is the cause)."""
    if not failures or any(f.kind != "collateral" for f in failures) \
            or not any(_TIMEOUT.search(f.message) for f in failures):
        return []
    waited = sorted(f.rank for f in failures)
    limit = f" (scaling.collective_timeout_s={timeout_s:g})" if timeout_s else ""
    out = []
    for rank in sorted(set(workers) - {f.rank for f in failures}):
        meta, pos = dict(workers[rank]), dict(positions.get(rank) or {})
        at = f"at step {pos['step']}" if pos.get("step") is not None else "at an unknown step"
        out.append(RankFailure(
            rank=rank, kind="hung", step=pos.get("step"), epoch=pos.get("epoch"), phase=pos.get("phase"),
            node=meta.get("node_ip", ""), pid=meta.get("pid"),
            how=f"it was still in its {pos.get('phase') or 'work'} {at} (its position record) while "
                f"rank(s) {', '.join(map(str, waited))} timed out waiting for it{limit}"))
    return out


def signature(f: Optional[RankFailure]) -> Optional[tuple]:
    """The failure's fingerprint across attempts (no rank: a restart may renumber
    ranks); None when its step is unknown (nothing to compare)."""
    if f is None or f.step is None:
        return None
    if f.kind in ("died", "hung"):
        return (f.kind, f.phase, f.step, f.how if f.kind == "died" else "")
    first = f.message.strip().splitlines()[0] if f.message.strip() else ""
    return (f.kind, f.phase, f.step, f.error_type, normalise(first)[:500])


def likely_cause(f: RankFailure) -> str:
    """What usually makes this failure repeat, and what to do. The task is named only
    for an error raised in the task's code (``RankFailure.origin``)."""
    if f.kind == "died":
        if f.signal == "SIGKILL":
            return ("likely cause: memory (the kernel OOM killer and Ray's memory monitor kill "
                    "with SIGKILL). Lower batch.micro_batch_size or the data a step reads, or give "
                    "the workers more memory; `dmesg` on that node shows 'Out of memory: Killed "
                    "process'")
        return "check the worker's log on that node (Ray's logs/worker-*.err)"
    if f.kind == "hung":
        return (f"likely cause: rank {f.rank} was slow or stuck in its {f.phase or 'step'} (a hang "
                "in the task's loss or data, a deadlock, a much slower node); if such a step is "
                "legitimately slow, raise scaling.collective_timeout_s")
    storage = storage_problem(f.message) if f.kind != "died" else None
    if storage is not None:
        return f"cause: {storage}"
    if says_so(f.message):
        return f"cause: {says_so(f.message)}"
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
    if f.origin == "library":
        return ("likely cause: not the task's code (the error was raised in elastic-ddp, PyTorch "
                "or Ray, outside the task's frames): the worker's log has the traceback")
    if f.origin == "task":
        return "likely cause: the task's code or the rows of that step"
    return ("likely cause: the task's code or the rows of that step, or a library it calls "
            "(the worker's log has the traceback)")


def stops_at_once(failures: list[RankFailure], cause: Optional[RankFailure],
                  world_size: Optional[int], storage: Optional[str] = None) -> Optional[str]:
    """Why ``cause`` is deterministic on its first attempt, or None (then a restart is
    tried): the storage is full or read-only (``causes.storage_problem``: the path, else
    ``storage``), its error text says so (DDP's unused-parameter error, naming the config
    field that fixes it: ``causes.says_so``), or every rank of the group (``world_size``)
    raised the same shape or dtype error at the same step."""
    if cause is None or cause.kind != "error":
        return None
    problem = storage_problem(cause.message, storage)
    if problem is not None:
        return f"not retried: {cause.describe()}; {problem}"
    if says_so(cause.message):
        return (f"not retried (the error says a restart cannot fix it): {cause.describe()}; "
                f"{says_so(cause.message)}")
    if not SHAPE_OR_DTYPE.search(cause.message):
        return None
    errors = [f for f in failures if f.kind == "error"]
    key = normalise(first_line(cause.message))
    same = all(f.step == cause.step and f.error_type == cause.error_type
               and normalise(first_line(f.message)) == key for f in errors)
    if not same or world_size is None or len({f.rank for f in errors}) < world_size:
        return None
    return (f"not retried (every rank raised the same shape/dtype error at step {cause.step}): "
            f"{cause.describe()}; {likely_cause(cause)}")


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
    if failures and all(preempted_in(f) is not None for f in failures.values()):
        return (f"{preempted_in(next(iter(failures.values())))}; the preemption budget "
                "(scaling.max_preemptions) is spent")
    if type(exc).__name__ == "PreemptionError":
        return f"{str(exc).splitlines()[0]}; the preemption budget (scaling.max_preemptions) is spent"
    if failures:
        p = primary(classify(failures))
        if p is not None:
            tail = f" ({likely_cause(p)})" if p.kind == "died" else ""
            return f"{p.describe()}{tail}; the restart budget (scaling.max_failures) is spent"
    cf = getattr(exc, "controller_failure", None)
    if isinstance(cf, BaseException):
        # Ray's ControllerError puts its cause after a line ending at a colon.
        return f"{type(exc).__name__}: the Ray Train controller failed: {_lead(cf)}"
    return _lead(exc)


def _lead(exc: BaseException) -> str:
    """``Type: message`` in one line: the message's first line, joined with the next
    ones while a line ends at a colon (its cause is on the next line); never empty
    after the colon (the type's name stands in for a message-less error)."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    for ln in lines[1:]:
        if not text.endswith(":"):
            break
        text = f"{text} {ln}"
    return f"{type(exc).__name__}: {text}" if text else f"{type(exc).__name__} (no message)"
