"""The batch settings' checks over a worker range: which world sizes can carry them,
and the one-line refusal with the nearest fixes (``check_batch_config``, by the config's
validation; ``valid_world_sizes``, by ``elastic-ddp plan``)."""

from __future__ import annotations

import math
from typing import Literal

from elastic_ddp.batching.plan import (BatchConfigError, BatchPlan, Policy, default_partitions,
                                       plan_for_world_size, shard_count)


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
