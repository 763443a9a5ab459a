"""What elastic-ddp changes in Ray Train's ``TorchTrainer``, and why: fewer Python processes
between the command and the first step, and after every restart.

    trainer = trainer_class(TorchTrainer)(train_func, ...)

Every Ray actor is a fresh Python process that imports Ray; on the nodes where the
workers start, each one takes CPU time from the workers' own start (imports, process
group, model). Ray Train 2.60 starts, per job, a controller, a placement-group cleaner and
a preemption watcher, and per worker group, the workers, a synchronization actor and a
dataset manager. Here:

- no dataset manager when no dataset is passed, and no placement-group cleaner
  (:func:`trainer_class`); the preemption watcher is off (``launcher.build_trainer``);
- no runtime environment for the controller and the workers when the user sets none
  (:class:`EnvController`). Ray Train passes its ``RAY_TRAIN_*`` settings from the
  driver to the controller and on to every worker as a runtime environment's
  ``env_vars``, and a process with a runtime environment starts through Ray's
  ``setup_worker.py``, which imports Ray once more before it execs the worker.

What it costs: these override private parts of Ray Train 2.60 (pinned in
``pyproject.toml``); ``tests/test_startup_imports.py`` fails if they stop applying.
"""

from __future__ import annotations

import os
import threading

# Read only by the Ray Train controller (its health checks and worker-group starts, in its
# own process), never by a worker; set by launcher.build_trainer or by the user.
CONTROLLER_ENV_VARS = frozenset({
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S",
    "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER",
    "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC",
})


def _without_controller_vars(env: dict) -> dict:
    return {k: v for k, v in env.items() if k not in CONTROLLER_ENV_VARS}


def _controller_class():
    from ray.train.v2._internal.execution.controller import TrainController

    class EnvController(TrainController):
        """Ray Train's controller with its ``RAY_TRAIN_*`` settings handed over as an
        argument (set in this process before Ray's ``__init__`` reads them) instead of a
        runtime environment, and its workers started without those settings, which they
        never read (an empty propagation means no runtime environment for them)."""

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

    EnvController.__name__ = EnvController.__qualname__ = "TrainController"
    return EnvController


def run_controller(trainer, controller_init_kwargs: dict):
    """Ray Train 2.60's ``DataParallelTrainer._initialize_and_run_controller`` with
    :class:`EnvController`: the controller on the driver's node, Ctrl-C aborting it, the
    result returned (or the run's error raised) as Ray Train does."""
    import ray
    from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
    from ray.train.v2._internal.constants import (DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
                                                  get_env_vars_to_propagate)

    env_vars = get_env_vars_to_propagate()
    env_vars.setdefault(RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,
                        DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE)
    controller_env = {k: v for k, v in env_vars.items() if k in CONTROLLER_ENV_VARS}
    rest = _without_controller_vars(env_vars)
    options: dict = {"num_cpus": 0,
                     "label_selector": {ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()}}
    if rest:  # a user's own RAY_TRAIN_* settings travel as Ray Train sends them
        options["runtime_env"] = {"env_vars": rest}
    controller = ray.remote(**options)(_controller_class()).remote(controller_env, **controller_init_kwargs)
    # Not in the main thread (Ray Tune), registering a SIGINT handler raises.
    if threading.current_thread() is threading.main_thread():
        trainer._register_sigint_handler(controller)
    ray.get(controller.run.remote())
    return ray.get(controller.get_result.remote())


def trainer_class(torch_trainer):
    """``TorchTrainer`` run by :func:`run_controller`, without two of Ray Train's default
    callbacks, each of which starts one more Python process:

    - the datasets callback, when no dataset is passed: a ``DatasetManager`` actor (it
      also imports Ray Data) at every worker-group start and restart, managing nothing
      here. Each rank reads through its own pipeline (``elastic_ddp.data.ingest``) and
      sets its own ``DataContext``, so the driver's, which the callback would copy to the
      workers, is not needed there;
    - the placement-group cleaner: a detached ``PlacementGroupCleaner`` actor that the
      controller waits for (``ray.get`` of its registration) after the first worker
      group starts. It removes the group's placement group if the controller dies
      without cleaning up while the driver lives on. The driver does that instead
      (:func:`remove_leftover_placement_groups`, after a ``fit`` that raised)."""
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    class Trainer(torch_trainer):
        def _create_default_callbacks(self):
            drop = (PlacementGroupCleanerCallback,) + (() if self.datasets else (DatasetsCallback,))
            return [c for c in super()._create_default_callbacks() if not isinstance(c, drop)]

        def _initialize_and_run_controller(self, **controller_init_kwargs):
            return run_controller(self, controller_init_kwargs)

    return Trainer


def remove_leftover_placement_groups(timeline: list) -> list[str]:
    """Remove the placement groups of this job's worker groups (``placement_group`` in the
    controller's ``worker_group_started`` marks, ``events.ControllerEvents``) that are
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
