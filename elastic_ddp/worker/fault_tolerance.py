"""Per-step fault tolerance (``scaling.fault_tolerance: per_step``): every Ray Train worker is
its own torchft replica group (Ray 2.60's ``TorchftConfig``); a quorum is decided every
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
  starting never reaches: durable checkpoints are reported only by a full quorum; a
  final state written by a partial quorum goes straight to storage;
- a replacement that starts after the others finished would form a quorum alone at step 0
  and retrain from scratch: a done marker, keyed by the run's lighthouse address, stops it.

Costs: one flat gradient copy and a torchft quorum (a few ms) per step; ``parallel.strategy``
must be ``ddp`` without a comm hook (torchft replicates the model; no sharding).
"""

from __future__ import annotations

import hashlib
import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional

import torch

# Lighthouse settings: the survivors' longest gap is the heartbeat timeout
# (5 s by default, 0.6-0.8 s at 500 ms); one live replica may form a quorum.
LIGHTHOUSE = {"min_replicas": 1, "heartbeat_timeout_ms": 500}


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
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.pg_transport import PGTransport

        logging.getLogger("torchft").setLevel(logging.WARNING)  # one INFO line per step
        self.world_rank, self.world_size = world_rank, world_size
        timeout = timedelta(seconds=collective_timeout_s)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=pg, min_replica_size=min_replicas, load_state_dict=load_state_dict,
            # Synchronous quorum: a healing replica loads the peer's state before the
            # forward pass and takes its share of the step. With the asynchronous quorum a
            # healer can get a participant rank while torchft zeroes its gradient
            # (is_participating() False): its share of the step would be counted, not
            # learned from (measured: the first step after a join lost half its rows).
            # Costs the quorum's latency (ms) before each forward instead of beside it.
            state_dict=state_dict, use_async_quorum=False, timeout=timedelta(seconds=30),
            quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=10),
            world_size=1, rank=0, replica_id=f"rg{world_rank}",
            checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=60), device=device))
        self.participant: Optional[int] = None
        self.participants = 0
        self.quorum_id = 0

    # -- one step ---------------------------------------------------------------------------
    def quorum(self) -> tuple[Optional[int], int]:
        """Start this step's quorum and wait for it: (this replica's rank among the step's
        participants, or None while it heals; the number of participants)."""
        self.manager.start_quorum()
        self.participant = self.manager.participating_rank()
        self.participants = self.manager.num_participants()
        if self.participant is not None and not self.manager.is_participating():
            raise RuntimeError("torchft: a participant rank without participating (healing under "
                               "an asynchronous quorum); its share would be lost")
        self.quorum_id += 1
        return self.participant, self.participants

    @property
    def step(self) -> int:
        """Committed steps (the same on every participant once the quorum is decided)."""
        return self.manager.current_step()

    @property
    def full(self) -> bool:
        """Every world rank is in this step's quorum (a barrier over all ranks is safe)."""
        return self.participants == self.world_size

    def allreduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """SUM the gradients over the step's participants, in one flat buffer (a healing
        replica sends zeros). A failed all-reduce is swallowed by torchft and shows in
        ``should_commit``."""
        from torch.distributed import ReduceOp

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.participant is None:
            flat.zero_()
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(g)  # views of one buffer
            offset += g.numel()

    def should_commit(self) -> bool:
        return bool(self.manager.should_commit())

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def done_marker(storage: str, run_name: str) -> Optional[Path]:
    """The file a finished replica leaves for its run (local storage only), keyed by the
    lighthouse address, which is new for every Ray Train run."""
    addr = os.environ.get("TORCHFT_LIGHTHOUSE")
    if not addr or "://" in storage:
        return None
    return Path(storage) / run_name / "run_markers" / f"done-{hashlib.sha1(addr.encode()).hexdigest()}"


def per_step_trainer_class():
    """The ``Trainer`` subclass of per-step fault tolerance (imported lazily: torchft is
    an optional dependency, ``pip install 'elastic-ddp[ft]'``)."""
    from elastic_ddp.worker.trainer import Counters, Progress, Trainer

    class PerStepTrainer(Trainer):
        """A replica group of its own; each step's quorum decides who computes which
        rows, and whether the step is applied (see the module docstring)."""

        shares_process_group = False  # torchft's own process group joins the replicas

        def __init__(self, job, rank: int, world_size: int, device):
            super().__init__(job, rank, world_size, device)
            s = self.cfg.scaling
            self.ft = ReplicaGroup(rank, world_size, device, s.min_workers, self._peer_state,
                                   self._load_peer_state, s.collective_timeout_s)
            self.marker = done_marker(job.storage, self.cfg.run.name)

        # -- torchft's view of the state: what a healing replica receives ------------
        def _peer_state(self) -> dict:
            return self.state_dict()  # CheckpointManager.live_state

        def _load_peer_state(self, state: dict) -> None:
            from elastic_ddp.checkpoint.manager import CheckpointManager

            run = CheckpointManager.load_live_state(self.strategy, state)
            # In place: the loop holds these objects.
            self.progress.__dict__.update(Progress(**run["progress"]).__dict__)
            seen = self.counters.world_sizes_seen
            self.counters.__dict__.update(Counters(**run["counters"]).__dict__)
            self.counters.world_sizes_seen = seen
            # The position moved forward: the reader warmed at the restored cursor
            # (fit) serves it if it is in the same epoch (Trainer.ensure_reader).

        def run_state(self) -> dict:
            return {**super().run_state(), "torchft": self.ft.manager.state_dict()}

        def load_run_state(self, state: dict) -> None:
            super().load_run_state(state)
            if "torchft" in state:
                self.ft.manager.load_state_dict(state["torchft"])

        # -- a step --------------------------------------------------------------------
        def begin_step(self):
            prank, n = self.ft.quorum()
            return prank, n

        def loss_weight(self, n: int) -> float:
            return 1.0 / n  # the all-reduce SUMs over the participants

        def sync_gradients(self, probe: bool) -> bool:
            self.ft.allreduce_gradients([p for p in self.strategy.module.parameters() if p.requires_grad])
            return self.ft.should_commit()

        def ledger_extra(self) -> dict:
            return {"quorum": int(self.ft.manager._quorum_id), "n": self.ft.participants}

        # -- checkpoints, evaluation, the end -----------------------------------------
        def checkpoint(self, metrics: dict, final: bool = False) -> None:
            """Reported (a barrier over every world rank) only by a full quorum; the run's
            final state from a partial quorum goes straight to storage."""
            if self.ft.full:
                return super().checkpoint(metrics, final)
            if final and self.ft.participant == 0:
                self._write_direct()

        def _write_direct(self) -> None:
            """The final state straight to storage, by this replica alone (no report:
            Ray Train's barrier would wait for replicas outside the quorum)."""
            c = self.counters
            c.committed_train_s += c.uncommitted_train_s
            c.uncommitted_train_s = 0.0
            self.ckpt.save(self.progress.step, self.strategy, self.run_state(), report=False,
                           writer=True)

        def evaluate(self) -> dict:
            """Participant 0 of the step's quorum evaluates the whole val split alone: no
            collective that a replica's death could break mid-way."""
            if self.ft.participant != 0:
                return {}
            from elastic_ddp.worker.evaluation import evaluate

            out = evaluate(self, rank=0, world_size=1)
            if out:
                self.tracker.log_metrics(out, self.progress.step)
            return out

        def fit(self) -> None:
            if self.marker is not None and self.marker.exists():
                self.ft.shutdown()  # the run is over: a late replacement must not retrain it
                return
            self.ledger_mode = "per_step"
            try:
                if not self.done and self.cfg.data.order == "windowed":
                    # Read this rank's first round before joining a quorum: a replacement
                    # then takes its share at once, and the survivors do not wait in their
                    # all-reduce while it reads (a peer's state moves the cursor a few
                    # steps on, within the windows read here).
                    self.ensure_reader(self.rank, self.world_size)
                    self._reader.warm()
                super().fit()
            finally:
                if self.marker is not None and self.done:
                    self.marker.parent.mkdir(parents=True, exist_ok=True)
                    self.marker.touch()
                self.ft.shutdown()

    return PerStepTrainer
