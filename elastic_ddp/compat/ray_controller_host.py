"""The controller host: the Ray actor that becomes the job's Ray Train controller and
serves each worker group's synchronization barrier.

    host = start_controller_host()            # as soon as the driver is connected
    run_controller(controller_init_kwargs, host)   # in TorchTrainer.fit (compat.ray_trainer)

Every Ray actor is a fresh Python process that imports Ray. Ray Train starts its
controller only in ``fit``, and a ``SynchronizationActor`` process per worker group, at
every start and restart. Here one process, started before the input checks on a running
cluster, builds the controller (``compat.ray_controller``) and holds each group's
barrier object.

What it costs: it replaces private parts of Ray Train (its worker group module's
``SynchronizationActor`` and ``_shutdown_sync_actor``, ``DataParallelTrainer.
_initialize_and_run_controller``): override ``controller_host`` of ``compat.versions``;
on a Ray it was not tested on, Ray Train starts its own controller and barrier actors.
"""

from __future__ import annotations

import os

from elastic_ddp.compat.ray_controller import controller_class

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
        controller_class()  # Ray Train's controller modules: the import this actor is for
        _serve_sync_actors_in(self)

    def start(self, controller_env: dict, controller_init_kwargs: dict) -> None:
        """Build the controller (Ray's ``TrainController.__init__``: its callbacks'
        ``after_controller_start`` run here)."""
        self._controller = controller_class()(controller_env, **controller_init_kwargs)

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
