"""World-size arithmetic: global batch -> per-rank rows x grad_accum_steps (``plan``),
the settings' checks over a worker range (``checks``), the run's length and the LR
schedule (``schedule``). Pure functions, no torch.distributed, no Ray; every name is
imported from ``elastic_ddp.batching``.

    elastic-ddp plan experiments/configs/digits_cnn.yaml

The elastic contract rests on one idea: an epoch is a fixed order of the data set's rows,
drawn from ``(seed, epoch)`` alone (``elastic_ddp.data.order``), and step k of the epoch
always takes global positions ``[cursor_k, cursor_k + G)`` whatever the world size. A
rank only decides *which part* of that global batch it computes. So the committed
progress of an epoch is one integer (the cursor), a restart at any world size continues
exactly where the last checkpoint left off, and no sample is repeated or lost.

Global batch G = sum over ranks of the rank's rows; each rank cuts its rows into
``grad_accum_steps`` micro-batches of at most ``micro_batch_size`` rows. The loss of a
micro-batch is ``sum(per-sample loss) / G_step`` and the gradients are SUM-all-reduced
over the ranks, so the step's gradient is the exact mean over its G_step rows even when
ranks hold different row counts (a comm hook that averages, bf16/fp16/PowerSGD or FSDP's
reduce-scatter, gets ``world_size / G_step`` instead: ``Strategy.grad_divisor``).

**Shards.** A job that may run at world size 2 (``max_workers >= 2``, not ``scale_lr``)
has ``shards = 2``: at world size 1 a step's rows are computed as the two ranks of world
size 2 would compute them, shard by shard (each shard cut into the same micro-batches),
and the two shards' gradients are added last. A micro-batch then holds the same rows in
the same order at world size 1 and 2, and the step's gradient is ``g0 + g1`` at both
(``a + b == b + a`` exactly in floating point; an all-reduce of two ranks is one such
addition), so training is bitwise identical at world sizes 1 and 2 (docs/design.md,
"Bitwise across world sizes").
"""

from __future__ import annotations

from elastic_ddp.batching.checks import (check_batch_config, divisible_ranges, nearest_divisible,
                                         valid_world_sizes)
from elastic_ddp.batching.plan import (ROW_GROUPS_PER_PARTITION, BatchConfigError, BatchPlan, Policy,
                                       default_partitions, fit_partitions, grad_accum_steps,
                                       micro_slices, plan_for_world_size, shard_count, split_evenly,
                                       step_rows, steps_in_epoch)
from elastic_ddp.batching.schedule import RunLength, lr_at, run_length

__all__ = ["ROW_GROUPS_PER_PARTITION", "BatchConfigError", "BatchPlan", "Policy", "RunLength",
           "check_batch_config", "default_partitions", "divisible_ranges", "fit_partitions",
           "grad_accum_steps", "lr_at", "micro_slices", "nearest_divisible", "plan_for_world_size",
           "run_length", "shard_count", "split_evenly", "step_rows", "steps_in_epoch",
           "valid_world_sizes"]
