"""SIGTERM or Ctrl-C to a real ``elastic-ddp train`` process while it runs the user's
code before anything started: importing the task file, or the task's dry run on two rows.
The signal is the reason the command ends (143 on SIGTERM, 130 on Ctrl-C), with the
stop's own message, never a task error blamed on the code it landed in; no MLflow run,
no Ray, no checkpoint. No Ray cluster is started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import mlflow_runs
from helpers import TASK, user_config, write_rows, write_task

REPO = Path(__file__).resolve().parents[3]

# The task's user code announces that it runs (a file), then waits to be signalled.
WAIT = "import pathlib as _p, time as _t; _p.Path({marker!r}).touch(); _t.sleep(120)"


def _cli_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("elastic-ddp")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "elastic_ddp"]


@pytest.mark.parametrize("where,sig,code,message", [
    ("import", signal.SIGTERM, 143, "elastic-ddp: stopped on SIGTERM before training started "
                                    "(nothing to checkpoint); run the same command to start the job"),
    ("transform", signal.SIGTERM, 143, "elastic-ddp: stopped on SIGTERM before training started"),
    ("import", signal.SIGINT, 130, "elastic-ddp: interrupted before the job started: no MLflow run "
                                   "was opened and no checkpoint written; run the same command to "
                                   "start the job"),
])
def test_a_signal_in_the_users_code_before_the_start_is_the_signal_not_a_task_error(
        tmp_path, where, sig, code, message):
    import yaml

    marker = tmp_path / "running"
    wait = WAIT.format(marker=str(marker))
    if where == "import":
        body = wait + "\n" + TASK
    else:
        body = TASK.replace("    def transform(self, batch, ctx):\n",
                            "    def transform(self, batch, ctx):\n        " + wait + "\n")
        assert body != TASK
    task_file = write_task(tmp_path, body)
    data = tmp_path / "data"
    write_rows(data / "train" / "part-0.parquet", range(32))
    raw = user_config(data, tmp_path, task_file, {"data": {"val_path": None}})
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *sys.path])
    p = subprocess.Popen(_cli_cmd() + ["train", str(cfg), "--no-progress"], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not marker.exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert marker.exists(), p.communicate(timeout=60) if p.poll() is not None else "no start"
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == code, (p.returncode, err)
    assert err.strip() == message or err.strip().startswith(message), err
    assert "task error" not in err and "Traceback" not in err, err
    assert out == ""  # not even the config print: the checks had not passed
    assert mlflow_runs(tmp_path) == [] and not (tmp_path / "ray_results").exists()


@pytest.mark.slow
@pytest.mark.ray  # the sweep starts its local Ray before its first child
def test_sigterm_in_a_sweeps_child_before_its_start_closes_the_parent_run_killed(tmp_path):
    """A sweep's parent MLflow run is open while a child job starts: SIGTERM in the
    child's task import ends the command with 143 and leaves no run RUNNING."""
    import yaml

    marker = tmp_path / "running"
    task_file = write_task(tmp_path, WAIT.format(marker=str(marker)) + "\n" + TASK)
    data = tmp_path / "data"
    write_rows(data / "train" / "part-0.parquet", range(32))
    raw = user_config(data, tmp_path, task_file, {"data": {"val_path": None}})
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *sys.path])
    p = subprocess.Popen(_cli_cmd() + ["sweep", str(cfg), "--world-sizes", "1"], cwd=tmp_path,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not marker.exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert marker.exists(), p.communicate(timeout=60) if p.poll() is not None else "no start"
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 143, (p.returncode, err[-3000:])
    assert err.strip().endswith("elastic-ddp: stopped on SIGTERM: every MLflow run of the sweep "
                                "opened by then is closed KILLED; the same command starts a new "
                                "sweep"), err[-3000:]
    assert "Traceback" not in err, err
    runs = mlflow_runs(tmp_path)
    assert runs and [r.info.status for r in runs] == ["KILLED"] * len(runs), \
        [(r.info.run_name, r.info.status) for r in runs]
