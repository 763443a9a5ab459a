"""World-size arithmetic: global batch -> per-rank rows x grad_accum_steps, the epoch's
sample order, and the LR schedule. Pure functions, no torch.distributed, no Ray.

    elastic-ddp plan experiments/configs/digits_cnn.yaml

The elastic contract rests on one idea: an epoch is a fixed permutation of the data set's
``sample_id``s, drawn from ``(seed, epoch)``, and step k of the epoch always takes the rows
``order[cursor_k : cursor_k + G]`` whatever the world size. A rank only decides *which
part* of that global batch it computes. So the committed progress of an epoch is one
integer (the cursor), a restart at any world size continues exactly where the last
checkpoint left off, and no sample is repeated or lost.

Global batch G = sum over ranks of the rank's rows; each rank cuts its rows into
``grad_accum_steps`` micro-batches of at most ``micro_batch_size`` rows. The loss of a
micro-batch is ``sum(per-sample loss) * world_size / G_step``; DDP averages gradients over
ranks (divides by world_size), so the step's gradient is the exact mean over its G_step
rows even when ranks hold different row counts (PyTorch DDP docs, "gradient averaging").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

Policy = Literal["fixed_global", "uneven", "scale_lr"]


class BatchConfigError(ValueError):
    """The batch settings cannot run at some allowed world size; names the field and fix."""


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
    """

    world_size: int
    global_batch_size: int
    rows_per_rank: tuple[int, ...]
    grad_accum_steps: int
    micro_batch_size: int
    lr_multiplier: float
    even: bool


def split_evenly(n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous chunks of ``n`` items differing by at most one
    (the first ``n % parts`` chunks are one larger), as ``numpy.array_split`` does."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def plan_for_world_size(
    global_batch_size: int,
    micro_batch_size: int,
    world_size: int,
    policy: Policy = "fixed_global",
    min_workers: int = 1,
    lr_scaling: Literal["linear", "sqrt"] = "linear",
) -> BatchPlan:
    """The batch plan at ``world_size``.

    fixed_global / uneven: G stays ``global_batch_size``; rows are split over ranks
    (differing by at most one under ``uneven``). scale_lr: each rank keeps the rows it had
    at ``min_workers``; G and the LR grow with the world size by the linear scaling rule
    (Goyal et al. 2017, "Accurate, Large Minibatch SGD", sec. 2.1) or its square-root
    variant (Krizhevsky 2014, "One weird trick").

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
        if policy == "fixed_global" and global_batch_size % world_size:
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
    accum = max(1, math.ceil(max(rows) / micro_batch_size))
    return BatchPlan(
        world_size=world_size,
        global_batch_size=sum(rows),
        rows_per_rank=tuple(rows),
        grad_accum_steps=accum,
        micro_batch_size=micro_batch_size,
        lr_multiplier=mult,
        even=len(set(rows)) == 1,
    )


def check_batch_config(
    global_batch_size: int,
    micro_batch_size: int,
    min_workers: int,
    max_workers: int,
    policy: Policy,
) -> None:
    """Refuse, up front, batch settings that some world size in [min, max] cannot carry.

    Raises:
        BatchConfigError: names ``batch.global_batch_size`` (or ``scaling.*``) and the fix.
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
    if policy == "fixed_global":
        bad = [ws for ws in range(min_workers, max_workers + 1) if global_batch_size % ws]
        if bad:
            lcm = math.lcm(*range(min_workers, max_workers + 1))
            suggestion = math.ceil(global_batch_size / lcm) * lcm
            raise BatchConfigError(
                f"batch.global_batch_size={global_batch_size} does not divide over world "
                f"size(s) {bad} allowed by scaling.min_workers..max_workers="
                f"{min_workers}..{max_workers}; use a multiple of {lcm} (e.g. {suggestion}), "
                f"narrow the worker range, or set batch.policy=uneven"
            )


def valid_world_sizes(
    global_batch_size: int,
    micro_batch_size: int,
    min_workers: int,
    max_workers: int,
    policy: Policy,
    lr_scaling: Literal["linear", "sqrt"] = "linear",
) -> list[tuple[int, BatchPlan | None, str]]:
    """Every world size in [min, max] with its plan, or None and the reason it is refused
    (the role of DeepSpeed's elasticity calculator)."""
    out: list[tuple[int, BatchPlan | None, str]] = []
    for ws in range(min_workers, max_workers + 1):
        try:
            out.append((ws, plan_for_world_size(global_batch_size, micro_batch_size, ws,
                                                policy, min_workers, lr_scaling), ""))
        except BatchConfigError as e:
            out.append((ws, None, str(e)))
    return out


def epoch_order(sample_ids: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """The epoch's global sample order: a permutation of ``sample_ids`` (shape [N], int64)
    reproducible from (seed, epoch) alone and different for every epoch.

    ``sample_ids`` must be sorted (``scan_parquet`` returns them so), which makes the order
    independent of file layout, reader parallelism and world size.
    """
    rng = np.random.default_rng([int(seed), int(epoch), 0x5EED])
    return sample_ids[rng.permutation(len(sample_ids))]


def steps_in_epoch(num_rows: int, global_batch_size: int) -> int:
    """Optimizer steps per epoch: ceil(N / G). The last step carries the N mod G
    remainder (a smaller batch) instead of dropping it."""
    return math.ceil(num_rows / global_batch_size)


def step_rows(num_rows: int, cursor: int, global_batch_size: int) -> int:
    """Rows in the step that starts at ``cursor`` of an N-row epoch: G or the remainder."""
    return min(global_batch_size, num_rows - cursor)


def rank_micro_slices(
    rows_in_step: int, plan: BatchPlan, rank: int
) -> list[tuple[int, int]]:
    """This rank's micro-batches inside one step, as [start, stop) offsets into the step's
    rows (``order[cursor : cursor + rows_in_step]``).

    Always ``plan.grad_accum_steps`` slices, so every rank runs the same number of
    forward/backward passes and all-reduces; a slice may be empty (a rank with fewer rows
    than micro-steps, only in an epoch's short last step).

    For a full step the rank chunk sizes are ``plan.rows_per_rank``; a short last step
    is split evenly over ranks.
    """
    ws = plan.world_size
    if rows_in_step == plan.global_batch_size:
        sizes = list(plan.rows_per_rank)
    else:
        sizes = split_evenly(rows_in_step, ws)
    start = sum(sizes[:rank])
    slices: list[tuple[int, int]] = []
    for n in split_evenly(sizes[rank], plan.grad_accum_steps):
        slices.append((start, start + n))
        start += n
    return slices


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
