"""Notice of a coming stop, in every process of a job that needs it (torch-free: the
controller imports it).

A notice is one of:

- ``drain``: Ray Core is draining a node that hosts workers (``ray drain-node --reason
  DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N``, what the autoscaler and
  KubeRay do before a spot reclaim or a maintenance); Ray Train's preemption watcher
  hands it to every worker (``compat.ray_train.local_preemption_info``);
- ``sigterm``: a worker process got SIGTERM (Kubernetes' eviction, a cloud's spot
  notice); the handler (:func:`note`) only records it, so that the process lives on
  until the checkpoint is committed;
- ``stop``: the driver got SIGTERM (a Ray job being stopped, a CI runner cancelled) and
  asked the controller to stop the job (``compat.ray_controller_host.ControllerHost.request_stop``);
- ``grow``: the controller's elastic policy decided to restart the running group onto
  more workers (``compat.ray_grow``): the workers commit a checkpoint at the next step
  boundary and wait there (:data:`GROW_METRIC` marks its report) until the controller
  tears the group down and starts the larger one from it; no step is recomputed and no
  budget is spent (``restart`` mode only).

In ``restart`` mode the workers agree on it at a step boundary
(``elastic_ddp.worker.notice``), commit a checkpoint there, and every rank raises
:class:`Preempted`. In ``per_step`` mode the replica that holds the notice (its own
SIGTERM, or a drain of its own node) leaves its quorum at a step boundary and raises
:class:`Preempted` alone (``left``): the other replicas continue without it and Ray
replaces it. The controller counts it against the preemption budget
(``scaling.max_preemptions``), never against ``scaling.max_failures``, and restarts (or,
in ``per_step`` mode, replaces the replica), or for ``stop`` ends the job
(``controller.events``).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

from elastic_ddp.errors import ElasticDDPError

#: The notice kinds, in the order of their codes in the workers' agreement (0: none).
SOURCES = ("drain", "sigterm", "stop", "grow")

#: The report metric (1.0) of the checkpoint the workers commit at a ``grow`` notice: the
#: controller resizes once a checkpoint with it is reported (``compat.ray_grow``).
GROW_METRIC = "grow_checkpoint"

_lock = threading.Lock()
_noted: dict[str, Any] = {}


def note(source: str, t: Optional[float] = None) -> None:
    """Record a notice in this process (a signal handler may call it: no I/O, no
    allocation beyond one dict). The first notice of each kind is kept."""
    if source not in SOURCES:
        raise ValueError(f"unknown notice {source!r}; one of {', '.join(SOURCES)}")
    with _lock:
        _noted.setdefault(source, time.time() if t is None else t)


def noted() -> dict[str, float]:
    """The notices recorded in this process: kind -> when (seconds since the epoch)."""
    with _lock:
        return dict(_noted)


def clear() -> None:
    """Forget this process's notices (a worker process that Ray reuses for a new group
    never is, but a test's process is)."""
    with _lock:
        _noted.clear()


def request_stop() -> None:
    """The driver's stop, run in a worker's main thread by the controller."""
    note("stop")


def request_grow() -> None:
    """The controller's planned grow, run in a worker's main thread by the controller."""
    note("grow")


class Preempted(ElasticDDPError, RuntimeError):
    """Raised by every rank after the checkpoint at a notice is committed: the worker
    group ends so that the job restarts (or, for ``stop``, ends) from that checkpoint.
    In ``per_step`` mode (``left``) raised by the noticed replica alone, once it has left
    its quorum after a committed step: Ray replaces that replica, the others go on.

    ``source``: one of :data:`SOURCES`; ``step``: the committed step (the checkpoint's,
    or the last step the leaving replica took part in); ``noticed_t``: when the first
    rank learned it (seconds since the epoch); ``deadline_t``: when the node goes away
    (drain with a deadline; else None); ``committed_t``: when the checkpoint was
    committed, or when the replica left; ``ranks``: the world ranks that got the notice
    themselves (a SIGTERM's process; all ranks for a drain in ``restart`` mode); ``rank``:
    the raising rank; ``left``: a ``per_step`` replica that left its quorum (no
    checkpoint)."""

    def __init__(self, source: str, step: int, noticed_t: float, deadline_t: Optional[float],
                 committed_t: float, ranks: tuple[int, ...] = (), rank: int = 0, left: bool = False):
        self.source, self.step, self.noticed_t = source, step, noticed_t
        self.deadline_t, self.committed_t = deadline_t, committed_t
        self.ranks, self.rank, self.left = tuple(ranks), rank, left
        super().__init__(f"rank {rank}: {source} notice{self.lead_text()}; {self.what()}")

    def lead_text(self) -> str:
        """``", N s before its deadline"``, or "" without a deadline."""
        return f", {self.deadline_t - self.noticed_t:.1f} s before its deadline" if self.deadline_t else ""

    def what(self) -> str:
        """What was done at the notice, and how long after it."""
        after = f"{self.committed_t - self.noticed_t:.1f} s after it"
        if self.left:
            return f"left the quorum after step {self.step}, {after}; the other replicas continued"
        return f"checkpoint of step {self.step} committed {after}"

    def __reduce__(self):
        return (Preempted, (self.source, self.step, self.noticed_t, self.deadline_t,
                            self.committed_t, self.ranks, self.rank, self.left))

    def as_event(self) -> dict[str, Any]:
        """The fields of the controller's ``preemption`` event: ``checkpoint_step`` and
        ``notice_to_commit_s`` (``restart`` mode), or ``left_after_step``,
        ``notice_to_leave_s`` and ``left_quorum: True`` (``per_step`` mode)."""
        lead = round(self.deadline_t - self.noticed_t, 3) if self.deadline_t else None
        took = round(self.committed_t - self.noticed_t, 3)
        out = {"source": self.source, "noticed_t": self.noticed_t, "deadline_t": self.deadline_t,
               "notice_lead_s": lead, "noticed_ranks": list(self.ranks)}
        if self.left:
            out.update({"left_quorum": True, "left_after_step": self.step, "notice_to_leave_s": took})
        else:
            out.update({"checkpoint_step": self.step, "notice_to_commit_s": took})
        return out


def preempted_in(exc: BaseException) -> Optional[Preempted]:
    """The :class:`Preempted` that ``exc`` is or wraps (Ray Train wraps a train
    function's error with its traceback), or None."""
    from elastic_ddp.compat.ray_train import user_error

    seen = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, Preempted):
            return e
        e = user_error(e) or e.__cause__
    return None
