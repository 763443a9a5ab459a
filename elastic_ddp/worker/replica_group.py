"""This worker's torchft replica group (``scaling.fault_tolerance: per_step``): its
Manager, one step's quorum, the step's flat gradient all-reduce and torchft's commit
decision. Used by ``worker.per_step.PerStepFaultTolerance``; torchft is imported only
when the Manager starts (``pip install 'elastic-ddp[ft]'``)."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Callable, Optional

import torch


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
        ``worker.leave.ReplicaLeave``; None: notices are crashes) this replica's last
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
