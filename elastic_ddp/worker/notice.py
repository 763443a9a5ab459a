"""A notice of a coming stop, on the workers. ``restart`` mode (:class:`NoticeListener`):
every rank learns it at a step boundary at most about ``interval_s`` plus one step after
it (below), a checkpoint is committed there, and
every rank raises ``notice.Preempted`` (``elastic_ddp.notice``: the kinds and what the
controller does). ``per_step`` mode (:class:`ReplicaLeave`): the noticed replica takes
part in one more step, leaves its quorum after it and raises it alone.

    listener = build(trainer)          # restart mode; None: notices are handled as crashes
    ...after each committed step...
    if listener is not None and listener.agreed():
        listener.checkpoint_and_stop()  # raises notice.Preempted

    leave = build_leave(trainer)       # per_step mode; None: notices are handled as crashes
    ...before each step's quorum...
    if leave.held(): ...               # this step is the replica's last
    leave.check(step)                  # at the boundary after it: raises notice.Preempted

Agreements: an all-reduce (MAX) of ``6 + world_size`` int64 numbers (the kinds noted on
each rank, the earliest notice and deadline, the rank's wall time per step in microseconds, which ranks
it concerns), on the job's process group, started at a step boundary and read at the
next one: it runs while that step computes. One starts every ``every`` boundaries,
``every = max(1, floor(interval_s / step_s))`` (:func:`agreement_every`; ``interval_s``:
``scaling.notice_agreement_s``, 1 s by default, :data:`AGREE_EVERY_S`; 0: every step),
``step_s`` the slowest rank's wall time per step between the two previous starts, carried
by the agreement itself so that every rank starts the next one at the same boundary (the
first two agreements are one boundary apart: no step time yet). A notice is therefore
acted on (the checkpoint begins) at most ``every + 1`` boundaries after it reaches a rank:
at most ``max(interval_s, step_s) + step_s`` of wall time, plus a change of step time
since the last start (a step 10 times slower stretches the interval 10 times, until the
next start). Sources on a rank: its own SIGTERM (a handler in the worker's main thread
that only notes it, so the process lives until the checkpoint is committed; a second
SIGTERM ends it as Ray's handler would), Ray Train's preemption watcher's report of a
node drain (``compat.ray_train.local_preemption_info``), the driver's stop, and the
controller's planned grow (``compat.ray_grow``: the ranks commit the checkpoint and wait
there for the group's teardown instead of raising).

Costs (``experiments/bench_overhead.py --preemption`` measures the job with and without
listening; ``experiments/bench_listen.py`` times ``agreed()``): per agreement, the read
of the local sources, the all-reduce, started behind the step that follows it but waited
for at the read where the step's compute holds every core (gloo on CPUs: about 3 ms on
2 cores), and with NCCL one device sync; between agreements, one integer comparison per
step boundary.
A notice that reaches the ranks less than ``every + 1`` steps plus one checkpoint's
write before the node goes is too late: the restart resumes from the newest checkpoint, and the
controller's ``preemption`` event (``fell_back``) says how many steps that recomputed. A
SIGTERM is also written into the rank's position record at once, so that the controller
knows a rank killed before the checkpoint had been given notice.

Per-step mode needs no agreement: every step is already agreed by its quorum, and a
replica that stops asking for quorums is dropped by torchft's lighthouse once its
heartbeat is older than ``heartbeat_timeout_ms`` (``per_step.LIGHTHOUSE``; torchft
0.2.0 has no call that leaves a quorum). At the first step boundary with a notice held,
the replica takes part in one more step, stopping its torchft Manager (its heartbeat) as
soon as that step's quorum is decided (``per_step.ReplicaGroup.begin``; after the
step's all-reduce where the members changed, as a healer needs its source's Manager);
after that step (and the checkpoint there, if one is due: ``ray.train.report`` is a
barrier over every replica) :meth:`ReplicaLeave.check` raises ``Preempted(left=True)``.
The others' next quorum forms without it once its last heartbeat expires, which the step
computed in between hides in part, and no step is redone: that step was committed by its
whole quorum, and the next quorum's participants split the next steps' rows among
themselves. Sources: its own SIGTERM (the same handler as above) and a drain of its own
node, which a thread of the replica asks the GCS about every
``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S`` seconds (1; ``compat.ray_train.node_drain``: Ray
Train runs no preemption watcher for replica groups). The driver's stop is not a leave:
it rides in every step's all-reduce and every replica stops after the same committed step
(``per_step.PerStepFaultTolerance.stop_here``). Costs: one dict read per step, and
one GCS call a second per replica.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from elastic_ddp import notice
from elastic_ddp.notice import SOURCES, Preempted
from elastic_ddp.background import start_deferring_signals

_NONE = -(2 ** 62)  # "no time" in a MAX over negated milliseconds

#: Seconds of training between the starts of two agreements (``agreement_every``): the
#: default of ``scaling.notice_agreement_s``.
AGREE_EVERY_S = 1.0


def agreement_every(step_s: float, interval_s: float = AGREE_EVERY_S) -> int:
    """Step boundaries from one agreement's start to the next: ``max(1, floor(interval_s
    / step_s))``, ``step_s`` the slowest rank's wall time per step since the last start
    (seconds; 0: not measured yet, one boundary)."""
    if step_s <= 0 or interval_s <= 0:
        return 1
    return max(1, int(interval_s / step_s))


def build(trainer) -> Optional["NoticeListener"]:
    """The listener of ``trainer``'s job, or None where notices are handled as crashes
    (``scaling.preemption_checkpoint`` off, per-step mode, or a Ray without the
    preemption support: ``JobSpec.preemption`` is set by the driver)."""
    cfg = trainer.cfg
    if not (getattr(trainer.job, "preemption", False) and cfg.scaling.preemption_checkpoint
            and cfg.scaling.fault_tolerance == "restart"):
        return None
    listener = NoticeListener(trainer, interval_s=cfg.scaling.notice_agreement_s)
    listener.park_s = cfg.scaling.grow_checkpoint_timeout_s + 60.0
    return listener


#: This process's rank position record (``positions.Position``, set by the listener): a
#: SIGTERM is written there at once, so that a kill before the checkpoint at the notice
#: leaves the notice for the controller (a preemption with too little notice).
_position = None


def install_sigterm_handler() -> None:
    """Run in the worker's main thread: SIGTERM notes a notice (and writes it into the
    rank's position record); a second one runs the handler that was there before (Ray's:
    the process exits)."""
    before = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        if "sigterm" in notice.noted():
            signal.signal(signal.SIGTERM, before if callable(before) else signal.SIG_DFL)
            if callable(before):
                before(signum, frame)
            else:
                os.kill(os.getpid(), signal.SIGTERM)
            return
        notice.note("sigterm")
        if _position is not None:
            _position.noticed("sigterm", notice.noted()["sigterm"])

    signal.signal(signal.SIGTERM, on_sigterm)


class NoticeListener:
    """See the module docstring. ``trainer``: the rank's ``Trainer`` (its rank, world
    size, device, progress and ``checkpoint``). ``install``: put the SIGTERM handler in
    the Ray Train worker's main thread (False: the caller installs it, outside Ray).
    ``interval_s``: the wall time the agreements are spread over (default
    :data:`AGREE_EVERY_S`; 0: one agreement per step boundary)."""

    def __init__(self, trainer, install: bool = True, interval_s: Optional[float] = None):
        self.t = trainer
        self.rank, self.world_size = trainer.rank, trainer.world_size
        # NCCL reduces device tensors only; gloo host ones.
        self.device = trainer.device if (dist.is_initialized() and dist.get_backend() == "nccl") \
            else torch.device("cpu")
        self.drain_seen: Optional[float] = None
        self.interval_s = AGREE_EVERY_S if interval_s is None else interval_s
        self.every = 1  # boundaries from one agreement's start to the next (agreed)
        self.agreements = 0  # agreements started
        self._boundary = 0  # boundaries seen (agreed() calls): the same count on every rank
        self._next_start = 1
        self._started_at, self._started_t = 0, None  # the last start: boundary, perf_counter
        self._step_s: Optional[float] = None  # this rank's wall time per boundary since then
        global _position
        _position = getattr(trainer, "position", None)
        if install:
            from elastic_ddp.compat.ray_train import run_in_main_thread

            run_in_main_thread(install_sigterm_handler)

    def _local(self) -> tuple[dict, Optional[float], set]:
        """(kind -> when, deadline, the ranks it concerns) of the notices this rank
        holds now: a drain concerns the ranks on the drained nodes (Ray's report, the
        same on every rank), a SIGTERM this rank, the driver's stop none in particular."""
        from elastic_ddp.compat.ray_train import local_preemption_info

        held = notice.noted()
        ranks = {self.rank} if "sigterm" in held else set()
        info = local_preemption_info()
        deadline = None
        if info is not None:
            if self.drain_seen is None:
                self.drain_seen = time.time()
            held.setdefault("drain", self.drain_seen)
            deadline = info["deadline_t"]
            ranks |= {r for r in info["ranks"] if 0 <= r < self.world_size}
        return held, deadline, ranks

    def agreed(self) -> Optional[dict]:
        """At a step boundary, on every rank (a collective on some boundaries): the notice
        some rank held when the last agreement started (the same dict on every rank), or
        None. ``{"sources": [kinds], "noticed_t": s, "deadline_t": s or None, "ranks":
        [the ranks it concerns]}``.

        An agreement starts every ``every`` boundaries (the module docstring: ``every``
        is agreed by the ranks) and is read at the boundary after its start: its
        all-reduce (``async_op``) runs during that one step. Other boundaries cost one
        integer comparison."""
        self._boundary += 1
        if self._pending is not None:
            out = self._finish()
            if out is not None:
                return out
        if self._boundary < self._next_start:
            return None
        now = time.perf_counter()
        if self._started_t is not None:  # this rank's; the MAX is the slowest rank's
            self._step_s = (now - self._started_t) / (self._boundary - self._started_at)
        self._started_t, self._started_at = now, self._boundary
        self.agreements += 1
        held, deadline, ranks = self._local()
        k = len(SOURCES)
        vec = [0] * (k + 3 + self.world_size)
        for i, s in enumerate(SOURCES):
            vec[i] = 1 if s in held else 0
        vec[k] = -int(min(held.values()) * 1000) if held else _NONE
        vec[k + 1] = -int(deadline * 1000) if deadline else _NONE
        vec[k + 2] = int(self._step_s * 1e6) if self._step_s is not None else 0
        for r in ranks:
            vec[k + 3 + r] = 1
        box = torch.tensor(vec, dtype=torch.int64, device=self.device)
        work = dist.all_reduce(box, op=dist.ReduceOp.MAX, async_op=True) if self.world_size > 1 else None
        self._pending = (work, box)
        if work is None:  # one rank: its own notice, at once
            return self._finish()
        return None

    _pending = None

    def _finish(self) -> Optional[dict]:
        """Wait for the agreement in flight and read it (None: none, or no notice); sets
        the boundary at which the next one starts."""
        if self._pending is None:
            return None
        work, box = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        vec = box.tolist()  # with NCCL: the one device sync of an agreement
        k = len(SOURCES)
        self.every = agreement_every(vec[k + 2] / 1e6, self.interval_s)
        self._next_start = self._started_at + self.every
        if not any(vec[:k]):
            return None
        return {"sources": [s for i, s in enumerate(SOURCES) if vec[i]],
                "noticed_t": -vec[k] / 1000.0,
                "deadline_t": -vec[k + 1] / 1000.0 if vec[k + 1] != _NONE else None,
                "ranks": [r for r in range(self.world_size) if vec[k + 3 + r]]}

    def checkpoint_and_stop(self, agreed: dict) -> None:
        """Commit the checkpoint of the current step (synchronously: an asynchronous one
        in flight is finished first) and raise :class:`Preempted` on this rank. A
        ``grow`` notice alone: the checkpoint's report carries ``notice.GROW_METRIC``
        and the rank waits (:meth:`wait_for_teardown`) for the controller to tear the
        group down and start the larger one from it.

        Raises:
            Preempted: once the checkpoint is committed on every rank (after a grow's
                checkpoint: only if the wait ends without the teardown)."""
        t = self.t
        self._finish()  # none in flight once a notice is read (agreed() starts none then)
        step = t.progress.step
        # The driver's stop wins (the job ends), then a drain (its deadline is known); a
        # planned grow only where nothing else came.
        source = next(s for s in ("stop", "drain", "sigterm", "grow") if s in agreed["sources"])
        if source == "grow":
            t.log(f"grow notice at step {step}: committing a checkpoint; the group restarts larger from it")
        else:
            t.log(f"{source} notice at step {step} (ranks {agreed['ranks']}): committing a checkpoint")
        t.checkpoint({notice.GROW_METRIC: 1.0} if source == "grow" else {}, final=True)
        t.ledger.close()
        if source == "grow":
            source = self.wait_for_teardown(self.park_s)
        raise Preempted(source, step, agreed["noticed_t"], agreed["deadline_t"], time.time(),
                        tuple(agreed["ranks"]), self.rank)

    #: Seconds a rank waits after a grow's checkpoint for the controller's teardown
    #: (``scaling.grow_checkpoint_timeout_s`` plus this, set by :func:`build`).
    park_s = 120.0

    @staticmethod
    def wait_for_teardown(limit_s: float, poll_s: float = 0.2) -> str:
        """After a grow's checkpoint: sleep until the controller ends this process (its
        resize shuts the group down, ``compat.ray_grow``), at most ``limit_s`` seconds.
        Returns the notice to raise :class:`Preempted` with when it did not: another
        notice that came meanwhile (a drain, a SIGTERM, the driver's stop: its
        checkpoint is the one just committed), else ``"grow"`` (the controller never
        resized: Ray Train restarts the group from this checkpoint as a preemption).
        Costs a dict read every ``poll_s``; the rank computes nothing."""
        from elastic_ddp.compat.ray_train import local_preemption_info

        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            other = [s for s in ("stop", "drain", "sigterm") if s in notice.noted()]
            if other:
                return other[0]
            if local_preemption_info() is not None:
                return "drain"
            time.sleep(poll_s)
        return "grow"

# ------------------------------------------------------------------------ per-step mode
def build_leave(trainer) -> Optional["ReplicaLeave"]:
    """The leave of ``trainer``'s replica (``per_step`` mode), or None where notices are
    handled as crashes (``scaling.preemption_checkpoint`` off, ``restart`` mode, or a
    Ray without the preemption support: ``JobSpec.preemption``)."""
    cfg = trainer.cfg
    if not (getattr(trainer.job, "preemption", False) and cfg.scaling.preemption_checkpoint
            and cfg.scaling.fault_tolerance == "per_step"):
        return None
    import ray

    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    poll_s = float(os.environ.get("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "1"))
    return ReplicaLeave(trainer.rank, trainer.world_size, node_id=node, poll_s=poll_s)


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
