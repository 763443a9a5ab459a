"""CLI jobs that meet a run's lease (``elastic_ddp.driver.lease``), each a real
``elastic-ddp train`` process whose winner starts its own local Ray: two jobs of one run
started together, one trains and the other is refused at once (exit 2, one line naming
the live job's host, pid and start), on local storage and on S3; a job whose driver was
SIGKILLed is resumed by the next one, which takes its lease over. The lease itself:
tests/unit/driver/test_lease.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import digits_config, mlflow_runs

REPO = Path(__file__).resolve().parents[3]


def _job_config(tmp: Path, data: Path, name: str, steps: int) -> Path:
    raw = digits_config(data, tmp, {
        "scaling": {"min_workers": 1, "max_workers": 1},
        "train": {"epochs": 1, "max_steps": steps, "checkpoint_every_steps": 2, "log_every_steps": 2},
        "run": {"name": name}})
    raw["data"]["val_path"] = None
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _cli(cfg: Path, cwd: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen([sys.executable, "-m", "elastic_ddp", "train", str(cfg), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)


@pytest.mark.ray  # the job that wins starts its own local Ray
def test_two_cli_jobs_of_one_run_started_together_one_trains_the_other_is_refused(tmp_path, digits_data):
    cfg = _job_config(tmp_path, digits_data, "twin", 40)
    a, b = _cli(cfg, tmp_path), _cli(cfg, tmp_path)
    # The refused one ends long before the other has trained (no hang, no Ray for it).
    done = {}
    deadline = time.monotonic() + 400
    while len(done) < 2 and time.monotonic() < deadline:
        for p in (a, b):
            if p not in done and p.poll() is not None:
                done[p] = p.communicate()
        time.sleep(0.5)
    assert len(done) == 2, "a job hung"
    (first, second) = list(done)
    assert second.returncode == 0, done[second][1][-3000:]
    assert first.returncode == 2, done[first]
    err = done[first][1].strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"elastic-ddp: run in use: run.name='twin' in {tmp_path / 'ray_results'} "
                             f"is in use by a live job on host {socket.gethostname()}, pid {second.pid}, "
                             "since "), err
    # One MLflow run, FINISHED: the refused job neither resumed nor marked it.
    runs = mlflow_runs(tmp_path)
    assert [r.info.status for r in runs] == ["FINISHED"], [(r.info.status, r.data.tags) for r in runs]
    assert not (tmp_path / "ray_results" / ".leases").exists()


@pytest.mark.slow
@pytest.mark.ray
def test_a_job_whose_driver_was_killed_is_resumed_by_the_next_taking_its_lease(tmp_path, digits_data):
    cfg = _job_config(tmp_path, digits_data, "phoenix", 200)
    a = _cli(cfg, tmp_path)
    ckpt_root = tmp_path / "ray_results" / "phoenix"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not list(ckpt_root.glob("checkpoint_*")):
        time.sleep(0.5)
    assert list(ckpt_root.glob("checkpoint_*")), "no checkpoint before the kill"
    a.send_signal(signal.SIGKILL)  # the driver: its lease and its RUNNING run stay behind
    a.communicate()
    assert (tmp_path / "ray_results" / ".leases" / "phoenix.json").exists()
    # The rerun of the same run, same config (a resume refuses a changed run length): the
    # lease is taken over at once and the run resumed.
    b = _cli(cfg, tmp_path)
    out, err = b.communicate(timeout=400)
    assert b.returncode == 0, err[-3000:]
    assert f"took over the lease of the job on host {socket.gethostname()}, pid {a.pid}" in out, out
    assert "(resumed)" in out, out
    runs = mlflow_runs(tmp_path)
    assert [r.info.status for r in runs] == ["FINISHED"], [r.info.status for r in runs]


@pytest.mark.slow  # about 2 minutes: a digits job on a local Ray with its storage on S3
@pytest.mark.ray  # the job that wins starts its own local Ray
def test_two_cli_jobs_of_one_run_on_s3_storage_one_trains_the_other_is_refused(tmp_path, digits_data, s3):
    raw = digits_config(digits_data, tmp_path, {
        "scaling": {"min_workers": 1, "max_workers": 1},
        "train": {"epochs": 1, "max_steps": 20, "checkpoint_every_steps": 10, "log_every_steps": 2},
        "run": {"name": "twin", "storage_path": s3.uri("runs")}})
    raw["data"]["val_path"] = None
    cfg = tmp_path / "twin.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    env = dict(os.environ, **s3.env, PYTHONPATH=str(REPO))
    env.pop("RAY_ADDRESS", None)
    a, b = (subprocess.Popen([sys.executable, "-m", "elastic_ddp", "train", str(cfg), "--no-progress"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             cwd=tmp_path) for _ in range(2))
    done = {}
    deadline = time.monotonic() + 400
    while len(done) < 2 and time.monotonic() < deadline:
        for p in (a, b):
            if p not in done and p.poll() is not None:
                done[p] = p.communicate()
        time.sleep(0.5)
    for p in (a, b):
        if p not in done:
            p.kill()
    assert len(done) == 2, "a job hung"
    first, second = list(done)
    assert second.returncode == 0, done[second][1][-3000:]
    assert first.returncode == 2, done[first]
    err = done[first][1].strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"elastic-ddp: run in use: run.name='twin' in {s3.uri('runs')} is in "
                             f"use by a live job on host {socket.gethostname()}, pid {second.pid}, "
                             "since "), err
    runs = mlflow_runs(tmp_path)
    assert [r.info.status for r in runs] == ["FINISHED"], [(r.info.status, r.data.tags) for r in runs]
    assert s3.keys("runs/.leases/") == [], "the winner released its lease"
    assert any(k.startswith("runs/twin/checkpoint_step") for k in s3.keys("runs/twin/"))
