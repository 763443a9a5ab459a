"""SIGTERM to a real ``elastic-ddp train`` process before its trainer is built (the
checks have passed; MLflow's run is being created and Ray is starting): the process exits
143 (``driver.stop.EXIT_STOPPED``) within seconds, saying it stopped before training
started, and leaves no MLflow run RUNNING; the same command then runs the job to the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import digits_config, mlflow_runs

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[3]


def _cli_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("elastic-ddp")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "elastic_ddp"]


@pytest.mark.slow
def test_sigterm_before_the_trainer_is_built_exits_143_with_no_run_left_running(digits_data, tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(digits_config(digits_data, tmp_path, {
        "train": {"epochs": 1}, "scaling": {"min_workers": 1, "max_workers": 1},
        "run": {"name": "early-stop"}})))
    # A local Ray of this process only (no RAY_ADDRESS): the CLI starts one after the checks.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *sys.path])
    cmd = _cli_cmd() + ["train", str(cfg), "--no-progress"]
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    first = threading.Event()

    def read():
        for ln in p.stdout:
            lines.append(ln)
            first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    # The config print: every input check has passed; MLflow and Ray start next.
    assert first.wait(300), p.stderr.read() if p.poll() is not None else "no output in 300 s"
    assert p.poll() is None, (lines, p.stderr.read())
    p.send_signal(signal.SIGTERM)
    t = time.time()
    err = p.stderr.read()
    p.wait(timeout=120)
    took = time.time() - t
    out = "".join(lines)
    print(out[-2000:], err[-2000:], f"exited {took:.1f} s after SIGTERM")
    assert not any("-> MLflow run" in ln for ln in lines), "the SIGTERM landed after start-up: " + out
    assert p.returncode == 143, (p.returncode, err[-3000:])
    assert "stopped on SIGTERM before training started" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert all(r.info.status == "KILLED" for r in mlflow_runs(tmp_path)), \
        [(r.info.run_id, r.info.status) for r in mlflow_runs(tmp_path)]
    assert not list((tmp_path / "ray_results").glob("early-stop*/checkpoint_step*"))

    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    runs = mlflow_runs(tmp_path)
    assert runs and runs[0].info.status == "FINISHED", [(r.info.run_id, r.info.status) for r in runs]
