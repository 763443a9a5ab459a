"""Plain ``torchrun`` DDP baseline for the overhead benchmark: no Ray, no MLflow.

    .venv/bin/torchrun --standalone --nproc-per-node 2 experiments/torchrun_baseline.py \\
        experiments/configs/bench_gpt.yaml --set train.max_steps=60

Same job as ``elastic-ddp train`` on the same config with ``data.order: permutation``: the
task and model from the config (``elastic_ddp.tasks.loading``, same seed), rows from the
same Parquet files (read with pyarrow; every rank reads all rows), the same epoch order,
global batch, per-rank split and gradient accumulation, the task's transform, collate and
per-sample loss with the same weighting, optimizer and LR schedule, gloo, and the same
torch thread count per process. What it leaves out is everything elastic-ddp adds: Ray,
Ray Data, MLflow, checkpoints, the ledger, per-phase timers.

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
from pathlib import Path

T_IMPORT = time.time()

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ray.data.block import BlockAccessor  # noqa: E402

from elastic_ddp.batching import grad_accum_steps, lr_at, micro_slices, run_length, step_rows  # noqa: E402
from elastic_ddp.config import Config  # noqa: E402
from elastic_ddp.data.order import EpochOrder  # noqa: E402
from elastic_ddp.data.scan import scan_parquet  # noqa: E402
from elastic_ddp.parallel.strategies import build_optimizer  # noqa: E402
from elastic_ddp.tasks.loading import build_model, load_task  # noqa: E402
from elastic_ddp.tasks.protocol import TransformContext  # noqa: E402


def _proc_start() -> float:
    """This process's start time (epoch seconds) from /proc; falls back to import time."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001
        return T_IMPORT


def read_all_rows(cfg: Config, task) -> tuple[dict, object]:
    """Every row of the training split (the task's columns and the ids) in file order,
    as a numpy batch, and the scan's info (row groups, for the epoch order)."""
    info = scan_parquet(cfg.data.train_path, task.input_columns(), cfg.data.id_column)
    table = pa.concat_tables(pq.read_table(f, columns=info.schema.names).select(info.schema.names)
                             .cast(info.schema) for f in info.files)
    return BlockAccessor.for_block(table).to_batch_format("numpy"), info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--warmup-steps", type=int, default=10,
                    help="steps excluded from the steady-state figures")
    ap.add_argument("--ckpt-dir", default=None,
                    help="checkpoint here every --ckpt-every steps and resume from the newest at "
                         "start (what torchrun --max-restarts needs to recover)")
    ap.add_argument("--ckpt-every", type=int, default=20)
    ap.add_argument("--step-log", default=None,
                    help="rank 0 appends one JSON line per step and per checkpoint here")
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

    task = load_task(cfg)
    rows, info = read_all_rows(cfg, task)
    plan, run = run_length(cfg, info.num_rows, ws)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, task)
    opt = build_optimizer(cfg, model.parameters())
    ddp = torch.nn.parallel.DistributedDataParallel(model) if ws > 1 else model

    n = info.num_rows
    max_steps = cfg.train.max_steps or 100
    warm = min(args.warmup_steps, max_steps - 1)
    step, epoch, cursor, samples_seen = 0, 0, 0, 0
    first_step_ts = t_warm = None
    data_s = steady_data_s = 0.0
    ckpt = Path(args.ckpt_dir) / "state.pt" if args.ckpt_dir else None
    if ckpt is not None and ckpt.exists():  # a torchrun restart: resume like elastic-ddp does
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, epoch, cursor, samples_seen = (int(state[k]) for k in ("step", "epoch", "cursor", "samples_seen"))
        warm = min(max_steps - 1, step + args.warmup_steps)
    log = open(args.step_log, "a") if args.step_log and rank == 0 else None
    order = EpochOrder(info.row_groups, cfg.seed, epoch, mode="permutation")
    while step < max_steps:
        t_step = time.time()
        if cursor >= n:
            epoch, cursor = epoch + 1, 0
            order = EpochOrder(info.row_groups, cfg.seed, epoch, mode="permutation")
        n_rows = step_rows(n, cursor, plan.global_batch_size)
        lr = lr_at(samples_seen, run.schedule_samples, run.peak_lr, run.warmup_samples,
                   cfg.optim.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        shares = order.rank_rows(cursor, n_rows, ws, list(plan.rows_per_rank))
        start = cursor + sum(shares[:rank])
        mine = order.permutation[start:start + shares[rank]]
        slices = micro_slices(shares[rank], grad_accum_steps(shares, cfg.batch.micro_batch_size))
        weight = ws / n_rows
        loss_sum = 0.0
        for i, (a, b) in enumerate(slices):
            t_d = time.perf_counter()
            idx = mine[a:b]
            batch = {k: v[idx] for k, v in rows.items()}
            batch = task.transform(batch, TransformContext(cfg.seed, epoch, "train",
                                                           batch[cfg.data.id_column]))
            tensors = task.collate(batch)
            data_s += time.perf_counter() - t_d
            last = i == len(slices) - 1
            ctx = ddp.no_sync() if ws > 1 and not last else contextlib.nullcontext()
            with ctx:
                out = task.loss(ddp, tensors)
                loss_vec = out[0] if isinstance(out, tuple) else out
                (loss_vec.sum() * weight).backward()
            loss_sum += float(loss_vec.detach().sum())
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        cursor += n_rows
        samples_seen += n_rows
        if first_step_ts is None:
            first_step_ts = time.time()
        if log is not None:
            log.write(json.dumps({"step": step, "t": time.time(), "dt": time.time() - t_step,
                                  "pid": os.getpid()}) + "\n")
            log.flush()
        if ckpt is not None and step % args.ckpt_every == 0:
            if rank == 0:  # atomic: a kill mid-write leaves the previous checkpoint
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                            "epoch": epoch, "cursor": cursor, "samples_seen": samples_seen},
                           ckpt.with_suffix(".tmp"))
                os.replace(ckpt.with_suffix(".tmp"), ckpt)
                if log is not None:
                    log.write(json.dumps({"ckpt": step, "t": time.time()}) + "\n")
                    log.flush()
            if ws > 1:
                dist.barrier()
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
