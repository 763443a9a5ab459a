"""A notice of a coming stop on a ``per_step`` replica: the noticed replica takes part
in one more step, leaves its quorum after it and raises ``notice.Preempted(left=True)``
alone (``restart`` mode's agreement over the group: ``worker.notice``).

    leave = build_leave(job, rank, world_size)  # None: notices are handled as crashes
    ...before each step's quorum...
    if leave.held(): ...               # this step is the replica's last
    leave.check(step)                  # at the boundary after it: raises notice.Preempted

Per-step mode needs no agreement: every step is already agreed by its quorum, and a
replica that stops asking for quorums is dropped by torchft's lighthouse once its
heartbeat is older than ``heartbeat_timeout_ms`` (``per_step.LIGHTHOUSE``; torchft
0.2.0 has no call that leaves a quorum). At the first step boundary with a notice held,
the replica takes part in one more step, stopping its torchft Manager (its heartbeat) as
soon as that step's quorum is decided (``replica_group.ReplicaGroup.begin``; after the
step's all-reduce where the members changed, as a healer needs its source's Manager);
after that step (and the checkpoint there, if one is due: ``ray.train.report`` is a
barrier over every replica) :meth:`ReplicaLeave.check` raises ``Preempted(left=True)``.
The others' next quorum forms without it once its last heartbeat expires, which the step
computed in between hides in part, and no step is redone: that step was committed by its
whole quorum, and the next quorum's participants split the next steps' rows among
themselves. Sources: its own SIGTERM (``worker.notice.install_sigterm_handler``) and a
drain of its own node, which a thread of the replica asks the GCS about every
``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S`` seconds (1; ``compat.ray_train.node_drain``: Ray
Train runs no preemption watcher for replica groups). The driver's stop is not a leave:
it rides in every step's all-reduce and every replica stops after the same committed step
(``per_step.PerStepFaultTolerance.stop_due``). Costs: one dict read per step, and
one GCS call a second per replica.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, Optional

from elastic_ddp import notice
from elastic_ddp.background import start_deferring_signals
from elastic_ddp.notice import Preempted
from elastic_ddp.worker.notice import install_sigterm_handler


def build_leave(job, rank: int, world_size: int) -> Optional["ReplicaLeave"]:
    """The leave of replica ``rank`` of ``world_size`` (``per_step`` mode) of ``job``, or
    None where notices are handled as crashes (``scaling.preemption_checkpoint`` off,
    ``restart`` mode, or a Ray without the preemption support: ``JobSpec.preemption``)."""
    cfg = job.config
    if not (getattr(job, "preemption", False) and cfg.scaling.preemption_checkpoint
            and cfg.scaling.fault_tolerance == "per_step"):
        return None
    import ray

    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    poll_s = float(os.environ.get("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "1"))
    return ReplicaLeave(rank, world_size, node_id=node, poll_s=poll_s)


class DrainWatch:
    """A daemon thread asking the GCS every ``poll_s`` seconds whether node ``node_id``
    (hex) is being drained (``compat.ray_train.node_drain``); the first yes is noted as
    a ``drain`` notice and its deadline kept in ``deadline_t`` (seconds since the epoch,
    or None: no deadline). ``close`` stops it."""

    def __init__(self, node_id: str, poll_s: float = 1.0):
        self.node_id, self.poll_s = node_id, poll_s
        self.deadline_t: Optional[float] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic-ddp-drain-watch", daemon=True)
        start_deferring_signals(self._thread)

    def _run(self) -> None:
        from elastic_ddp.compat.ray_train import node_drain

        while not self._stop.is_set():
            info = node_drain(self.node_id)
            if info is not None:
                self.deadline_t = info["deadline_t"]
                notice.note("drain")  # after deadline_t is set: whoever sees it sees both
                return
            self._stop.wait(self.poll_s)

    def close(self) -> None:
        self._stop.set()


class ReplicaLeave:
    """``per_step`` mode: this replica's own notices make it leave at the next step
    boundary (the module docstring). ``rank``/``world_size``: this replica among the
    job's; ``node_id``: its Ray node (None: no drain watch); ``install``: put the
    SIGTERM handler in the Ray Train worker's main thread (False: the caller installs
    it, outside Ray); ``log``: where the one line at the leave goes (stdout: the
    replica's Ray worker log)."""

    def __init__(self, rank: int, world_size: int, node_id: Optional[str] = None,
                 poll_s: float = 1.0, install: bool = True,
                 log: Optional[Callable[[str], None]] = None):
        self.rank, self.world_size = rank, world_size
        self.drain = DrainWatch(node_id, poll_s) if node_id else None
        self._log = log
        if install:
            from elastic_ddp.compat.ray_train import run_in_main_thread

            run_in_main_thread(install_sigterm_handler)

    def held(self) -> Optional[dict]:
        """The notice this replica holds now: ``{"source": "drain" | "sigterm",
        "noticed_t": s, "deadline_t": s or None}``, or None. A drain wins (its deadline
        is known); the driver's stop is not this mode's."""
        held = {k: v for k, v in notice.noted().items() if k in ("drain", "sigterm")}
        if not held:
            return None
        source = "drain" if "drain" in held else "sigterm"
        deadline = self.drain.deadline_t if (self.drain is not None and source == "drain") else None
        return {"source": source, "noticed_t": min(held.values()), "deadline_t": deadline}

    def check(self, step: int, before_leave: Optional[Callable[[], None]] = None) -> None:
        """At a step boundary, before this replica would ask for the next quorum: with a
        notice held, run ``before_leave`` (e.g. stop the torchft Manager, if the caller has
        not yet) and leave. ``step``: the last step this replica took part in.

        Raises:
            Preempted: with ``left=True``, when a notice is held."""
        got = self.held()
        if got is None:
            return
        if before_leave is not None:
            before_leave()
        self.close()
        left_t = time.time()
        err = Preempted(got["source"], step, got["noticed_t"], got["deadline_t"], left_t,
                        (self.rank,), self.rank, left=True)
        line = f"[rank {self.rank}/{self.world_size}] {err}\n"
        if self._log is not None:
            self._log(line)
        else:
            sys.stdout.write(line)  # not print: Ray Train patches print() into its logger
            sys.stdout.flush()
        raise err

    def close(self) -> None:
        if self.drain is not None:
            self.drain.close()
