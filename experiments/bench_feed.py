"""The reader's ceiling on an image workload: rows/s the elastic reader delivers to a step
that does almost no work, against plain Ray Data and ``torch.utils.data.DataLoader`` over
the same files with the same transform and the same number of data-path processes.

    .venv/bin/python experiments/bench_feed.py --out data/bench_feed --rows 4096 --procs 2

Data (``prepare``, written under ``--out`` only, never committed): scikit-learn's two
bundled photographs (``load_sample_images``, 427 x 640 RGB) cut into ``--rows`` square
crops at random offsets and scales (side 45-100 % of the short edge), each resized to
256 x 256 and JPEG-encoded (quality 90, ~20-30 kB); Parquet ``sample_id`` int64, ``jpeg``
binary, 4 files, 128-row row groups.

Transform (the same function in all three loaders): decode each JPEG (PIL), a random
224 x 224 crop and a random horizontal flip drawn from ``TransformContext.rngs()``
(``(seed, epoch, sample_id)`` alone, as the task protocol requires), collated to uint8
``[B, 3, 224, 224]``. Per-row work is array slicing; no Python per-pixel work.

Loaders, each given ``--procs`` processes for the data path on one local Ray cluster:

* ``elastic``: ``elastic_ddp.train``, 1 worker, global batch ``--batch``, a model of one
  weight (the step is a mean over the batch): its per-rank Ray Data pipeline runs
  ``READ_TASKS`` (2) read+transform tasks at a time, so ``--procs`` must be 2 for a like
  budget. Rows/s: rows of the steps after the first ``--warmup`` over the wall time
  between their ends (the ledger's step end times; reads outside the step, logging and
  the epochs' validation included); the ledger audit says whether every row was used
  exactly once per epoch.
* ``ray_data``: ``read_parquet -> map_batches(transform, concurrency=procs)`` and
  ``iter_torch_batches`` in this process (no exactness: no resume, no fixed order).
* ``dataloader``: the Parquet bytes in memory, a map-style dataset of batches,
  ``DataLoader(num_workers=procs)``.

Steady rows/s for the last two: rows after the first ``--warmup`` batches over the time
since. Figures on a shared machine are noisy: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SIZE, CROP = 256, 224


def prepare(out: Path, rows: int, seed: int = 0) -> Path:
    """``out/train`` (and a 64-row ``out/val``) of JPEG crops; returns ``out``."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = [Image.fromarray(a) for a in load_sample_images().images]
    rng = np.random.default_rng(seed)

    def crops(n: int) -> list[bytes]:
        out_bytes = []
        for _ in range(n):
            im = photos[int(rng.integers(len(photos)))]
            w, h = im.size
            side = int(min(w, h) * rng.uniform(0.45, 1.0))
            x, y = int(rng.integers(0, w - side + 1)), int(rng.integers(0, h - side + 1))
            buf = io.BytesIO()
            im.crop((x, y, x + side, y + side)).resize((SIZE, SIZE), Image.BILINEAR).save(
                buf, format="JPEG", quality=90)
            out_bytes.append(buf.getvalue())
        return out_bytes

    for split, n, files in (("train", rows, 4), ("val", 64, 1)):
        d = out / split
        d.mkdir(parents=True, exist_ok=True)
        for p in d.glob("*.parquet"):
            p.unlink()
        data = crops(n)
        bounds = np.linspace(0, n, files + 1).astype(int)
        for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            pq.write_table(pa.table({"sample_id": pa.array(np.arange(a, b, dtype=np.int64)),
                                     "jpeg": pa.array(data[a:b], pa.binary())}),
                           d / f"part-{k:05d}.parquet", row_group_size=128)
    return out


TASK = '''
import io

import numpy as np
import torch

from elastic_ddp import Column, Task, TransformContext

CROP = 224


def decode_crop_flip(jpegs, ctx: TransformContext) -> np.ndarray:
    """JPEG bytes [B] -> uint8 [B, 3, CROP, CROP]: decode, random crop, random flip."""
    from PIL import Image

    out = np.empty((len(jpegs), 3, CROP, CROP), dtype=np.uint8)
    for i, (data, g) in enumerate(zip(jpegs, ctx.rngs())):
        img = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        h, w = img.shape[:2]
        y, x = int(g.integers(0, h - CROP + 1)), int(g.integers(0, w - CROP + 1))
        img = img[y:y + CROP, x:x + CROP]
        if ctx.split == "train" and g.random() < 0.5:
            img = img[:, ::-1]
        out[i] = img.transpose(2, 0, 1)
    return out


class Feed(Task):
    columns = {"jpeg": Column.binary()}

    def transform(self, batch, ctx):
        return {"image": decode_crop_flip(batch["jpeg"], ctx)}

    def collate(self, batch):
        return {"image": torch.from_numpy(np.ascontiguousarray(batch["image"]))}

    def build_model(self):
        return torch.nn.Linear(1, 1)

    def loss(self, model, batch):
        # Almost no work: one channel mean per image through one weight.
        x = batch["image"][:, 0, ::56, ::56].float().mean(dim=(1, 2)).unsqueeze(1) / 255.0
        return model(x).squeeze(1) ** 2
'''


def _task_module(tmp: Path):
    import importlib.util

    path = tmp / "feed_task.py"
    path.write_text(TASK)
    spec = importlib.util.spec_from_file_location("feed_task", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, path


def run_elastic(data: Path, tmp: Path, task_path: Path, batch: int, epochs: int, warmup: int) -> dict:
    from mlflow.tracking import MlflowClient

    from elastic_ddp import Diagnostics, train
    from elastic_ddp.config import Config
    from elastic_ddp.data.scan import read_sample_ids
    from elastic_ddp.ledger import audit

    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    cfg = Config.from_dict({
        "seed": 0, "data": {"train_path": str(data / "train"), "val_path": str(data / "val"),
                            "id_column": "sample_id"},
        "task": {"path": f"{task_path}:Feed"},
        "optim": {"name": "sgd", "lr": 0.001, "warmup_steps": 0},
        "batch": {"global_batch_size": batch, "micro_batch_size": batch},
        "train": {"epochs": epochs, "log_every_steps": 4, "checkpoint_every_steps": 10_000},
        "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 1},
        "run": {"name": "bench-feed", "experiment_name": "bench-feed", "tracking_uri": uri,
                "storage_path": str(tmp / "ray_results")}})
    ledger = tmp / "ledger"
    s = train(cfg, progress=False, diagnostics=Diagnostics(ledger_dir=str(ledger)))
    # Step ends from the ledger: wall clock between steps, everything in between included
    # (the reader's blocking reads outside the step, logging, the epoch's validation).
    ends = []
    for f in sorted(ledger.glob("attempt-*-rank0.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if "step" in rec and "t" in rec:
                ends.append((rec["step"], rec["t"], len(rec["ids"])))
    ends.sort()
    tail = ends[warmup:]
    rows = sum(n for _, _, n in tail[1:])
    wait = [m.value for m in MlflowClient(uri).get_metric_history(s.run_id, "worker/data_wait_frac")]
    rep = audit(ledger, read_sample_ids(data / "train"), epochs)
    return {"rows_per_s": rows / max(1e-9, tail[-1][1] - tail[0][1]), "steps": len(ends),
            "data_wait_frac": float(np.median(wait)) if wait else float("nan"),
            "ledger_ok": bool(rep["ok"])}


def _timed(batches, warmup: int) -> dict:
    """Steady rows/s over an iterator of dicts with "image" [B, ...]."""
    rows, t_start, n = 0, None, 0
    for b in batches:
        n += 1
        if n == warmup:
            t_start = time.perf_counter()
        elif n > warmup:
            rows += len(b["image"])
    dt = time.perf_counter() - t_start if t_start is not None else float("nan")
    return {"rows_per_s": rows / dt if dt > 0 else float("nan"), "batches": n}


def run_ray_data(data: Path, mod, procs: int, batch: int, epochs: int, warmup: int) -> dict:
    import logging

    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)

    from elastic_ddp import TransformContext

    def gen():
        for epoch in range(epochs):
            def fn(b, epoch=epoch):
                ctx = TransformContext(0, epoch, "train", b["sample_id"])
                return {"sample_id": b["sample_id"], "image": mod.decode_crop_flip(b["jpeg"], ctx)}

            ds = ray.data.read_parquet(str(data / "train"), shuffle="files") \
                .map_batches(fn, batch_size=batch, batch_format="numpy", concurrency=procs)
            yield from ds.iter_torch_batches(batch_size=batch)
    return _timed(gen(), warmup)


class _Batches:
    """Map-style dataset: item k is the k-th batch of an epoch's permutation, transformed."""

    def __init__(self, ids: np.ndarray, jpegs: list, mod, batch: int, epochs: int):
        self.ids, self.jpegs, self.mod, self.batch = ids, jpegs, mod, batch
        self.plan = []
        for epoch in range(epochs):
            perm = np.random.default_rng(epoch).permutation(len(ids))
            self.plan += [(epoch, perm[a:a + batch]) for a in range(0, len(ids), batch)]

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, k: int) -> dict:
        import torch

        from elastic_ddp import TransformContext

        epoch, rows = self.plan[k]
        ctx = TransformContext(0, epoch, "train", self.ids[rows])
        return {"image": torch.from_numpy(self.mod.decode_crop_flip([self.jpegs[i] for i in rows], ctx))}


def run_dataloader(data: Path, mod, procs: int, batch: int, epochs: int, warmup: int) -> dict:
    import pyarrow.parquet as pq
    from torch.utils.data import DataLoader

    t = pq.read_table(data / "train")
    ds = _Batches(t["sample_id"].to_numpy(), t["jpeg"].to_pylist(), mod, batch, epochs)
    return _timed(DataLoader(ds, batch_size=None, num_workers=procs, prefetch_factor=2), warmup)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="data/bench_feed", help="where the Parquet crops are written")
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--procs", type=int, default=2, help="data-path processes per loader")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3, help="batches left out of the steady rate")
    p.add_argument("--only", default="elastic,ray_data,dataloader")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)
    out = Path(a.out)
    t0 = time.perf_counter()
    prepare(out, a.rows)
    print(f"prepared {a.rows} crops under {out} in {time.perf_counter() - t0:.1f} s", flush=True)

    from elastic_ddp.driver.local_ray import init_local_ray

    # The trainer's worker (1 CPU) plus the data path's processes.
    init_local_ray(num_cpus=a.procs + 1, configure_logging=False, log_to_driver=False)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        mod, task_path = _task_module(Path(tmp))
        for name in a.only.split(","):
            t = time.perf_counter()
            if name == "elastic":
                r = run_elastic(out, Path(tmp), task_path, a.batch, a.epochs, a.warmup)
            elif name == "ray_data":
                r = run_ray_data(out, mod, a.procs, a.batch, a.epochs, a.warmup)
            else:
                r = run_dataloader(out, mod, a.procs, a.batch, a.epochs, a.warmup)
            r["wall_s"] = time.perf_counter() - t
            results[name] = r
            print(f"{name}: {json.dumps(r)}", flush=True)
    best = max(r["rows_per_s"] for r in results.values())
    print(f"\n{'loader':<12} {'procs':>5} {'rows/s':>8} {'rows/s/proc':>11} {'of best':>8}")
    for name, r in results.items():
        print(f"{name:<12} {a.procs:>5} {r['rows_per_s']:>8.1f} {r['rows_per_s'] / a.procs:>11.1f} "
              f"{r['rows_per_s'] / best:>8.1%}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
