"""Per-step fault tolerance (``scaling.fault_tolerance: per_step``): every Ray Train worker is
its own torchft replica group (Ray Train's ``TorchftConfig``); a quorum is decided every
step, survivors keep committing steps when a replica dies, and Ray replaces only the dead
replica, which heals the live weights and optimizer state from a peer.

What elastic-ddp adds to torchft: the step's global batch of G samples (the same global
positions as in ``restart`` mode) is split among the replicas of that step's quorum, by
partition ownership over the quorum (``data.order``), each replica's loss is
``sum(per-sample loss) / G`` and gradients are SUM-all-reduced, so the update is the mean
over exactly those G samples whatever the quorum size; a step the quorum did not commit is
redone on the same samples.

The settings and the three torchft/Ray pitfalls the recipe avoids (docs/design.md,
"Per-step mode"):

- torchft 0.2.0's ``DistributedDataParallel`` comm hook asserts after a failed all-reduce
  (the survivor died with its peer), so gradients go through one flat
  ``manager.allreduce(SUM)`` per step instead of the DDP wrapper;
- ``ray.train.report`` is a barrier over every world rank, which a replacement still
  starting never reaches: checkpoints are reported only by a full quorum; a
  partial quorum's lead writes its checkpoints straight to storage;
- a replacement that starts after the others finished would form a quorum alone at step 0
  and retrain from scratch: a done marker, keyed by the run's lighthouse address, stops it
  (checked before its first quorum, and after every quorum it is alone in: the last
  replica may finish while the replacement starts).

A notice (this worker's SIGTERM, a drain of its node) makes the replica's next step its
last (``worker.notice.ReplicaLeave``, ``ReplicaGroup.begin``): it takes part in that step
but stops its torchft Manager (its heartbeat) as soon as the step's quorum is decided
(after the step's all-reduce where the quorum's members changed: a healer needs the
source's Manager), and leaves at the boundary after it (and after the checkpoint there,
if one is due). The others' next quorum forms without it once its last heartbeat is
``heartbeat_timeout_ms`` old, which the step it still computed hides in part (all of it
for steps longer than the timeout); no step is redone, and Ray replaces it as after a
crash, charged to ``scaling.max_preemptions``.

Costs: one flat gradient copy and a torchft quorum (a few ms) per step; ``parallel.strategy``
must be ``ddp`` without a comm hook (torchft replicates the model; no sharding). The logged
train metrics are the whole global batch's: on log steps the replicas' row sums (a few
floats) ride in the same all-reduce, so they cost no collective and fail and are redone
with the step; the logged timings are the logging replica's own.
"""

from __future__ import annotations

import hashlib
import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional

import torch

from elastic_ddp.worker.roles import PerStepRoles
from elastic_ddp.errors import ElasticDDPError

# Lighthouse settings: the survivors' longest gap is the heartbeat timeout
# (5 s by default, 0.6-0.8 s at 500 ms); one live replica may form a quorum.
LIGHTHOUSE = {"min_replicas": 1, "heartbeat_timeout_ms": 500}
# The key of the driver's stop among the sums of a per-step all-reduce.
STOP_KEY = "elastic_ddp.stop"


class ReplicaGroup:
    """This worker's torchft replica group: its Manager, and one step's quorum.

    Args:
        world_rank, world_size: this worker among the job's workers (= replica groups).
        device: where gradients live (gloo on CPU, NCCL on CUDA).
        min_replicas: fewest replicas a step may commit with (``scaling.min_workers``).
        state_dict, load_state_dict: the trainer's state a healing replica receives.
        collective_timeout_s: bounds an all-reduce with a hung peer.
    """

    def __init__(self, world_rank: int, world_size: int, device: torch.device, min_replicas: int,
                 state_dict: Callable[[], dict], load_state_dict: Callable[[dict], None],
                 collective_timeout_s: float = 30.0):
        logging.getLogger("torchft").setLevel(logging.WARNING)  # one INFO line per step
        self.world_rank, self.world_size = world_rank, world_size
        self._device, self._min_replicas = device, min_replicas
        self._state_dict, self._load_state_dict = state_dict, load_state_dict
        self._timeout = timedelta(seconds=collective_timeout_s)
        # Created by :meth:`start`, at the first quorum: see there.
        self._manager = None
        self._restored: Optional[dict] = None  # torchft's counters from a checkpoint, until then
        self.participant: Optional[int] = None
        self.participants = 0
        self._tries = (-1, 0)  # (committed step, quorums joined at it): compat's fallback id
        # Whether this step's quorum may differ in members from the previous one (a
        # replica joined or left: one may heal from this one during the quorum).
        self.changed = True

    def start(self) -> None:
        """Create this replica's torchft Manager, whose server heartbeats to the lighthouse
        from then on; a second call, or one after :meth:`shutdown`, does nothing.

        The lighthouse counts a replica that heartbeats as healthy, and forms no quorum
        but the fast one (the last quorum's members all back) while half or more of the
        healthy replicas have not asked for one (torchft's split-brain rule; with more
        replicas it waits for such stragglers up to ``join_timeout_ms``). So a replica
        that resumes a run (``PerStepFaultTolerance.fit``) starts it at its first
        :meth:`quorum`: started before its restore and its first round's read, it would
        hold the survivors' next new quorum for all of that time. A fresh run's replicas
        start it before their first read instead, so that their first quorum waits for
        all of them: one that began alone and died before another healed from it would
        take its steps with it."""
        if self._manager is not None or self._shut:
            return
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.pg_transport import PGTransport

        device, timeout = self._device, self._timeout
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self._manager = Manager(
            pg=pg, min_replica_size=self._min_replicas, load_state_dict=self._load_state_dict,
            # Synchronous quorum: a healing replica loads the peer's state before the
            # forward pass and takes its share of the step. With the asynchronous quorum a
            # healer can get a participant rank while torchft zeroes its gradient
            # (is_participating() False): its share of the step would be counted, not
            # learned from (measured: the first step after a join lost half its rows).
            # Costs the quorum's latency (ms) before each forward instead of beside it.
            state_dict=self._state_dict, use_async_quorum=False, timeout=timedelta(seconds=30),
            quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=10),
            world_size=1, rank=0, replica_id=f"rg{self.world_rank}",
            checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=60), device=device))
        if self._restored is not None:
            self._manager.load_state_dict(self._restored)

    @property
    def manager(self):
        """The torchft Manager (started by the first :meth:`quorum`)."""
        if self._manager is None:
            raise RuntimeError("the replica group's Manager is not started (no quorum yet)")
        return self._manager

    # -- one step ---------------------------------------------------------------------------
    def begin(self, leave=None, step: int = 0) -> tuple[Optional[int], int]:
        """This step's :meth:`quorum`, or with a notice held by ``leave`` (a
        ``worker.notice.ReplicaLeave``; None: notices are crashes) this replica's last
        step: it takes part (the quorum already counts it), but its Manager, whose
        heartbeat keeps it in the lighthouse's view, stops as soon as the quorum is
        decided when the members are the last step's (none heals from it: a healer asks
        the source's Manager during the quorum), else after the step's all-reduce
        (:meth:`commit`). The lighthouse's heartbeat timeout then runs while the step
        computes, not while the others wait for their next quorum. ``step``: the last
        step this replica committed.

        A replica that has joined no quorum yet leaves at once.

        Raises:
            Preempted: at the first call after the last step (``left=True``)."""
        if leave is None:
            return self.quorum()
        if self.leaving:  # the last step is done (and the checkpoint after it, if one was due)
            leave.check(step, before_leave=self.shutdown)
        if leave.held() is None:
            return self.quorum()
        if self.participants == 0:  # in no quorum yet: nothing to finish, leave at once
            leave.check(step, before_leave=self.shutdown)
        got = self.quorum()
        self.leaving = True
        if not self.changed:
            self.shutdown()
        return got

    leaving = False  # this replica's last step is under way or done

    def commit(self) -> bool:
        """After the step's all-reduce: whether it may be applied (``should_commit``);
        the Manager stops here in a last step where :meth:`begin` did not stop it."""
        ok = self.should_commit()
        if self.leaving:
            self.shutdown()
        return ok

    def quorum(self) -> tuple[Optional[int], int]:
        """Start this step's quorum and wait for it: (this replica's rank among the step's
        participants, or None while it heals; the number of participants)."""
        from elastic_ddp.compat.torchft import quorum_id_is_exact

        before = self.quorum_id if self.participants else None
        self.start()
        self.manager.start_quorum()
        self.participant = self.manager.participating_rank()
        self.participants = self.manager.num_participants()
        if self.participant is not None and not self.manager.is_participating():
            raise RuntimeError("torchft: a participant rank without participating (healing under "
                               "an asynchronous quorum); its share would be lost")
        step = self.manager.current_step()
        self._tries = (step, self._tries[1] + 1 if self._tries[0] == step else 1)
        self.changed = not quorum_id_is_exact() or before != self.quorum_id
        return self.participant, self.participants

    @property
    def quorum_id(self) -> int:
        """The id of this step's quorum, the same on its participants (``compat.torchft``)."""
        from elastic_ddp.compat.torchft import quorum_id

        return quorum_id(self.manager, self._tries[1])

    @property
    def step(self) -> int:
        """Committed steps (the same on every participant once the quorum is decided)."""
        return self.manager.current_step() + self._uncounted[0]

    @property
    def full(self) -> bool:
        """Every world rank is in this step's quorum (a barrier over all ranks is safe)."""
        return self.participants == self.world_size

    def allreduce_gradients(self, params: list[torch.nn.Parameter],
                            sums: Optional[dict[str, float]] = None) -> Optional[dict[str, float]]:
        """SUM the gradients over the step's participants, in one flat buffer (a healing
        replica sends zeros). A failed all-reduce is swallowed by torchft and shows in
        ``should_commit``.

        ``sums``: values to SUM over the participants in the same buffer (the metric
        window's row sums on a log step: no collective of their own, and they fail and
        are redone with the step). Every participant passes the same keys in the same
        order. Carried in the gradients' dtype (float32: ~1e-7 relative). Returns them
        summed, or None without ``sums``."""
        from torch.distributed import ReduceOp

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        parts = [g.reshape(-1) for g in grads]
        if sums is not None:
            parts.append(torch.tensor(list(sums.values()), dtype=parts[0].dtype, device=parts[0].device))
        flat = torch.cat(parts)
        if self.participant is None:
            flat.zero_()
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(g)  # views of one buffer
            offset += g.numel()
        if sums is None:
            return None
        return dict(zip(sums, flat[offset:].double().tolist()))

    def should_commit(self) -> bool:
        """torchft's commit decision of this step. After :meth:`shutdown` (a leaving
        replica's last step: its Manager server, which decides it, is gone) whether this
        replica's all-reduce went through, which is then the others' decision too."""
        if self._shut:
            ok = self.manager.errored() is None
            if ok:  # torchft's count of it (state_dict, step), which its should_commit keeps
                self._uncounted = (self._uncounted[0] + 1, self._uncounted[1] + self.participants)
            return ok
        return bool(self.manager.should_commit())

    _uncounted = (0, 0)  # (steps, batches) committed after shutdown: torchft did not count them

    def state_dict(self) -> dict:
        """torchft's step counters (``Manager.state_dict``), with the steps committed
        after :meth:`shutdown`; before the Manager starts, those restored."""
        st = dict(self._manager.state_dict() if self._manager is not None
                  else self._restored or {"step": 0, "batches_committed": 0})
        st["step"] += self._uncounted[0]
        st["batches_committed"] += self._uncounted[1]
        return st

    def load_state_dict(self, state: dict) -> None:
        """torchft's step counters from a checkpoint (kept for the Manager until it starts)."""
        if self._manager is not None:
            self._manager.load_state_dict(state)
        else:
            self._restored = dict(state)

    def shutdown(self) -> None:
        """Stop this replica's torchft Manager (its heartbeat to the lighthouse stops);
        a second call does nothing, and none is started after it."""
        if not self._shut:
            self._shut = True
            if self._manager is not None:
                self._manager.shutdown(wait=False)

    _shut = False


class RunOver(ElasticDDPError):
    """A replica found the run finished by another (the done marker) once it was in a
    quorum: it ends without training (``PerStepFaultTolerance.fit`` returns)."""


def done_marker(storage: str, run_name: str) -> Optional[Path]:
    """The file a finished replica leaves for its run (local storage only), keyed by the
    lighthouse address, which is new for every Ray Train run."""
    addr = os.environ.get("TORCHFT_LIGHTHOUSE")
    if not addr or "://" in storage:
        return None
    return Path(storage) / run_name / "run_markers" / f"done-{hashlib.sha1(addr.encode()).hexdigest()}"


class PerStepFaultTolerance:
    """``per_step`` mode: a replica group of its own; each step's quorum decides who
    computes which rows, and whether the step is applied (see the module docstring)."""

    ledger_mode = "per_step"
    sums_in_step = True  # the metric window's row sums ride in the gradient all-reduce
    comm_size = 1  # torchft's own process group joins the replicas
    #: A committed step's all-reduce carried the driver's stop (:meth:`stop_here`).
    stop_agreed = False

    def __init__(self, trainer):
        self.t = t = trainer
        s = t.cfg.scaling
        self.group = ReplicaGroup(t.rank, t.world_size, t.device, s.min_workers, self._peer_state,
                                  self._load_peer_state, s.collective_timeout_s)
        self.marker = done_marker(t.job.storage, t.cfg.run.name)
        self.roles = PerStepRoles(t.rank, self.group)
        # A notice (this worker's SIGTERM, a drain of its node): leave the quorum at the
        # next step boundary (None: handled as a crash).
        from elastic_ddp.worker.notice import build_leave

        self.leave = build_leave(t)

    # -- torchft's view of the state: what a healing replica receives ----------------
    def _peer_state(self) -> dict:
        return self.t.state_dict()  # CheckpointManager.live_state

    def _load_peer_state(self, state: dict) -> None:
        from elastic_ddp.checkpoint.manager import CheckpointManager
        from elastic_ddp.run_state import Counters, Progress

        t = self.t
        run = CheckpointManager.load_live_state(t.strategy, state)
        # In place: the loop holds these objects.
        t.progress.__dict__.update(Progress(**run["progress"]).__dict__)
        seen = t.counters.world_sizes_seen
        t.counters.__dict__.update(Counters(**run["counters"]).__dict__)
        t.counters.world_sizes_seen = seen
        # The position moved forward: the reader warmed at the restored cursor
        # (fit) serves it if it is in the same epoch (RankLoader.ensure).

    def state_dict(self) -> dict:
        return {"torchft": self.group.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "torchft" in state:
            self.group.load_state_dict(state["torchft"])

    # -- a step --------------------------------------------------------------------------
    def begin_step(self) -> tuple[Optional[int], int]:
        """This step's quorum: (this replica's participant rank, None while it heals;
        the number of participants); with a notice held, this replica's last step
        (``ReplicaGroup.begin``).

        Raises:
            Preempted: at the boundary after the last step (``left=True``).
            RunOver: alone in its quorum after another replica finished the run (a
                replacement that passed the done-marker check in ``fit`` just before the
                last replica finished: alone it would retrain the run from step 0)."""
        t = self.t
        if self.group.leaving and self.group.participants == 1 and t.checkpointed_step != t.progress.step:
            # The last step was a quorum of this replica alone: the live state leaves with
            # it, so it commits a checkpoint of that step first (a replacement would else
            # restart from an older one and redo the steps since).
            t.log(f"leaving alone in its quorum at step {t.progress.step}: committing a checkpoint")
            t.checkpoint({})
        got = self.group.begin(self.leave, t.progress.step)
        if self.group.participants == 1 and self.marker is not None and self.marker.exists():
            raise RunOver(f"rank {self.t.rank}: the run is over (done marker {self.marker})")
        return got

    def loss_weight(self, n: int) -> float:
        return 1.0 / n  # the all-reduce SUMs over the participants

    def sync_gradients(self, probe: bool, sums: Optional[dict] = None) -> tuple[bool, Optional[dict]]:
        """The step's one all-reduce (gradients, ``sums`` on a log step, and whether this
        replica holds the driver's stop) and torchft's commit decision: (whether the step
        may be applied, ``sums`` summed over the quorum or None). The stop rides in every
        step (one float): every participant of the step that first carries it learns it
        there, so all of them stop after the same committed step (``stop_agreed``; a
        healing replica's share is zeros, its own stop rides in its next step)."""
        from elastic_ddp import notice

        params = [p for p in self.t.strategy.module.parameters() if p.requires_grad]
        mine = {**(sums or {}), STOP_KEY: 1.0 if "stop" in notice.noted() else 0.0}
        summed = self.group.allreduce_gradients(params, mine)
        ok = self.group.commit()
        stop = summed.pop(STOP_KEY) > 0
        self.stop_agreed = self.stop_agreed or (ok and stop)
        return ok, (summed if sums is not None else None)

    def stop_here(self) -> None:
        """After the committed step where the stop was agreed: commit a checkpoint of it
        (a full quorum reports it, every replica at this step; a partial one's lead writes
        it to storage, as at the run's end) and raise ``notice.Preempted("stop")`` on this
        replica; the controller then ends the job (``controller.events.StopRequested``).

        Raises:
            Preempted: always, once the checkpoint is committed."""
        import time

        from elastic_ddp import notice

        t = self.t
        step = t.progress.step
        t.log(f"stop notice (the driver's SIGTERM) at step {step}: committing a checkpoint")
        t.checkpoint({}, final=True)
        t.ledger.close()
        noticed = notice.noted().get("stop", time.time())
        raise notice.Preempted("stop", step, noticed, None, time.time(), (), t.rank)

    def ledger_extra(self) -> dict:
        return {"quorum": self.group.quorum_id, "n": self.group.participants}

    # -- checkpoints, the end ------------------------------------------------------------
    def may_report(self) -> bool:
        """Checkpoints are reported (a barrier over every world rank) only by a full
        quorum; a partial quorum's go straight to storage (``write_unreported``, by the
        lead)."""
        return self.group.full

    def write_unreported(self) -> None:
        """A checkpoint of a partial quorum (periodic, at a notice or the run's last):
        every participant commits its step time, the lead writes the state straight to
        storage (no report: Ray Train's barrier would wait for the replicas outside the
        quorum) and removes its older unreported ones beyond ``train.keep_checkpoints``
        (``CheckpointManager.prune_unreported``). A restore reads storage first
        (``CheckpointManager.restore``), so the run's durable state keeps up with its
        committed steps while a replacement is starting or healing: when the last live
        replica then dies, the restart redoes at most a checkpoint interval. What it
        costs: the lead's synchronous write, which the other participants wait out in
        their next all-reduce (as a full quorum waits out a reported one)."""
        t = self.t
        c = t.counters
        c.committed_train_s += c.uncommitted_train_s
        c.uncommitted_train_s = 0.0
        if not t.roles.lead:
            return
        path = t.ckpt.save(t.progress.step, t.strategy, t.run_state(), report=False, writer=True)
        removed = t.ckpt.prune_unreported(t.cfg.train.keep_checkpoints)
        t.log(f"checkpoint of a quorum of {self.group.participants} of {t.world_size} at step "
              f"{t.progress.step} written unreported: {path}"
              + (f" (removed {len(removed)} older unreported)" if removed else ""))

    def fit(self, loop: Callable[[], None]) -> None:
        """Run ``loop`` (the trainer's) between the done-marker check and torchft's
        shutdown."""
        t = self.t
        if self.marker is not None and self.marker.exists():
            self.group.shutdown()  # the run is over: a late replacement must not retrain it
            return
        if t.restored_path is None:
            self.group.start()  # a fresh run: the first quorum waits for every replica (start)
        try:
            if not t.done and t.cfg.data.order == "windowed":
                # Read this rank's first round before joining a quorum: a replacement
                # then takes its share at once, and the survivors do not wait in their
                # all-reduce while it reads (a peer's state moves the cursor a few
                # steps on, within the windows read here).
                t.warm_reader()
            loop()
        except RunOver as e:
            t.log(str(e))
        finally:
            if self.marker is not None and t.done:
                self.marker.parent.mkdir(parents=True, exist_ok=True)
                self.marker.touch()
            if self.leave is not None:
                self.leave.close()
            self.group.shutdown()
