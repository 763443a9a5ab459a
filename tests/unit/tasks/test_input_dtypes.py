"""dtypes between the Parquet files, the task and the model: a transform's float64
features (NumPy's default) are cast to the model's parameter dtype, and integer labels
stored at any width (int8..int32, uint8, uint16) are accepted, through the dry run and a
real training job; integer features and float labels exit 2 with one line naming the
tensor, the Parquet column it came from and the fix, before any run or Ray."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from conftest import digits_config, mlflow_runs

TASK = '''
import numpy as np
import torch.nn as nn
import torch.nn.functional as F

import elastic_ddp


class Flat(elastic_ddp.Task):
    columns = {"x": elastic_ddp.Column.list_of("number", length=16),
               "y": elastic_ddp.Column.integer(min=0, max=3)}

    def transform(self, batch, ctx):
        x = np.stack(list(batch["x"]))
        return {"features": %(features)s, "label": %(label)s}

    def build_model(self):
        return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))

    def loss(self, model, batch):
        return F.cross_entropy(model(batch["features"]), batch["label"], reduction="none")
'''


def _data(root: Path, label_type: pa.DataType, x_type: pa.DataType = pa.float64(), n: int = 128) -> Path:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 16, size=(n, 16))
    y = (x[:, 0] // 4).astype(np.int64)  # a threshold of the first feature
    for split, rows in (("train", range(0, n - 32)), ("val", range(n - 32, n))):
        d = root / split
        d.mkdir(parents=True)
        rows = list(rows)
        half = len(rows) // 2
        for i, part in enumerate((rows[:half], rows[half:])):
            t = pa.table({"sample_id": pa.array(part, pa.int64()),
                          "x": pa.array([x[r].tolist() for r in part], pa.list_(x_type)),
                          "y": pa.array([int(y[r]) for r in part], label_type)})
            pq.write_table(t, d / f"part-{i}.parquet")
    return root


def _job(tmp: Path, data: Path, features: str, label: str, extra: dict | None = None) -> Path:
    task = tmp / "user_code" / "flat_task.py"
    task.parent.mkdir(parents=True, exist_ok=True)
    task.write_text(textwrap.dedent(TASK % {"features": features, "label": label}))
    raw = digits_config(data, tmp, extra)
    raw["task"] = {"path": f"{task}:Flat", "kwargs": {}}
    raw["model"] = {"kwargs": {}}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("label_type", [pa.int8(), pa.int16(), pa.int32(), pa.uint8(), pa.uint16()],
                         ids=str)
def test_float64_features_and_labels_of_any_integer_width_pass_the_dry_run(tmp_path, label_type):
    from elastic_ddp.config import Config
    from elastic_ddp.driver.preflight import prepare

    data = _data(tmp_path / "data", label_type)
    cfg = Config.load(str(_job(tmp_path, data, "x.astype(np.float64)", 'batch["y"]')))
    sample = prepare(cfg).sample
    assert sample["train"]["features"].dtype == np.float64
    assert sample["train"]["label"].dtype == label_type.to_pandas_dtype()


@pytest.mark.parametrize("features,label,needle", [
    ("x.astype(np.int32)", 'batch["y"]',
     "RuntimeError: mat1 and mat2 must have the same dtype, but got Long and Float; tensor "
     "'features' (int64 [2, 16], computed by Task.transform): the model's parameters are float32 "
     "and floating inputs are cast to that dtype, integer ones are not: make it float in "
     "Task.transform (.astype(np.float32))"),
    ("x.astype(np.float32)", 'batch["y"].astype(np.float32)',
     "RuntimeError: expected target dtype to be Long or Byte, but got Float; tensor 'label' "
     "(float32 [2], from Parquet column 'y'): class labels and token ids must be integers: "
     "cast it in Task.transform (.astype(np.int64))"),
])
def test_a_tensor_of_the_wrong_kind_exits_2_naming_its_key_and_column(tmp_path, capsys, features,
                                                                      label, needle):
    from elastic_ddp.driver.cli import main

    data = _data(tmp_path / "data", pa.int64(), pa.int64())
    rc = main(["train", str(_job(tmp_path, data, features, label)), "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastic-ddp: task error: Flat.loss failed on "
                                                   "two rows of the data: "), err
    assert needle in lines[0], lines[0]
    assert mlflow_runs(tmp_path) == [] and not (tmp_path / "ray_results").exists()
    if "ray" in sys.modules:
        assert not sys.modules["ray"].is_initialized()


def test_the_default_collate_widens_integers_and_keeps_images_and_floats():
    from elastic_ddp.tasks.protocol import default_collate, model_inputs

    out = default_collate({"a": np.arange(3, dtype=np.int16), "b": np.ones((2, 3), np.uint16),
                           "img": np.ones((2, 1, 4, 4), np.uint8), "f": np.ones(2, np.float64),
                           "m": np.ones(2, bool)})
    assert {k: v.dtype for k, v in out.items()} == {
        "a": torch.int64, "b": torch.int64, "img": torch.uint8, "f": torch.float64, "m": torch.bool}
    moved = model_inputs(out, "cpu", torch.float32)
    assert moved["f"].dtype == torch.float32 and moved["img"].dtype == torch.uint8
    assert moved["a"].dtype == torch.int64 and model_inputs(out, "cpu", None)["f"].dtype == torch.float64


@pytest.mark.slow
def test_float64_features_and_int16_labels_train_through_the_cli(ray_cluster, tmp_path, capsys):
    """A real job (one worker, a few steps, validation included) on float64 features and
    int16 labels: it finishes, and the loss falls."""
    from elastic_ddp.driver.cli import main

    data = _data(tmp_path / "data", pa.int16(), n=288)
    extra = {"scaling": {"min_workers": 1, "max_workers": 1},
             "batch": {"global_batch_size": 32, "micro_batch_size": 32},
             "optim": {"lr": 0.03}, "train": {"epochs": 5, "checkpoint_every_steps": 100,
                                              "log_every_steps": 2},
             "run": {"name": "dtypes"}}
    rc = main(["train", str(_job(tmp_path, data, "x.astype(np.float64) / 16", 'batch["y"]', extra)),
               "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 0, (out[-3000:], err[-3000:])
    (run,) = mlflow_runs(tmp_path)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["val/loss"] < np.log(4), run.data.metrics
