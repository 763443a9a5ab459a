"""A notice of a coming stop, on the workers (``restart`` mode): every rank learns it at
the next step boundary, a checkpoint is committed there, and every rank raises
``notice.Preempted`` (``elastic_ddp.notice``: the kinds and what the controller does).

    listener = build(trainer)          # None: notices are handled as crashes
    ...after each committed step...
    if listener is not None and listener.agreed():
        listener.checkpoint_and_stop()  # raises notice.Preempted

One agreement per step: an all-reduce (MAX) of ``5 + world_size`` int64 numbers (the
kinds noted on each rank, the earliest notice and deadline, which ranks it concerns), on
the job's process group, started at a step boundary and read at the next one: it runs
while the step computes, so a notice is acted on at the second boundary after it. Sources on a rank: its own SIGTERM (a handler in the worker's main
thread that only notes it, so the process lives until the checkpoint is committed; a
second SIGTERM ends it as Ray's handler would), Ray Train's preemption watcher's report
of a node drain (``compat.ray_train.local_preemption_info``), and the driver's stop.

Costs: that all-reduce, hidden behind the step (``experiments/bench_overhead.py
--preemption`` measures the job with and without it), and with NCCL one device sync per
step.
A notice that reaches the ranks less than one step plus one checkpoint's write before the
node goes is too late: the restart resumes from the newest checkpoint, and the
controller's ``preemption`` event (``fell_back``) says how many steps that recomputed. A
SIGTERM is also written into the rank's position record at once, so that the controller
knows a rank killed before the checkpoint had been given notice.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Optional

import torch
import torch.distributed as dist

from elastic_ddp import notice
from elastic_ddp.notice import SOURCES, Preempted

_NONE = -(2 ** 62)  # "no time" in a MAX over negated milliseconds


def build(trainer) -> Optional["NoticeListener"]:
    """The listener of ``trainer``'s job, or None where notices are handled as crashes
    (``scaling.preemption_checkpoint`` off, per-step mode, or a Ray without the
    preemption support: ``JobSpec.preemption`` is set by the driver)."""
    cfg = trainer.cfg
    if not (getattr(trainer.job, "preemption", False) and cfg.scaling.preemption_checkpoint
            and cfg.scaling.fault_tolerance == "restart"):
        return None
    return NoticeListener(trainer)


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
    the Ray Train worker's main thread (False: the caller installs it, outside Ray)."""

    def __init__(self, trainer, install: bool = True):
        self.t = trainer
        self.rank, self.world_size = trainer.rank, trainer.world_size
        # NCCL reduces device tensors only; gloo host ones.
        self.device = trainer.device if (dist.is_initialized() and dist.get_backend() == "nccl") \
            else torch.device("cpu")
        self.drain_seen: Optional[float] = None
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
        """At a step boundary, on every rank (a collective): the notice some rank held at
        the previous boundary (the same dict on every rank), or None. ``{"sources":
        [kinds], "noticed_t": s, "deadline_t": s or None, "ranks": [the ranks it
        concerns]}``. The all-reduce of this boundary runs in the background during the
        next step (``async_op``), so a boundary waits only for the one before: a notice
        is acted on one step after the boundary it reaches."""
        out = self._finish()
        held, deadline, ranks = self._local()
        k = len(SOURCES)
        vec = [0] * (k + 2 + self.world_size)
        for i, s in enumerate(SOURCES):
            vec[i] = 1 if s in held else 0
        vec[k] = -int(min(held.values()) * 1000) if held else _NONE
        vec[k + 1] = -int(deadline * 1000) if deadline else _NONE
        for r in ranks:
            vec[k + 2 + r] = 1
        box = torch.tensor(vec, dtype=torch.int64, device=self.device)
        if self.world_size > 1:
            self._pending = (dist.all_reduce(box, op=dist.ReduceOp.MAX, async_op=True), box)
            return out
        self._pending = (None, box)  # one rank: its own notice, at once
        return self._finish()

    _pending = None

    def _finish(self) -> Optional[dict]:
        """Wait for the agreement in flight and read it (None: none, or no notice)."""
        if self._pending is None:
            return None
        work, box = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        vec = box.tolist()
        k = len(SOURCES)
        if not any(vec[:k]):
            return None
        return {"sources": [s for i, s in enumerate(SOURCES) if vec[i]],
                "noticed_t": -vec[k] / 1000.0,
                "deadline_t": -vec[k + 1] / 1000.0 if vec[k + 1] != _NONE else None,
                "ranks": [r for r in range(self.world_size) if vec[k + 2 + r]]}

    def checkpoint_and_stop(self, agreed: dict) -> None:
        """Commit the checkpoint of the current step (synchronously: an asynchronous one
        in flight is finished first) and raise :class:`Preempted` on this rank.

        Raises:
            Preempted: always, once the checkpoint is committed on every rank."""
        t = self.t
        self._finish()  # the next boundary's agreement, already sent by every rank
        step = t.progress.step
        # The driver's stop wins (the job ends), then a drain (its deadline is known).
        source = next(s for s in ("stop", "drain", "sigterm") if s in agreed["sources"])
        t.log(f"{source} notice at step {step} (ranks {agreed['ranks']}): committing a checkpoint")
        t.checkpoint({}, final=True)
        t.ledger.close()
        raise Preempted(source, step, agreed["noticed_t"], agreed["deadline_t"], time.time(),
                        tuple(agreed["ranks"]), self.rank)
