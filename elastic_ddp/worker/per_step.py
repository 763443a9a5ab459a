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
last (``worker.leave.ReplicaLeave``, ``ReplicaGroup.begin``): it takes part in that step
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
import os
import time
from pathlib import Path
from typing import Callable, Optional

from elastic_ddp import notice
from elastic_ddp.errors import ElasticDDPError
from elastic_ddp.worker.checkpoint_policy import Due
from elastic_ddp.worker.replica_group import ReplicaGroup
from elastic_ddp.worker.roles import PerStepRoles

# Lighthouse settings: the survivors' longest gap is the heartbeat timeout
# (5 s by default, 0.6-0.8 s at 500 ms); one live replica may form a quorum.
LIGHTHOUSE = {"min_replicas": 1, "heartbeat_timeout_ms": 500}
# The key of the driver's stop among the sums of a per-step all-reduce.
STOP_KEY = "elastic_ddp.stop"


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
    computes which rows, and whether the step is applied (see the module docstring).
    The arguments are ``fault_tolerance.build``'s."""

    ledger_mode = "per_step"
    sums_in_step = True  # the metric window's row sums ride in the gradient all-reduce
    comm_size = 1  # torchft's own process group joins the replicas
    #: A committed step's all-reduce carried the driver's stop (:meth:`stop_due`).
    stop_agreed = False

    def __init__(self, job, rank: int, world_size: int, device, strategy,
                 state_dict: Callable[[], dict], load_state_dict: Callable[[dict], None],
                 log: Callable[[str], None]):
        cfg, s = job.config, job.config.scaling
        self.rank, self.world_size, self.strategy, self.log = rank, world_size, strategy, log
        self.windowed = cfg.data.order == "windowed"
        self.group = ReplicaGroup(rank, world_size, device, s.min_workers, state_dict,
                                  load_state_dict, s.collective_timeout_s)
        self.marker = done_marker(job.storage, cfg.run.name)
        self.roles = PerStepRoles(rank, self.group)
        # A notice (this worker's SIGTERM, a drain of its node): leave the quorum at the
        # next step boundary (None: handled as a crash).
        from elastic_ddp.worker.leave import build_leave

        self.leave = build_leave(job, rank, world_size)

    def state_dict(self) -> dict:
        return {"torchft": self.group.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "torchft" in state:
            self.group.load_state_dict(state["torchft"])

    # -- a step --------------------------------------------------------------------------
    def begin_step(self, step: int = 0) -> tuple[Optional[int], int]:
        """This step's quorum: (this replica's participant rank, None while it heals;
        the number of participants); with a notice held, this replica's last step
        (``ReplicaGroup.begin``). ``step``: the last committed step.

        Raises:
            Preempted: at the boundary after the last step (``left=True``).
            RunOver: alone in its quorum after another replica finished the run (a
                replacement that passed the done-marker check in ``fit`` just before the
                last replica finished: alone it would retrain the run from step 0)."""
        got = self.group.begin(self.leave, step)
        if self.group.participants == 1 and self.marker is not None and self.marker.exists():
            raise RunOver(f"rank {self.rank}: the run is over (done marker {self.marker})")
        return got

    @property
    def leaving_alone(self) -> bool:
        """This replica's last step was a quorum of itself alone: the live state leaves
        with it, so a checkpoint of that step is due before it leaves (a replacement
        would else restart from an older one and redo the steps since)."""
        return self.group.leaving and self.group.participants == 1

    def loss_weight(self, n: int) -> float:
        return 1.0 / n  # the all-reduce SUMs over the participants

    def sync_gradients(self, probe: bool, sums: Optional[dict] = None) -> tuple[bool, Optional[dict]]:
        """The step's one all-reduce (gradients, ``sums`` on a log step, and whether this
        replica holds the driver's stop) and torchft's commit decision: (whether the step
        may be applied, ``sums`` summed over the quorum or None). The stop rides in every
        step (one float): every participant of the step that first carries it learns it
        there, so all of them stop after the same committed step (``stop_agreed``; a
        healing replica's share is zeros, its own stop rides in its next step)."""
        params = [p for p in self.strategy.module.parameters() if p.requires_grad]
        mine = {**(sums or {}), STOP_KEY: 1.0 if "stop" in notice.noted() else 0.0}
        summed = self.group.allreduce_gradients(params, mine)
        ok = self.group.commit()
        stop = summed.pop(STOP_KEY) > 0
        self.stop_agreed = self.stop_agreed or (ok and stop)
        return ok, (summed if sums is not None else None)

    def stop_due(self, step: int) -> Optional[Due]:
        """After the committed step ``step`` where the stop was agreed: its checkpoint (a
        full quorum reports it, every replica at this step; a partial one's lead writes
        it to storage, as at the run's end), then ``notice.Preempted("stop")`` on this
        replica; the controller then ends the job (``controller.events.StopRequested``).
        None before the stop is agreed."""
        if not self.stop_agreed:
            return None

        def stopped() -> None:
            noticed = notice.noted().get("stop", time.time())
            raise notice.Preempted("stop", step, noticed, None, time.time(), (), self.rank)

        return Due("stop", final=True, then=stopped,
                   line=f"stop notice (the driver's SIGTERM) at step {step}: committing a checkpoint")

    def ledger_extra(self) -> dict:
        return {"quorum": self.group.quorum_id, "n": self.group.participants}

    # -- checkpoints, the end ------------------------------------------------------------
    def may_report(self) -> bool:
        """Checkpoints are reported (a barrier over every world rank) only by a full
        quorum; a partial quorum's lead writes them straight to storage
        (``Trainer.checkpoint``: unreported, where a restore reads first)."""
        return self.group.full

    def quorum_line(self) -> str:
        """Which quorum an unreported checkpoint is of, for its log line."""
        return f"a quorum of {self.group.participants} of {self.world_size}"

    def fit(self, loop: Callable[[], None], fresh: bool, done: Callable[[], bool],
            warm: Callable[[], None]) -> None:
        """Run ``loop`` (the trainer's) between the done-marker check and torchft's
        shutdown. ``fresh``: no checkpoint was restored; ``done``: whether the run is
        over; ``warm``: read this rank's first round (``RankLoader.warm``)."""
        if self.marker is not None and self.marker.exists():
            self.group.shutdown()  # the run is over: a late replacement must not retrain it
            return
        if fresh:
            self.group.start()  # a fresh run: the first quorum waits for every replica (start)
        try:
            if not done() and self.windowed:
                # Read this rank's first round before joining a quorum: a replacement
                # then takes its share at once, and the survivors do not wait in their
                # all-reduce while it reads (a peer's state moves the cursor a few
                # steps on, within the windows read here).
                warm()
            loop()
        except RunOver as e:
            self.log(str(e))
        finally:
            if self.marker is not None and done():
                self.marker.parent.mkdir(parents=True, exist_ok=True)
                self.marker.touch()
            if self.leave is not None:
                self.leave.close()
            self.group.shutdown()
