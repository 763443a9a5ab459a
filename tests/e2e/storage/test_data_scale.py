"""A data set several times larger than the memory a worker is allowed trains with a
worker SIGKILLed mid-epoch: each worker's memory follows its window, not the data set,
and the ledger shows every sample once.

The allowance is relative, measured in the same test: a worker's peak RSS (VmHWM) on a
tiny data set, plus 200 MiB. The large set decodes to 600 MiB (150k rows of 4 KiB), so
a worker holding its share (300 MiB at 2 workers) or the whole set would exceed it;
``data.order: permutation``, which keeps the share, does (``ELASTIC_DDP_SCALE_ORDER=
permutation`` runs this test that way; measured figures in docs/benchmarks.md).
"""

from __future__ import annotations

import math
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import mlflow_runs
from elastic_ddp.config import Config
from elastic_ddp import train
from elastic_ddp.ledger import audit, format_audit
from elastic_ddp.tracking import metric_history
from elastic_ddp.run_state import Diagnostics

pytestmark = pytest.mark.slow

WIDTH = 4096  # bytes per row
TASK = '''
import numpy as np, torch, torch.nn as nn, torch.nn.functional as F
import elastic_ddp

class Wide(elastic_ddp.Task):
    columns = {"x": elastic_ddp.Column.list_of("int", length=4096), "y": elastic_ddp.Column.integer(min=0, max=9)}

    def collate(self, batch):
        x = np.stack(list(batch["x"])) if batch["x"].dtype == object else batch["x"]
        return {"x": torch.from_numpy(np.asarray(x, dtype=np.float32) / 255.0),
                "y": torch.from_numpy(np.array(batch["y"], dtype=np.int64))}

    def build_model(self):
        return nn.Linear(4096, 10)

    def loss(self, model, batch):
        return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")
'''


def _write(root, rows: int, files: int = 6):
    rng = np.random.default_rng(0)
    for split, n in (("train", rows), ("val", 512)):
        (root / split).mkdir(parents=True)
        for f, part in enumerate(np.array_split(np.arange(n), files if split == "train" else 1)):
            x = rng.integers(0, 256, (len(part), WIDTH), dtype=np.uint8)
            pq.write_table(pa.table({
                "sample_id": pa.array(part + (0 if split == "train" else 10**9), pa.int64()),
                "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), WIDTH),
                "y": pa.array(part % 10, pa.int64())}), root / split / f"part-{f}.parquet",
                row_group_size=128, compression="none")


def _cfg(root, tmp, name: str, rows: int) -> Config:
    (tmp / "task.py").write_text(TASK)
    return Config.from_dict({
        "data": {"train_path": str(root / "train"), "val_path": str(root / "val"),
                 "shuffle_window_rows": 8192,
                 "order": os.environ.get("ELASTIC_DDP_SCALE_ORDER", "windowed")},
        "task": {"path": f"{tmp / 'task.py'}:Wide"},
        "batch": {"global_batch_size": 1024, "micro_batch_size": 512},
        "train": {"epochs": 1, "checkpoint_every_steps": 20, "log_every_steps": 5,
                  "eval_max_batches": 1},
        "scaling": {"min_workers": 2, "max_workers": 2, "max_failures": 2, "torch_threads": 1},
        "run": {"name": name, "storage_path": str(tmp / "ray"), "experiment_name": "tests",
                "tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}"},
    })


def test_data_larger_than_a_workers_memory_with_a_worker_killed(ray_cluster, tmp_path):
    small, big = tmp_path / "small", tmp_path / "big"
    _write(small, 4096)
    _write(big, 150_000)  # 600 MiB of rows
    s0 = train(_cfg(small, tmp_path, "small", 4096), progress=False)
    small_hist = metric_history(s0.tracking_uri, s0.run_id, "worker/peak_mem_mib_max")
    base = max(v for _, v in small_hist)

    cfg = _cfg(big, tmp_path, "big", 150_000)
    steps = math.ceil(150_000 / 1024)
    s = train(cfg, progress=False, diagnostics=Diagnostics(ledger_dir=str(tmp_path / "ledger"), fault={"rank": 1, "at_step": steps // 2, "where": "step", "marker": str(tmp_path / "fired")}))
    hist = metric_history(s.tracking_uri, s.run_id, "worker/peak_mem_mib_max")
    peak = max(v for _, v in hist)
    print("\n[data scale] peak RSS (MiB) by step, tiny set:", [(k, round(v)) for k, v in small_hist],
          "\n[data scale] 600 MiB set:", [(k, round(v)) for k, v in hist])
    print(f"\n[data scale] peak RSS per worker: tiny set {base:.0f} MiB, 600 MiB set {peak:.0f} MiB; "
          f"recovery {s.events[0].get('recovery_s') if s.events else None} s")
    assert (tmp_path / "fired").exists() and s.restarts == 1 and s.steps == steps
    assert peak <= base + 200, (base, peak)
    ids = np.arange(150_000, dtype=np.int64)
    report = audit(tmp_path / "ledger", ids, 1)
    print(format_audit(report))
    assert report["ok"] and report["epochs"][0]["lost"] == 0 and report["epochs"][0]["repeated"] == 0
    assert [r.info.status for r in mlflow_runs(tmp_path)] == ["FINISHED", "FINISHED"]
