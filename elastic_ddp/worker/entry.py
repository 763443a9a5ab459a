"""The Ray Train entry point, run on every rank at every (re)start of the worker group.

    TorchTrainer(train_func, train_loop_config={"job": cloudpickle.dumps(JobSpec(...))}, ...)  # launcher.py
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elastic_ddp.run_state import JobSpec


def load_job(loop_config: dict) -> JobSpec:
    """The :class:`~elastic_ddp.run_state.JobSpec` the driver shipped
    (``driver.launcher.build_trainer``: cloudpickle bytes under ``"job"``, opaque to the
    Ray Train controller), with the driver's validated ``Config`` in ``job.config``.

    Raises:
        TypeError: ``job.config`` is not a ``Config`` (a driver that sent a plain dict).
    """
    from ray import cloudpickle

    from elastic_ddp.config import Config

    job = cloudpickle.loads(loop_config["job"])
    if not isinstance(job.config, Config):
        raise TypeError(f"JobSpec.config is a {type(job.config).__name__}; the driver hands the "
                        "workers its validated elastic_ddp.config.Config")
    return job


def start_marks() -> dict:
    """This worker process's marks before the train function (seconds since the epoch):
    ``proc_start`` (the process was created: a fresh Ray worker process, or one the worker
    pool had started earlier) and the process-group set-up's
    (``compat.ray_backend.PG_MARKS``; absent under Ray's own ``TorchConfig``)."""
    marks: dict = {}
    try:
        import psutil  # a Ray dependency

        marks["proc_start"] = psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - bookkeeping only
        pass
    try:
        from elastic_ddp.compat.ray_backend import PG_MARKS

        marks.update(PG_MARKS)
    except Exception:  # noqa: BLE001 - bookkeeping only
        pass
    return marks


def train_func(loop_config: dict) -> None:
    """Build this rank's :class:`~elastic_ddp.worker.trainer.Trainer`, restore the newest
    checkpoint Ray Train hands over, train to the end."""
    t_enter = time.time()
    import ray.train
    import torch

    from elastic_ddp.compat.ray_backend import rank_device
    from elastic_ddp.notice import Preempted
    from elastic_ddp.positions import located
    from elastic_ddp.tracking.node_metrics import start_node_sampler
    from elastic_ddp.worker.trainer import Trainer

    marks = start_marks()
    marks["imported"] = time.time()
    job = load_job(loop_config)
    marks["job_loaded"] = time.time()
    ctx = ray.train.get_context()
    scaling = job.config.scaling
    torch.set_num_threads(scaling.torch_threads or max(1, int(scaling.cpus_per_worker)))
    trainer = None
    # This node's system metrics, sent by one of its workers (tracking.node_metrics).
    sampler = start_node_sampler(job.tracker, job.config.run.name)
    try:
        trainer = Trainer(job, ctx.get_world_rank(), ctx.get_world_size(), rank_device())
        marks["built"] = time.time()
        trainer.restore(ray.train.get_checkpoint())
        marks["restored"] = time.time()
        trainer.fit(t_enter, marks)
        trainer.finish()
    except Preempted:
        # Not an error: the checkpoint at a notice is committed, or (per-step mode) the
        # replica left its quorum (elastic_ddp.notice).
        if trainer is not None:
            trainer.position.close()
        raise
    except Exception as e:
        # Every error leaves this rank with where it happened (step, epoch, phase) and
        # whether a restart can fix it, for the controller (elastic_ddp.controller.events).
        where = trainer.position.record if trainer is not None else None
        if trainer is not None:
            trainer.position.close()  # the error itself carries the position now
        raise located(e, ctx.get_world_rank(), where) from e
    finally:
        if sampler is not None:
            sampler.stop()
