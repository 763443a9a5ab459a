"""A user's own task, from a module a test writes into a temporary directory outside the
repository, trains on a real local Ray cluster through the CLI and through the Python
API; the API run has a worker SIGKILLed mid-epoch, loses no sample and repeats none, and
ends on the uninterrupted (CLI) run's validation loss."""

from __future__ import annotations

import importlib.util
import math

import pytest
import yaml

from conftest import mlflow_runs
from elastic_ddp.driver.cli import main
from elastic_ddp.config import Config
from elastic_ddp.data.scan import read_sample_ids
from elastic_ddp import train
from elastic_ddp.ledger import audit, format_audit
from elastic_ddp.run_state import Diagnostics
from helpers import user_config, write_task

pytestmark = pytest.mark.ray

JOB = {"batch": {"global_batch_size": 32, "micro_batch_size": 16},
       "optim": {"lr": 0.01, "warmup_steps": 10},
       "train": {"epochs": 2, "checkpoint_every_steps": 10, "log_every_steps": 5}}


def test_user_task_cli_and_api_with_a_worker_killed(ray_cluster, digits_data, tmp_path, capsys):
    task_file = write_task(tmp_path)
    raw = user_config(digits_data, tmp_path, task_file, JOB)
    steps = math.ceil(len(read_sample_ids(digits_data / "train")) / 32) * 2

    # CLI, uninterrupted: the reference.
    raw["run"]["name"] = "user-cli"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["train", str(path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "=== elastic-ddp summary ===" in out and "val_acc=" in out
    (cli_run,) = [r for r in mlflow_runs(tmp_path) if r.data.tags.get("mlflow.runName") == "user-cli"]
    assert cli_run.info.status == "FINISHED"
    ref_loss = cli_run.data.metrics["val/loss"]
    assert cli_run.data.metrics["val/acc"] > 0.5  # 90 steps of a tiny net: well above chance

    # Python API with a task object; rank 1 SIGKILLs itself before step 25 (epoch 1).
    spec = importlib.util.spec_from_file_location("user_task_api", task_file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    raw["run"]["name"] = "user-api"
    cfg = Config.from_dict(raw)
    ledger = tmp_path / "ledger"
    s = train(cfg, task=mod.Digits(), diagnostics=Diagnostics(ledger_dir=str(ledger), fault={"rank": 1, "at_step": 25, "where": "step", "marker": str(tmp_path / "fired")}), progress=False)
    assert (tmp_path / "fired").exists() and s.restarts == 1 and s.steps == steps
    report = audit(ledger, read_sample_ids(digits_data / "train"), 2)
    print(format_audit(report))
    assert report["ok"] and all(e["lost"] == 0 and e["repeated"] == 0 for e in report["epochs"].values())
    assert [a["resumed_from"] for a in report["attempts"]] == [0, 20]
    # The restart recomputed steps 21-24 on the same samples: the same model as without it.
    assert s.metrics["val_loss"] == pytest.approx(ref_loss, rel=1e-5), (s.metrics, ref_loss)
    api = [r for r in mlflow_runs(tmp_path) if r.data.tags.get("mlflow.runName") == "user-api"]
    assert len(api) == 1 and api[0].info.status == "FINISHED"
