"""What Ray Train's ``TorchTrainer`` gets for a job, as one frozen value, and the trainer
built from it.

    spec = trainer_spec(cfg, ray_plan(), storage_root(cfg))   # pure: no Ray, no os.environ
    trainer = build_trainer(cfg, job, tracker, spec)

:func:`trainer_spec` decides everything from the config and the compat plan (the Ray
release's overrides, ``compat.versions``): the controller's ``RAY_TRAIN_*`` settings,
the worker count, resources and backend, the failure budget, the controller callbacks'
settings and whether a notice becomes a checkpoint. :func:`build_trainer` applies it:
it writes the settings into ``os.environ`` (Ray Train reads them there and hands them
to its controller) and builds the trainer.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Union

from elastic_ddp.compat.versions import RayPlan, preemption_notice_line, preemption_supported
from elastic_ddp.config import Config


def storage_root(cfg: Config) -> str:
    """``run.storage_path`` as the job uses it everywhere: a URI as it is, a local path
    made absolute (``paths.local_path``)."""
    from elastic_ddp.paths import is_uri, local_path

    p = cfg.run.storage_path
    return p if is_uri(p) else local_path(p)


@dataclasses.dataclass(frozen=True)
class TrainerSpec:
    """What the job's ``TorchTrainer`` gets (built by :func:`trainer_spec`).

    ``env``: ``RAY_TRAIN_*`` settings written into ``os.environ`` as they are;
    ``env_defaults``: written unless a person set them (a value an earlier job of this
    process wrote is replaced). ``preemption``: a notice becomes a checkpoint (restart
    mode) or a replica leaving its quorum (per-step mode), charged to the preemption
    budget (``worker.notice``); ``notice_line``: the line a job prints where this Ray
    cannot do that. ``num_workers``: an int (fixed) or ``(min, max)`` (elastic).
    ``torch_config``: ``"torchft"`` (per-step mode's replica groups), ``"process_group"``
    (``compat.ray_backend``: the controller imports no torch) or ``"torch"`` (Ray's
    ``TorchConfig``). ``events``: the keyword arguments of the controller's
    ``ElasticEvents`` besides the tracker; ``controller_events``: its
    ``ControllerEvents`` callback is added. Seconds are floats."""

    run_name: str
    storage: str
    env: tuple[tuple[str, str], ...]
    env_defaults: tuple[tuple[str, str], ...]
    preemption: bool
    notice_line: Optional[str]
    use_gpu: bool
    num_workers: Union[int, tuple[int, int]]
    cpus_per_worker: float
    gpus_per_worker: float
    backend: str
    torch_config: str
    collective_timeout_s: int
    resize_monitor_interval_s: float
    max_failures: int
    controller_failure_limit: int
    max_preemptions: int
    keep_checkpoints: int
    events: tuple[tuple[str, object], ...]
    controller_events: bool

    @property
    def resources_per_worker(self) -> dict:
        return {"CPU": self.cpus_per_worker, **({"GPU": self.gpus_per_worker} if self.use_gpu else {})}


def trainer_spec(cfg: Config, plan: RayPlan, storage: str, cluster_gpus: float = 0.0) -> TrainerSpec:
    """The :class:`TrainerSpec` of ``cfg`` on ``plan``'s Ray (``compat.versions.ray_plan``).
    ``storage``: the run's storage root (:func:`storage_root`); ``cluster_gpus``: the GPUs
    the Ray cluster has, read only for ``scaling.use_gpu: auto``. Pure: reads nothing
    else, writes nothing."""
    s = cfg.scaling
    elastic = s.min_workers < s.max_workers
    # A notice becomes a checkpoint (restart mode) or a replica leaving its quorum
    # (per_step mode). Ray Train's preemption watcher (a thread of the controller's
    # process here; Ray's own: one more actor process per worker-group start) tells
    # restart mode's workers of a node drain, polling the GCS every second; Ray Train
    # runs none for replica groups, whose replicas poll for their own node. Off where
    # notices are handled as crashes.
    preempt = preemption_supported(plan) and s.preemption_checkpoint
    env = (
        # Read by the Ray Train controller when it starts (propagated from the driver).
        ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", str(s.health_check_interval_s)),
        ("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", str(s.placement_timeout_s or (25.0 if elastic else 600.0))),
    )
    env_defaults = (
        # A frozen worker (alive, not polling) is declared dead after this (Ray's default
        # 600 s would leave a per-step job short of a replica for ten minutes).
        ("RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S", "60"),
        ("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "1" if preempt and s.fault_tolerance == "restart" else "0"),
        ("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "1"),
    )
    use_gpu = bool(s.use_gpu if s.use_gpu != "auto" else cluster_gpus > 0)
    num_workers: Union[int, tuple[int, int]] = s.min_workers if not elastic else (s.min_workers, s.max_workers)
    if s.fault_tolerance == "per_step":
        # max_workers replica groups of one worker; a quorum below it still commits, and
        # Ray replaces a dead replica alone (a different worker count would restart all).
        num_workers, torch_config = s.max_workers, "torchft"
    else:
        # Ray's TorchConfig makes the controller import torch (compat.ray_backend).
        torch_config = "process_group" if plan.applies("process_group_backend") else "torch"
    events = (("run_name", cfg.run.name), ("storage", storage),
              ("collective_timeout_s", s.collective_timeout_s), ("preemption", preempt),
              ("grow_checkpoint_timeout_s",
               s.grow_checkpoint_timeout_s if elastic and s.fault_tolerance == "restart" else None))
    return TrainerSpec(
        run_name=cfg.run.name, storage=storage, env=env, env_defaults=env_defaults,
        preemption=preempt,
        notice_line=preemption_notice_line(plan) if s.preemption_checkpoint else None,
        use_gpu=use_gpu, num_workers=num_workers, cpus_per_worker=s.cpus_per_worker,
        gpus_per_worker=s.gpus_per_worker,
        # NCCL on GPUs, gloo on CPUs; the timeout bounds how long a rank waits in a
        # collective for a dead peer before Ray Train tears the group down.
        backend="nccl" if use_gpu else "gloo", torch_config=torch_config,
        collective_timeout_s=s.collective_timeout_s,
        resize_monitor_interval_s=s.resize_monitor_interval_s,
        # Controller errors (a placement that timed out, a worker dead before its train
        # function ran: compat.ray_train.retry_worker_deaths_at_start) are retried too,
        # but not forever: Ray's default is unbounded, and a death that repeats at
        # start-up (out of memory on import) would loop.
        max_failures=s.max_failures,
        controller_failure_limit=-1 if s.max_failures == -1 else max(10, 3 * s.max_failures),
        max_preemptions=s.max_preemptions, keep_checkpoints=cfg.train.keep_checkpoints,
        events=events, controller_events=plan.applies("controller_events"))


def cluster_gpus(cfg: Config) -> float:
    """The GPUs of the connected Ray cluster where ``scaling.use_gpu`` is ``auto`` (the one
    setting that needs them), else 0 without asking Ray."""
    if cfg.scaling.use_gpu != "auto":
        return 0.0
    import ray

    return ray.cluster_resources().get("GPU", 0)


_env_written: dict[str, str] = {}


def apply_env(spec: TrainerSpec) -> None:
    """Write ``spec``'s settings into ``os.environ``, where Ray Train reads them. A
    default is kept where someone else set it: a value this process's jobs wrote is
    theirs to change (a restart-mode job after a per-step one in the same process gets
    its watcher back), one a person set is kept."""
    for name, value in spec.env:
        os.environ[name] = value
    for name, value in spec.env_defaults:
        if os.environ.get(name) in (None, _env_written.get(name)):
            os.environ[name] = _env_written[name] = value


def build_trainer(cfg: Config, job, tracker, spec: Optional[TrainerSpec] = None):
    """The ``TorchTrainer`` for ``cfg`` (not yet fitted), from ``spec`` (default:
    :func:`trainer_spec` of ``cfg`` on the installed Ray) with ``spec``'s settings
    applied (:func:`apply_env`): with the compat overrides on a Ray release they were
    tested on, else stock Ray Train for each part they skip, after one warning line
    (``compat.versions``). ``job``: the workers' ``run_state.JobSpec``, sent with its
    ``preemption`` set from ``spec`` (None: a trainer built only to be inspected)."""
    from ray import cloudpickle
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from elastic_ddp.compat.ray_trainer import trainer_class
    from elastic_ddp.compat.versions import ray_plan, warn_skipped
    from elastic_ddp.controller.events import ElasticEvents
    from elastic_ddp.controller.lifecycle import ControllerEvents
    from elastic_ddp.paths import uri_to_filesystem
    from elastic_ddp.worker.entry import train_func

    plan = ray_plan()
    warn_skipped(plan)
    if spec is None:
        spec = trainer_spec(cfg, plan, storage_root(cfg), cluster_gpus(cfg))
    apply_env(spec)
    if spec.notice_line:
        print(spec.notice_line, flush=True)
    if job is not None:
        job = dataclasses.replace(job, preemption=spec.preemption)
    if spec.torch_config == "torchft":
        # Every supported Ray has it (compat.versions.TORCHFT_RAY).
        from ray.train.v2.torch.torchft_config import TorchftConfig

        from elastic_ddp.worker.per_step import LIGHTHOUSE

        torch_config = TorchftConfig(lighthouse_kwargs=dict(LIGHTHOUSE), backend=spec.backend,
                                     timeout_s=spec.collective_timeout_s)
    elif spec.torch_config == "process_group":
        from elastic_ddp.compat.ray_backend import ProcessGroupConfig

        torch_config = ProcessGroupConfig(backend=spec.backend, timeout_s=spec.collective_timeout_s)
    else:
        from ray.train.torch import TorchConfig

        torch_config = TorchConfig(backend=spec.backend, timeout_s=spec.collective_timeout_s)
    sink = ElasticEvents(tracker, **dict(spec.events))
    callbacks = [sink, ControllerEvents(sink)] if spec.controller_events else [sink]
    # Ray Train gets the file system and the path, never a string to parse as a URI.
    storage_fs, storage_fs_path = uri_to_filesystem(spec.storage)
    # Preemptions have their own budget where Ray Train counts them (2.60).
    preemptions = ({"max_preemption_failures": spec.max_preemptions}
                   if "max_preemption_failures" in FailureConfig.__dataclass_fields__ else {})
    return trainer_class(TorchTrainer, plan)(
        train_func,
        # Pickled here: the controller unpickles train_loop_config when it starts, and the
        # job's task and data classes would make it import torch and the task's modules.
        train_loop_config={"job": cloudpickle.dumps(job)},
        torch_config=torch_config,
        scaling_config=ScalingConfig(
            num_workers=spec.num_workers, use_gpu=spec.use_gpu,
            elastic_resize_monitor_interval_s=spec.resize_monitor_interval_s,
            resources_per_worker=spec.resources_per_worker),
        run_config=RunConfig(
            name=spec.run_name, storage_path=storage_fs_path, storage_filesystem=storage_fs,
            failure_config=FailureConfig(max_failures=spec.max_failures,
                                         controller_failure_limit=spec.controller_failure_limit,
                                         **preemptions),
            checkpoint_config=CheckpointConfig(num_to_keep=spec.keep_checkpoints),
            callbacks=callbacks),
        # Each rank reads its own rows through its own Ray Data pipeline
        # (elastic_ddp.data.ingest): no dataset is split by Ray Train.
    )
