"""Shuffle quality: final validation loss with the windowed order against the full
permutation, over several seeds, for a config's task.

    .venv/bin/python experiments/shuffle_quality.py --config experiments/configs/digits_cnn.yaml --seeds 0,1,2,3,4
    .venv/bin/python experiments/shuffle_quality.py --config experiments/configs/pycode_gpt.yaml --seeds 0,1,2,3,4

Each (order, seed) trains the config in one process, without Ray: the plain-PyTorch
replay of the job (the library's epoch order over the real row groups, the task's
transform, collate and per-sample loss, the mean over each global batch, the same
optimizer, LR schedule and clipping), which the end-to-end tests show equal to the
distributed job (``tests/e2e/tracking/test_train_e2e.py``: the same step-1 loss, the same final
accuracy within one val row). Validation: the task's ``evaluate`` over the whole val
split (or ``train.eval_max_batches`` batches of 2 x micro_batch_size rows, as the job).

Prints per order the mean final val loss +- standard error over seeds, and the paired
difference windowed - permutation (per seed, relative, then mean +- s.e.).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch


def _rows(cfg, task, split_path):
    from ray.data.block import BlockAccessor

    from elastic_ddp.data.scan import scan_parquet

    info = scan_parquet(split_path, task.input_columns(), cfg.data.id_column)
    table = pa.concat_tables(pq.read_table(f, columns=info.schema.names).select(info.schema.names)
                             .cast(info.schema) for f in info.files)
    return info, BlockAccessor.for_block(table).to_batch_format("numpy")


def replay(cfg, task, train, val) -> float:
    """Final val loss of ``cfg`` trained in one process on the library's order."""
    from elastic_ddp.batching import lr_at, run_length, step_rows
    from elastic_ddp.data.ingest import epoch_order
    from elastic_ddp.parallel.strategies import build_optimizer
    from elastic_ddp.tasks.loading import build_model
    from elastic_ddp.tasks.protocol import TransformContext

    info, rows = train
    starts = np.cumsum([0] + [g.num_rows for g in info.row_groups])
    plan, run = run_length(cfg, info.num_rows, 1)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, task)
    opt = build_optimizer(cfg, model.parameters())
    g, step = plan.global_batch_size, 0
    for epoch in range(cfg.train.epochs):
        order = epoch_order(info, cfg, epoch)
        glob = np.array([starts[i] + r for i, r in order.global_rows()])
        for c in range(0, info.num_rows, g):
            n = step_rows(info.num_rows, c, g)
            for grp in opt.param_groups:
                grp["lr"] = lr_at(c + epoch * info.num_rows, run.schedule_samples, run.peak_lr,
                                  run.warmup_samples, cfg.optim.min_lr_ratio)
            torch.manual_seed(cfg.seed * 1_000_003 + step * 1009)
            batch = {k: v[glob[c:c + n]] for k, v in rows.items()}
            batch = task.transform(batch, TransformContext(cfg.seed, epoch, "train",
                                                           batch[cfg.data.id_column]))
            out = task.loss(model, task.collate(batch))
            loss = (out[0] if isinstance(out, tuple) else out).float().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            opt.step()
            step += 1
            if cfg.train.max_steps and step >= cfg.train.max_steps:
                break
        if cfg.train.max_steps and step >= cfg.train.max_steps:
            break
    vinfo, vrows = val
    bs = 2 * cfg.batch.micro_batch_size
    n_val = vinfo.num_rows if not cfg.train.eval_max_batches else min(vinfo.num_rows, bs * cfg.train.eval_max_batches)
    model.eval()
    total = count = 0.0
    with torch.no_grad():
        for a in range(0, n_val, bs):
            b = {k: v[a:min(a + bs, n_val)] for k, v in vrows.items()}
            b = task.transform(b, TransformContext(cfg.seed, cfg.train.epochs, "val", b[cfg.data.id_column]))
            loss = task.evaluate(model, task.collate(b))["loss"]
            total += float(loss.sum())
            count += len(loss)
    return total / count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from elastic_ddp.config import Config
    from elastic_ddp.data.ingest import epoch_partitions
    from elastic_ddp.tasks.loading import load_task

    seeds = [int(s) for s in args.seeds.split(",")]
    base = Config.load(args.config, args.overrides)
    task = load_task(base)
    train, val = _rows(base, task, base.data.train_path), _rows(base, task, base.data.val_path)
    results: dict[str, list[float]] = {}
    for order in ("windowed", "permutation"):
        for seed in seeds:
            cfg = Config.load(args.config, args.overrides + [f"seed={seed}", f"data.order={order}"])
            t = time.time()
            loss = replay(cfg, task, train, val)
            results.setdefault(order, []).append(loss)
            print(f"{order:>11} seed {seed}: val_loss {loss:.4f} ({time.time() - t:.0f} s)", flush=True)
    print(f"\nconfig {args.config} {' '.join(args.overrides)}; seeds {seeds}; "
          f"partitions {epoch_partitions(train[0], base)}, shuffle_window_rows {base.data.shuffle_window_rows}")
    for order, vals in results.items():
        se = statistics.stdev(vals) / math.sqrt(len(vals)) if len(vals) > 1 else float("nan")
        print(f"{order:>11}: mean val_loss {statistics.mean(vals):.4f} +- {se:.4f} (s.e.)")
    diffs = [(w - p) / p for w, p in zip(results["windowed"], results["permutation"])]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    print(f"paired (windowed - permutation) / permutation: {statistics.mean(diffs):+.2%} +- {se:.2%}")


if __name__ == "__main__":
    main()
