"""A notice of a coming stop, on the workers. ``restart`` mode (:class:`NoticeListener`):
every rank learns it at a step boundary at most about ``interval_s`` plus one step after
it (below), a checkpoint is committed there, and
every rank raises ``notice.Preempted`` (``elastic_ddp.notice``: the kinds and what the
controller does). ``per_step`` mode (``worker.leave.ReplicaLeave``): the noticed replica
takes part in one more step, leaves its quorum after it and raises it alone.

    listener = build(job, rank, world_size, device, position)  # restart mode; None: crashes
    ...after each committed step (worker.checkpoint_policy)...
    due = listener.due(step)            # the checkpoint at an agreed notice; its then()
                                        # raises notice.Preempted once it is committed

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

Per-step mode: ``worker.leave`` (the noticed replica leaves its quorum).
"""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist

from elastic_ddp import notice
from elastic_ddp.notice import SOURCES, Preempted
from elastic_ddp.worker.checkpoint_policy import Due

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


def build(job, rank: int, world_size: int, device, position=None) -> Optional["NoticeListener"]:
    """The listener of ``job`` (a ``JobSpec``) on rank ``rank`` of ``world_size``, or
    None where notices are handled as crashes (``scaling.preemption_checkpoint`` off,
    per-step mode, or a Ray without the preemption support: ``JobSpec.preemption`` is
    set by the driver). ``position``: the rank's ``positions.Position``."""
    cfg = job.config
    if not (getattr(job, "preemption", False) and cfg.scaling.preemption_checkpoint
            and cfg.scaling.fault_tolerance == "restart"):
        return None
    where = SimpleNamespace(rank=rank, world_size=world_size, device=device, position=position)
    listener = NoticeListener(where, interval_s=cfg.scaling.notice_agreement_s)
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
    """See the module docstring. ``trainer``: where the listener runs (its ``rank``,
    ``world_size``, ``device`` and, if set, ``position``: the rank's
    ``positions.Position``; ``build`` makes it). ``install``: put the SIGTERM handler in
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

    def due(self, step: int) -> Optional[Due]:
        """At the boundary after step ``step``, on every rank (:meth:`agreed`): the
        checkpoint an agreed notice makes due (synchronous, the run's last of this
        attempt), whose ``then`` raises :class:`Preempted` on this rank once it is
        committed; None without one. A ``grow`` notice alone: the checkpoint's report
        carries ``notice.GROW_METRIC`` and the rank waits (:meth:`wait_for_teardown`)
        for the controller to tear the group down and start the larger one from it
        (``Preempted`` only if the wait ends without the teardown)."""
        agreed = self.agreed()
        if agreed is None:
            return None
        self._finish()  # none in flight once a notice is read (agreed() starts none then)
        # The driver's stop wins (the job ends), then a drain (its deadline is known); a
        # planned grow only where nothing else came.
        source = next(s for s in ("stop", "drain", "sigterm", "grow") if s in agreed["sources"])

        def stop() -> None:
            got = self.wait_for_teardown(self.park_s) if source == "grow" else source
            raise Preempted(got, step, agreed["noticed_t"], agreed["deadline_t"], time.time(),
                            tuple(agreed["ranks"]), self.rank)

        if source == "grow":
            line = f"grow notice at step {step}: committing a checkpoint; the group restarts larger from it"
            return Due("grow", line=line, metrics={notice.GROW_METRIC: 1.0}, final=True, then=stop)
        line = f"{source} notice at step {step} (ranks {agreed['ranks']}): committing a checkpoint"
        return Due("notice", line=line, final=True, then=stop)

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
