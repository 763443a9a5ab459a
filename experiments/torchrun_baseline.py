"""Plain ``torchrun`` DDP baseline for the overhead benchmark: no Ray, no MLflow.

    .venv/bin/torchrun --standalone --nproc-per-node 2 experiments/torchrun_baseline.py \\
        experiments/configs/bench_gpt.yaml --set train.max_steps=60

Same job as ``elastic-ddp train`` on the same config: the model from
``elastic_ddp.models.build_model`` (same seed), rows from the same Parquet files (read
with pyarrow, every rank reads all rows like the elastic worker does), the same global
batch, per-rank split and gradient accumulation (``elastic_ddp.batching``), the same
per-sample loss weighting, optimizer and LR schedule, gloo, and the same torch thread
count per process. What it leaves out is everything elastic-ddp adds: Ray, Ray Data,
MLflow, checkpoints, the ledger, per-phase timers.

Prints one JSON line on rank 0 (prefixed ``BASELINE_RESULT``):
    world_size, steps, samples_per_s (steady state: steps warmup+1..max_steps, wall time
    on rank 0), first_step_ts (epoch seconds at the end of step 1),
    proc_start_to_first_step_s (from this process's creation), data_wait_frac (share of
    the steady-state steps spent gathering rows and making tensors).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

T_IMPORT = time.time()

import numpy as np  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from elastic_ddp.batching import epoch_order, lr_at, plan_for_world_size, rank_micro_slices, step_rows  # noqa: E402
from elastic_ddp.config import Config  # noqa: E402
from elastic_ddp.models import build_model, per_sample_loss  # noqa: E402
from elastic_ddp.parallel import build_optimizer  # noqa: E402
from elastic_ddp.worker import LocalRows, _to_tensor  # noqa: E402


def _proc_start() -> float:
    """This process's start time (epoch seconds) from /proc; falls back to import time."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001
        return T_IMPORT


def read_all_rows(path: str, cfg: Config) -> LocalRows:
    """Every row of the Parquet data set at ``path`` with pyarrow, sorted by sample_id.
    x: [n, D] from the fixed-length list column (one flatten, no per-row Python)."""
    d = cfg.data
    cols = [d.id_column, d.feature_column] + ([d.label_column] if d.label_column else [])
    table = pq.ParquetDataset(path).read(columns=cols)
    ids = table.column(d.id_column).to_numpy().astype(np.int64)
    feat = table.column(d.feature_column).combine_chunks()
    flat = pc.list_flatten(feat).to_numpy(zero_copy_only=False)
    x = flat.reshape(len(ids), -1)
    y = table.column(d.label_column).to_numpy().astype(np.int64) if d.label_column else None
    order = np.argsort(ids, kind="stable")
    return LocalRows(ids[order], x[order], y[order] if y is not None else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--warmup-steps", type=int, default=10,
                    help="steps excluded from the steady-state figures")
    args = ap.parse_args()

    rank = int(os.environ.get("RANK", 0))
    ws = int(os.environ.get("WORLD_SIZE", 1))
    cfg = Config.load(args.config, args.overrides + [f"scaling.min_workers={ws}",
                                                     f"scaling.max_workers={ws}"])
    threads = cfg.scaling.torch_threads or max(1, int(cfg.scaling.cpus_per_worker))
    torch.set_num_threads(threads)
    if ws > 1:
        dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(
            seconds=cfg.scaling.collective_timeout_s))

    plan = plan_for_world_size(cfg.batch.global_batch_size, cfg.batch.micro_batch_size, ws,
                               cfg.batch.policy, cfg.scaling.min_workers, cfg.batch.lr_scaling)
    rows = read_all_rows(cfg.data.train_path, cfg)
    device = torch.device("cpu")
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model)
    opt = build_optimizer(cfg, model.parameters())
    ddp = torch.nn.parallel.DistributedDataParallel(model) if ws > 1 else model

    n = len(rows.ids)
    max_steps = cfg.train.max_steps or 100
    total_samples = n * cfg.train.epochs
    warm = min(args.warmup_steps, max_steps - 1)
    step, epoch, cursor, samples_seen = 0, 0, 0, 0
    first_step_ts = t_warm = None
    data_s = steady_data_s = 0.0
    order = epoch_order(rows.ids, cfg.seed, epoch)
    while step < max_steps:
        if cursor >= n:
            epoch, cursor = epoch + 1, 0
            order = epoch_order(rows.ids, cfg.seed, epoch)
        n_rows = step_rows(n, cursor, plan.global_batch_size)
        step_ids = order[cursor:cursor + n_rows]
        lr = lr_at(samples_seen, total_samples, cfg.optim.lr * plan.lr_multiplier,
                   cfg.optim.warmup_steps * cfg.batch.global_batch_size, cfg.optim.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        slices = rank_micro_slices(n_rows, plan, rank)
        weight = plan.world_size / n_rows
        loss_sum = 0.0
        for i, (a, b) in enumerate(slices):
            t_d = time.perf_counter()
            x, y = rows.take(step_ids[a:b])
            xt, yt = _to_tensor(x, y, cfg, device)
            data_s += time.perf_counter() - t_d
            last = i == len(slices) - 1
            ctx = ddp.no_sync() if ws > 1 and not last else contextlib.nullcontext()
            with ctx:
                loss_vec, _ = per_sample_loss(ddp, cfg.model, xt, yt)
                (loss_vec.sum() * weight).backward()
            loss_sum += float(loss_vec.detach().sum())
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        cursor += n_rows
        samples_seen += n_rows
        if step == 1:
            first_step_ts = time.time()
        if step == warm:
            t_warm, steady_data_s = time.perf_counter(), data_s
    t_end = time.perf_counter()
    steady = max(1, max_steps - warm)
    result = {
        "world_size": ws, "steps": max_steps, "threads": threads,
        "samples_per_s": steady * plan.global_batch_size / (t_end - t_warm),
        "first_step_ts": first_step_ts,
        "proc_start_to_first_step_s": first_step_ts - _proc_start(),
        "data_wait_frac": (data_s - steady_data_s) / (t_end - t_warm),
        "last_loss": loss_sum / max(1, sum(b - a for a, b in slices)),
    }
    if rank == 0:
        print("BASELINE_RESULT " + json.dumps(result), flush=True)
    if ws > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
