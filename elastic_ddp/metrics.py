"""Where a step's time goes: the formulas behind the per-run performance metrics, and the
one cross-rank reduction that turns per-rank sums into ``*_mean`` / ``*_max`` figures.

Everything except :func:`reduce_mean_max` and :class:`PhaseClock` is a pure function of
numbers (unit-tested in ``tests/unit/test_metrics.py``). The worker
(``worker.trainer.Trainer.train_step``, :class:`StepWindow`) measures; this module computes.

How a step is split (per rank, seconds per optimizer step):

    step = data_wait + fwd_bwd + optimizer + other
    fwd_bwd = compute + allreduce_exposed

* ``data_wait``: gathering this step's rows and making tensors (host to device copy).
* ``fwd_bwd``: every micro-batch's forward + backward. DDP starts each gradient bucket's
  all-reduce as soon as the bucket is ready, so most of the all-reduce runs *inside* the
  backward of the syncing micro-step; only the part that backward cannot hide delays the
  step: ``allreduce_exposed``.
* ``optimizer``: gradient clipping + ``opt.step()`` + ``zero_grad``.
* ``other``: what is left (LR update, ledger, Python between phases).

Exposed all-reduce is estimated as ``t(syncing micro-step) - t(no_sync micro-step)``
(:func:`exposed_allreduce_s`): with gradient accumulation both kinds run inside every
step; without it the no_sync reference comes from *probe steps* (see
``worker.trainer.Trainer.train_step``): once per log window the backward runs under
``no_sync`` and the flattened gradient is all-reduced explicitly afterwards, which also times the whole,
un-overlapped all-reduce, the denominator of the achieved bus bandwidth.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from typing import Iterable, Mapping, Optional

import torch


# ------------------------------------------------------------------ pure formulas
def gradient_bytes(params: Iterable[torch.nn.Parameter]) -> int:
    """Bytes of the gradient DDP all-reduces: sum of numel x element size over the
    parameters that require a gradient. Each tensor counts once (a weight tied to two
    modules, like GPT's embedding/head, is one parameter and one gradient)."""
    seen: set[int] = set()
    total = 0
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def ring_allreduce_bytes(grad_bytes: float, world_size: int) -> float:
    """Bytes each rank sends (and receives) in one ring all-reduce of ``grad_bytes``:
    ``2 (N - 1) / N x grad_bytes`` -- a reduce-scatter then an all-gather, each moving
    (N - 1) chunks of size grad_bytes / N (Patarasuk & Yuan 2009, "Bandwidth optimal
    all-reduce algorithms for clusters of workstations"; NCCL docs, nccl-tests
    PERFORMANCE.md, "bus bandwidth"). 0 for one rank.

    Raises:
        ValueError: world_size < 1 or grad_bytes < 0.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if grad_bytes < 0:
        raise ValueError(f"grad_bytes must be >= 0, got {grad_bytes}")
    return 2.0 * (world_size - 1) / world_size * grad_bytes


def bus_bandwidth(grad_bytes: float, world_size: int, allreduce_s: float) -> float:
    """Achieved bus bandwidth in bytes/s: ``ring_allreduce_bytes / allreduce_s``, i.e.
    algorithm bandwidth ``grad_bytes / t`` times ``2 (N - 1) / N`` (nccl-tests
    PERFORMANCE.md). Comparable across world sizes and with the link's peak. ``nan``
    when there is no all-reduce (one rank) or no time was measured."""
    moved = ring_allreduce_bytes(grad_bytes, world_size)
    if moved == 0 or not allreduce_s > 0:
        return math.nan
    return moved / allreduce_s


def exposed_allreduce_s(sync_micro_s: float, nosync_micro_s: float) -> float:
    """Seconds of all-reduce the backward did not hide, per step: the mean time of a
    syncing micro-step (forward + backward + bucket all-reduces) minus the mean time of a
    ``no_sync`` micro-step of the same size (forward + backward only), floored at 0
    (timing noise can make the difference negative). ``nan`` when either is unknown."""
    if not (sync_micro_s >= 0 and nosync_micro_s >= 0):
        return math.nan
    return max(0.0, sync_micro_s - nosync_micro_s)


def throughput(samples: float, seconds: float) -> float:
    """Samples (or tokens) per second; 0 when no time has passed."""
    return samples / seconds if seconds > 0 else 0.0


def scaling_efficiency(throughput_n: float, throughput_1: float, world_size: int) -> float:
    """Weak-scaling efficiency at ``world_size``: ``T_N / (N x T_1)``; 1.0 is linear
    scaling. With a fixed global batch this is strong scaling of the step: the same
    work split over N ranks. ``nan`` when the 1-rank throughput is unknown."""
    if not throughput_1 > 0 or world_size < 1:
        return math.nan
    return throughput_n / (world_size * throughput_1)


def step_breakdown(step_s: float, data_s: float, fwd_bwd_s: float, exposed_s: float,
                   opt_s: float) -> dict[str, float]:
    """Split a step's seconds into disjoint parts that sum to ``step_s``:
    data_wait, compute (fwd_bwd minus the exposed all-reduce), allreduce_exposed,
    optimizer, other (the rest, floored at 0). ``nan`` exposed counts as 0."""
    exposed = 0.0 if math.isnan(exposed_s) else min(exposed_s, fwd_bwd_s)
    parts = {
        "data_wait": data_s,
        "compute": fwd_bwd_s - exposed,
        "allreduce_exposed": exposed,
        "optimizer": opt_s,
    }
    parts["other"] = max(0.0, step_s - sum(parts.values()))
    return parts


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark in bytes: ``VmHWM`` of
    ``/proc/self/status`` on Linux (per address space, so it starts afresh in a new
    program), else ``getrusage`` ru_maxrss (KiB on Linux, bytes on macOS), which a child
    inherits from its parent across ``fork``/``exec`` and so may read the parent's peak.
    Includes the Python interpreter and torch (~300 MB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def peak_memory_bytes(device: Optional[torch.device] = None) -> int:
    """Peak memory of this worker: ``torch.cuda.max_memory_allocated`` on a GPU (tensors
    only, not the caching allocator's reserve), the process RSS high-water mark on CPU."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


# ------------------------------------------------------------------ measuring
class PhaseClock:
    """Wall time of named phases of a step, without adding device syncs.

    CPU: ``time.perf_counter`` around the phase (CPU work is synchronous). CUDA: a pair
    of CUDA events recorded on the current stream, resolved in :meth:`collect` (one
    ``synchronize`` per log window): host timers would only see kernel launches. An
    event pair measures how long the *GPU stream* spent between the two points, so a
    data-wait phase reads ~0 when the GPU still had queued work to hide the host's
    loading, and the real stall when it did not -- the wait the GPU actually saw.

        clock = PhaseClock(device); t = clock.start(); ...; clock.stop("data", t)
        seconds = clock.collect()   # {"data": 0.012, ...}, and resets
    """

    def __init__(self, device: Optional[torch.device] = None):
        self.cuda = device is not None and device.type == "cuda"
        self._sums: dict[str, float] = {}
        self._events: list[tuple[str, object, object]] = []

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, name: str, token) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events.append((name, token, ev))
        else:
            self._sums[name] = self._sums.get(name, 0.0) + time.perf_counter() - token

    def collect(self) -> dict[str, float]:
        """Seconds per phase name since the last collect; resets."""
        if self._events:
            torch.cuda.synchronize()
            for name, a, b in self._events:
                self._sums[name] = self._sums.get(name, 0.0) + a.elapsed_time(b) / 1000.0
            self._events.clear()
        out, self._sums = self._sums, {}
        return out


def reduce_mean_max(per_rank: Mapping[str, float], world_size: int,
                    device: Optional[torch.device] = None,
                    extra_sums: Optional[Mapping[str, float]] = None
                    ) -> tuple[dict[str, float], dict[str, float]]:
    """Across ranks: ``{name}_mean``, ``{name}_max`` and ``{name}_min`` of each value in
    ``per_rank`` (a straggler shows in the max), and the plain sum of each value in
    ``extra_sums``.

    Two all-reduces of one small float64 tensor each (SUM; MAX over [v, -v] gives max and
    min): a sync point, so call it on log steps only. Every rank must pass the same keys
    in the same order, all finite. Without an initialised process group (or one rank)
    the values pass through.

    Returns:
        (stats, sums): ``stats`` has ``{name}_mean``/``_max``/``_min``; ``sums`` has the
        cross-rank sum of each ``extra_sums`` value.
    """
    import torch.distributed as dist

    names = list(per_rank)
    sum_names = list(extra_sums or {})
    vals = [float(per_rank[k]) for k in names]
    s = torch.tensor(vals + [float(extra_sums[k]) for k in sum_names], dtype=torch.float64,
                     device=device)
    m = torch.tensor(vals + [-v for v in vals], dtype=torch.float64, device=device)
    n = 1
    if dist.is_available() and dist.is_initialized() and world_size > 1:
        dist.all_reduce(s)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        n = world_size
    s_l, m_l = s.tolist(), m.tolist()
    stats: dict[str, float] = {}
    for i, k in enumerate(names):
        stats[f"{k}_mean"] = s_l[i] / n
        stats[f"{k}_max"] = m_l[i]
        stats[f"{k}_min"] = -m_l[len(names) + i]
    sums = {k: s_l[len(names) + j] for j, k in enumerate(sum_names)}
    return stats, sums


class StepWindow:
    """Per-rank sums between two metric logs; ``reduce`` all-reduces them (two small
    collectives, a sync point paid only on log steps).

    Logged (``elastic_ddp.metrics`` has the formulas; ``*_mean``/``*_max`` over ranks,
    seconds per optimizer step unless noted): step_time_s, data_wait_s, fwd_bwd_s
    (forward+backward, overlapped all-reduce inside), allreduce_exposed_s (the part
    backward did not hide), optimizer_s, allreduce_s (one whole un-overlapped all-reduce,
    probe windows only; plus _min), peak_mem_mib (RSS high-water mark on CPU,
    max_memory_allocated on GPU); train_loss and train_<name> for each per-sample metric
    the task's loss returns (means over the rows of the window's applied steps; left out
    when every step of the window was skipped); and samples_per_s
    (tokens_per_s for sequence tasks) over the
    slowest rank's step time, data_wait_frac, grad_bytes, allreduce_bytes_per_step
    (ring: 2(N-1)/N x grad bytes per rank), allreduce_busbw_GBps (ring bytes over the
    fastest rank's whole all-reduce time, 1e9 bytes/s).
    """

    def __init__(self):
        self.loss_sum = 0.0
        self.metric_sums: dict[str, float] = {}
        self.count = self.steps = 0
        self.step_s = 0.0
        self.data_s = 0.0   # host-side data time outside the step (epoch pipeline starts)
        self.samples = 0
        self.lr = 0.0
        self.micro: dict[str, int] = {}
        self.probes = 0
        self.grad_bytes: Optional[int] = None
        self.tokens = 0.0  # this rank's tokens (Task.tokens), summed over micro-batches
        self.token_task = False
        # The window's row_sums() already summed over the step's quorum (per-step fault
        # tolerance, set at a log step): used by reduce instead of its own reduction.
        self.quorum_sums: Optional[dict[str, float]] = None
        self._clock: Optional[PhaseClock] = None

    def clock(self, device) -> PhaseClock:
        if self._clock is None:
            self._clock = PhaseClock(device)
        return self._clock

    def add_rows(self, loss_sum: float, metric_sums: Mapping[str, float], count: int) -> None:
        """One micro-batch's sums over its rows (loss and the task's per-sample metrics)."""
        self.loss_sum += loss_sum
        for k, v in metric_sums.items():
            self.metric_sums[k] = self.metric_sums.get(k, 0.0) + v
        self.count += count

    def row_sums(self, pending: Iterable[tuple[float, Mapping[str, float], int]] = ()) -> dict[str, float]:
        """This rank's sums over the window's rows, ``pending`` micro-batch sums (loss,
        {name: sum}, rows) not yet added included: ``loss_sum``, ``count``, ``tokens`` and
        ``m_<name>`` per task metric, keys sorted (every rank sends the same vector)."""
        loss, count, metric = self.loss_sum, float(self.count), dict(self.metric_sums)
        for loss_sum, metric_sums, rows in pending:
            loss, count = loss + loss_sum, count + rows
            for k, v in metric_sums.items():
                metric[k] = metric.get(k, 0.0) + v
        return {"loss_sum": loss, "count": count, "tokens": self.tokens,
                **{f"m_{k}": metric[k] for k in sorted(metric)}}

    def add(self, n_rows: int, dt: float, lr: float) -> None:
        """One optimizer step of ``n_rows`` global rows that took ``dt`` seconds here."""
        self.steps += 1
        self.samples += n_rows
        self.step_s += dt
        self.lr = lr

    def reduce(self, ws: int, device) -> dict[str, float]:
        ph = self._clock.collect() if self._clock is not None else {}
        n = max(1, self.steps)
        fb_total = ph.get("fb", 0.0) + ph.get("fb_sync", 0.0) + ph.get("fb_nosync", 0.0)
        probe_s = ph.get("allreduce_probe", 0.0)
        per_rank = {
            "step_time_s": self.step_s / n,
            "data_wait_s": (ph.get("data", 0.0) + self.data_s) / n,
            "fwd_bwd_s": (fb_total + probe_s) / n,
            "optimizer_s": ph.get("opt", 0.0) / n,
            "peak_mem_mib": peak_memory_bytes(device) / 2**20,
        }
        # Which keys exist depends only on (world size, plan, step numbers), the same on
        # every rank, so all ranks send the same vector.
        n_sync, n_nosync = self.micro.get("fb_sync", 0), self.micro.get("fb_nosync", 0)
        if ws == 1:
            per_rank["allreduce_exposed_s"] = 0.0
        elif n_sync and n_nosync:
            est = exposed_allreduce_s(ph["fb_sync"] / n_sync, ph["fb_nosync"] / n_nosync)
            per_rank["allreduce_exposed_s"] = (est * n_sync + probe_s) / n
        if self.probes:
            per_rank["allreduce_s"] = probe_s / self.probes
        if self.quorum_sums is None:
            stats, sums = reduce_mean_max(per_rank, ws, device, extra_sums=self.row_sums())
        else:
            stats, _ = reduce_mean_max(per_rank, ws, device)
            sums = self.quorum_sums
        names = [k[2:] for k in sums if k.startswith("m_")]
        count = sums["count"]
        step_s_max = stats["step_time_s_max"] * n
        out = {k: v for k, v in stats.items() if not k.endswith("_min")}
        if count > 0:  # a window of skipped steps only (non-finite gradient) has no rows
            out.update({"train_loss": sums["loss_sum"] / count,
                        **{f"train_{k}": sums[f"m_{k}"] / count for k in names}})
        out.update({
            "lr": self.lr,
            # The slowest rank sets the pace of a synchronous step.
            "samples_per_s": throughput(self.samples, step_s_max),
            "step_time_s": stats["step_time_s_max"],
            "data_wait_frac": stats["data_wait_s_max"] / max(1e-12, stats["step_time_s_max"]),
        })
        if self.token_task:
            out["tokens_per_s"] = throughput(sums["tokens"], step_s_max)
        if self.grad_bytes is not None:
            out["grad_bytes"] = float(self.grad_bytes)
            out["allreduce_bytes_per_step"] = ring_allreduce_bytes(self.grad_bytes, ws)
        if "allreduce_s_min" in stats:
            out["allreduce_s_min"] = stats["allreduce_s_min"]
            # The last rank to enter the collective waits only for the transfer; the
            # others also wait for it to arrive, so the fastest rank's time is the link's.
            bw = bus_bandwidth(self.grad_bytes or 0, ws, stats["allreduce_s_min"])
            if not math.isnan(bw):
                out["allreduce_busbw_GBps"] = bw / 1e9
        return out
