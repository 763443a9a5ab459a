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
from elastic_ddp.checkpoint import load_state, save_state, unwrap_state_dict
from elastic_ddp.config import Config
from elastic_ddp.models import build_model, per_sample_loss
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
    tracker = RankZeroTracker(job["tracking_uri"], job["run_id"], enabled=rank == 0)

    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model).to(device)
    opt = _build_optimizer(cfg, model)

    train_ids = np.asarray(job["train_ids"], dtype=np.int64)
    val_ids = np.asarray(job["val_ids"], dtype=np.int64) if job.get("val_ids") is not None else None
    n_train = len(train_ids)
    total_samples = n_train * cfg.train.epochs
    steps_per_epoch = steps_in_epoch(n_train, plan.global_batch_size)

    step, epoch, cursor, samples_seen = 0, 0, 0, 0
    counters = Counters()
    resumed_from: Optional[int] = None
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = load_state(d)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, epoch, cursor = state["step"], state["epoch"], state["cursor"]
        samples_seen = state["samples_seen"]
        counters = Counters(**json.loads(state["counters"]))
        counters.restarts += 1
        resumed_from = step
    counters.world_sizes_seen.append(ws)
    counters.uncommitted_train_s = 0.0

    ddp_model = model
    if dist.is_available() and dist.is_initialized() and ws > 1:
        ddp_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)

    ledger = _Ledger(job.get("ledger_dir"), rank, resumed_from, ws)
    if rank == 0:
        tracker.set_tags({"elastic_ddp.world_size": ws, "elastic_ddp.restarts": counters.restarts})
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
    win = _Window()
    max_steps = cfg.train.max_steps
    done = max_steps is not None and step >= max_steps
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
                stats = _train_step(cfg, ddp_model, opt, rows, step_ids, n_rows, plan, rank,
                                    device, win)
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

            if cfg.train.checksum_every_steps and step % cfg.train.checksum_every_steps == 0:
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
                _checkpoint(cfg, model, opt, step, epoch, cursor, samples_seen, counters, ws,
                            {"step": step, "epoch": epoch})
        if cursor >= n_train:
            epoch, cursor = epoch + 1, 0
            if val_rows is not None:
                vm = _evaluate(cfg, model, val_rows, device)
                vm.update(epoch=epoch)
                tracker.log_metrics(vm, step)
                tracker.flush()
                log.info(f"epoch {epoch} done: " + " ".join(f"{k}={v:.4f}" for k, v in vm.items()))
            else:
                vm = {}
            _checkpoint(cfg, model, opt, step, epoch, cursor, samples_seen, counters, ws,
                        {"step": step, "epoch": epoch, **vm})

    if done and cursor != 0:
        vm = _evaluate(cfg, model, val_rows, device) if val_rows is not None else {}
        tracker.log_metrics(vm, step)
        _checkpoint(cfg, model, opt, step, epoch, cursor, samples_seen, counters, ws,
                    {"step": step, "epoch": epoch, **vm})
    goodput = counters.committed_train_s / max(1e-9, time.time() - job["t0"])
    tracker.log_metrics({"goodput": goodput, "restarts": counters.restarts}, step)
    tracker.flush()
    tracker.set_tags({"elastic_ddp.world_sizes_seen": counters.world_sizes_seen})
    ledger.close()


def _build_optimizer(cfg: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    o = cfg.optim
    if o.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum,
                               weight_decay=o.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas),
                             weight_decay=o.weight_decay)


def _train_step(cfg: Config, ddp_model, opt, rows: LocalRows, step_ids: np.ndarray,
                n_rows: int, plan: BatchPlan, rank: int, device, win: "_Window") -> dict:
    """One optimizer step: grad_accum_steps micro-batches, DDP all-reduce only on the last
    (``no_sync`` on the others saves (A-1) all-reduces of the full gradient per step)."""
    slices = rank_micro_slices(n_rows, plan, rank)
    weight = plan.world_size / n_rows
    loss_sum, correct_sum, count = 0.0, 0.0, 0
    used = []
    for i, (a, b) in enumerate(slices):
        t_data = time.perf_counter()
        ids = step_ids[a:b]
        x, y = rows.take(ids)
        xt, yt = _to_tensor(x, y, cfg, device)
        win.data_s += time.perf_counter() - t_data
        last = i == len(slices) - 1
        sync_ctx = contextlib.nullcontext() if last or not hasattr(ddp_model, "no_sync") else ddp_model.no_sync()
        with sync_ctx:
            loss_vec, correct = per_sample_loss(ddp_model, cfg.model, xt, yt)
            (loss_vec.sum() * weight).backward()
        # .item() is a device sync; on CPU it is free, on GPU it costs one sync per
        # micro-step, accepted for exact per-step metrics.
        loss_sum += float(loss_vec.detach().sum())
        correct_sum += float(correct.detach().float().sum())
        count += b - a
        used.append(ids)
    t_opt = time.perf_counter()
    if cfg.optim.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), cfg.optim.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    win.opt_s += time.perf_counter() - t_opt
    return {"loss_sum": loss_sum, "correct_sum": correct_sum, "count": count,
            "ids": np.concatenate(used) if used else np.zeros(0, np.int64)}


class _Window:
    """Per-rank sums between two metric logs; ``reduce`` all-reduces them (a sync point,
    paid only on log steps)."""

    def __init__(self):
        self.loss_sum = self.correct_sum = 0.0
        self.count = self.steps = 0
        self.step_s = self.data_s = self.opt_s = 0.0
        self.samples = 0
        self.lr = 0.0

    def add(self, stats: dict, n_rows: int, dt: float, lr: float) -> None:
        self.loss_sum += stats["loss_sum"]
        self.correct_sum += stats["correct_sum"]
        self.count += stats["count"]
        self.steps += 1
        self.samples += n_rows
        self.step_s += dt
        self.lr = lr

    def reduce(self, ws: int, device) -> dict[str, float]:
        t = torch.tensor([self.loss_sum, self.correct_sum, float(self.count)],
                         dtype=torch.float64, device=device)
        mx = torch.tensor([self.step_s, self.data_s], dtype=torch.float64, device=device)
        if dist.is_initialized() and ws > 1:
            dist.all_reduce(t)
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        loss_sum, correct_sum, count = t.tolist()
        step_s_max, data_s_max = mx.tolist()
        return {
            "train_loss": loss_sum / max(1.0, count),
            "train_acc": correct_sum / max(1.0, count),
            "lr": self.lr,
            "samples_per_s": self.samples / max(1e-9, step_s_max),
            "step_time_s": step_s_max / max(1, self.steps),
            "data_wait_frac": data_s_max / max(1e-9, step_s_max),
        }


@torch.no_grad()
def _evaluate(cfg: Config, model: torch.nn.Module, rows: LocalRows, device) -> dict[str, float]:
    """Validation over this rank's slice of the val set, summed across ranks (exact mean
    whatever the split). Language models report bits per byte = nats/token / ln 2."""
    model.eval()
    bs = max(1, cfg.batch.micro_batch_size * 2)
    loss_sum = correct_sum = count = 0.0
    n_batches = math.ceil(len(rows.ids) / bs)
    if cfg.train.eval_max_batches:
        n_batches = min(n_batches, cfg.train.eval_max_batches)
    for i in range(n_batches):
        sl = slice(i * bs, (i + 1) * bs)
        xt, yt = _to_tensor(rows.x[sl], rows.y[sl] if rows.y is not None else None, cfg, device)
        loss_vec, correct = per_sample_loss(model, cfg.model, xt, yt)
        loss_sum += float(loss_vec.sum())
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


def _checkpoint(cfg: Config, model, opt, step: int, epoch: int, cursor: int,
                samples_seen: int, counters: Counters, ws: int, metrics: dict) -> None:
    """Every rank calls ``ray.train.report`` (a barrier); rank 0 alone writes the state.
    The steps since the last checkpoint become committed once report returns."""
    import tempfile

    import ray.train
    from ray.train import Checkpoint

    rank = ray.train.get_context().get_world_rank()
    pending = counters.uncommitted_train_s
    counters.committed_train_s += pending
    counters.uncommitted_train_s = 0.0
    report_metrics = {k: float(v) for k, v in metrics.items()}
    if rank != 0:
        ray.train.report(report_metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory(prefix="elastic-ddp-ckpt-") as d:
        state = {
            "model": unwrap_state_dict(model),
            "optimizer": opt.state_dict(),
            "step": step, "epoch": epoch, "cursor": cursor, "samples_seen": samples_seen,
            "world_size": ws,
            "rng": torch.get_rng_state(),
            "counters": json.dumps(counters.__dict__),
        }
        save_state(d, state, config=cfg.model_dump(mode="json"))
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


class _Ledger:
    """Test/audit record of the sample ids each rank trained on, one JSON line per step,
    one file per (attempt, rank). Off unless ``job.ledger_dir`` is set."""

    def __init__(self, directory: Optional[str], rank: int, resumed_from: Optional[int], ws: int):
        self._f = None
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            name = f"attempt-{time.time_ns()}-{uuid.uuid4().hex[:6]}-rank{rank}.jsonl"
            self._f = open(Path(directory) / name, "w")
            self._f.write(json.dumps({"header": True, "rank": rank, "world_size": ws,
                                      "resumed_from": resumed_from or 0,
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
