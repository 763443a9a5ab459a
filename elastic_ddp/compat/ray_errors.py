"""What the controller reads from Ray's exceptions where Ray has no API for it.

- :func:`death_of`: a dead rank's ``RayActorError``, found also inside Ray Train's
  health-check failure (its ``health_check_failure`` attribute) and by the name of its
  health-check timeout (``WorkerHealthCheckTimeoutError``, a class of Ray Train's
  ``_internal`` package). It buys the difference between a rank that died (its position
  file is read: the step it died in) and a rank that raised. Where Ray renames them, a
  death reads as an error of that class (the job still restarts).
- :func:`how_it_died` and :func:`where_it_died`: the cause, the signal, the node and the
  pid parsed from the text of Ray's death message (Ray's memory monitor, a lost or
  preempted node, an exit code, a vanished process; ``ip: ...``, ``pid: ...``). Version
  guard: the ``death_messages`` override of :mod:`elastic_ddp.compat.versions`; on a Ray
  release its message formats were not tested on, nothing is parsed (``"the process
  died"``, and the worker group's own node and pid) rather than a cause read from a
  format that may have changed.
"""

from __future__ import annotations

import re
from typing import Optional

_OOM = re.compile(r"OutOfMemoryError|memory monitor|low on memory")
_PREEMPTED = re.compile(r"preempt", re.I)
_NODE_LOST = re.compile(r"node .*(died|terminated|removed)|NodeDiedError|raylet", re.I)
_EXIT_CODE = re.compile(r"exit(?:ed|s)? with (?:an )?exit code (-?\d+)")
_VANISHED = re.compile(r"connection error code 2|End of file|unexpectedly exits|died unexpectedly")
_IP = re.compile(r"\bip: (\S+)")
_PID = re.compile(r"\bpid: (\d+)")

DIED = "the process died"


def death_of(exc: BaseException) -> Optional[BaseException]:
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


def _parse() -> bool:
    from elastic_ddp.compat.versions import ray_plan

    return ray_plan().applies("death_messages")


def how_it_died(text: str) -> tuple[str, str]:
    """(what killed the process, the signal or "") from Ray's death message ``text``;
    ``("the process died", "")`` when it says neither, or on an untested Ray."""
    if not _parse():
        return DIED, ""
    if _OOM.search(text):
        return "killed by Ray's memory monitor (the node ran low on memory)", "SIGKILL"
    if _PREEMPTED.search(text):
        return "its node was preempted", ""
    if _NODE_LOST.search(text):
        return "its node was lost", ""
    if "health check has been hanging" in text:
        return "stopped answering Ray's health checks (hung or stopped)", ""
    m = _EXIT_CODE.search(text)
    if m and m.group(1) not in ("0", "2"):
        return f"the process exited with code {m.group(1)}", ""
    if _VANISHED.search(text):
        return ("killed by a signal: the process vanished without a Python error, as SIGKILL "
                "leaves it (the kernel OOM killer, `kill -9`) or a native crash"), "SIGKILL"
    return DIED, ""


def where_it_died(text: str) -> tuple[str, Optional[int]]:
    """(node IP or "", pid or None) named by Ray's death message ``text`` (None, "" on an
    untested Ray)."""
    if not _parse():
        return "", None
    ip, pid = _IP.search(text), _PID.search(text)
    return (ip.group(1) if ip else ""), (int(pid.group(1)) if pid else None)
