"""The run's length and its learning-rate schedule at one world size (``run_length``,
``lr_at``): in samples, so the LR at a given sample count does not depend on the world
size or on the restarts before it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastic_ddp.batching.plan import BatchPlan, plan_for_world_size, shard_count, steps_in_epoch


@dataclass(frozen=True)
class RunLength:
    """How long the run is and how big its steps are, at one world size: the one place
    these numbers come from.

    Attributes:
        global_batch_size: samples per optimizer step at this world size (the config's,
            or under ``scale_lr`` per-rank rows x world size).
        steps_per_epoch: ceil(N / global_batch_size).
        total_steps: optimizer steps of the run (``train.max_steps`` applied).
        schedule_samples: samples over which warm-up + cosine run: N x epochs, or
            ``max_steps x batch.global_batch_size`` when that is smaller. In samples, and
            from the config's global batch, so the LR at a given sample count does not
            depend on the world size.
        warmup_samples: ``optim.warmup_steps x batch.global_batch_size``.
        peak_lr: ``optim.lr`` x the plan's LR multiplier (1 unless ``scale_lr``).
    """

    global_batch_size: int
    steps_per_epoch: int
    total_steps: int
    schedule_samples: int
    warmup_samples: int
    peak_lr: float


def run_length(cfg, num_rows: int, world_size: int) -> tuple[BatchPlan, RunLength]:
    """The batch plan and run length of ``cfg`` (an ``elastic_ddp.config.Config``) on a
    training split of ``num_rows`` rows at ``world_size``.

    Raises:
        BatchConfigError: the batch settings cannot carry this world size.
    """
    b = cfg.batch
    plan = plan_for_world_size(b.global_batch_size, b.micro_batch_size, world_size, b.policy,
                               cfg.scaling.min_workers, b.lr_scaling, cfg.partitions,
                               shard_count(cfg.scaling.max_workers, b.policy))
    g = plan.global_batch_size
    steps_per_epoch = steps_in_epoch(num_rows, g)
    total_steps = steps_per_epoch * cfg.train.epochs
    schedule = num_rows * cfg.train.epochs
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)
        # The cosine reaches its floor at the run's real end, also when max_steps cuts it.
        schedule = min(schedule, cfg.train.max_steps * b.global_batch_size)
    return plan, RunLength(g, steps_per_epoch, total_steps, schedule,
                           cfg.optim.warmup_steps * b.global_batch_size,
                           cfg.optim.lr * plan.lr_multiplier)


def lr_at(
    samples_seen: int,
    total_samples: int,
    peak_lr: float,
    warmup_samples: int = 0,
    min_lr_ratio: float = 0.1,
) -> float:
    """LR for the step that starts after ``samples_seen`` samples of the run: linear
    warm-up over ``warmup_samples``, then cosine decay to ``min_lr_ratio * peak_lr`` at
    ``total_samples`` (Loshchilov & Hutter 2017, SGDR, eq. 5; warm-up: Goyal et al. 2017).

    Measured in samples, not steps, so it is a pure function of the checkpointed sample
    counter: the LR at step k is the same whatever restarts or resizes came before.
    """
    if warmup_samples > 0 and samples_seen < warmup_samples:
        return peak_lr * (samples_seen + 1) / warmup_samples
    span = max(1, total_samples - warmup_samples)
    progress = min(1.0, max(0.0, (samples_seen - warmup_samples) / span))
    floor = min_lr_ratio * peak_lr
    return floor + 0.5 * (peak_lr - floor) * (1.0 + math.cos(math.pi * progress))
