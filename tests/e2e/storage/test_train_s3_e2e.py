"""The digits job with its data on object storage only (moto's S3 server): the console
command as a user runs it, 2 workers on the local Ray it starts, both splits read from
``s3://`` by the workers. It trains as the same job over the same data on local disk does:
the first step's loss equals a plain-PyTorch replay's over the local files (same init,
same 32 rows), and the final accuracy is the replay's within two validation rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import digits_config, replay_plain_torch
from elastic_ddp.config import Config

ELASTIC_DDP = str(Path(sys.executable).with_name("elastic-ddp"))
FAST = {"model": {"kwargs": {"hidden": 64}}, "optim": {"lr": 0.01, "warmup_steps": 20},
        "batch": {"global_batch_size": 32, "micro_batch_size": 16},
        "train": {"epochs": 2, "log_every_steps": 5, "checkpoint_every_steps": 1000}}


def _upload(s3, local: Path, prefix: str) -> str:
    for f in sorted(local.rglob("*.parquet")):
        s3.client.upload_file(str(f), s3.name, f"{prefix}/{f.relative_to(local).as_posix()}")
    return s3.uri(prefix)


# ~3 min on the shared 2-core machine (a local Ray, 2 workers, 90 steps): the slow tier.
@pytest.mark.slow
@pytest.mark.ray
def test_the_digits_job_trains_from_s3_as_from_local_disk(s3, digits_data, tmp_path):
    uri = _upload(s3, digits_data, "digits")
    raw = digits_config(digits_data, tmp_path, FAST)
    raw["data"]["train_path"], raw["data"]["val_path"] = f"{uri}/train", f"{uri}/val"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(raw))
    t0 = time.perf_counter()
    out = subprocess.run([ELASTIC_DDP, "train", str(job), "--no-progress", "--json"],
                         env={**os.environ, **s3.env}, capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout[out.stdout.index("{\n"):])
    print(f"\n[s3 e2e] wall {time.perf_counter() - t0:.1f}s metrics {summary['metrics']}")
    assert summary["steps"] == -(-1438 // 32) * 2 and summary["world_sizes_seen"] == [2]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(summary["run_id"])
    assert run.data.params["data.train_path"] == f"{uri}/train"
    first = min(client.get_metric_history(summary["run_id"], "train/loss"), key=lambda m: m.step)
    local = Config.from_dict(digits_config(digits_data, tmp_path, FAST))
    losses, model = replay_plain_torch(local, digits_data)
    assert first.step == 1 and first.value == pytest.approx(losses[0], rel=1e-5)

    from helpers.models import val_accuracy_of

    acc, n_val = val_accuracy_of(model, digits_data / "val")
    assert abs(acc - summary["metrics"]["val_acc"]) <= 2.0 / n_val + 1e-12, (acc, summary["metrics"])
    assert summary["metrics"]["val_acc"] >= 0.85
