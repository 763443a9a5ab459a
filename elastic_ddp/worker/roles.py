"""Which worker does what, decided once per fault-tolerance mode.

- ``lead``: sends the step and validation metrics to the tracker, prints the log line,
  writes the checkpoint's state and the run's final state.
- ``eval_share``: how this worker takes part in evaluation, ``(index, n)`` of the val
  split, or None when it does not evaluate.
- ``records_start``: counts a worker-group start and sets the attempt's tags (world rank
  0 in both modes: the count is per worker-group start, not per quorum).
- ``records_attempt``: sends its start and first-step marks (``events/attempts.json``,
  the recovery table's join): world rank 0 in ``restart`` mode, every replica in
  ``per_step`` mode (a replacement is the recovery of its own rank's failure).
- ``may_log``: holds a live tracker client (the lead may send; ``records_start`` does).

``restart``: the worker group is one DDP job, world rank 0 leads, every rank evaluates
its share of the val split. ``per_step``: the lead is participant 0 of the last decided
quorum, whichever replica that is, so that the metrics flow while world rank 0 is dead
or healing; it evaluates the whole val split alone (no collective a replica's death
could break mid-way).
"""

from __future__ import annotations

from typing import Optional


class RestartRoles:
    """``restart`` mode: world rank 0 leads."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    @property
    def lead(self) -> bool:
        return self.rank == 0

    @property
    def eval_share(self) -> Optional[tuple[int, int]]:
        return self.rank, self.world_size

    @property
    def records_start(self) -> bool:
        return self.rank == 0

    @property
    def records_attempt(self) -> bool:
        return self.rank == 0

    @property
    def may_log(self) -> bool:
        return self.rank == 0


class PerStepRoles:
    """``per_step`` mode: participant 0 of the last decided quorum leads (world rank 0
    before this replica's first quorum).

    ``group``: this replica's ``replica_group.ReplicaGroup`` (its ``participant``, None
    while healing, and ``participants``, 0 before the first quorum)."""

    def __init__(self, rank: int, group):
        self.rank, self.group = rank, group

    @property
    def lead(self) -> bool:
        if self.group.participants == 0:
            return self.rank == 0
        return self.group.participant == 0

    @property
    def eval_share(self) -> Optional[tuple[int, int]]:
        return (0, 1) if self.lead else None

    @property
    def records_start(self) -> bool:
        return self.rank == 0

    @property
    def records_attempt(self) -> bool:
        return True

    @property
    def may_log(self) -> bool:
        return True
