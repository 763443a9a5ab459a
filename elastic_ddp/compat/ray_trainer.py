"""What elastic-ddp changes in Ray Train's ``TorchTrainer``, and why: fewer Python processes
between the command and the first step, and after every restart.

    trainer = trainer_class(TorchTrainer, ray_plan())(train_func, ...)

Every Ray actor is a fresh Python process that imports Ray; on the nodes where the
workers start, each one takes CPU time from the workers' own start (imports, process
group, model). Ray Train starts, per job, a controller and a placement-group cleaner, and
per worker group, the workers, a synchronization actor, a dataset manager and (from 2.60)
a preemption watcher. Here:

- no synchronization actor: the controller's process (``compat.ray_controller_host``)
  serves each worker group's barrier, and on a running cluster it boots before ``fit``;
- no preemption watcher actor: the watcher runs in the controller's process
  (``compat.ray_train.host_preemption_watcher``), and only where a notice becomes a
  checkpoint (``driver.trainer_spec``, ``worker.notice``);
- no dataset manager when no dataset is passed, and no placement-group cleaner
  (:func:`trainer_class`; the driver removes a dead controller's placement groups:
  ``compat.ray_placement_groups``);
- no runtime environment for the controller and the workers when the user sets none
  (``compat.ray_controller``). Ray Train passes its ``RAY_TRAIN_*`` settings from the
  driver to the controller and on to every worker as a runtime environment's
  ``env_vars``, and a process with a runtime environment starts through Ray's
  ``setup_worker.py``, which imports Ray once more before it execs the worker.

In per_step mode a replica group without capacity waits outside the controller's loop
(``compat.ray_capacity``).

What it costs: these override private parts of Ray Train. ``compat.versions`` lists the
Ray releases each was tested on (overrides ``controller_host``, ``default_callbacks`` and
``replica_group_capacity``); on any other, :func:`trainer_class` leaves that part as Ray
ships it.
"""

from __future__ import annotations


def trainer_class(torch_trainer, plan):
    """``torch_trainer`` (Ray's ``TorchTrainer``) with the overrides ``plan`` (a
    ``compat.versions.RayPlan``) applies; with neither, ``torch_trainer`` itself.

    ``controller_host``: run by ``compat.ray_controller_host.run_controller`` (its
    ``controller_host`` attribute: a ``ControllerHost`` started ahead of ``fit``, or None).
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
      (``compat.ray_placement_groups``, after a ``fit`` that raised), from the
      groups ``controller_events`` records: kept where that override is skipped."""
    host, trim = plan.applies("controller_host"), plan.applies("default_callbacks")
    if not (host or trim):
        return torch_trainer
    body = {}
    if trim:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

        from elastic_ddp.compat.ray_placement_groups import driver_removes_placement_groups

        cleaner = (PlacementGroupCleanerCallback,) if driver_removes_placement_groups(plan) else ()

        def _create_default_callbacks(self):
            drop = cleaner + (() if self.datasets else (DatasetsCallback,))
            return [c for c in torch_trainer._create_default_callbacks(self) if not isinstance(c, drop)]

        body["_create_default_callbacks"] = _create_default_callbacks
    if host:
        from elastic_ddp.compat.ray_controller_host import run_controller

        def _initialize_and_run_controller(self, **controller_init_kwargs):
            return run_controller(controller_init_kwargs, self.controller_host)

        body.update(controller_host=None, _initialize_and_run_controller=_initialize_and_run_controller)
    return type("Trainer", (torch_trainer,), body)
