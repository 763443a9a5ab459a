"""Issue #13 without a Ray cluster: real inputs people hit, each a class of failure, each
ending in a finished job or a clear error before any work is lost. Real Parquet files,
real sqlite MLflow stores, real processes killed by real signals; the Ray end-to-end
jobs for the same items are in tests/test_failures_e2e.py.

Items: 1 storage/data paths with URI characters, 2 the scan and the reader agree on the
schema, 3 the validation split checked like training, 4 deterministic failures stopped
with step/rank/cause, 5 skipped non-finite steps in the ledger audit, 6 driver set-up
errors up front, 7 the data fingerprint, 8 what the scan skipped shown by the CLI,
9 tracking outages retried, 10 the cause of a failure and error fingerprints.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import digits_config, mlflow_runs
from elastic_ddp.driver.cli import main
from elastic_ddp.data.scan import DataError, scan_parquet

# ------------------------------------------------------------------------ data helpers
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
    from elastic_ddp.tasks.vision import CNNClassifier

    return CNNClassifier("x", "y", num_classes, [1, 8, 8]).input_columns()


def _cli(tmp: Path, raw: dict, capsys, *extra) -> tuple[int, str, str]:
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    rc = main(["train", str(path), "--no-progress", *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def _nothing_started(tmp: Path) -> None:
    assert mlflow_runs(tmp) == [] and not (tmp / "ray_results").exists()
    if "ray" in sys.modules:
        assert not sys.modules["ray"].is_initialized()


def small_config(data: Path, tmp: Path, extra: dict | None = None) -> dict:
    raw = digits_config(data, tmp, {
        "task": {"kwargs": {"num_classes": 3}},
        "model": {"kwargs": {"hidden": 8}},
        "batch": {"global_batch_size": 16, "micro_batch_size": 8, "policy": "uneven"},
        "train": {"epochs": 1, "checkpoint_every_steps": 2, "log_every_steps": 1},
    })
    from conftest import _deep_update

    return _deep_update(raw, extra or {})


