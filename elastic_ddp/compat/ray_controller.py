"""Ray Train's controller with its settings handed over as an argument: neither the
controller nor the workers start with a runtime environment.

Ray Train passes its ``RAY_TRAIN_*`` settings from the driver to the controller and on to
every worker as a runtime environment's ``env_vars``, and a process with a runtime
environment starts through Ray's ``setup_worker.py``, which imports Ray once more before
it execs the worker. :func:`controller_class`'s ``EnvController`` takes them as an
argument instead (set in its own process before Ray's ``__init__`` reads them), starts
the workers without the controller-only ones (an empty propagation: no runtime
environment), and runs Ray 2.60's preemption watcher in its own process
(``compat.ray_train.host_preemption_watcher``). It is built inside the controller host
(``compat.ray_controller_host``).

What it costs: it subclasses Ray Train's private ``TrainController`` and patches its
worker group module's ``get_env_vars_to_propagate`` (override ``controller_host`` of
``compat.versions``; on a Ray it was not tested on, Ray's own controller runs).
"""

from __future__ import annotations

import functools
import os

# Read only by the Ray Train controller (its health checks and worker-group starts, in its
# own process), never by a worker; set by driver.trainer_spec.apply_env or by the user.
CONTROLLER_ENV_VARS = frozenset({
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S",
    "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER",
    "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S",
    "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC",
})


def _without_controller_vars(env: dict) -> dict:
    return {k: v for k, v in env.items() if k not in CONTROLLER_ENV_VARS}


@functools.lru_cache(maxsize=None)
def controller_class():
    """The ``EnvController`` class (built once per process: Ray Train's controller modules
    are imported here)."""
    from ray.train.v2._internal.execution.controller import TrainController

    from elastic_ddp.compat.ray_capacity import CapacityWait

    class EnvController(CapacityWait, TrainController):
        """Ray Train's controller with its ``RAY_TRAIN_*`` settings handed over as an
        argument (set in this process before Ray's ``__init__`` reads them) instead of a
        runtime environment, its workers started without those settings, which they
        never read (an empty propagation means no runtime environment for them), and
        Ray's preemption watcher run in this process instead of an actor per worker
        group (``compat.ray_train.host_preemption_watcher``); in per_step mode, a replica
        group without capacity waits outside its loop (``compat.ray_capacity``)."""

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
            self._init_capacity_wait(ray_plan().applies("replica_group_capacity"))

    EnvController.__name__ = EnvController.__qualname__ = "TrainController"
    return EnvController
