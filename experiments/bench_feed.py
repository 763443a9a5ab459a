"""The reader's ceiling: rows/s the elastic reader delivers to a step that does almost no
work, against plain Ray Data and ``torch.utils.data.DataLoader`` over the same files with
the same transform and collate and the same number of data-path processes, on two
workloads (images and tokens), each printed as one table.

    .venv/bin/python experiments/bench_feed.py --out data/bench_feed --rows 4096 --procs 2

Workloads (``--workloads images,tokens``; data written under ``--out`` only, never
committed):

* ``images``: scikit-learn's two bundled photographs (``load_sample_images``, 427 x 640
  RGB) cut into ``--rows`` square crops at random offsets and scales (side 45-100 % of the
  short edge), each resized to 256 x 256 and JPEG-encoded (quality 90, ~20-30 kB); Parquet
  ``sample_id`` int64, ``jpeg`` binary, 4 files, 128-row row groups. Transform: decode each
  JPEG (``simplejpeg`` where it is installed, ``pip install -e '.[feed]'``, else PIL; the
  table names it), a random 224 x 224 crop and a random horizontal flip drawn from
  ``TransformContext.rngs()`` (``(seed, epoch, sample_id)`` alone, as the task protocol
  requires); collate: uint8 ``[B, 3, 224, 224]``. Per-row work is array slicing.
* ``tokens``: this Python's standard-library source cut into documents of 64-2048 UTF-8
  bytes (``experiments/examples/stdlib_lm/prepare.py``, ``--token-mib`` MiB of text, 256-row
  row groups) and a 2,048-id byte-level BPE trained on them (``experiments/examples/hf_lm/
  prepare.py``'s ``train_tokenizer``). Transform: ``tokenizers`` ``encode_batch`` (one
  thread: ``TOKENIZERS_PARALLELISM=false``), each document ``int32 [n + 2]`` (BOS ... EOS,
  cut at 514 ids); collate: the batch's documents packed end to end into int64
  ``[R, 512]`` rows with a document index per token (``-1`` after the last), and ``lens``
  int64 ``[B]``.

Loaders, each given ``--procs`` processes for the data path on one local Ray cluster of
``--procs + 1`` CPUs:

* ``elastic``: ``elastic_ddp.train``, 1 worker, global batch ``--batch``, a model of one
  weight (the step is a mean over the batch), no validation split (the others have none);
  ``data.reader`` at its default (``dataloader``: ``data.read_tasks`` = ``--procs``
  DataLoader worker processes read and transform the rank's windows). Step end times come from the sample ledger, whose audit says whether every row
  was used exactly once per epoch. ``elastic_ray_data`` (only when named in ``--only``):
  the same with ``data.reader: ray_data`` (a Ray Data pipeline per rank, ``--procs``
  read+transform tasks at a time).
* ``elastic_reader``: the elastic reader alone in this process (:func:`run_reader`): the
  same readers, windows, order and DataLoader workers as ``elastic``, each step's rows
  taken and collated, the next epoch prefetched, but no training job beside it (no Ray
  Train worker, step, checkpoint, ledger or tracker on the cores); ``exact`` says every
  epoch took every row once. ``elastic`` against it is what the job itself costs.
* ``ray_data``: ``read_parquet`` (one block per row group) ``-> map_batches(transform,
  concurrency=procs)`` and
  ``iter_torch_batches(collate_fn=collate)`` in this process (no exactness: no resume, no
  fixed order).
* ``dataloader``: the Parquet columns in memory, a map-style dataset of batches (transform
  and collate in the workers), ``DataLoader(num_workers=procs)``.

Rows/s (steady): the rows of the epochs after the first ``--warmup-epochs`` over the wall
time from the last batch of the last warm-up epoch to the last batch (``--epochs`` >
``--warmup-epochs``; everything in between counts: for the elastic reader the steps, its
blocking reads, logging, the epoch-end checkpoints). The warm-up leaves out what happens
once per process: for the elastic job Ray Train's start-up, the first reads of new
DataLoader workers and the tracker's MLflow import after the first step, which share the
cores with the first epochs. ``first_s``: seconds from the loader's start to its first
batch (Ray Train's start-up included for the elastic reader). The loaders run interleaved, ``--repeat``
rounds; the table gives each loader's median and its ratio to the fastest median. Figures
on a shared machine are noisy: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SIZE, CROP = 256, 224
EXAMPLES = Path(__file__).resolve().parent / "examples"
LOADERS = ("elastic", "elastic_reader", "ray_data", "dataloader")
# data.reader of the elastic loaders: "elastic" is the default (auto); "elastic_ray_data"
# (only with --only) the Ray Data path.
ELASTIC = {"elastic": "auto", "elastic_ray_data": "ray_data"}
# The column of a collated batch whose length is the batch's rows.
COUNT = {"images": "image", "tokens": "lens"}
TASK_CLASS = {"images": "Feed", "tokens": "Tokens"}


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


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_prepare", EXAMPLES / name / "prepare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def prepare_tokens(out: Path, mib: float = 4.0, vocab_size: int = 2048) -> Path:
    """``out/train``, ``out/val`` (``sample_id``, ``text``, ``source``) of stdlib documents
    of 64-2048 bytes, ``mib`` MiB of text in all, and ``out/tokenizer.json``; returns ``out``."""
    import pyarrow.parquet as pq

    _example("stdlib_lm").prepare(out, doc_bytes=2048, min_bytes=64, max_bytes=int(mib * 2**20),
                                  train_files=4, row_group_rows=256)
    texts = pq.read_table(out / "train", columns=["text"])["text"].to_pylist()
    _example("hf_lm").train_tokenizer(texts, vocab_size).save(str(out / "tokenizer.json"))
    return out


TASK = '''
import io

import numpy as np
import torch

from elastic_ddp import Column, Task, TransformContext

CROP = 224
CTX = 512          # packed row length (tokens)
MAX_IDS = CTX + 2  # a document is cut to this many ids (BOS and EOS kept)

try:  # libjpeg-turbo without PIL's image objects: ~25% less time per 256 x 256 JPEG
    import simplejpeg

    DECODER = "simplejpeg"

    def decode(data: bytes) -> np.ndarray:
        return simplejpeg.decode_jpeg(data, colorspace="RGB")
except ImportError:
    DECODER = "PIL"

    def decode(data: bytes) -> np.ndarray:
        from PIL import Image

        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def decode_crop_flip(jpegs, ctx: TransformContext) -> np.ndarray:
    """JPEG bytes [B] -> uint8 [B, 3, CROP, CROP]: decode (``DECODER``), random crop,
    random flip."""
    out = np.empty((len(jpegs), 3, CROP, CROP), dtype=np.uint8)
    for i, (data, g) in enumerate(zip(jpegs, ctx.rngs())):
        img = decode(data)
        h, w = img.shape[:2]
        y, x = int(g.integers(0, h - CROP + 1)), int(g.integers(0, w - CROP + 1))
        img = img[y:y + CROP, x:x + CROP]
        if ctx.split == "train" and g.random() < 0.5:
            img = img[:, ::-1]
        out[i] = img.transpose(2, 0, 1)
    return out


def pack(seqs) -> dict:
    """Documents (int [n_i] each) end to end in rows of CTX tokens: ``ids`` int64 [R, CTX]
    (0 after the last), ``doc`` int64 [R, CTX] (the document of each token, -1 after the
    last), ``lens`` int64 [B]."""
    lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    flat = np.concatenate(list(seqs)) if len(seqs) else np.zeros(0, np.int64)
    n = max(1, -(-len(flat) // CTX)) * CTX
    ids, doc = np.zeros(n, np.int64), np.full(n, -1, np.int64)
    ids[:len(flat)], doc[:len(flat)] = flat, np.repeat(np.arange(len(seqs)), lens)
    return {"ids": torch.from_numpy(ids.reshape(-1, CTX)), "doc": torch.from_numpy(doc.reshape(-1, CTX)),
            "lens": torch.from_numpy(lens)}


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


class Tokens(Task):
    """Documents tokenized in the transform, packed in the collate."""

    columns = {"text": Column.string()}

    def __init__(self, tokenizer: str):
        with open(tokenizer) as f:
            self.tokenizer_json = f.read()
        self._tok = None

    def __getstate__(self):
        return {**self.__dict__, "_tok": None}  # rebuilt from its JSON in each process

    def tokenizer(self):
        if self._tok is None:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_str(self.tokenizer_json)
            self._tok.enable_truncation(MAX_IDS)
        return self._tok

    def transform(self, batch, ctx):
        encs = self.tokenizer().encode_batch([str(t) for t in batch["text"]])
        ids = np.empty(len(encs), dtype=object)
        for i, e in enumerate(encs):
            ids[i] = np.asarray(e.ids, dtype=np.int32)
        return {"ids": ids}

    def collate(self, batch):
        return pack(batch["ids"])

    def build_model(self):
        return torch.nn.Linear(1, 1)

    def loss(self, model, batch):
        # Almost no work: each document's mean id through one weight.
        doc, ids = batch["doc"].reshape(-1), batch["ids"].reshape(-1).float()
        keep = doc >= 0
        s = torch.zeros(len(batch["lens"]), device=ids.device).index_add_(0, doc[keep], ids[keep])
        x = (s / batch["lens"].clamp_min(1) / 2048.0).unsqueeze(1)
        return model(x).squeeze(1) ** 2
'''


def _task_module(tmp: Path):
    path = tmp / "feed_task.py"
    path.write_text(TASK)
    spec = importlib.util.spec_from_file_location("feed_task", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, path


def task_kwargs(workload: str, data: Path) -> dict:
    return {"tokenizer": str(data / "tokenizer.json")} if workload == "tokens" else {}


def _steady(marks: list[tuple[float, int, int]], warmup: int = 1) -> dict:
    """``marks``: (time s, epoch, rows) per batch in order. Rows of the epochs from
    ``warmup`` on over the time from the last warm-up epoch's last batch to the last
    batch."""
    first = [t for t, e, _ in marks if e < warmup]
    later = [(t, n) for t, e, n in marks if e >= warmup]
    if not first or not later:
        return {"rows_per_s": float("nan"), "batches": len(marks)}
    dt = later[-1][0] - first[-1]
    return {"rows_per_s": sum(n for _, n in later) / dt if dt > 0 else float("nan"),
            "batches": len(marks)}


def elastic_config(data: Path, run: Path, task_path: Path, workload: str, batch: int,
                   epochs: int, reader: str = "auto", **data_extra):
    """The elastic loader's job: 1 worker of 1 CPU, the whole batch in one micro-batch, a
    checkpoint at each epoch's end only; ``data_extra``: more ``data.*`` fields
    (``read_tasks``: the data-path processes)."""
    from elastic_ddp.config import Config

    return Config.from_dict({
        "seed": 0, "data": {"train_path": str(data / "train"), "id_column": "sample_id",
                              "reader": reader, **data_extra},
        "task": {"path": f"{task_path}:{TASK_CLASS[workload]}", "kwargs": task_kwargs(workload, data)},
        "optim": {"name": "sgd", "lr": 0.001, "warmup_steps": 0},
        "batch": {"global_batch_size": batch, "micro_batch_size": batch},
        "train": {"epochs": epochs, "log_every_steps": 16, "checkpoint_every_steps": 10_000},
        "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 1},
        "run": {"name": "bench-feed", "experiment_name": "bench-feed",
                "tracking_uri": f"sqlite:///{run / 'mlflow.db'}", "storage_path": str(run / "ray_results")}})


def ledger_marks(ledger: Path) -> list[tuple[float, int, int]]:
    """(time s, epoch, rows) of each step rank 0 recorded, in step order."""
    marks = []
    for f in sorted(ledger.glob("attempt-*-rank0.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if "step" in rec and "t" in rec:
                marks.append((rec["step"], rec["t"], rec["epoch"], len(rec["ids"])))
    return [(t, e, n) for _, t, e, n in sorted(marks)]


def run_elastic(data: Path, tmp: Path, task_path: Path, workload: str, batch: int,
                epochs: int, reader: str = "auto", warmup: int = 1, procs: int = 2) -> dict:
    from elastic_ddp import Diagnostics, train
    from elastic_ddp.data.scan import read_sample_ids
    from elastic_ddp.ledger import audit

    run = tmp / f"elastic-{time.time_ns()}"
    ledger = run / "ledger"
    t0 = time.time()
    train(elastic_config(data, run, task_path, workload, batch, epochs, reader, read_tasks=procs),
          progress=False, diagnostics=Diagnostics(ledger_dir=str(ledger)))
    marks = ledger_marks(ledger)
    rep = audit(ledger, read_sample_ids(data / "train"), epochs)
    return {**_steady(marks, warmup), "first_s": marks[0][0] - t0, "ledger_ok": bool(rep["ok"])}


def run_reader(data: Path, task, task_path: Path, workload: str, batch: int, epochs: int,
               warmup: int = 1, procs: int = 2) -> dict:
    """The elastic reader alone, as a rank of the elastic job uses it, in this process:
    ``open_train_reader`` of each epoch (rank 0 of 1, ``data.reader`` at its default),
    ``take`` of each step's rows and the task's collate, and the next epoch's reader
    opened and prefetching once this epoch's last round is being read (as
    ``worker.rank_loader`` does). No Ray Train job: no step, checkpoint, ledger or
    tracking beside it. ``exact``: every epoch took every row exactly once."""
    from elastic_ddp.data.readers import open_train_reader
    from elastic_ddp.data.scan import read_sample_ids, scan_parquet

    cfg = elastic_config(data, Path(tempfile.gettempdir()), task_path, workload, batch, epochs,
                         read_tasks=procs)
    info = scan_parquet(data / "train", task.columns, "sample_id")
    ids = np.sort(read_sample_ids(data / "train"))
    seen: dict[int, list] = {}

    def gen():
        nxt = None
        for epoch in range(epochs):
            _, rd = nxt or open_train_reader(info, task, cfg, 0, 1, epoch, 0, batch)
            nxt = None
            for c in range(0, info.num_rows, batch):
                rows = rd.take(c, min(batch, info.num_rows - c))
                seen.setdefault(epoch, []).append(rows["sample_id"])
                if nxt is None and epoch + 1 < epochs and rd.last_round_started:
                    nxt = open_train_reader(info, task, cfg, 0, 1, epoch + 1, 0, batch)
                    nxt[1].prefetch()
                yield epoch, task.collate(rows)

    r = _timed(gen(), COUNT[workload], warmup)
    r["exact"] = all(np.array_equal(np.sort(np.concatenate(seen[e])), ids) for e in range(epochs))
    return r


def run_scale_out(data: Path, tmp: Path, task_path: Path, workload: str, batch: int,
                  epochs: int, join_epoch: int, node_cpus: int, read_tasks: int, join: bool = True) -> dict:
    """The elastic job with ``data.reader: ray_data``, ``data.task_cpus: 1`` and
    ``data.read_tasks: read_tasks`` on a local multi-node cluster whose head (the
    trainer's node) has 2 CPUs: 1 for the training worker, 1 for the data path. Once the
    ledger shows epoch ``join_epoch`` started, a CPU-only node of ``node_cpus`` CPUs joins
    as a real one does (``ray start --address <head> --block``, its own raylet;
    stopped with SIGTERM at the end) (``join=False``: none joins, the control run).
    Returns each epoch's last step time (``ends``) and rows, ``after_from``: two epochs
    after the first one read with the node alive, the seconds from the join to the node being alive,
    and the ledger audit."""
    import signal
    import subprocess
    import threading

    import ray
    from ray.cluster_utils import Cluster

    from elastic_ddp import Diagnostics, train
    from elastic_ddp.data.scan import read_sample_ids
    from elastic_ddp.ledger import audit

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "object_store_memory": 2 * 2**30})
    ray.init(address=cluster.address, configure_logging=False, log_to_driver=False)
    run = tmp / f"scale-{time.time_ns()}"
    ledger = run / "ledger"
    stop, node = threading.Event(), {}

    def watch() -> None:
        while join and not stop.wait(0.2):
            try:
                started = any(e >= join_epoch for _, e, _ in ledger_marks(ledger))
            except (OSError, ValueError):  # a line being written
                continue
            if started:
                node["t"] = time.time()
                node["proc"] = subprocess.Popen(
                    [str(Path(sys.executable).parent / "ray"), "start", "--address", cluster.address,
                     "--num-cpus", str(node_cpus), "--object-store-memory", str(2**30), "--block",
                     "--disable-usage-stats"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
                while not stop.wait(0.2):
                    if sum(n["Alive"] for n in ray.nodes()) > 1:
                        node["alive_s"] = time.time() - node["t"]
                        return
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        train(elastic_config(data, run, task_path, workload, batch, epochs, "ray_data",
                             read_tasks=read_tasks, task_cpus=1),
              progress=False, diagnostics=Diagnostics(ledger_dir=str(ledger)))
    finally:
        stop.set()
        watcher.join()
        if "proc" in node:
            node["proc"].send_signal(signal.SIGTERM)
            node["proc"].wait(60)
        ray.shutdown()
        cluster.shutdown()
    marks = ledger_marks(ledger)
    ends = {e: max(t for t, x, _ in marks if x == e) for e in range(epochs)}
    rows = {e: sum(n for _, x, n in marks if x == e) for e in range(epochs)}
    # The first epoch whose round was read with the node alive (the one after the first
    # epoch that started once it was: its reader prefetched the next round then), plus
    # two: the new node's first tasks start its Ray worker processes (imports, the
    # task's set-up), once per node.
    alive = node["t"] + node["alive_s"] if "alive_s" in node else None
    after = next((e + 2 for e in range(2, epochs - 2) if alive is not None and ends[e - 2] >= alive), None)
    rep = audit(ledger, read_sample_ids(data / "train"), epochs)
    return {"ends": ends, "rows": rows, "after_from": after, "node_alive_s": node.get("alive_s"),
            "ledger_ok": bool(rep["ok"])}


def _rate(r: dict, epochs) -> float:
    """Rows/s over ``epochs`` of a :func:`run_scale_out` result (each from the end of
    the one before)."""
    es = [e for e in epochs if e >= 1 and e in r["ends"]]
    dt = sum(r["ends"][e] - r["ends"][e - 1] for e in es)
    return sum(r["rows"][e] for e in es) / dt if es and dt > 0 else float("nan")


def _timed(batches, key: str, warmup: int = 1) -> dict:
    """Steady rows/s (:func:`_steady`) over an iterator of (epoch, collated batch)."""
    t0, marks = time.perf_counter(), []
    for epoch, b in batches:
        marks.append((time.perf_counter(), epoch, len(b[key])))
    return {**_steady(marks, warmup), "first_s": marks[0][0] - t0 if marks else float("nan")}


def run_ray_data(data: Path, task, workload: str, procs: int, batch: int, epochs: int,
                 warmup: int = 1) -> dict:
    import logging

    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = ctx.print_on_execution_start = False
    ctx.execution_options.preserve_order = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)

    from elastic_ddp import TransformContext

    import pyarrow.parquet as pq

    cols = list(task.input_columns())
    row_groups = sum(pq.ParquetFile(f).num_row_groups for f in sorted((data / "train").glob("*.parquet")))

    def gen():
        for epoch in range(epochs):
            def fn(b, epoch=epoch):
                out = task.transform({c: b[c] for c in cols},
                                     TransformContext(0, epoch, "train", b["sample_id"]))
                return {"sample_id": b["sample_id"], **out}

            # One block per row group: with one per file (Ray Data's choice for a few
            # small files) the map operator gets fewer inputs than its concurrency.
            ds = ray.data.read_parquet(str(data / "train"), columns=["sample_id", *cols],
                                       shuffle="files", override_num_blocks=row_groups) \
                .map_batches(fn, batch_size=batch, batch_format="numpy", concurrency=procs)
            for b in ds.iter_torch_batches(batch_size=batch, collate_fn=task.collate):
                yield epoch, b
    return _timed(gen(), COUNT[workload], warmup)


class _Batches:
    """Map-style dataset: item k is the k-th batch of an epoch's permutation, transformed
    and collated."""

    def __init__(self, ids: np.ndarray, columns: dict, task, batch: int, epochs: int):
        self.ids, self.columns, self.task = ids, columns, task
        self.plan = []
        for epoch in range(epochs):
            perm = np.random.default_rng(epoch).permutation(len(ids))
            self.plan += [(epoch, perm[a:a + batch]) for a in range(0, len(ids), batch)]

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, k: int):
        from elastic_ddp import TransformContext

        epoch, rows = self.plan[k]
        ctx = TransformContext(0, epoch, "train", self.ids[rows])
        out = self.task.transform({c: v[rows] for c, v in self.columns.items()}, ctx)
        return epoch, self.task.collate(out)


def run_dataloader(data: Path, task, workload: str, procs: int, batch: int, epochs: int,
                   warmup: int = 1) -> dict:
    import pyarrow.parquet as pq
    from torch.utils.data import DataLoader

    cols = list(task.input_columns())
    t = pq.read_table(data / "train", columns=["sample_id", *cols])
    columns = {}
    for c in cols:
        arr = np.empty(t.num_rows, dtype=object)
        arr[:] = t[c].to_pylist()
        columns[c] = arr
    ds = _Batches(t["sample_id"].to_numpy(), columns, task, batch, epochs)
    return _timed(DataLoader(ds, batch_size=None, num_workers=procs, prefetch_factor=2), COUNT[workload], warmup)


def table(workload: str, results: dict, procs: int) -> str:
    """One workload's table: each loader's median steady rows/s over the rounds, per
    data-path process, and its ratio to the fastest median."""
    med = {k: statistics.median(r["rows_per_s"] for r in rs) for k, rs in results.items()}
    best = max(med.values())
    lines = [f"{workload}: {'loader':<16} {'procs':>5} {'rows/s':>8} {'rows/s/proc':>11} "
             f"{'of best':>8} {'first_s':>8}  rounds (rows/s)"]
    for k, rs in results.items():
        runs = " ".join(f"{r['rows_per_s']:.0f}" for r in rs)
        first = statistics.median(r["first_s"] for r in rs)
        lines.append(f"{'':<{len(workload) + 2}}{k:<16} {procs:>5} {med[k]:>8.1f} {med[k] / procs:>11.1f} "
                     f"{med[k] / best:>8.1%} {first:>8.1f}  {runs}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="data/bench_feed", help="where the workloads' Parquet is written")
    p.add_argument("--workloads", default="images,tokens")
    p.add_argument("--rows", type=int, default=4096, help="image crops")
    p.add_argument("--token-mib", type=float, default=4.0, help="MiB of document text")
    p.add_argument("--procs", type=int, default=2, help="data-path processes per loader")
    p.add_argument("--batch", type=int, default=64, help="images per batch")
    p.add_argument("--token-batch", type=int, default=256, help="documents per batch")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--warmup-epochs", type=int, default=2, help="epochs left out of the steady rate")
    p.add_argument("--repeat", type=int, default=1, help="interleaved rounds of the loaders")
    p.add_argument("--only", default=",".join(LOADERS))
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--scale-out", action="store_true",
                   help="instead: the elastic job on a local multi-node cluster, a CPU-only node "
                        "joining mid-run against a control run where none joins (the first of "
                        "--workloads; run_scale_out)")
    p.add_argument("--join-epoch", type=int, default=4, help="--scale-out: the epoch the node joins at")
    p.add_argument("--node-cpus", type=int, default=2, help="--scale-out: the CPU-only node's CPUs")
    p.add_argument("--read-tasks", type=int, default=3, help="--scale-out: data.read_tasks")
    a = p.parse_args(argv)
    if a.warmup_epochs < 1 or a.epochs <= a.warmup_epochs:
        p.error("--warmup-epochs must be >= 1 and --epochs larger (the steady rate is taken after the warm-up)")
    # One thread per data-path process: the tokenizer's Rust pool would otherwise take
    # every core (the environment is inherited by Ray's workers and the DataLoader's).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    out = Path(a.out)
    if a.scale_out:
        return scale_out(a, out)
    workloads = a.workloads.split(",")
    data = {}
    for w in workloads:
        t0 = time.perf_counter()
        data[w] = prepare(out / w, a.rows) if w == "images" else prepare_tokens(out / w, a.token_mib)
        import pyarrow.parquet as pq
        n = pq.ParquetDataset(data[w] / "train").read(columns=["sample_id"]).num_rows
        print(f"prepared {w}: {n} rows under {data[w]} in {time.perf_counter() - t0:.1f} s", flush=True)

    from elastic_ddp.driver.local_ray import init_local_ray

    # The trainer's worker (1 CPU) plus the data path's processes.
    init_local_ray(num_cpus=a.procs + 1, configure_logging=False, log_to_driver=False)
    results: dict = {w: {k: [] for k in a.only.split(",")} for w in workloads}
    with tempfile.TemporaryDirectory() as tmp:
        mod, task_path = _task_module(Path(tmp))
        for rnd in range(a.repeat):
            for w in workloads:
                task = getattr(mod, TASK_CLASS[w])(**task_kwargs(w, data[w]))
                batch = a.batch if w == "images" else a.token_batch
                for name in results[w]:
                    t = time.perf_counter()
                    if name in ELASTIC:
                        r = run_elastic(data[w], Path(tmp), task_path, w, batch, a.epochs, ELASTIC[name],
                                        a.warmup_epochs, a.procs)
                    elif name == "elastic_reader":
                        r = run_reader(data[w], task, task_path, w, batch, a.epochs, a.warmup_epochs, a.procs)
                    elif name == "ray_data":
                        r = run_ray_data(data[w], task, w, a.procs, batch, a.epochs, a.warmup_epochs)
                    else:
                        r = run_dataloader(data[w], task, w, a.procs, batch, a.epochs, a.warmup_epochs)
                    r["wall_s"] = time.perf_counter() - t
                    r["load"] = os.getloadavg()[0]
                    results[w][name].append(r)
                    print(f"round {rnd} {w} {name}: {json.dumps(r)}", flush=True)
    print()
    print(f"JPEG decoder: {mod.DECODER}")
    for w in workloads:
        print(table(w, results[w], a.procs))
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "decoder": mod.DECODER, "results": results}, indent=1))
    return 0


def scale_out(a, out: Path) -> int:
    """``--scale-out``: :func:`run_scale_out` with and without the join, interleaved,
    ``--repeat`` rounds; prints each run and the medians of after / before."""
    if a.join_epoch <= a.warmup_epochs or a.epochs < a.join_epoch + 5:
        raise SystemExit("--scale-out needs --join-epoch > --warmup-epochs and --epochs >= --join-epoch + 5")
    (w,) = a.workloads.split(",")[:1]
    data = prepare(out / w, a.rows) if w == "images" else prepare_tokens(out / w, a.token_mib)
    runs: dict[str, list] = {"join": [], "control": []}
    with tempfile.TemporaryDirectory() as tmp:
        _, task_path = _task_module(Path(tmp))
        for rnd in range(a.repeat):
            for name in runs:
                batch = a.batch if w == "images" else a.token_batch
                r = run_scale_out(data, Path(tmp), task_path, w, batch, a.epochs,
                                  a.join_epoch, a.node_cpus, a.read_tasks, join=name == "join")
                if name == "join" and r["after_from"] is None:
                    raise SystemExit("the node was alive too late for an 'after' window: more --epochs or --rows")
                # The control's "after": the same epochs as this round's join run's.
                after_from = r["after_from"] if name == "join" else runs["join"][-1]["after_from"]
                r["before"] = _rate(r, range(a.warmup_epochs, a.join_epoch))
                r["after"] = _rate(r, range(after_from, a.epochs))
                r["load"] = os.getloadavg()[0]
                runs[name].append(r)
                print(f"round {rnd} {name}: before {r['before']:.0f} after (epochs {after_from}-"
                      f"{a.epochs - 1}) {r['after']:.0f} rows/s, node alive after "
                      f"{r['node_alive_s'] or 0:.1f} s, ledger ok {r['ledger_ok']}, load {r['load']:.1f}; "
                      f"epochs' rows/s {[round(_rate(r, [e])) for e in range(1, a.epochs)]}", flush=True)
    print(f"\nscale-out, {w}, data.reader ray_data, data.task_cpus 1, data.read_tasks {a.read_tasks}; "
          f"head node 2 CPUs (1 training worker + 1 data); a CPU-only node of {a.node_cpus} CPUs "
          f"joins at epoch {a.join_epoch} (join) or none does (control); rows/s of epochs "
          f"{a.warmup_epochs}-{a.join_epoch - 1} (before) and from two epochs after the first one read "
          "with the node alive to the end (after; the control: the same epochs):")
    print(f"{'run':<8} {'before':>8} {'after':>8} {'after/before':>12}  rounds (after/before)  ledger")
    for name, rs in runs.items():
        ratios = [r["after"] / r["before"] for r in rs]
        print(f"{name:<8} {statistics.median(r['before'] for r in rs):>8.0f} "
              f"{statistics.median(r['after'] for r in rs):>8.0f} {statistics.median(ratios):>12.2f}  "
              f"{' '.join(f'{x:.2f}' for x in ratios):<21}  {all(r['ledger_ok'] for r in rs)}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
