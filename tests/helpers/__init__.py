"""Helpers shared by test modules (not a test module): digits-like Parquet files with the
differences real writers produce, a small job config over them, the CLI run in-process,
and real processes that hold a sqlite lock or die by SIGKILL at a recorded step."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from conftest import _deep_update, digits_config, mlflow_runs

ROW = 64  # an 8x8 image per row


def write_rows(path: Path, ids, *, x_type=pa.float32(), y_type=pa.int64(), child: str = "item",
               nullable: bool = True, labels=None, x_fill=None, seed: int = 0) -> Path:
    """A digits-like Parquet file (``sample_id``, ``x``: 64 numbers, ``y``: a class):
    ``child`` names the list's child field (writers use ``item`` or ``element``),
    ``nullable=False`` declares every column ``not null``, ``x_fill`` maps an id to the
    value of all its pixels (e.g. NaN), ``labels`` overrides ``y``."""
    ids = [int(i) for i in ids]
    rng = np.random.default_rng(seed + (ids[0] if ids else 0))
    xs = rng.random((len(ids), ROW)).astype(np.float32)
    for k, i in enumerate(ids):
        if x_fill and i in x_fill:
            xs[k, :] = x_fill[i]
    ys = [i % 3 for i in ids] if labels is None else list(labels)
    schema = pa.schema([pa.field("sample_id", pa.int64(), nullable=nullable),
                        pa.field("x", pa.list_(pa.field(child, x_type)), nullable=nullable),
                        pa.field("y", y_type, nullable=nullable)])
    table = pa.table({"sample_id": pa.array(ids, pa.int64()),
                      "x": pa.array([list(map(float, r)) for r in xs], pa.list_(pa.field(child, x_type))),
                      "y": pa.array(ys, y_type)}, schema=schema)
    path.parent.mkdir(parents=True, exist_ok=True)
    # use_compliant_nested_type=False keeps the child name as given in the file.
    pq.write_table(table, path, use_compliant_nested_type=False, row_group_size=8)
    return path


def mixed_dataset(root: Path, ids_per_file: int = 16, x_fill=None) -> list[int]:
    """Files that differ in what a careless scan misses: nullability (``not null`` in one
    file), the list child name (``element``/``item``), the label's integer width (int32
    in one file), and a directory named like a Hive partition key of the label column
    (``y=7/``). ``x_fill``: see :func:`write_rows`. Returns the ids written."""
    k = ids_per_file
    write_rows(root / "a" / "part-0.parquet", range(0, k), nullable=False, x_fill=x_fill)
    write_rows(root / "b" / "part-1.parquet", range(k, 2 * k), child="element", x_fill=x_fill)
    write_rows(root / "y=7" / "part-2.parquet", range(2 * k, 3 * k), x_fill=x_fill)
    write_rows(root / "c" / "part-3.parquet", range(3 * k, 4 * k), y_type=pa.int32(), x_fill=x_fill)
    return list(range(4 * k))


def task_columns(num_classes: int = 3):
    """The column specs the digits CNN task declares (what the scan checks)."""
    from elastic_ddp.tasks.vision import CNNClassifier

    return CNNClassifier("x", "y", num_classes, [1, 8, 8]).input_columns()


def small_config(data: Path, tmp: Path, extra: dict | None = None) -> dict:
    """A 3-class digits job over :func:`write_rows` files: 16-row global batches of two
    8-row micro-batches, one epoch, a checkpoint every 2 steps; ``extra`` deep-merged."""
    raw = digits_config(data, tmp, {
        "task": {"kwargs": {"num_classes": 3}},
        "model": {"kwargs": {"hidden": 8}},
        "batch": {"global_batch_size": 16, "micro_batch_size": 8, "policy": "uneven"},
        "train": {"epochs": 1, "checkpoint_every_steps": 2, "log_every_steps": 1},
    })
    return _deep_update(raw, extra or {})


def run_cli(tmp: Path, raw: dict, capsys, *extra) -> tuple[int, str, str]:
    """``elastic-ddp train`` on ``raw`` written to ``tmp/job.yaml``, in this process:
    (exit code, stdout, stderr)."""
    from elastic_ddp.driver.cli import main

    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    rc = main(["train", str(path), "--no-progress", *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def nothing_started(tmp: Path) -> None:
    """No MLflow run, no Ray storage under ``tmp``, and Ray not initialised here."""
    assert mlflow_runs(tmp) == [] and not (tmp / "ray_results").exists()
    if "ray" in sys.modules:
        assert not sys.modules["ray"].is_initialized()


def hold_sqlite_lock(db: Path, seconds: float) -> subprocess.Popen:
    """Another process holding ``BEGIN EXCLUSIVE`` on the sqlite file for ``seconds``
    (it prints 'locked' once it holds the lock, then 'released <time>')."""
    code = textwrap.dedent(f"""
        import sqlite3, sys, time
        c = sqlite3.connect({str(db)!r}, timeout=60, isolation_level=None)
        c.execute("BEGIN EXCLUSIVE")
        print("locked", flush=True)
        time.sleep({seconds})
        c.execute("COMMIT")
        print("released", time.time(), flush=True)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def sigkilled_rank(rank: int, step: int, run: str = "job") -> int:
    """A real process that records its position at ``step`` (as a rank does) and is
    killed by SIGKILL; returns its pid (its position record stays behind)."""
    code = textwrap.dedent(f"""
        import os, signal
        from elastic_ddp.positions import Position
        p = Position({rank}, {run!r})
        p.at("data read", {step}, 0)
        p.at("training step", {step}, 0)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code])
    assert proc.wait(timeout=120) == -signal.SIGKILL
    return proc.pid


# ------------------------------------------------------- a user task from its own file
# A task module as a user writes it (its own model, transform and loss), for tests that
# load it from a directory outside the repository.
TASK = '''
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import elastic_ddp


class Net(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.head = nn.Linear(width * 16, 10)

    def forward(self, x):                      # x: [B, 1, 8, 8] float32
        h = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return self.head(h.flatten(1))


class Digits(elastic_ddp.Task):
    columns = {"x": elastic_ddp.Column.list_of("float", length=64),
               "y": elastic_ddp.Column.integer(min=0, max=9)}

    def __init__(self, scale=1.0):
        self.scale = scale

    def transform(self, batch, ctx):
        img = np.stack(list(batch["x"])).astype(np.float32).reshape(-1, 1, 8, 8) * self.scale
        if ctx.split == "train":                # brightness jitter from (seed, epoch, id)
            img = img * (0.9 + 0.2 * ctx.uniform(1, 1, 1).astype(np.float32))
        return {"image": img, "label": batch["y"]}

    def build_model(self, width=16):
        return Net(width)

    def loss(self, model, batch):
        logits = model(batch["image"])
        return (F.cross_entropy(logits, batch["label"], reduction="none"),
                {"acc": (logits.argmax(-1) == batch["label"]).float()})
'''


def write_task(tmp: Path, body: str = TASK, name: str = "my_task.py") -> Path:
    """A task module in a directory outside the repository."""
    path = tmp / "user_code" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return path


def user_config(data: Path, tmp: Path, task_file: Path, extra: dict | None = None) -> dict:
    """A digits job (:func:`conftest.digits_config`) training ``task_file``'s ``Digits``
    task with an 8-channel ``Net``."""
    raw = digits_config(data, tmp, extra)
    raw["task"] = {"path": f"{task_file}:Digits", "kwargs": {}}
    raw["model"] = {"kwargs": {"width": 8}}
    return raw


# ------------------------------------------------------------ the MLflow helper process
def open_request(cfg, uri: str, storage: str) -> dict:
    """The keyword arguments the driver passes to ``RunOpener.open`` for ``cfg`` (its
    training data scanned, one skipped entry), MLflow at ``uri``, Ray storage ``storage``."""
    from elastic_ddp import tracking
    from elastic_ddp.data.scan import scan_parquet
    from elastic_ddp.tasks.dry_run import count_params
    from elastic_ddp.tasks.loading import load_task

    task = load_task(cfg)
    info = scan_parquet(cfg.data.train_path, task.input_columns(), "sample_id")
    return dict(cfg=cfg, storage=storage, uri=uri, parent_run_id=None,
                task_params=tracking.task_params(task, count_params(cfg, task)), train_info=info, val_info=None,
                skipped={"train": ["_staging"]})


def train_ids(data: Path):
    from elastic_ddp.data.scan import read_sample_ids

    return read_sample_ids(data / "train")


def max_step(ledger: Path, world_size: int | None = None) -> int:
    """The highest step any rank-0 ledger file has recorded (of attempts at
    ``world_size`` when given; a per-step ledger's last line may be a commit); 0 when
    none yet."""
    best = 0
    for f in ledger.glob("attempt-*-rank0.jsonl"):
        lines = f.read_text().splitlines()
        if not lines:
            continue
        try:
            head = json.loads(lines[0])
            last = json.loads(lines[-1]) if len(lines) > 1 else {}
        except json.JSONDecodeError:
            continue
        if world_size is not None and head.get("world_size") != world_size:
            continue
        best = max(best, int(last.get("step", last.get("commit", 0))))
    return best


def _cluster_faults():
    """``experiments/cluster_faults.py`` (the experiments' local multi-node cluster and
    its faults), loaded by path: the experiments directory is not a package."""
    import importlib.util

    name = "cluster_faults"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).resolve().parents[2] / "experiments" / "cluster_faults.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


#: ``cluster.add_node`` with retries (a raylet has 30 s to register with the GCS, which a
#: shared machine does not always meet); ``local_cluster(nodes, node_cpus)``: a head and
#: worker nodes, this process connected, shut down on exit.
add_node = _cluster_faults().add_node
local_cluster = _cluster_faults().local_cluster


# ------------------------------------------------------------ ranks of gloo process groups
# What a spawned rank imports anyway, imported once by this process's forkserver: each rank
# is then forked from it (a fraction of a second) instead of starting an interpreter that
# imports torch (seconds of CPU per rank, tens of seconds of wall on a loaded machine).
RANK_PRELOAD = ["torch", "torch.distributed", "elastic_ddp.config", "elastic_ddp.parallel.strategies",
                "elastic_ddp.tasks.loading", "elastic_ddp.tasks.dry_run", "elastic_ddp.checkpoint.manager"]


def rank_context():
    """The ``forkserver`` multiprocessing context whose server preloads :data:`RANK_PRELOAD`
    (the preload is set before the server's first start; it then serves this process's
    every later rank). Its children get the environment the server started with."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx



def gpt_checkpoint_config(strategy: str, n_embd: int = 128, n_layer: int = 2):
    """The small GPT job the checkpoint tests save and restore on gloo ranks: global batch
    12 split unevenly over 1-3 ranks."""
    from elastic_ddp.config import Config

    return Config.from_dict({
        "data": {"train_path": "unused"}, "task": {"kwargs": {"block_size": 16}},
        "model": {"name": "gpt", "kwargs": {"n_embd": n_embd, "n_head": 2, "n_layer": n_layer}},
        "optim": {"name": "adamw", "lr": 3e-3}, "parallel": {"strategy": strategy},
        "scaling": {"min_workers": 1, "max_workers": 3},
        "batch": {"global_batch_size": 12, "micro_batch_size": 12, "policy": "uneven"}})

def start_ranks(fn, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.start_processes(fn, args, nprocs)`` with its ranks forked by
    :func:`rank_context`'s server; raises as ``start_processes`` does when a rank fails."""
    import torch.multiprocessing as mp

    rank_context()
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def write_gathered(result, rank: int, world_size: int, path) -> None:
    """Every rank's ``result`` gathered (``all_gather_object`` on the default group, none at
    world size 1) and written by rank 0 to ``path`` as a JSON list indexed by rank."""
    import torch.distributed as dist

    parts = [result]
    if world_size > 1:
        parts = [None] * world_size
        dist.all_gather_object(parts, result)
    if rank == 0:
        Path(path).write_text(json.dumps(parts))


def exits_cleanly(fn):
    """A rank body that ends with ``os._exit(0)`` once it returned: gloo's C++ threads can
    abort a clean interpreter exit (an exception still propagates to torch's spawn)."""
    import functools
    import os

    @functools.wraps(fn)
    def run(*args):
        fn(*args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return run


def wait_until(pred, timeout: float) -> None:
    end = time.time() + timeout
    while not pred():
        if time.time() > end:
            raise TimeoutError(f"condition not met in {timeout}s")
        time.sleep(0.1)


def ledger_files(ledger) -> list:
    """The sample ledger's attempt files under ``ledger`` (a directory), read as they are
    being written: ``[(header record, [the later records]), ...]``, a partly written last
    line left out."""
    from pathlib import Path

    out = []
    for f in sorted(Path(ledger).glob("attempt-*.jsonl")):
        recs = jsonl_records(f)
        if recs:
            out.append((recs[0], recs[1:]))
    return out


def jsonl_records(path) -> list:
    """The JSON records of a JSON-lines file that may still be being written: [] when it
    does not exist yet, a partly written line left out."""
    import json
    from pathlib import Path

    path = Path(path)
    if not path.exists():
        return []
    out = []
    for ln in path.read_text().splitlines():
        try:
            out.append(json.loads(ln))
        except ValueError:
            pass  # a line being written
    return out


def replicas_together(ledger, k: int = 5, quorum: int = 2, files: int = 2, since: float = 0.0) -> bool:
    """Per-step mode: ``files`` replica processes whose ledger files started after
    ``since`` (seconds since the epoch) have each committed ``k`` steps in a quorum of
    ``quorum`` replicas (a signal then reaches a replica that trains, not one still
    starting). ``files=1, since=t``: a replacement started after ``t`` trains with its peer."""
    return sum(1 for head, recs in ledger_files(ledger) if head.get("t", 0) > since
               and sum(1 for r in recs if "commit" in r and r.get("n") == quorum) >= k) >= files


# ------------------------------------------------------ the product's Trainer, without Ray
def trainer_steps(job, rank: int, ws: int, steps: int, load=None, losses: Optional[list] = None) -> dict:
    """``steps`` optimizer steps of the product's ``worker.trainer.Trainer`` for ``job`` (a
    ``JobSpec``) as rank ``rank`` of ``ws`` (``ws > 1``: in an initialised gloo process
    group), from the live state ``load`` (a ``Trainer.state_dict()``, what a healing
    replica receives) when given, with no checkpoint, evaluation or ledger; returns its
    ``state_dict()`` after (model, optimizer, progress). ``losses``: a list to which every
    step's train loss (this rank's mean over its rows, as the metric window sums it) is
    appended."""
    import torch

    from elastic_ddp.ledger import LedgerWriter
    from elastic_ddp.metrics import StepWindow
    from elastic_ddp.worker.trainer import Trainer

    t = Trainer(job, rank, ws, torch.device("cpu"))
    t.ledger = LedgerWriter(None, rank, None, ws, t.ft.ledger_mode)  # off
    if load is not None:
        t.load_state_dict(load)
    p = t.progress
    for _ in range(steps):
        if p.cursor >= t.n_train:  # as Trainer._loop does at an epoch's end
            p.epoch, p.cursor = p.epoch + 1, 0
        if losses is not None:
            t.window = StepWindow()
        assert t.train_step()
        if losses is not None:
            losses.append(t.window.loss_sum / t.window.count)
    return t.state_dict()


def one_thread_steps(job, steps: int, load=None, losses: Optional[list] = None) -> dict:
    """:func:`trainer_steps` at world size 1 in this process, on one torch thread (as a
    job's workers with ``scaling.torch_threads: 1``: a kernel's reduction order may
    follow the thread count)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return trainer_steps(job, 0, 1, steps, load, losses)
    finally:
        torch.set_num_threads(threads)
