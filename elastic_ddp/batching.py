"""World-size arithmetic: global batch -> per-rank rows x grad_accum_steps, the run's
length, and the LR schedule. Pure functions, no torch.distributed, no Ray.

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


def divisible_ranges(unit: int, min_workers: int, max_workers: int) -> list[tuple[int, int]]:
    """The longest runs ``a..b`` of consecutive world sizes in [min, max] that all divide
    ``unit``, longest first (then smallest): the narrower worker ranges that keep it."""
    runs, start = [], None
    for ws in range(min_workers, max_workers + 2):
        if ws <= max_workers and unit % ws == 0:
            start = ws if start is None else start
        elif start is not None:
            runs.append((start, ws - 1))
            start = None
    return sorted(runs, key=lambda r: (r[0] - r[1], r[0]))


def nearest_divisible(unit: int, min_workers: int, max_workers: int, low: float,
                      high: float) -> list[int]:
    """The values nearest ``unit``, one below and one above, that every world size in
    [min, max] divides (multiples of their lcm), kept only within [low, high]."""
    lcm = math.lcm(*range(min_workers, max_workers + 1))
    below = unit // lcm * lcm
    return [m for m in (below, below + lcm) if m >= lcm and low <= m <= high]


def _divisibility_fixes(unit: int, what: str, min_workers: int, max_workers: int) -> str:
    """The fixes for a ``fixed_global`` ``what`` (the global batch, or ``data.partitions``)
    that some world size in [min, max] does not divide: the nearest values every world
    size divides, where they are near (a batch within a factor 2 of this one; partitions
    up to twice this count or the default); the narrower worker ranges that this value
    divides over; ``batch.policy=uneven``, which needs neither."""
    if what == "data.partitions":
        near = nearest_divisible(unit, min_workers, max_workers, max_workers,
                                 max(2 * unit, default_partitions(max_workers)))
    else:
        near = nearest_divisible(unit, min_workers, max_workers, unit / 2, 2 * unit)

    def alternatives(items: list[str]) -> str:
        return " or ".join(items) if len(items) < 3 else ", ".join(items[:-1]) + " or " + items[-1]

    fixes = []
    if near:
        fixes.append(f"set {what} to {alternatives([str(m) for m in near])} (the nearest "
                     f"value{'s' if len(near) > 1 else ''} divisible by every world size in "
                     f"{min_workers}..{max_workers})")
    runs = divisible_ranges(unit, min_workers, max_workers)[:3]
    if runs:
        fixes.append("narrow scaling.min_workers..max_workers to "
                     f"{alternatives([f'{a}..{b}' for a, b in runs])} (world sizes that divide "
                     f"{unit})")
    fixes.append("set batch.policy=uneven (ranks own unequal numbers of partitions)"
                 if what == "data.partitions" else
                 "set batch.policy=uneven (ranks differ by at most one row)")
    return ", ".join(fixes[:-1]) + (", or " if len(fixes) > 1 else "") + fixes[-1]


def check_batch_config(
    global_batch_size: int,
    micro_batch_size: int,
    min_workers: int,
    max_workers: int,
    policy: Policy,
    partitions: int = 1,
) -> None:
    """Refuse, up front, batch settings that some world size in [min, max] cannot carry.

    ``partitions`` is the epoch order's canonical partition count (1: ``data.order:
    permutation``, where ranks split each step by position). With P > 1 a rank reads its
    own partitions, so no world size may exceed P, and ``fixed_global`` (equal rows per
    rank) needs every world size to divide P instead of the global batch.

    Raises:
        BatchConfigError: names ``batch.global_batch_size``, ``data.partitions`` or
            ``scaling.*`` and the fix: the nearest values that work for the whole worker
            range when they are near, the narrower ranges that work with the value as it
            is, ``batch.policy=uneven``.
    """
    if policy == "scale_lr" and global_batch_size % min_workers:
        raise BatchConfigError(
            f"batch.global_batch_size={global_batch_size} must be divisible by "
            f"scaling.min_workers={min_workers} under policy scale_lr (it fixes the "
            f"per-rank batch at global/min_workers)"
        )
    if policy != "scale_lr" and global_batch_size < max_workers:
        raise BatchConfigError(
            f"batch.global_batch_size={global_batch_size} is smaller than "
            f"scaling.max_workers={max_workers}: some rank would get no rows; raise the "
            f"batch or lower max_workers"
        )
    if partitions > 1 and max_workers > partitions:
        fix = (_divisibility_fixes(partitions, "data.partitions", min_workers, max_workers)
               if policy == "fixed_global" else
               f"raise data.partitions to at least {max_workers} (or leave it unset: its default "
               f"here is {default_partitions(max_workers)})" + (
                   f", or lower scaling.max_workers to {partitions}"
                   if min_workers <= partitions else ""))
        raise BatchConfigError(
            f"scaling.max_workers={max_workers} exceeds data.partitions={partitions}: a rank "
            f"would own no partition of the data; {fix}"
        )
    if policy == "fixed_global":
        unit, what = (partitions, "data.partitions") if partitions > 1 else \
            (global_batch_size, "batch.global_batch_size")
        bad = [ws for ws in range(min_workers, max_workers + 1) if unit % ws]
        if bad:
            raise BatchConfigError(
                f"{what}={unit} does not divide over world "
                f"size(s) {bad} allowed by scaling.min_workers..max_workers="
                f"{min_workers}..{max_workers}; "
                f"{_divisibility_fixes(unit, what, min_workers, max_workers)}"
            )


def valid_world_sizes(
    global_batch_size: int,
    micro_batch_size: int,
    min_workers: int,
    max_workers: int,
    policy: Policy,
    lr_scaling: Literal["linear", "sqrt"] = "linear",
    partitions: int = 1,
) -> list[tuple[int, BatchPlan | None, str]]:
    """Every world size in [min, max] with its plan, or None and the reason it is refused
    (the role of DeepSpeed's elasticity calculator). With ``partitions`` > 1 a world size
    must not exceed it; one that does not divide it keeps the exact order but is
    unbalanced (refused under ``fixed_global``)."""
    out: list[tuple[int, BatchPlan | None, str]] = []
    for ws in range(min_workers, max_workers + 1):
        if partitions > 1 and (ws > partitions or (policy == "fixed_global" and partitions % ws)):
            out.append((ws, None, f"world_size={ws} does not divide data.partitions={partitions}"))
            continue
        try:
            out.append((ws, plan_for_world_size(global_batch_size, micro_batch_size, ws,
                                                policy, min_workers, lr_scaling, partitions,
                                                shard_count(max_workers, policy)), ""))
        except BatchConfigError as e:
            out.append((ws, None, str(e)))
    return out


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
