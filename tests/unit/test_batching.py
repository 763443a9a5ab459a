"""The world-size arithmetic of ``elastic_ddp.batching``: pure logic, no Ray.

The central claims checked here: a step's rows are split over ranks and micro-batches
with nothing lost or repeated at any world size; the per-sample loss weight
``world_size / rows_in_step`` followed by DDP's gradient average gives exactly the
full-batch mean gradient (the world-size invariance of a step); the sample order and the
LR are pure functions of (seed, epoch) and samples seen.

hypothesis is not a dependency, so the combinations are an explicit grid plus a seeded
random sample of (N, G, micro, world_size, policy).
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from elastic_ddp.batching import (
    BatchConfigError,
    check_batch_config,
    grad_accum_steps,
    lr_at,
    micro_slices,
    plan_for_world_size,
    run_length,
    shard_count,
    split_evenly,
    step_rows,
    steps_in_epoch,
    valid_world_sizes,
)
from elastic_ddp.data.order import EpochOrder, RowGroup


def rank_micro_slices(rows_in_step, plan, rank):
    """A rank's micro-batches of one step under ``data.order: permutation`` (positional
    shares), as offsets into the step's rows: what the trainer computes."""
    rows = EpochOrder([RowGroup(0, 0, max(rows_in_step, 1))], 0, 0, mode="permutation").rank_rows(
        0, rows_in_step, plan.world_size, list(plan.rows_per_rank))
    accum = grad_accum_steps(rows, plan.micro_batch_size)
    start = sum(rows[:rank])
    return [(start + a, start + b) for a, b in micro_slices(rows[rank], accum)]


def _combos() -> list[tuple[int, int, int, int, str, int]]:
    """(N rows in epoch, global batch G, micro_batch_size, world_size, policy, min_workers)."""
    out = [
        (1437, 64, 32, 2, "fixed_global", 2),     # the digits job
        (1437, 64, 32, 3, "uneven", 2),
        (10, 64, 8, 4, "uneven", 1),              # one short step, smaller than G
        (7, 7, 1, 7, "fixed_global", 1),          # one row per rank, 1-row micro-batches
        (100, 10, 3, 4, "uneven", 2),
        (100, 12, 100, 5, "uneven", 1),           # micro larger than any rank's rows
        (50, 8, 4, 4, "scale_lr", 2),             # G grows to 16 at world size 4
        (33, 9, 2, 3, "scale_lr", 3),
        (5, 4, 1, 4, "fixed_global", 1),          # last step has 1 row for 4 ranks
    ]
    rng = random.Random(1234)
    while len(out) < 120:
        policy = rng.choice(["fixed_global", "uneven", "scale_lr"])
        min_w = rng.randint(1, 4)
        ws = rng.randint(min_w, 8)
        micro = rng.randint(1, 40)
        if policy == "fixed_global":
            g = ws * rng.randint(1, 20)
        elif policy == "uneven":
            g = rng.randint(ws, 150)
        else:
            g = min_w * rng.randint(1, 20)
        n = rng.randint(1, 400)
        out.append((n, g, micro, ws, policy, min_w))
    return out


COMBOS = _combos()


def _plan(g, micro, ws, policy, min_w, lr_scaling="linear"):
    return plan_for_world_size(g, micro, ws, policy, min_w, lr_scaling)


@pytest.mark.parametrize("n,g,micro,ws,policy,min_w", COMBOS)
def test_step_slices_partition_rows(n, g, micro, ws, policy, min_w):
    plan = _plan(g, micro, ws, policy, min_w)
    assert plan.world_size == ws and len(plan.rows_per_rank) == ws
    assert sum(plan.rows_per_rank) == plan.global_batch_size
    if policy != "scale_lr":
        assert plan.global_batch_size == g
        assert max(plan.rows_per_rank) - min(plan.rows_per_rank) <= 1
    else:
        assert plan.global_batch_size == (g // min_w) * ws
    assert plan.even == (len(set(plan.rows_per_rank)) == 1)

    cursor, steps = 0, 0
    while cursor < n:
        rows = step_rows(n, cursor, plan.global_batch_size)
        assert 1 <= rows <= plan.global_batch_size
        covered = np.zeros(rows, dtype=np.int64)
        counts = {len(rank_micro_slices(rows, plan, rank)) for rank in range(ws)}
        assert len(counts) == 1  # every rank runs as many micro-steps (and all-reduces)
        if rows == plan.global_batch_size:  # a short last step may need fewer
            assert counts == {plan.grad_accum_steps}
        for rank in range(ws):
            slices = rank_micro_slices(rows, plan, rank)
            for a, b in slices:
                assert 0 <= a <= b <= rows
                assert b - a <= micro
                covered[a:b] += 1
            if rows == plan.global_batch_size:
                assert sum(b - a for a, b in slices) == plan.rows_per_rank[rank]
        assert np.all(covered == 1), f"rows covered {covered.tolist()}"
        cursor += rows
        steps += 1
    assert cursor == n
    assert steps == steps_in_epoch(n, plan.global_batch_size) == math.ceil(n / plan.global_batch_size)


@pytest.mark.parametrize("n,g,micro,ws,policy,min_w", COMBOS[:40])
def test_windowed_rank_rows_cover_every_step(n, g, micro, ws, policy, min_w):
    """windowed order: ranks own partitions, so their rows per step come from the order;
    over the ranks they are exactly the step's rows, and the micro-batches cut them
    without loss, each within micro_batch_size, the same count on every rank."""
    plan = _plan(g, micro, ws, policy, min_w)
    parts = max(ws, 8)
    order = EpochOrder([RowGroup(0, 0, n)], 0, 0, partitions=min(parts, n), window_rows=16)
    if order.partitions < ws:
        return
    for cursor in range(0, n, plan.global_batch_size):
        rows = order.rank_rows(cursor, step_rows(n, cursor, plan.global_batch_size), ws)
        assert sum(rows) == step_rows(n, cursor, plan.global_batch_size)
        accum = grad_accum_steps(rows, micro)
        for r in range(ws):
            sl = micro_slices(rows[r], accum)
            assert len(sl) == accum and sum(b - a for a, b in sl) == rows[r]
            assert all(b - a <= micro for a, b in sl)


def test_run_length_is_the_one_source_of_the_global_batch(tmp_path):
    """Under scale_lr the global batch grows with the world size; the LR schedule stays
    in samples of the config's global batch, the same at every world size."""
    from elastic_ddp.config import Config

    cfg = Config.from_dict({"data": {"train_path": "x"}, "model": {"name": "mlp"},
                            "batch": {"global_batch_size": 32, "micro_batch_size": 8, "policy": "scale_lr"},
                            "optim": {"warmup_steps": 5},
                            "train": {"epochs": 2, "max_steps": 50},
                            "scaling": {"min_workers": 2, "max_workers": 4}})
    runs = {ws: run_length(cfg, 1000, ws)[1] for ws in (2, 3, 4)}
    assert [runs[ws].global_batch_size for ws in (2, 3, 4)] == [32, 48, 64]
    assert [runs[ws].steps_per_epoch for ws in (2, 3, 4)] == [32, 21, 16]
    assert {r.schedule_samples for r in runs.values()} == {50 * 32}
    assert {r.warmup_samples for r in runs.values()} == {5 * 32}
    assert runs[4].peak_lr == pytest.approx(2 * runs[2].peak_lr)


def test_split_evenly():
    assert split_evenly(10, 3) == [4, 3, 3]
    assert split_evenly(2, 4) == [1, 1, 0, 0]
    for n in range(0, 40):
        for p in range(1, 9):
            s = split_evenly(n, p)
            assert sum(s) == n and len(s) == p and max(s) - min(s) <= 1


def test_steps_in_epoch_and_step_rows():
    assert steps_in_epoch(1437, 64) == 23
    assert step_rows(1437, 22 * 64, 64) == 1437 - 22 * 64 == 29
    assert steps_in_epoch(128, 64) == 2 and step_rows(128, 64, 64) == 64
    assert steps_in_epoch(1, 64) == 1


def test_fixed_global_refuses_indivisible_world_size():
    with pytest.raises(BatchConfigError, match="world_size=3"):
        plan_for_world_size(64, 32, 3, "fixed_global")
    # windowed order: the shares come from partitions, so G need not divide.
    assert plan_for_world_size(64, 32, 3, "fixed_global", partitions=12).global_batch_size == 64
    plan = plan_for_world_size(64, 32, 3, "uneven")
    assert plan.rows_per_rank == (22, 21, 21) and plan.grad_accum_steps == 1
    with pytest.raises(BatchConfigError, match="batch.global_batch_size"):
        check_batch_config(64, 32, 2, 4, "fixed_global")
    check_batch_config(48, 32, 2, 4, "fixed_global")  # lcm(2, 3, 4) = 12 divides 48
    refused = {ws: why for ws, plan, why in valid_world_sizes(64, 32, 1, 6, "fixed_global") if plan is None}
    assert sorted(refused) == [3, 5, 6]



def test_every_fix_a_divisibility_refusal_names_is_accepted():
    """Each value and each narrower worker range the fixed_global refusal suggests passes
    the same check (batch under permutation, partitions under windowed), no suggested
    value is more than 2x (batch) away, and every refusal offers batch.policy=uneven."""
    import re

    for lo in range(1, 9):
        for hi in range(lo, 9):
            for unit in range(hi, 200):
                for partitions, what in ((1, "batch.global_batch_size"), (unit, "data.partitions")):
                    if partitions > 1 and unit < 2:
                        continue
                    g = unit if partitions == 1 else 64 * hi
                    try:
                        check_batch_config(g, 32, lo, hi, "fixed_global", partitions)
                        continue
                    except BatchConfigError as e:
                        msg = str(e)
                    assert f"{what}={unit} does not divide" in msg, msg
                    assert msg.endswith(")") and "set batch.policy=uneven" in msg, msg
                    values = re.search(rf"set {re.escape(what)} to ([\d ,or]+) \(", msg)
                    for v in map(int, re.findall(r"\d+", values.group(1)) if values else []):
                        check_batch_config(v if partitions == 1 else g, 32, lo, hi, "fixed_global",
                                           v if partitions > 1 else 1)
                        assert partitions > 1 or unit / 2 <= v <= 2 * unit, msg
                    ranges = re.search(r"max_workers to ([\d., or]+) \(", msg)
                    for a, b in re.findall(r"(\d+)\.\.(\d+)", ranges.group(1) if ranges else ""):
                        assert lo <= int(a) <= int(b) <= hi, msg
                        check_batch_config(g, 32, int(a), int(b), "fixed_global", partitions)
                    assert values or ranges or not any(unit % ws == 0 for ws in range(lo, hi + 1)), msg


def test_a_divisibility_refusal_suggests_no_far_value():
    """1..7 workers and a batch of 64: the values all of 1..7 divide are multiples of 420,
    6.6x the batch; the refusal names the narrower ranges 64 divides over instead."""
    with pytest.raises(BatchConfigError) as e:
        check_batch_config(64, 32, 1, 7, "fixed_global")
    assert str(e.value) == (
        "batch.global_batch_size=64 does not divide over world size(s) [3, 5, 6, 7] allowed by "
        "scaling.min_workers..max_workers=1..7; narrow scaling.min_workers..max_workers to 1..2 "
        "or 4..4 (world sizes that divide 64), or set batch.policy=uneven (ranks differ by at "
        "most one row)")
    with pytest.raises(BatchConfigError) as e:
        check_batch_config(4096, 32, 1, 8, "fixed_global")  # 3360 and 4200 are near 4096
    assert ("set batch.global_batch_size to 3360 or 4200 (the nearest values divisible by every "
            "world size in 1..8), narrow scaling.min_workers..max_workers to 1..2, 4..4 or 8..8 "
            "(world sizes that divide 4096)") in str(e.value)

# ----------------------------------------------------- loss weights: exact mean gradient
def _grads_by_ranks(model, x, y, rows, plan) -> list[torch.Tensor]:
    """Each "rank"'s accumulated gradient for one step of ``rows`` rows, as the worker
    computes it: per micro-slice, sum(per-sample loss) * world_size / rows."""
    weight = plan.world_size / rows
    out = []
    for rank in range(plan.world_size):
        model.zero_grad(set_to_none=False)
        for a, b in rank_micro_slices(rows, plan, rank):
            if b == a:
                continue
            loss_vec = torch.nn.functional.cross_entropy(model(x[a:b]), y[a:b], reduction="none")
            (loss_vec.sum() * weight).backward()
        out.append(torch.cat([p.grad.detach().flatten().clone() for p in model.parameters()]))
    return out


@pytest.mark.parametrize("g,micro,ws,policy,min_w,rows", [
    (64, 32, 2, "fixed_global", 2, 64),
    (64, 32, 3, "uneven", 2, 64),      # ranks hold 22/21/21 rows
    (64, 32, 4, "uneven", 2, 29),      # short last step, split 8/7/7/7
    (64, 5, 5, "uneven", 1, 64),       # 13/13/13/13/12 rows, 3 micro-batches each
    (10, 4, 7, "uneven", 1, 3),        # short step: 4 ranks get nothing
    (16, 3, 4, "scale_lr", 2, 32),     # G grows to 32 at world size 4
])
def test_weighted_rank_gradients_average_to_full_batch_mean(g, micro, ws, policy, min_w, rows):
    """World-size invariance: averaging the ranks' gradients (what DDP's all-reduce
    does, sum / world_size) equals the gradient of the mean loss over the step's rows."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4).double()
    x = torch.randn(rows, 6, dtype=torch.float64)
    y = torch.randint(0, 4, (rows,))
    plan = _plan(g, micro, ws, policy, min_w)
    per_rank = _grads_by_ranks(model, x, y, rows, plan)
    ddp_avg = torch.stack(per_rank).sum(0) / ws

    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()  # mean reduction
    full = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(ddp_avg, full, rtol=1e-12, atol=1e-12)

    # The same rows at world size 1 give the same gradient: the step does not depend
    # on how many ranks computed it.
    plan1 = _plan(rows, micro, 1, "uneven", 1)
    one = _grads_by_ranks(model, x, y, rows, plan1)[0]
    torch.testing.assert_close(one, full, rtol=1e-12, atol=1e-12)


def test_shards_only_where_the_job_may_run_at_world_size_2():
    """``shard_count``; world size 1's micro-batches are those of both shards."""
    assert [shard_count(m) for m in (1, 2, 3, 8)] == [1, 2, 2, 2]
    assert shard_count(4, "scale_lr") == 1  # the global batch differs at world size 2
    assert plan_for_world_size(64, 64, 1).grad_accum_steps == 1
    assert plan_for_world_size(64, 64, 1, shards=2).grad_accum_steps == 2  # 2 x 32 rows
    assert plan_for_world_size(64, 16, 1, shards=2).grad_accum_steps == 4  # as without
    assert plan_for_world_size(33, 16, 1, "uneven", shards=2).grad_accum_steps == 4  # 17 + 16: 2 each
    assert plan_for_world_size(33, 16, 2, "uneven", shards=2).grad_accum_steps == 2


@pytest.mark.parametrize("sizes", [(16, 16), (17, 16), (3, 2), (1, 0), (40, 39), (0, 0)])
@pytest.mark.parametrize("micro", [16, 8, 5])
def test_world_size_1_cuts_its_shards_as_world_size_2_ranks_cut_their_rows(sizes, micro):
    """The micro-batches of world size 1 (shards) and of the two ranks of world size 2:
    the same rows, counts, units (the seed) and BatchNorm guard decisions, in order."""
    from elastic_ddp.worker.micro_steps import micro_batches

    n = sum(sizes)
    shard_rows = [np.arange(sizes[0]), np.arange(sizes[0], n)]
    one = micro_batches([n], 0, micro, shard_rows)
    two = [mb for r in range(2) for mb in micro_batches(list(sizes), r, micro)]
    assert [(m.count, m.unit, m.smallest) for m in one] == [(m.count, m.unit, m.smallest) for m in two]
    offsets = [0] * (len(two) // 2) + [sizes[0]] * (len(two) // 2)
    assert [m.rows.tolist() for m in one] == [list(range(o + m.rows.start, o + m.rows.stop))
                                               for o, m in zip(offsets, two)]
    # Shard 0's gradient is set aside only when its micro-batches are several.
    assert [m.shard_end for m in one].count(True) == (len(one) > 2)


def test_unweighted_mean_per_rank_is_not_exact():
    """Guard that the test above can fail: with uneven ranks, the naive per-rank mean
    followed by DDP's average is biased."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4).double()
    x = torch.randn(64, 6, dtype=torch.float64)
    y = torch.randint(0, 4, (64,))
    plan = _plan(64, 64, 3, "uneven", 1)
    grads = []
    for rank in range(3):
        model.zero_grad()
        (a, b), = rank_micro_slices(64, plan, rank)
        torch.nn.functional.cross_entropy(model(x[a:b]), y[a:b]).backward()
        grads.append(torch.cat([p.grad.flatten().clone() for p in model.parameters()]))
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    full = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert not torch.allclose(torch.stack(grads).mean(0), full, rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------------- LR
def test_lr_warmup_then_cosine():
    peak, total, warm, ratio = 0.01, 10_000, 1_000, 0.1
    floor = peak * ratio
    lrs = [lr_at(s, total, peak, warm, ratio) for s in range(0, total + 1, 10)]
    assert lrs[0] == pytest.approx(peak / warm)
    # Warm-up: strictly increasing, linear in samples_seen.
    w = [lr_at(s, total, peak, warm, ratio) for s in range(0, warm)]
    assert all(b > a for a, b in zip(w, w[1:]))
    assert lr_at(499, total, peak, warm, ratio) == pytest.approx(peak * 500 / warm)
    # Peak at the end of warm-up, then non-increasing to the floor.
    assert lr_at(warm, total, peak, warm, ratio) == pytest.approx(peak)
    decay = [lr_at(s, total, peak, warm, ratio) for s in range(warm, total + 1, 7)]
    assert all(b <= a + 1e-15 for a, b in zip(decay, decay[1:]))
    mid = warm + (total - warm) // 2
    assert lr_at(mid, total, peak, warm, ratio) == pytest.approx((peak + floor) / 2)
    assert lr_at(total, total, peak, warm, ratio) == pytest.approx(floor)
    assert lr_at(total * 3, total, peak, warm, ratio) == pytest.approx(floor)  # clamped
    assert max(lrs) <= peak * (1 + 1e-12)
    assert min(decay) >= floor * (1 - 1e-12)  # never below the cosine floor after warm-up
    # No warm-up: starts at the peak.
    assert lr_at(0, total, peak, 0, ratio) == pytest.approx(peak)


def test_lr_is_a_function_of_samples_seen_not_steps():
    """Two histories that reach the same samples_seen (64-row steps at one world size vs.
    a mix of step sizes after a resize) get the same LR."""
    total, peak = 1437 * 5, 0.01
    a = 0
    for _ in range(10):
        a += 64
    b = 0
    for rows in (64, 64, 64, 29, 64, 64, 64, 64, 64, 35, 64):
        b += rows
    assert a == 640 and b == 640
    assert lr_at(a, total, peak, 320, 0.05) == lr_at(b, total, peak, 320, 0.05)
    assert lr_at(a + 1, total, peak, 320, 0.05) != lr_at(a, total, peak, 320, 0.05)


@pytest.mark.parametrize("min_w,ws", [(1, 1), (2, 4), (2, 3), (1, 8)])
def test_scale_lr_multipliers(min_w, ws):
    lin = _plan(32 * min_w, 16, ws, "scale_lr", min_w, "linear")
    sq = _plan(32 * min_w, 16, ws, "scale_lr", min_w, "sqrt")
    assert lin.rows_per_rank == (32,) * ws and lin.global_batch_size == 32 * ws
    assert lin.lr_multiplier == pytest.approx(ws / min_w)
    assert sq.lr_multiplier == pytest.approx(math.sqrt(ws / min_w))
    assert lin.grad_accum_steps == 2
    for policy in ("fixed_global", "uneven"):
        assert _plan(32 * ws, 16, ws, policy, min_w).lr_multiplier == 1.0


def test_scale_lr_needs_divisible_min_workers():
    with pytest.raises(BatchConfigError, match="scaling.min_workers=3"):
        check_batch_config(64, 16, 3, 4, "scale_lr")
