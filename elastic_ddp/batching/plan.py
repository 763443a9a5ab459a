"""The batch plan of one world size: the global batch as per-rank rows x
``grad_accum_steps`` micro-batches, the job's shards and partitions, the rows of a
step (the package docstring: ``elastic_ddp.batching``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

from elastic_ddp.errors import EXIT_BAD_INPUT, ElasticDDPError

Policy = Literal["fixed_global", "uneven", "scale_lr"]


class BatchConfigError(ElasticDDPError, ValueError):
    """The batch settings cannot run at some allowed world size; names the field and fix."""

    exit_code = EXIT_BAD_INPUT
    kind = "config error"


@dataclass(frozen=True)
class BatchPlan:
    """How one world size carries the global batch.

    Attributes:
        world_size: number of ranks.
        global_batch_size: samples per optimizer step at this world size.
        rows_per_rank: samples each rank computes per full step (length world_size).
        grad_accum_steps: micro-steps per optimizer step (same on every rank).
        micro_batch_size: the configured per-rank micro-batch limit.
        lr_multiplier: factor on the configured peak LR (1.0 unless policy=scale_lr).
        even: True when every rank holds the same number of rows.
        shards: the job's shard count (:func:`shard_count`): at world size 1 with 2
            shards, ``grad_accum_steps`` counts the micro-batches of both.
    """

    world_size: int
    global_batch_size: int
    rows_per_rank: tuple[int, ...]
    grad_accum_steps: int
    micro_batch_size: int
    lr_multiplier: float
    even: bool
    shards: int = 1


def split_evenly(n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous chunks of ``n`` items differing by at most one
    (the first ``n % parts`` chunks are one larger), as ``numpy.array_split`` does."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def shard_count(max_workers: int, policy: Policy = "fixed_global") -> int:
    """The job's shards (module docstring, "Shards"): 2 when it may run at world size 2
    and keeps its global batch there (``max_workers >= 2``, policy not ``scale_lr``), else
    1. Only world size 1 computes more than one shard: a rank of world size 2 or more
    computes its own rows, as without shards.

    What 2 shards cost at world size 1: ``2 x ceil(G / 2 / micro_batch_size)``
    micro-batches instead of ``ceil(G / micro_batch_size)`` (two of ``G / 2`` rows where
    ``G`` would fit one), and, when a shard takes more than one micro-batch, one
    gradient-sized buffer and one addition per step."""
    return 2 if max_workers >= 2 and policy != "scale_lr" else 1


def plan_for_world_size(
    global_batch_size: int,
    micro_batch_size: int,
    world_size: int,
    policy: Policy = "fixed_global",
    min_workers: int = 1,
    lr_scaling: Literal["linear", "sqrt"] = "linear",
    partitions: int = 1,
    shards: int = 1,
) -> BatchPlan:
    """The batch plan at ``world_size``.

    fixed_global / uneven: G stays ``global_batch_size``; rows are split over ranks
    (differing by at most one under ``uneven``). scale_lr: each rank keeps the rows it had
    at ``min_workers``; G and the LR grow with the world size by the linear scaling rule
    (Goyal et al. 2017, "Accurate, Large Minibatch SGD", sec. 2.1) or its square-root
    variant (Krizhevsky 2014, "One weird trick"). With ``partitions`` > 1 the rows of a
    rank come from its partitions (``data.order``); ``rows_per_rank`` is then the even
    split, a guide for memory, and each step's exact split comes from the order.
    ``shards`` (:func:`shard_count`): at world size 1, the micro-batches of each shard.

    Raises:
        BatchConfigError: the policy cannot carry this world size.
    """
    if world_size < 1:
        raise BatchConfigError(f"world_size must be >= 1, got {world_size}")
    mult = 1.0
    if policy == "scale_lr":
        per_rank = global_batch_size // min_workers
        rows = [per_rank] * world_size
        ratio = world_size / min_workers
        mult = ratio if lr_scaling == "linear" else math.sqrt(ratio)
    else:
        if policy == "fixed_global" and partitions == 1 and global_batch_size % world_size:
            raise BatchConfigError(
                f"batch.global_batch_size={global_batch_size} does not divide over "
                f"world_size={world_size} (policy fixed_global)"
            )
        rows = split_evenly(global_batch_size, world_size)
    if min(rows) < 1:
        raise BatchConfigError(
            f"batch.global_batch_size={global_batch_size} leaves a rank with no rows at "
            f"world_size={world_size}; raise the global batch or lower scaling.max_workers"
        )
    if world_size == 1 and shards > 1:
        accum = shards * grad_accum_steps(split_evenly(rows[0], shards), micro_batch_size)
    else:
        accum = grad_accum_steps(rows, micro_batch_size)
    return BatchPlan(
        world_size=world_size,
        global_batch_size=sum(rows),
        rows_per_rank=tuple(rows),
        grad_accum_steps=accum,
        micro_batch_size=micro_batch_size,
        lr_multiplier=mult,
        even=len(set(rows)) == 1,
        shards=shards,
    )


def default_partitions(max_workers: int) -> int:
    """``data.partitions`` when unset: 60, or the smallest multiple of 60 that is at least
    ``max_workers``. Independent of the world size and of ``min_workers``, so resubmitting
    a job with another worker range keeps its sample order (and its checkpoint valid).
    60 divides over 1, 2, 3, 4, 5, 6, 10, 12, 15, 20 and 30 ranks; a step mixes rows of
    60 regions of the shuffled data."""
    return 60 * math.ceil(max_workers / 60)


# A canonical partition should span at least this many row groups: partition boundaries
# cut row groups, and a cut row group is read by the ranks owning both sides (adjacent
# partitions belong to different ranks), so the extra reads per epoch are about
# partitions / row groups of the data set: at most 1/10 (a rank reads <= 1.1 x its share).
ROW_GROUPS_PER_PARTITION = 10


def fit_partitions(partitions: int, max_workers: int, row_groups: int, rows: int,
                   window_rows: Optional[int] = None, unit_rows: float = 0.0) -> int:
    """The canonical partition count when ``data.partitions`` is unset: the largest
    divisor of the default ``partitions`` (:func:`default_partitions`) that is still
    divisible by every world size up to ``max(max_workers, 4)`` that divides the default,
    at least ``max_workers``, and that fits the data set:

    * at most ``row_groups / ROW_GROUPS_PER_PARTITION`` (cut row groups are read twice);
    * with ``window_rows`` (``data.shuffle_window_rows``, W) and ``unit_rows`` (mean rows
      of the shuffled units: row groups, or ``data.block_rows`` blocks), at most
      ``W / unit_rows``: a partition's window is at least one unit, so a round (one window
      per owned partition, what a rank reads before its first step after a restart)
      holds ``max(W / P, unit_rows) x P / N`` rows; beyond ``W / unit_rows`` partitions it
      grows with P instead of staying at the configured ``W / N``.

    The smallest such divisor if none fits. So the world sizes that keep a balanced order
    are the default's, reads per rank stay near the rank's share, a restart's first read
    does not grow with the partition count, and jobs of up to 4 workers (a sweep's
    children) share one order on the same data. Never more than ``rows``."""
    worlds = [ws for ws in range(1, max(max_workers, 4) + 1) if partitions % ws == 0]
    unit = math.lcm(*worlds)
    cands = [d for d in range(1, partitions + 1)
             if partitions % d == 0 and d % unit == 0 and max_workers <= d <= rows]
    if not cands:
        return min(partitions, rows)
    fit = [d for d in cands if d * ROW_GROUPS_PER_PARTITION <= row_groups
           and (not window_rows or not unit_rows or d * unit_rows <= window_rows)]
    return max(fit) if fit else min(cands)


def steps_in_epoch(num_rows: int, global_batch_size: int) -> int:
    """Optimizer steps per epoch: ceil(N / G). The last step carries the N mod G
    remainder (a smaller batch) instead of dropping it."""
    return math.ceil(num_rows / global_batch_size)


def step_rows(num_rows: int, cursor: int, global_batch_size: int) -> int:
    """Rows in the step that starts at ``cursor`` of an N-row epoch: G or the remainder."""
    return min(global_batch_size, num_rows - cursor)


def grad_accum_steps(rows_per_rank: Sequence[int], micro_batch_size: int) -> int:
    """Micro-steps of one optimizer step: ceil(largest rank's rows / micro_batch_size),
    the same on every rank (every rank runs as many forward/backward passes and
    all-reduces), at least 1."""
    return max(1, math.ceil(max(rows_per_rank) / micro_batch_size))


def micro_slices(rows: int, accum: int) -> list[tuple[int, int]]:
    """A rank's ``rows`` cut into ``accum`` contiguous micro-batches ``[start, stop)``
    differing by at most one row (some may be empty when rows < accum)."""
    out, start = [], 0
    for n in split_evenly(rows, accum):
        out.append((start, start + n))
        start += n
    return out
