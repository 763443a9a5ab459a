"""The per-worker training loop, run by Ray Train on every rank at every (re)start.

    train_func({"config": cfg.model_dump(mode="json"), "job": {...}})   # by launcher.py

Order on every start: world (rank, world size, device) -> batch plan for this world size
-> model -> resume from ``ray.train.get_checkpoint()`` -> DDP wrap -> this rank's rows for
the rest of the epoch -> loop. Everything that depends on the world size is derived here,
because Ray Train restarts the whole worker group on every failure and resize.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from elastic_ddp.batching import (
    BatchPlan,
    epoch_order,
    lr_at,
    plan_for_world_size,
    rank_micro_slices,
    step_rows,
    steps_in_epoch,
)
from elastic_ddp.checkpoint import CheckpointError, load_state, save_state
from elastic_ddp.config import Config
from elastic_ddp.metrics import (
    PhaseClock,
    bus_bandwidth,
    exposed_allreduce_s,
    gradient_bytes,
    peak_memory_bytes,
    reduce_mean_max,
    ring_allreduce_bytes,
    throughput,
)
from elastic_ddp.models import build_model, per_sample_loss
from elastic_ddp.parallel import Strategy, build_strategy
from elastic_ddp.tracking import RankZeroTracker


class StepError(RuntimeError):
    """An exception raised inside a training step, tagged with the step so the controller
    can tell a deterministic error (same step, same message, every attempt) from a
    failure worth a restart."""


# ----------------------------------------------------------------------------- data
@dataclass
class LocalRows:
    """Rows this rank holds in memory, sorted by sample_id.

    ids: [n] int64 sorted; x: [n, D] (float32 pixels or uint8 tokens); y: [n] int64 or None.
    """

    ids: np.ndarray
    x: np.ndarray
    y: Optional[np.ndarray]

    def take(self, ids: np.ndarray) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """Rows for ``ids`` (shape [k]), in that order. Raises KeyError for an id not held."""
        pos = np.searchsorted(self.ids, ids)
        if len(ids) and (pos.max(initial=0) >= len(self.ids) or not np.array_equal(self.ids[pos], ids)):
            missing = np.setdiff1d(ids, self.ids)[:5]
            raise KeyError(f"sample_id(s) {missing.tolist()} not in this rank's rows")
        return self.x[pos], (self.y[pos] if self.y is not None else None)


def _stack_column(col: Any) -> np.ndarray:
    """A Ray Data numpy batch column of lists -> a 2-D array (one copy)."""
    arr = np.asarray(col)
    if arr.dtype == object:
        arr = np.stack([np.asarray(v) for v in col])
    return arr


def read_rows(dataset_name: str, wanted: np.ndarray, cfg: Config) -> LocalRows:
    """Stream the ``dataset_name`` Ray Data shard once and keep the rows whose id is in
    ``wanted`` (shape [k], any order). Reads every row of the data set and keeps about
    1/world_size of them: read amplification traded for an exact, world-size-free sample
    order (Ray Data has no indexed or mid-epoch-resumable reader).

    Raises:
        KeyError: a wanted id is not in the data set (the driver's scan prevents this).
    """
    import ray.train

    wanted = np.unique(wanted)
    d = cfg.data
    it = ray.train.get_dataset_shard(dataset_name)
    ids_parts, x_parts, y_parts = [], [], []
    for batch in it.iter_batches(batch_size=8192, batch_format="numpy", prefetch_batches=2):
        ids = np.asarray(batch[d.id_column], dtype=np.int64)
        keep = np.isin(ids, wanted)
        if not keep.any():
            continue
        ids_parts.append(ids[keep])
        x_parts.append(_stack_column(batch[d.feature_column])[keep])
        if d.label_column:
            y_parts.append(np.asarray(batch[d.label_column], dtype=np.int64)[keep])
    if not ids_parts:
        raise KeyError(f"none of {len(wanted)} wanted rows found in dataset {dataset_name!r}")
    ids = np.concatenate(ids_parts)
    order = np.argsort(ids, kind="stable")
    rows = LocalRows(ids[order], np.concatenate(x_parts)[order],
                     np.concatenate(y_parts)[order] if y_parts else None)
    if len(rows.ids) != len(wanted):
        missing = np.setdiff1d(wanted, rows.ids)[:5]
        raise KeyError(f"dataset {dataset_name!r} lacks sample_id(s) {missing.tolist()}")
    return rows


def rank_ids_for_epoch(order: np.ndarray, cursor: int, plan: BatchPlan,
                       rank: int) -> np.ndarray:
    """Every sample_id this rank computes from ``cursor`` to the end of the epoch."""
    parts = []
    n = len(order)
    c = cursor
    while c < n:
        rows = step_rows(n, c, plan.global_batch_size)
        for a, b in rank_micro_slices(rows, plan, rank):
            parts.append(order[c + a:c + b])
        c += rows
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


# -------------------------------------------------------------------------- trainer
@dataclass
class Counters:
    """Run-wide counters that travel in the checkpoint (seconds are wall-clock)."""

    committed_train_s: float = 0.0   # step time of steps covered by a checkpoint
    uncommitted_train_s: float = 0.0  # step time since the last checkpoint (lost on failure)
    restarts: int = 0
    world_sizes_seen: list[int] = field(default_factory=list)
    tail_unseen: int = 0              # rows no rank trained on (always 0: short last step)


def _to_tensor(x: np.ndarray, y: Optional[np.ndarray], cfg: Config, device: torch.device):
    if cfg.model.name == "gpt":
        xt = torch.from_numpy(np.ascontiguousarray(x)).long()
    else:
        xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    yt = torch.from_numpy(y) if y is not None else None
    if device.type != "cpu":
        xt = xt.to(device, non_blocking=True)
        yt = yt.to(device, non_blocking=True) if yt is not None else None
    return xt, yt


def train_func(loop_config: dict) -> None:
    """Ray Train entry point; see the module docstring. ``loop_config`` holds ``config``
    (the validated Config as a dict) and ``job`` (run id, tracking URI, sorted train/val
    sample ids, job start time, ledger dir)."""
    t_enter = time.time()
    import ray.train
    import ray.train.torch

    cfg = Config.from_dict(loop_config["config"])
    job = loop_config["job"]
    ctx = ray.train.get_context()
    rank, ws = ctx.get_world_rank(), ctx.get_world_size()
    threads = cfg.scaling.torch_threads or max(1, int(cfg.scaling.cpus_per_worker))
    torch.set_num_threads(threads)
    device = ray.train.torch.get_device()
    t_start = time.time()

    plan = plan_for_world_size(cfg.batch.global_batch_size, cfg.batch.micro_batch_size, ws,
                               cfg.batch.policy, cfg.scaling.min_workers, cfg.batch.lr_scaling)
    t_marks = {"enter": t_enter, "imports": time.time()}
    tracker = RankZeroTracker(job["tracking_uri"], job["run_id"], enabled=rank == 0)
    t_marks["mlflow"] = time.time()

    train_ids = np.asarray(job["train_ids"], dtype=np.int64)
    val_ids = np.asarray(job["val_ids"], dtype=np.int64) if job.get("val_ids") is not None else None
    n_train = len(train_ids)
    total_samples = n_train * cfg.train.epochs
    if cfg.train.max_steps:
        # The cosine reaches its floor at the run's real end, also when max_steps cuts it.
        total_samples = min(total_samples, cfg.train.max_steps * cfg.batch.global_batch_size)
    steps_per_epoch = steps_in_epoch(n_train, plan.global_batch_size)
    total_steps = steps_per_epoch * cfg.train.epochs
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)

    # Same seed on every rank: identical initial weights without a broadcast (DDP also
    # broadcasts rank 0's at wrap time; FSDP shards what each rank built).
    torch.manual_seed(cfg.seed)
    strategy = build_strategy(cfg, build_model(cfg.model).to(device), device, ws, total_steps)
    model, opt, ddp_model = strategy.module, strategy.optimizer, strategy.model
    t_marks["model"] = time.time()

    step, epoch, cursor, samples_seen = 0, 0, 0, 0
    counters = Counters()
    resumed_from: Optional[int] = None
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = load_state(d)
        try:
            # Full (gathered) state: loads at any world size and under any strategy.
            strategy.load_full_state(state)
        except (RuntimeError, ValueError, KeyError) as e:
            # A checkpoint of another model config fails the same way on every attempt;
            # as a CheckpointError the controller stops at once (events._FATAL_PATTERNS)
            # instead of spending max_failures restarts on it.
            raise CheckpointError(
                f"checkpoint at step {state.get('step')} does not fit this config's model/"
                f"optimizer ({type(e).__name__}: {str(e).splitlines()[0][:300]}); resume it "
                f"with its own config (config.json beside state.pt) or set a new "
                f"run.name") from e
        step, epoch, cursor = state["step"], state["epoch"], state["cursor"]
        samples_seen = state["samples_seen"]
        counters = Counters(**json.loads(state["counters"]))
        counters.restarts += 1
        resumed_from = step
    counters.world_sizes_seen.append(ws)
    counters.uncommitted_train_s = 0.0
    t_marks["checkpoint"] = time.time()

    ledger = _Ledger(job.get("ledger_dir"), rank, resumed_from, ws)
    fault = _Fault(job.get("fault"), rank)
    if rank == 0:
        tracker.set_tags({"elastic_ddp.world_size": ws, "elastic_ddp.restarts": counters.restarts,
                          # gloo or nccl: what this attempt's collectives actually ran on.
                          "elastic_ddp.backend": dist.get_backend() if dist.is_initialized() else "none",
                          "elastic_ddp.device": str(device)})
    log = _Logger(rank, ws)
    log.info(f"start: world_size={ws} plan={plan} resume_step={resumed_from} "
             f"epoch={epoch} cursor={cursor} threads={threads} device={device}")

    # A materialized data set is read once per attempt and kept whole (each execution of
    # a Ray Data iterator costs seconds of fixed overhead); a streamed one is re-read
    # every epoch keeping only this rank's rows (memory ~ N / world_size).
    t_read = time.perf_counter()
    cached_rows = read_rows("train", train_ids, cfg) if cfg.data.materialize else None
    log.info(f"read {len(train_ids) if cached_rows is not None else 0} train rows in "
             f"{time.perf_counter() - t_read:.2f}s")
    val_rows = read_rows("val", val_ids[rank::ws], cfg) if val_ids is not None and len(val_ids[rank::ws]) else None
    t_marks["rows"] = time.time()
    names = list(t_marks)
    log.info(f"ready in {t_marks['rows'] - t_enter:.1f}s: " + ", ".join(
        f"{b} {t_marks[b] - t_marks[a]:.1f}s" for a, b in zip(names, names[1:])))
    win = _Window()
    max_steps = cfg.train.max_steps
    done = max_steps is not None and step >= max_steps
    # Where this (re)start's time went before its first step, joined by the driver with
    # the controller's marks (launcher.startup_breakdown); keyed by the first step.
    tracker.log_metrics({"attempt_enter_ts": t_enter, "attempt_ready_ts": time.time()}, step + 1)
    first_step_of_attempt = True

    while epoch < cfg.train.epochs and not done:
        order = epoch_order(train_ids, cfg.seed, epoch)
        t_read = time.perf_counter()
        if cached_rows is not None:
            rows = cached_rows
        elif cursor < n_train:
            rows = read_rows("train", rank_ids_for_epoch(order, cursor, plan, rank), cfg)
        win.data_s += time.perf_counter() - t_read
        while cursor < n_train:
            t0 = time.perf_counter()
            n_rows = step_rows(n_train, cursor, plan.global_batch_size)
            step_ids = order[cursor:cursor + n_rows]
            lr = lr_at(samples_seen, total_samples, cfg.optim.lr * plan.lr_multiplier,
                       cfg.optim.warmup_steps * cfg.batch.global_batch_size, cfg.optim.min_lr_ratio)
            for g in opt.param_groups:
                g["lr"] = lr
            # Per-step seeding makes dropout a function of (seed, step, rank) alone: RNG
            # streams cannot "continue" across a resize, where ranks change their rows.
            torch.manual_seed(cfg.seed * 1_000_003 + step * 1009 + rank)
            try:
                fault.at_step(step + 1)  # test hook; a no-op unless job["fault"] is set
                stats = _train_step(cfg, ddp_model, opt, rows, step_ids, n_rows, plan, rank,
                                    device, win, probe=_probe_step(step + 1, cfg),
                                    strategy=strategy)
            except Exception as e:
                raise StepError(f"step {step + 1} (epoch {epoch}, rank {rank}): "
                                f"{type(e).__name__}: {e}") from e
            ledger.record(epoch, step + 1, stats.pop("ids"))
            step += 1
            cursor += n_rows
            samples_seen += n_rows
            dt = time.perf_counter() - t0
            counters.uncommitted_train_s += dt
            win.add(stats, n_rows, dt, lr)
            if first_step_of_attempt:
                # The driver joins this with the controller's failure/resize times into
                # recovery seconds (launcher._log_events).
                tracker.log_metrics({"attempt_first_step_ts": time.time()}, step)
                first_step_of_attempt = False

            if (cfg.train.checksum_every_steps and step % cfg.train.checksum_every_steps == 0
                    and strategy.name != "fsdp"):  # fsdp ranks hold different shards by design
                _check_params_equal(model, step)
            if step == 1 or step % cfg.train.log_every_steps == 0:
                metrics = win.reduce(ws, device)
                metrics.update(step=step, epoch=epoch, world_size=ws)
                tracker.log_metrics(metrics, step)
                tracker.flush()
                log.info(f"epoch {epoch} step {step}/{steps_per_epoch * cfg.train.epochs} "
                         f"loss {metrics['train_loss']:.4f} lr {lr:.2e} "
                         f"{metrics['samples_per_s']:.0f} samples/s")
                win = _Window()
            if max_steps is not None and step >= max_steps:
                done = True
                break
            if step % cfg.train.checkpoint_every_steps == 0 and cursor < n_train:
                _checkpoint(cfg, strategy, step, epoch, cursor, samples_seen, counters, ws,
                            {"step": step, "epoch": epoch}, fault)
        if cursor >= n_train:
            epoch, cursor = epoch + 1, 0
            if val_rows is not None:
                vm = _evaluate(cfg, model, val_rows, device, len(val_ids), ws)
                vm.update(epoch=epoch)
                tracker.log_metrics(vm, step)
                tracker.flush()
                log.info(f"epoch {epoch} done: " + " ".join(f"{k}={v:.4f}" for k, v in vm.items()))
            else:
                vm = {}
            _checkpoint(cfg, strategy, step, epoch, cursor, samples_seen, counters, ws,
                        {"step": step, "epoch": epoch, **vm}, fault)

    if done and cursor != 0:
        vm = _evaluate(cfg, model, val_rows, device, len(val_ids), ws) if val_rows is not None else {}
        tracker.log_metrics(vm, step)
        _checkpoint(cfg, strategy, step, epoch, cursor, samples_seen, counters, ws,
                    {"step": step, "epoch": epoch, **vm})
    goodput = counters.committed_train_s / max(1e-9, time.time() - job["t0"])
    tracker.log_metrics({"goodput": goodput, "restarts": counters.restarts}, step)
    tracker.flush()
    tracker.set_tags({"elastic_ddp.world_sizes_seen": counters.world_sizes_seen})
    ledger.close()


def _train_step(cfg: Config, ddp_model, opt, rows: LocalRows, step_ids: np.ndarray,
                n_rows: int, plan: BatchPlan, rank: int, device, win: "_Window",
                probe: bool = False, strategy: Optional[Strategy] = None) -> dict:
    """One optimizer step: grad_accum_steps micro-batches, DDP all-reduce only on the last
    (``no_sync`` on the others saves (A-1) all-reduces of the full gradient per step).

    Timing (into ``win``, see ``elastic_ddp.metrics``): data wait, each micro-step's
    forward+backward split into syncing (overlapped all-reduce inside) and ``no_sync``
    ones, and the optimizer. ``probe=True`` (once per log window, multi-rank only) runs
    the last micro-step under ``no_sync`` too and then all-reduces the flattened
    gradient explicitly: the same averaged gradient (divide by N then SUM, as DDP's
    default hook does; bit-identical for N=2, summation order may differ in the last bit
    for N>2 in gloo's ring), at the price of that one step's overlap. It gives the
    no_sync reference when there is no accumulation, and the whole un-overlapped
    all-reduce time for the bus bandwidth.
    """
    slices = rank_micro_slices(n_rows, plan, rank)
    weight = plan.world_size / n_rows
    is_ddp = hasattr(ddp_model, "no_sync")
    # The probe's hand-made all-reduce would bypass a compression hook: other maths.
    probe = probe and is_ddp and cfg.parallel.comm_hook == "none"
    all_slices = [rank_micro_slices(n_rows, plan, r) for r in range(plan.world_size)]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.parallel.bf16)
    clock = win.clock(device)
    loss_sum, correct_sum, count = 0.0, 0.0, 0
    used = []
    for i, (a, b) in enumerate(slices):
        t = clock.start()
        ids = step_ids[a:b]
        x, y = rows.take(ids)
        xt, yt = _to_tensor(x, y, cfg, device)
        clock.stop("data", t)
        syncing = is_ddp and i == len(slices) - 1 and not probe
        sync_ctx = ddp_model.no_sync() if is_ddp and not syncing else contextlib.nullcontext()
        if strategy is not None and strategy.name == "fsdp":
            strategy.maybe_no_sync(i == len(slices) - 1)  # FSDP2: reduce-scatter on the last only
        # Every rank knows every rank's slice sizes, so all take the same BatchNorm
        # decision without a collective (see _batchnorm_guard).
        smallest = min(s_[i][1] - s_[i][0] for s_ in all_slices)
        t = clock.start()
        with sync_ctx, _batchnorm_guard(ddp_model, smallest), autocast:
            loss_vec, correct = per_sample_loss(ddp_model, cfg.model, xt, yt)
            loss_vec = loss_vec.float()
            (loss_vec.sum() * weight).backward()
        # Three kinds: "fb" (one rank, no DDP), "fb_sync", "fb_nosync". Counted the same
        # way on every rank (even an empty slice), so every rank reduces the same keys.
        kind = "fb_sync" if syncing else ("fb_nosync" if is_ddp else "fb")
        clock.stop(kind, t)
        win.micro[kind] = win.micro.get(kind, 0) + 1
        if xt.dim() == 2 and cfg.model.name == "gpt":
            win.tokens_per_sample = xt.shape[1] - 1
        # .item() is a device sync; on CPU it is free, on GPU it costs one sync per
        # micro-step, accepted for exact per-step metrics.
        loss_sum += float(loss_vec.detach().sum())
        correct_sum += float(correct.detach().float().sum())
        count += b - a
        used.append(ids)
    if win.grad_bytes is None:
        win.grad_bytes = gradient_bytes(ddp_model.parameters())
    if probe:
        t = clock.start()
        _allreduce_gradients(ddp_model, plan.world_size)
        clock.stop("allreduce_probe", t)
        win.probes += 1
    t = clock.start()
    if cfg.optim.grad_clip > 0:
        if strategy is not None:
            strategy.clip_grad_norm(cfg.optim.grad_clip)
        else:
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), cfg.optim.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    clock.stop("opt", t)
    return {"loss_sum": loss_sum, "correct_sum": correct_sum, "count": count,
            "ids": np.concatenate(used) if used else np.zeros(0, np.int64)}


@contextlib.contextmanager
def _batchnorm_guard(model: torch.nn.Module, smallest_rows: int):
    """Run BatchNorm layers on their running statistics for a micro-step in which some
    rank holds fewer than 2 rows (batch statistics of 0 or 1 sample are undefined or
    raise). The decision uses the smallest slice over all ranks, so SyncBatchNorm's
    collective is skipped on every rank or on none."""
    if smallest_rows >= 2:
        yield
        return
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]
    for m in bns:
        m.eval()
    try:
        yield
    finally:
        for m in bns:
            m.train()


def _allreduce_gradients(model: torch.nn.Module, ws: int) -> None:
    """Average gradients over ranks by hand, as DDP's default comm hook does (divide by
    ws, then all-reduce SUM), in one flat buffer per dtype -- one collective, like one
    big DDP bucket, so its time is the whole all-reduce. Costs a gradient-sized copy."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for dtype in sorted({g.dtype for g in grads}, key=str):
        group = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in group]).div_(ws)
        dist.all_reduce(flat)
        offset = 0
        for g in group:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _probe_step(step: int, cfg: Config) -> bool:
    """Whether optimizer step ``step`` (1-based) is a probe step: the log step that
    closes each window, except step 1 (a cold first all-reduce would read as a slow
    link). At most 1 in log_every_steps steps loses its all-reduce overlap."""
    return step > 1 and step % cfg.train.log_every_steps == 0


class _Window:
    """Per-rank sums between two metric logs; ``reduce`` all-reduces them (two small
    collectives, a sync point paid only on log steps).

    Logged (``elastic_ddp.metrics`` has the formulas; ``*_mean``/``*_max`` over ranks,
    seconds per optimizer step unless noted): step_time_s, data_wait_s, fwd_bwd_s
    (forward+backward, overlapped all-reduce inside), allreduce_exposed_s (the part
    backward did not hide), optimizer_s, allreduce_s (one whole un-overlapped all-reduce,
    probe windows only; plus _min), peak_mem_mib (RSS high-water mark on CPU,
    max_memory_allocated on GPU); and samples_per_s (tokens_per_s for gpt) over the
    slowest rank's step time, data_wait_frac, grad_bytes, allreduce_bytes_per_step
    (ring: 2(N-1)/N x grad bytes per rank), allreduce_busbw_GBps (ring bytes over the
    fastest rank's whole all-reduce time, 1e9 bytes/s).
    """

    def __init__(self):
        self.loss_sum = self.correct_sum = 0.0
        self.count = self.steps = 0
        self.step_s = 0.0
        self.data_s = 0.0   # host-side data time added by train_func (epoch reads)
        self.samples = 0
        self.lr = 0.0
        self.micro: dict[str, int] = {}
        self.probes = 0
        self.grad_bytes: Optional[int] = None
        self.tokens_per_sample: Optional[int] = None
        self._clock: Optional[PhaseClock] = None

    def clock(self, device) -> PhaseClock:
        if self._clock is None:
            self._clock = PhaseClock(device)
        return self._clock

    def add(self, stats: dict, n_rows: int, dt: float, lr: float) -> None:
        self.loss_sum += stats["loss_sum"]
        self.correct_sum += stats["correct_sum"]
        self.count += stats["count"]
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
        stats, sums = reduce_mean_max(
            per_rank, ws, device,
            extra_sums={"loss_sum": self.loss_sum, "correct_sum": self.correct_sum,
                        "count": float(self.count)})
        count = max(1.0, sums["count"])
        step_s_max = stats["step_time_s_max"] * n
        out = {k: v for k, v in stats.items() if not k.endswith("_min")}
        out.update({
            "train_loss": sums["loss_sum"] / count,
            "train_acc": sums["correct_sum"] / count,
            "lr": self.lr,
            # The slowest rank sets the pace of a synchronous step.
            "samples_per_s": throughput(self.samples, step_s_max),
            "step_time_s": stats["step_time_s_max"],
            "data_wait_frac": stats["data_wait_s_max"] / max(1e-12, stats["step_time_s_max"]),
        })
        if self.tokens_per_sample:
            out["tokens_per_s"] = throughput(self.samples * self.tokens_per_sample, step_s_max)
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


@torch.no_grad()
def _evaluate(cfg: Config, model: torch.nn.Module, rows: LocalRows, device,
              total_rows: Optional[int] = None, ws: int = 1) -> dict[str, float]:
    """Validation over this rank's slice of the val set, summed across ranks (exact mean
    whatever the split). Language models report bits per byte = nats/token / ln 2.

    Every rank runs the same number of batches (the largest rank slice's count; short
    ranks run empty batches): FSDP's forward all-gathers parameters, so an unequal count
    would hang the ranks that ran out first."""
    model.eval()
    bs = max(1, cfg.batch.micro_batch_size * 2)
    loss_sum = correct_sum = count = 0.0
    per_rank = math.ceil(total_rows / ws) if total_rows else len(rows.ids)
    n_batches = math.ceil(per_rank / bs)
    if cfg.train.eval_max_batches:
        n_batches = min(n_batches, cfg.train.eval_max_batches)
    for i in range(n_batches):
        sl = slice(i * bs, (i + 1) * bs)
        xt, yt = _to_tensor(rows.x[sl], rows.y[sl] if rows.y is not None else None, cfg, device)
        loss_vec, correct = per_sample_loss(model, cfg.model, xt, yt)
        loss_sum += float(loss_vec.float().sum())
        correct_sum += float(correct.float().sum())
        count += len(loss_vec)
    model.train()
    t = torch.tensor([loss_sum, correct_sum, count], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    loss_sum, correct_sum, count = t.tolist()
    out = {"val_loss": loss_sum / max(1.0, count), "val_acc": correct_sum / max(1.0, count)}
    if cfg.model.name == "gpt":
        out["val_bpb"] = out["val_loss"] / math.log(2)
    return out


def _checkpoint(cfg: Config, strategy: Strategy, step: int, epoch: int, cursor: int,
                samples_seen: int, counters: Counters, ws: int, metrics: dict,
                fault: Optional["_Fault"] = None) -> None:
    """Every rank calls ``ray.train.report`` (a barrier); rank 0 alone writes the state.
    The steps since the last checkpoint become committed once report returns.
    ``fault``: the test hook (``where="checkpoint_write"`` kills rank 0 mid-write)."""
    import tempfile

    import ray.train
    from ray.train import Checkpoint

    rank = ray.train.get_context().get_world_rank()
    pending = counters.uncommitted_train_s
    counters.committed_train_s += pending
    counters.uncommitted_train_s = 0.0
    report_metrics = {k: float(v) for k, v in metrics.items()}
    # Collective for zero1 / fsdp / PowerSGD (gathers shards to rank 0): every rank calls it.
    full = strategy.full_state(rank)
    if rank != 0:
        ray.train.report(report_metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory(prefix="elastic-ddp-ckpt-") as d:
        state = {
            **full,  # "model" (no DDP prefix), "optimizer", and "comm_hook" for PowerSGD
            "step": step, "epoch": epoch, "cursor": cursor, "samples_seen": samples_seen,
            "world_size": ws,
            "rng": torch.get_rng_state(),
            "counters": json.dumps(counters.__dict__),
        }
        save_state(d, state, config=cfg.model_dump(mode="json"),
                   before_replace=fault.checkpoint_hook(step) if fault is not None else None)
        ray.train.report(report_metrics, checkpoint=Checkpoint.from_directory(d),
                         checkpoint_dir_name=f"checkpoint_step{step:08d}")


def _check_params_equal(model: torch.nn.Module, step: int) -> None:
    """All-reduce MIN and MAX of a float64 parameter checksum; unequal means ranks
    diverged (a bug or a silent corruption). Costs two tiny all-reduces."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    s = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
    lo, hi = s.clone().reshape(1), s.clone().reshape(1)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    if lo.item() != hi.item():
        raise RuntimeError(f"parameter checksum differs across ranks at step {step}: "
                           f"min {lo.item()!r} max {hi.item()!r}")


class _Fault:
    """TEST HOOK: fault injection in real processes (``job["fault"]``, set only by
    ``launcher.train(..., fault=...)``; None makes every method a no-op).

    ``{"rank": r, "at_step": k, "where": "step" | "checkpoint_write" | "error",
    "marker": "/path/fired"}``:

    - ``step``: rank r SIGKILLs itself just before computing step k (its peers block in
      that step's all-reduce: a worker dying mid-step as seen by the group).
    - ``checkpoint_write``: rank r (must be 0, the only writer) SIGKILLs itself inside
      ``save_state`` of the checkpoint at step k, after half of ``state.pt.tmp`` is on
      disk and before the ``os.replace``.
    - ``error``: rank r raises ``ValueError`` at step k on every attempt (a deterministic
      user error).

    A kill fires once per job: it creates ``marker`` first and never fires while the
    marker exists (a restarted attempt passes step k again). ``error`` ignores the marker
    for firing but creates it, so a test can see that it ran.
    """

    def __init__(self, spec: Optional[dict], rank: int):
        self.spec = spec if spec and int(spec.get("rank", 0)) == rank else None

    def _arm(self, where: str, step: int) -> bool:
        s = self.spec
        if s is None or s.get("where") != where or int(s["at_step"]) != step:
            return False
        marker = Path(s["marker"])
        if where != "error" and marker.exists():
            return False
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"t": time.time(), "step": step, "where": where,
                                      "pid": os.getpid()}))
        return True

    def at_step(self, step: int) -> None:
        """Before computing ``step`` (counted from 1): kill or raise when armed here."""
        if self._arm("error", step):
            raise ValueError(f"injected deterministic error at step {step}")
        if self._arm("step", step):
            os.kill(os.getpid(), signal.SIGKILL)

    def checkpoint_hook(self, step: int):
        """The ``save_state(before_replace=...)`` hook for the checkpoint at ``step``, or None."""
        if self.spec is None or self.spec.get("where") != "checkpoint_write" \
                or int(self.spec["at_step"]) != step:
            return None

        def hook(tmp: Path) -> None:
            if self._arm("checkpoint_write", step):
                # Leave a half-written file, as a crash inside torch.save would.
                with open(tmp, "r+b") as f:
                    f.truncate(max(1, tmp.stat().st_size // 2))
                os.kill(os.getpid(), signal.SIGKILL)
        return hook


class _Ledger:
    """Test/audit record of the sample ids each rank trained on, one JSON line per step,
    one file per (attempt, rank); audited by ``elastic_ddp.ledger``. Off unless
    ``job.ledger_dir`` is set.

    The header's ``attempt`` id is drawn by rank 0 and broadcast (one small gloo/NCCL
    collective per attempt, only when the ledger is on), so the audit can group the
    ranks of one worker group without trusting clocks.
    """

    def __init__(self, directory: Optional[str], rank: int, resumed_from: Optional[int], ws: int):
        self._f = None
        if directory:
            attempt = [uuid.uuid4().hex[:12]]
            if dist.is_available() and dist.is_initialized() and ws > 1:
                dist.broadcast_object_list(attempt, src=0)
            Path(directory).mkdir(parents=True, exist_ok=True)
            name = f"attempt-{time.time_ns()}-{attempt[0]}-rank{rank}.jsonl"
            self._f = open(Path(directory) / name, "w")
            self._f.write(json.dumps({"header": True, "attempt": attempt[0], "rank": rank,
                                      "world_size": ws, "resumed_from": resumed_from or 0,
                                      "t": time.time()}) + "\n")
            self._f.flush()

    def record(self, epoch: int, step: int, ids: np.ndarray) -> None:
        if self._f:
            self._f.write(json.dumps({"epoch": epoch, "step": step, "ids": ids.tolist()}) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f:
            self._f.close()


class _Logger:
    """Rank-prefixed log lines; only rank 0 prints routine lines."""

    def __init__(self, rank: int, ws: int):
        self.prefix = f"[rank {rank}/{ws}]"
        self.rank = rank

    def info(self, msg: str) -> None:
        if self.rank == 0:
            # sys.stdout, not print: Ray Train patches print() into its logger, which
            # then echoes every line twice on the driver.
            sys.stdout.write(f"{self.prefix} {msg}\n")
            sys.stdout.flush()
