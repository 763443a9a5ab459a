"""What elastic-ddp changes in Ray Train's ``TorchTrainer``, and why: fewer Python processes
between the command and the first step, and after every restart.

    trainer = trainer_class(TorchTrainer, ray_plan())(train_func, ...)

Every Ray actor is a fresh Python process that imports Ray; on the nodes where the
workers start, each one takes CPU time from the workers' own start (imports, process
group, model). Ray Train starts, per job, a controller and a placement-group cleaner, and
per worker group, the workers, a synchronization actor, a dataset manager and (from 2.60)
a preemption watcher. Here:

- no synchronization actor: the controller's process (:class:`ControllerHost`) serves
  each worker group's barrier, and on a running cluster it boots before ``fit``;
- no preemption watcher actor: the watcher runs in the controller's process
  (``compat.ray_train.host_preemption_watcher``), and only where a notice becomes a
  checkpoint (``launcher.build_trainer``, ``worker.notice``);
- no dataset manager when no dataset is passed, and no placement-group cleaner
  (:func:`trainer_class`);
- no runtime environment for the controller and the workers when the user sets none
  (:class:`EnvController`). Ray Train passes its ``RAY_TRAIN_*`` settings from the
  driver to the controller and on to every worker as a runtime environment's
  ``env_vars``, and a process with a runtime environment starts through Ray's
  ``setup_worker.py``, which imports Ray once more before it execs the worker.

What it costs: these override private parts of Ray Train. ``compat.versions`` lists the
Ray releases each was tested on (overrides ``controller_host`` and ``default_callbacks``);
on any other, :func:`trainer_class` leaves that part as Ray ships it.
"""

from __future__ import annotations

import functools
import os

# Read only by the Ray Train controller (its health checks and worker-group starts, in its
# own process), never by a worker; set by launcher.build_trainer or by the user.
CONTROLLER_ENV_VARS = frozenset({
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S",
    "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER",
    "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S",
    "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC",
})


def _without_controller_vars(env: dict) -> dict:
    return {k: v for k, v in env.items() if k not in CONTROLLER_ENV_VARS}


@functools.lru_cache(maxsize=None)
def _controller_class():
    from ray.train.v2._internal.execution.controller import TrainController

    class EnvController(TrainController):
        """Ray Train's controller with its ``RAY_TRAIN_*`` settings handed over as an
        argument (set in this process before Ray's ``__init__`` reads them) instead of a
        runtime environment, its workers started without those settings, which they
        never read (an empty propagation means no runtime environment for them), and
        Ray's preemption watcher run in this process instead of an actor per worker
        group (``compat.ray_train.host_preemption_watcher``)."""

        def __init__(self, controller_env: dict, **kwargs):
            os.environ.update(controller_env)
            from ray.train.v2._internal.execution.worker_group import worker_group

            propagate = worker_group.get_env_vars_to_propagate
            if not getattr(propagate, "_elastic_ddp", False):
                def filtered() -> dict:
                    return _without_controller_vars(propagate())

                filtered._elastic_ddp = True
                worker_group.get_env_vars_to_propagate = filtered
            super().__init__(**kwargs)
            from elastic_ddp.compat.ray_train import host_preemption_watcher

            host_preemption_watcher(self._worker_group_callbacks_to_propagate)
            from elastic_ddp.compat.versions import ray_plan

            if ray_plan().applies("usable_node_count"):
                from elastic_ddp.compat.ray_scaling import count_usable_nodes_only

                count_usable_nodes_only(self._scaling_policy)
            from elastic_ddp.compat import ray_grow

            # Set by the job's controller callbacks in super().__init__ (their
            # after_controller_start); replica groups (per_step mode) never resize so.
            grow_s = ray_grow.grow_timeout()
            if grow_s and not self._manages_replica_groups and ray_plan().applies("grow_checkpoint"):
                ray_grow.checkpoint_before_grow(self._scaling_policy, self)
            # Replica groups (per_step mode) whose replacement waits for capacity.
            self._capacity_wait = ray_plan().applies("replica_group_capacity")
            self._waiting: set[int] = set()
            self._filtered_poll = None

        # ---- per_step: a replica group that has no capacity waits without the controller
        # Ray Train replaces a failed replica group in its placement-group bundle and
        # waits (``ray.get``, no timeout) until the replacement actor starts. A bundle
        # whose node was removed or is draining is placed again only when a node with
        # room joins, and until then the controller's loop is blocked: a second replica
        # that dies meanwhile is not replaced on its own, live node, and the job cannot
        # even end when the survivors finish. Here such a group waits outside the loop.

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

    EnvController.__name__ = EnvController.__qualname__ = "TrainController"
    return EnvController


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


# Called through the controller's actor handle: by the driver (fit, and the abort on
# Ctrl-C) and by the workers (ray.train's checkpoint listing). Any other public
# method of Ray's TrainController runs only inside its own process.
FORWARDED = ("run", "abort", "get_result", "get_training_failed_error", "get_all_reported_checkpoints")
# Ray Train's SynchronizationActor (the workers' barrier in ray.train.report and
# ray.train.collective; the controller resets it when it replaces a replica group): its
# methods in 2.56 to 2.60. set_required_ranks, get_required_ranks and
# get_last_released_seq are 2.60's (preemption); an older controller never calls them.
SYNC_METHODS = ("broadcast_from_rank_zero", "reset", "set_required_ranks", "get_counter",
                "get_world_size", "get_reduced_data", "get_required_ranks", "get_last_released_seq")
SYNC_GROUP = "sync"


class ControllerHost:
    """The Ray actor that becomes the job's Ray Train controller, started before the
    controller's arguments exist, and that also serves each worker group's
    synchronization barrier.

    - A controller is a fresh Python process that imports Ray Train before it can start
      a worker group, and while it does, nothing else of the job can run. The driver
      starts this actor as soon as it is connected to a running cluster, so that the
      process boots and imports Ray Train's controller while the driver still scans the
      data and dry-runs the task; :meth:`start` then builds :class:`EnvController`
      inside it, and the methods of :data:`FORWARDED` reach it as they would reach Ray's
      own controller actor (``ray.get_runtime_context().current_actor`` inside the
      controller is this actor's handle, which Ray Train gives the workers).
    - Ray Train starts one ``SynchronizationActor`` process per worker group, at every
      start and restart, beside the workers' own start. Here each worker group's
      ``SynchronizationActor`` object lives in this process instead, a fresh one per
      group as Ray Train would have, its methods (:data:`SYNC_METHODS`) served in their
      own concurrency group (an event loop of their own): a barrier never waits for the
      controller's loop, and the controller may call them on its own handle
      (``ray.get(sync_actor.reset.remote())``) without a deadlock.

    ``env``: the driver's ``RAY_TRAIN_*`` settings, set here before Ray Train is
    imported (Ray Train would send them as a runtime environment: see the module
    docstring).

    What it costs: a job that fails its input checks has started (and then kills) one
    process on a running cluster (a local Ray is not started for it earlier than
    before); the workers' barriers share a process with the controller; and this
    replaces private parts of Ray Train (override ``controller_host`` of
    ``compat.versions``)."""

    def __init__(self, env: dict):
        os.environ.update(env)
        self._controller = None
        self._sync = None
        self._sync_loop = None
        _controller_class()  # Ray Train's controller modules: the import this actor is for
        _serve_sync_actors_in(self)

    def start(self, controller_env: dict, controller_init_kwargs: dict) -> None:
        """Build the controller (Ray's ``TrainController.__init__``: its callbacks'
        ``after_controller_start`` run here)."""
        self._controller = _controller_class()(controller_env, **controller_init_kwargs)

    async def run(self):
        return await self._controller.run()

    async def abort(self):
        return await self._controller.abort()

    def get_result(self):
        return self._controller.get_result()

    def get_training_failed_error(self):
        return self._controller.get_training_failed_error()

    async def get_all_reported_checkpoints(self, *args, **kwargs):
        return await self._controller.get_all_reported_checkpoints(*args, **kwargs)

    async def request_stop(self, note) -> int:
        """The driver's stop (its SIGTERM): ``note()`` (``notice.request_stop``) runs in
        this process, where the controller's callbacks then end the run at the next
        failure decision instead of restarting (``controller.events.StopRequested``), and
        in every worker of the running group, which commit a checkpoint at the next step
        boundary (``elastic_ddp.notice``). Returns the number of workers told (0 between
        groups: ``ControllerEvents`` tells the next group when it starts)."""
        from elastic_ddp.compat.ray_train import tell_workers

        note()
        group = self._controller.get_worker_group() if self._controller is not None else None
        return tell_workers(group, note)

    def _drop_sync(self) -> None:
        """The worker group is gone: wake whatever waits at its barrier (dead ranks'
        calls), as killing its actor would have ended them."""
        import asyncio

        old, self._sync = self._sync, None
        if old is not None and self._sync_loop is not None:
            asyncio.run_coroutine_threadsafe(old.reset(), self._sync_loop)

    async def _call_sync(self, name: str, *args, **kwargs):
        import asyncio
        import inspect

        self._sync_loop = asyncio.get_running_loop()
        out = getattr(self._sync, name)(*args, **kwargs)
        return await out if inspect.isawaitable(out) else out


def _sync_forwarder(name: str):
    import ray

    async def forward(self, *args, **kwargs):
        return await self._call_sync(name, *args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    return ray.method(concurrency_group=SYNC_GROUP)(forward)


for _name in SYNC_METHODS:
    setattr(ControllerHost, _name, _sync_forwarder(_name))
del _name


class _HostedSyncActor:
    """Stands for ``SynchronizationActor`` in Ray Train's worker group module, inside a
    :class:`ControllerHost`: ``.options(...).remote(**kwargs)`` makes the group's barrier
    object here and returns this actor's own handle."""

    def __init__(self, host, cls):
        self._host, self._cls = host, cls

    def options(self, **_options):  # the driver's node: where this actor runs already
        return self

    def remote(self, **kwargs):
        import ray

        self._host._sync = self._cls(**kwargs)
        return ray.get_runtime_context().current_actor


def _serve_sync_actors_in(host) -> None:
    import ray
    from ray.train.v2._internal.execution.worker_group import state, worker_group

    actor_class = worker_group.SynchronizationActor  # @ray.remote: the class itself is inside
    worker_group.SynchronizationActor = _HostedSyncActor(host, actor_class.__ray_actor_class__)
    kill = state._shutdown_sync_actor
    own = ray.get_runtime_context().get_actor_id()

    def shutdown(sync_actor) -> None:
        if sync_actor._actor_id.hex() == own:
            host._drop_sync()
        else:
            kill(sync_actor)

    state._shutdown_sync_actor = shutdown


def start_controller_host():
    """A :class:`ControllerHost` actor on this driver's node (no CPU reserved, as Ray Train
    places its controller), booting from now on; pass it to :func:`run_controller`
    through ``trainer.controller_host``. Needs a connected Ray."""
    import ray
    from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR

    env = {k: v for k, v in os.environ.items() if k.startswith("RAY_TRAIN_")}
    # Ray Train's own default for its controller (the controller blocks in ray.get by
    # design); read when Ray's worker starts, so it is set at creation, not in start().
    env.setdefault(RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR, "0")
    return ray.remote(concurrency_groups={SYNC_GROUP: 1000})(ControllerHost).options(
        num_cpus=0, label_selector={ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()},
    ).remote(env)


def run_controller(controller_init_kwargs: dict, host=None):
    """Ray Train's ``DataParallelTrainer._initialize_and_run_controller`` (2.56 to 2.60) with
    :class:`EnvController` in a :class:`ControllerHost` (``host``, started earlier by
    :func:`start_controller_host`, or started here): the controller on the driver's
    node, the result returned (or the run's error raised) as Ray Train does; Ctrl-C
    aborts it (:func:`_abort`) and is raised as ``KeyboardInterrupt``."""
    import ray
    from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
    from ray.train.v2._internal.constants import (DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
                                                  get_env_vars_to_propagate)

    env_vars = get_env_vars_to_propagate()
    env_vars.setdefault(RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,
                        DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE)
    controller = host if host is not None else start_controller_host()
    try:
        # All of the driver's RAY_TRAIN_* settings as they are now (build_trainer sets
        # some after the host started): the controller-only ones for the controller, the
        # rest for it to propagate to its workers as Ray Train does.
        ray.get(controller.start.remote(env_vars, controller_init_kwargs))
        try:
            ray.get(controller.run.remote())
        except KeyboardInterrupt:
            _abort(controller)
            raise
        return ray.get(controller.get_result.remote())
    finally:
        if host is None:
            ray.kill(controller)


def _abort(controller, timeout_s: float = 30.0) -> None:
    """Ctrl-C: Ray Train's graceful abort (its callbacks' abort hooks, the worker group
    aborted, the run's state ABORTED; the controller then exits), as Ray's own SIGINT
    handler does. That handler is not installed: it turns the first Ctrl-C into
    ``sys.exit(0)`` inside ``fit``, which the process ended with status 1 and no word,
    where the CLI's ``KeyboardInterrupt`` path closes the MLflow run as KILLED, says so
    and exits 130. A second Ctrl-C during the abort interrupts the wait."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    try:
        ray.get(controller.abort.remote(), timeout=timeout_s)
    except (RayActorError, GetTimeoutError):
        pass  # abort ends with the controller's exit_actor()


def trainer_class(torch_trainer, plan):
    """``torch_trainer`` (Ray's ``TorchTrainer``) with the overrides ``plan`` (a
    ``compat.versions.RayPlan``) applies; with neither, ``torch_trainer`` itself.

    ``controller_host``: run by :func:`run_controller` (its ``controller_host``
    attribute: a :class:`ControllerHost` started ahead of ``fit``, or None).
    ``default_callbacks``: without two of Ray Train's default callbacks, each of which
    starts one more Python process:

    - the datasets callback, when no dataset is passed: a ``DatasetManager`` actor (it
      also imports Ray Data) at every worker-group start and restart, managing nothing
      here. Each rank reads through its own pipeline (``elastic_ddp.data.ingest``) and
      sets its own ``DataContext``, so the driver's, which the callback would copy to the
      workers, is not needed there;
    - the placement-group cleaner: a detached ``PlacementGroupCleaner`` actor that the
      controller waits for (``ray.get`` of its registration) after the first worker
      group starts. It removes the group's placement group if the controller dies
      without cleaning up while the driver lives on. The driver does that instead
      (:func:`remove_leftover_placement_groups`, after a ``fit`` that raised), from the
      groups ``controller_events`` records: kept where that override is skipped."""
    host, trim = plan.applies("controller_host"), plan.applies("default_callbacks")
    if not (host or trim):
        return torch_trainer
    body = {}
    if trim:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

        cleaner = (PlacementGroupCleanerCallback,) if driver_removes_placement_groups(plan) else ()

        def _create_default_callbacks(self):
            drop = cleaner + (() if self.datasets else (DatasetsCallback,))
            return [c for c in torch_trainer._create_default_callbacks(self) if not isinstance(c, drop)]

        body["_create_default_callbacks"] = _create_default_callbacks
    if host:
        def _initialize_and_run_controller(self, **controller_init_kwargs):
            return run_controller(controller_init_kwargs, self.controller_host)

        body.update(controller_host=None, _initialize_and_run_controller=_initialize_and_run_controller)
    return type("Trainer", (torch_trainer,), body)


def driver_removes_placement_groups(plan) -> bool:
    """Whether the driver, not Ray Train's ``PlacementGroupCleaner``, removes a dead
    controller's placement groups under ``plan``: it finds them in the marks of
    ``controller.events.ControllerEvents``."""
    return plan.applies("default_callbacks") and plan.applies("controller_events")


def remove_leftover_placement_groups(timeline: list) -> list[str]:
    """Remove the placement groups of this job's worker groups (``placement_group`` in the
    controller's ``worker_group_started`` marks, ``controller.events.ControllerEvents``) that are
    still reserved. Ray Train's controller removes them itself when it stops; one that
    died (its process killed) leaves its group reserved, and with it the CPUs the next
    job of this driver (a sweep's next trial) needs, until the driver exits.

    Returns: the ids (hex) removed."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    removed = []
    table = placement_group_table()
    for mark in timeline:
        h = mark.get("placement_group")
        if h and table.get(h, {}).get("state", "REMOVED") != "REMOVED":
            remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(h))))
            removed.append(h)
    return removed
