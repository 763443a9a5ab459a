"""The performance formulas of ``elastic_ddp.metrics`` and the two measuring pieces that
need real collectives: the cross-rank mean/max/min reduction and the probe step's hand
all-reduce (checked bit-for-bit against DDP's own on a real 2-process gloo group)."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
import torch.distributed as dist

from elastic_ddp.metrics import (
    PhaseClock,
    bus_bandwidth,
    exposed_allreduce_s,
    gradient_bytes,
    peak_memory_bytes,
    peak_rss_bytes,
    reduce_mean_max,
    ring_allreduce_bytes,
    scaling_efficiency,
    step_breakdown,
    throughput,
)
from helpers import rank_context


def test_ring_allreduce_bytes_matches_2_n_minus_1_over_n():
    # Patarasuk & Yuan 2009: 2(N-1)/N x S per rank.
    assert ring_allreduce_bytes(1000, 1) == 0.0
    assert ring_allreduce_bytes(1000, 2) == 1000.0
    assert ring_allreduce_bytes(1000, 4) == 1500.0
    assert ring_allreduce_bytes(1000, 8) == pytest.approx(1750.0)
    with pytest.raises(ValueError, match="world_size"):
        ring_allreduce_bytes(1000, 0)
    with pytest.raises(ValueError, match="grad_bytes"):
        ring_allreduce_bytes(-1, 2)


def test_bus_bandwidth_is_ring_bytes_over_time():
    # nccl-tests: busbw = algbw x 2(N-1)/N, algbw = S / t.
    assert bus_bandwidth(1e9, 4, 0.5) == pytest.approx(1e9 / 0.5 * 1.5)
    assert math.isnan(bus_bandwidth(1e9, 1, 0.5))   # nothing moves on one rank
    assert math.isnan(bus_bandwidth(1e9, 2, 0.0))   # no measurement


def test_exposed_allreduce_is_sync_minus_nosync_floored():
    assert exposed_allreduce_s(0.30, 0.25) == pytest.approx(0.05)
    assert exposed_allreduce_s(0.24, 0.25) == 0.0       # noise: never negative
    assert math.isnan(exposed_allreduce_s(float("nan"), 0.1))


def test_throughput_and_scaling_efficiency():
    assert throughput(640, 2.0) == 320.0
    assert throughput(640, 0.0) == 0.0
    assert scaling_efficiency(380.0, 200.0, 2) == pytest.approx(0.95)
    assert scaling_efficiency(200.0, 200.0, 1) == 1.0
    assert math.isnan(scaling_efficiency(100.0, 0.0, 2))


def test_step_breakdown_parts_sum_to_step():
    parts = step_breakdown(step_s=1.0, data_s=0.05, fwd_bwd_s=0.7, exposed_s=0.1, opt_s=0.1)
    assert parts == pytest.approx({"data_wait": 0.05, "compute": 0.6, "allreduce_exposed": 0.1,
                                   "optimizer": 0.1, "other": 0.15})
    assert sum(parts.values()) == pytest.approx(1.0)
    # unknown exposed time counts as compute; overshoot is clipped, "other" never < 0
    assert step_breakdown(0.5, 0.1, 0.5, float("nan"), 0.1)["other"] == 0.0
    assert step_breakdown(0.5, 0.1, 0.5, float("nan"), 0.1)["allreduce_exposed"] == 0.0


def test_gradient_bytes_counts_tied_weights_once():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "b": torch.nn.Linear(4, 2)})
    frozen = torch.nn.Linear(3, 3)
    frozen.requires_grad_(False)
    model["frozen"] = frozen
    # 10*4 tied weight once + 4*2 + 2 bias, float32
    assert gradient_bytes(model.parameters()) == (40 + 8 + 2) * 4


def test_peak_memory_is_a_high_water_mark():
    """In a fresh interpreter (this one's peak may already be above anything allocated
    here): touching 256 MiB raises the peak by about that much, and freeing it does not
    lower the peak."""
    import subprocess
    import sys

    code = ("import torch; from elastic_ddp.metrics import peak_rss_bytes, peak_memory_bytes;"
            "a = peak_rss_bytes(); big = torch.ones(64 * 2**20); b = peak_rss_bytes(); del big;"
            "c = peak_memory_bytes(torch.device('cpu')); print(a, b, c)")
    a, b, c = map(int, subprocess.check_output([sys.executable, "-c", code], text=True).split())
    assert a > 10 * 2**20                # an interpreter with torch is > 10 MiB
    assert b - a >= 200 * 2**20, (a, b)  # 256 MiB touched
    assert c >= a + 200 * 2**20          # a high-water mark: freeing does not lower it


def test_phase_clock_sums_named_phases_on_cpu():
    clock = PhaseClock(torch.device("cpu"))
    for _ in range(2):
        t = clock.start()
        time.sleep(0.01)
        clock.stop("data", t)
    t = clock.start()
    time.sleep(0.005)
    clock.stop("opt", t)
    got = clock.collect()
    assert set(got) == {"data", "opt"}
    assert got["data"] >= 0.02 and got["opt"] >= 0.005
    assert clock.collect() == {}        # collect resets


def test_reduce_mean_max_without_process_group_passes_through():
    stats, sums = reduce_mean_max({"a": 2.0}, 1, extra_sums={"n": 3.0})
    assert stats == {"a_mean": 2.0, "a_max": 2.0, "a_min": 2.0}
    assert sums == {"n": 3.0}


# ---------------------------------------------------------------- real 2-rank gloo
def _two_rank_body(rank: int, init_file: str, out: dict) -> None:
    from elastic_ddp.parallel.strategies import allreduce_gradients

    torch.set_num_threads(1)
    # A file rendezvous: no port picked here that another process could take first.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        stats, sums = reduce_mean_max({"step_s": 1.0 + rank, "mem": 10.0 * (rank + 1)}, 2,
                                      extra_sums={"count": 5.0})
        out[f"stats{rank}"] = stats
        out[f"sums{rank}"] = sums

        # The probe step's hand all-reduce must give DDP's averaged gradient exactly.
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        torch.manual_seed(100 + rank)       # different data per rank
        x = torch.randn(8, 16)
        ddp(x).square().sum().backward()    # DDP's overlapped bucket all-reduce
        want = [p.grad.clone() for p in ddp.parameters()]
        ddp.zero_grad(set_to_none=True)
        with ddp.no_sync():
            ddp(x).square().sum().backward()
        allreduce_gradients(ddp, 2)
        out[f"equal{rank}"] = all(torch.equal(p.grad, w) for p, w in zip(ddp.parameters(), want))

        # The SUM hook of plain DDP (comm_hooks.allreduce_sum): the hand all-reduce
        # without a divisor gives its gradient exactly, twice the average's bits.
        from elastic_ddp.parallel.comm_hooks import allreduce_sum

        torch.manual_seed(0)  # the same weights, in a module no other DDP wraps
        net2 = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        summing = torch.nn.parallel.DistributedDataParallel(net2)
        summing.register_comm_hook(None, allreduce_sum)
        summing.zero_grad(set_to_none=True)
        summing(x).square().sum().backward()
        got = [p.grad.clone() for p in summing.parameters()]
        summing.zero_grad(set_to_none=True)
        with summing.no_sync():
            summing(x).square().sum().backward()
        allreduce_gradients(summing, 1)
        out[f"sum_equal{rank}"] = (all(torch.equal(p.grad, g) for p, g in zip(summing.parameters(), got))
                                   and all(torch.equal(g, 2 * w) for g, w in zip(got, want)))
    finally:
        dist.destroy_process_group()


def _two_rank_entry(rank: int, init_file: str, q) -> None:
    out: dict = {}
    _two_rank_body(rank, init_file, out)
    q.put((rank, out))
    # Flush the queue, then leave without the interpreter's static destructors: gloo's
    # C++ threads can still be joinable then, and std::terminate would abort (SIGABRT)
    # a rank whose result is already sent.
    q.close()
    q.join_thread()
    os._exit(0)


def test_reduce_and_probe_allreduce_on_a_real_gloo_group(tmp_path):
    ctx = rank_context()
    q = ctx.Queue()
    init = str(tmp_path / "pg")
    procs = [ctx.Process(target=_two_rank_entry, args=(r, init, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for rank in (0, 1):
        out = results[rank]
        assert out[f"stats{rank}"] == {"step_s_mean": 1.5, "step_s_max": 2.0, "step_s_min": 1.0,
                                       "mem_mean": 15.0, "mem_max": 20.0, "mem_min": 10.0}
        assert out[f"sums{rank}"] == {"count": 10.0}
        assert out[f"equal{rank}"], "hand all-reduce differs from DDP's gradient"
        assert out[f"sum_equal{rank}"], "SUM hook differs from the hand all-reduce or from 2 x the average"
