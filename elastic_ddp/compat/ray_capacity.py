"""Per-step mode's replica groups: one without capacity waits outside the controller's loop.

Ray Train replaces a failed replica group in its placement-group bundle and waits
(``ray.get``, no timeout) until the replacement actor starts. A bundle whose node was
removed or is draining is placed again only when a node with room joins, and until then
the controller's loop is blocked: a second replica that dies meanwhile is not replaced on
its own, live node, and the job cannot even end when the survivors finish. Here such a
group waits outside the loop (:class:`CapacityWait`, mixed into the controller of
``compat.ray_controller``); the others are replaced at once.

What it costs: it overrides private parts of Ray Train's controller and worker group
(override ``replica_group_capacity`` of ``compat.versions``, tested on Ray 2.60.0 only;
elsewhere Ray Train's own replacement runs), and three GCS calls per failure decision
while a group waits.
"""

from __future__ import annotations


class CapacityWait:
    """The controller's resize decision and poll with replica groups that wait for
    capacity (per_step mode); mixed in before Ray Train's ``TrainController``, whose
    methods it calls through ``super()``. :meth:`_init_capacity_wait` runs after the
    controller's ``__init__``."""

    def _init_capacity_wait(self, enabled: bool) -> None:
        # Replica groups (per_step mode) whose replacement waits for capacity.
        self._capacity_wait = enabled
        self._waiting: set[int] = set()
        self._filtered_poll = None

    def _execute_resize_decision(self, decision):
        wg = self._worker_group
        if not (self._capacity_wait and self._manages_replica_groups and wg):
            return super()._execute_resize_decision(decision)
        poll = self._filtered_poll or wg.get_latest_poll_status()
        failing = (poll.failing_replica_group_indices if poll else set()) | self._waiting
        every = poll.all_replica_group_indices if poll else set()
        if not failing or decision.num_workers != len(wg.get_workers()):
            return super()._execute_resize_decision(decision)
        failure = self._run_controller_hook("before_controller_execute_resize_decision", decision)
        if failure:
            return failure
        waiting = replica_groups_without_capacity(wg, failing)
        if failing >= every and waiting in (set(), failing):
            # Every replica failed (a node hosting them all, SIGKILL to each), and
            # either each can start again or none can: none is left to heal from, and
            # a replacement would wait on the dead replicas' tasks. Ray Train's full
            # restart of the group from the newest checkpoint, as restart mode does
            # (bounded by its worker-group start timeout; the failure was counted
            # against max_failures before). Some with room and some without: those
            # with room are replaced below and train while the others wait.
            return self._restart_every_group(decision)
        # Every failed group is shut down before any is replaced: a replacement talks
        # to every active group's workers, and a dead one's would fail it.
        for i in failing - self._waiting:
            set_aside_replica_group(wg, i)
        self._waiting = waiting
        if waiting:
            # A survivor may wait in a barrier of the worker group (Ray Train resets
            # it in every replacement, which for these comes later).
            ray_get(wg.get_worker_group_state().sync_actor.reset.remote())
        for i in sorted(failing - waiting):
            if not replaced(wg, i):
                # A replica the last poll saw alive died meanwhile (the replacement
                # talks to every live replica): the same full restart.
                return self._restart_every_group(decision)
        return _iteration_result(self, next_state="running")

    def _restart_every_group(self, decision):
        """Ray Train's full restart (its resize decision's standard branch): the
        worker group shut down and started again, every replica restoring the
        newest checkpoint."""
        self._waiting.clear()
        self._filtered_poll = None
        if self._worker_group:
            self._shutdown_worker_group()
        self._start_worker_group(num_workers=decision.num_workers,
                                 resources_per_worker=decision.resources_per_worker)
        return _iteration_result(self, next_state="running")

    async def _poll_workers(self):
        status = await super()._poll_workers()
        self._filtered_poll = None
        if not self._waiting:
            return status
        wg = self._worker_group
        ready = self._waiting - replica_groups_without_capacity(wg, self._waiting)
        for i in sorted(ready):
            if not replaced(wg, i):  # another replica died: seen at the next poll
                ready = {j for j in ready if j < i}
                break
        hidden, self._waiting = set(self._waiting), self._waiting - ready
        self._filtered_poll = without_replica_groups(status, hidden, started=ready)
        return self._filtered_poll



def replaced(worker_group, index: int) -> bool:
    """``worker_group.replace_replica_group(index)``; False when another replica's actor
    was found dead on the way (the replacement clears every live replica's result queue
    first), which only a restart of the whole group mends. Other errors are raised."""
    from ray.exceptions import RayActorError

    try:
        worker_group.replace_replica_group(index)
    except RayActorError:
        return False
    return True


def ray_get(ref):
    import ray

    return ray.get(ref)


def _iteration_result(controller, next_state: str):
    """Ray Train's loop-iteration result moving ``controller`` to its running state."""
    from ray.train.v2._internal.execution.controller.controller import TrainControllerLoopIterationResult
    from ray.train.v2._internal.execution.controller.state import RunningState

    assert next_state == "running"
    return TrainControllerLoopIterationResult(
        run_attempt_id=controller._get_run_attempt_id(), previous_state=controller.get_state(),
        next_state=RunningState())


def set_aside_replica_group(worker_group, index: int) -> None:
    """Shut down the failed replica group ``index`` of ``worker_group`` until its
    replacement can start, as Ray Train's replacement first does: a later replacement of
    another group talks to every active group's workers, and this one's are dead. Its
    workers stay in the worker group (polled, their errors hidden) until replaced."""
    group = worker_group._replica_groups[index]
    for w in group.get_workers():
        if w.distributed_context is not None:
            worker_group._world_rank_to_ongoing_poll.pop(w.distributed_context.world_rank, None)
    if group.is_active():
        group.shutdown()


def replica_groups_without_capacity(worker_group, indices: set) -> set:
    """Of the replica groups ``indices`` of ``worker_group``, those a replacement could not
    start for now: a placement-group bundle of theirs is on no live node, or on a node
    being drained (its node was removed and Ray has found no room for the bundle yet, or
    it soon will be). Three GCS calls.

    Raises: nothing; with the GCS not answering, every group counts as placeable (the
    replacement then waits as Ray Train's does)."""
    from ray.util.placement_group import placement_group_table

    try:
        pg = worker_group.get_worker_group_state().placement_group_handle.placement_group
        where = placement_group_table(pg).get("bundles_to_node_id", {})
        from elastic_ddp.compat.ray_scaling import usable_nodes

        usable = usable_nodes()
        groups = worker_group._replica_groups
    except Exception:  # noqa: BLE001 - see Raises
        return set()
    return {i for i in indices
            if any(where.get(w.placement_group_bundle_index) not in usable for w in groups[i].get_workers())}


def without_replica_groups(status, hidden: set, started: set):
    """``status`` (a ``WorkerGroupPollStatus``) with the workers of the replica groups
    ``hidden`` shown healthy: running when in ``started`` (their replacement started
    after the poll), else not running (waiting for capacity: the job may end without
    them). Their failure was handled when it was first seen."""
    import dataclasses

    from ray.train.v2._internal.execution.worker_group.poll import WorkerStatus

    groups = status.worker_rank_to_replica_group_rank or {}
    statuses = {rank: (WorkerStatus(running=groups.get(rank) in started)
                       if groups.get(rank) in hidden else s)
                for rank, s in status.worker_statuses.items()}
    return dataclasses.replace(status, worker_statuses=statuses)
