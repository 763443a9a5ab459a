"""The job's MLflow run deleted while the job trains (a person cleaning up the MLflow
UI): training goes on to the end with its checkpoints, one warning says so when the
tracker finds it, and the command exits 3 with a line that names the fix (restore the
run from MLflow's trash, or another run.name); never "training failed".

The job runs as a user runs it: the ``elastic-ddp`` command, a local Ray with two
workers, a real sqlite MLflow store; the run is deleted through ``MlflowClient`` once a
training step is in it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import digits_config

RUN_LINE = "-> MLflow run "


def _cli() -> list[str]:
    exe = Path(sys.executable).with_name("elastic-ddp")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "elastic_ddp"]


@pytest.mark.slow
@pytest.mark.ray
def test_run_deleted_while_training_trains_on_and_exits_3_naming_the_fix(digits_data, tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    from elastic_ddp.checkpoint.layout import checkpoint_step, newest_complete
    from elastic_ddp.tracking import metric_key

    raw = digits_config(digits_data, tmp_path, {
        "train": {"epochs": 2, "checkpoint_every_steps": 10, "log_every_steps": 2}})
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "ELASTIC_DDP_RAY_LOGS")}
    p = subprocess.Popen([*_cli(), "train", str(cfg), "--no-progress"], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: list[str] = []
    errs: list[str] = []
    readers = [threading.Thread(target=lambda: out.extend(p.stdout), daemon=True),
               threading.Thread(target=lambda: errs.extend(p.stderr), daemon=True)]
    for r in readers:
        r.start()
    client = MlflowClient(mlflow_store)
    try:
        deadline = time.monotonic() + 300
        run_id = deleted_at = None
        while deleted_at is None and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            line = next((ln for ln in list(out) if RUN_LINE in ln), None)
            if line is None:
                continue
            run_id = line.split(RUN_LINE, 1)[1].split()[0]
            steps = client.get_metric_history(run_id, metric_key("train_loss"))
            if steps:  # a training step is in the run: delete it under the job
                client.delete_run(run_id)
                deleted_at = max(m.step for m in steps)
        assert deleted_at is not None, ("no step reached MLflow", "".join(out))
        p.wait(timeout=400)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    for r in readers:
        r.join(10)
    stdout, err = "".join(out), "".join(errs)
    print(err)  # shown with -rP: what the person saw
    assert p.returncode == 3, err[-3000:]
    assert "training failed" not in err and "Traceback" not in err, err[-3000:]
    # One warning when the tracker finds it, and the last line names the fix.
    found = [ln for ln in err.splitlines() if ln.startswith(f"elastic-ddp: warning: MLflow run {run_id} was deleted")]
    assert len(found) == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("elastic-ddp: the model trained and its checkpoints are kept"), last
    assert f"MLFLOW_TRACKING_URI={mlflow_store} mlflow runs restore --run-id {run_id}" in last, last
    assert "another run.name" in last, last
    # The summary is printed, and says what became of the run.
    assert "=== elastic-ddp summary ===" in stdout and f"{run_id} at {mlflow_store}: deleted" in stdout, stdout
    # Training went on past the deletion to the end: its newest checkpoint is the last step.
    total = int(next(ln for ln in out if RUN_LINE in ln).rsplit("; ", 1)[1].split()[0])  # "; N steps"
    ckpt = newest_complete(str(tmp_path / "ray_results"), "test-digits")
    assert ckpt is not None and checkpoint_step(ckpt.path) == total > deleted_at, ckpt
    # Nothing was written into the deleted run after it was found: it stays in the trash,
    # not marked FINISHED.
    run = client.get_run(run_id)
    assert run.info.lifecycle_stage == "deleted" and run.info.status == "RUNNING", run.info
