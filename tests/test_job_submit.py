"""``elastic-ddp submit`` against a real two-node Ray cluster on this machine.

``cluster/local_cluster.py`` starts a head (``ray start --head``, 1 CPU) and joins a
worker node (``ray start --address``, 1 CPU), with token authentication on. A 2-worker
job therefore needs both nodes. The module's fixture always stops exactly that cluster
(its own process trees; never ``ray stop``, which would kill other users' Ray).

Durations are printed (run with ``-s``), never asserted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import mlflow_runs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "cluster" / "local_cluster.py"
CONFIG = "experiments/configs/digits_cnn.yaml"
TIMINGS: dict[str, float] = {}

pytestmark = pytest.mark.timeout(1800)


def _local_cluster_module():
    spec = importlib.util.spec_from_file_location("local_cluster", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _script(cluster_dir: str, *args: str) -> str:
    out = subprocess.run([sys.executable, str(SCRIPT), "--dir", cluster_dir, *args],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"local_cluster {args}: {out.stdout}\n{out.stderr}"
    return out.stdout


@pytest.fixture(scope="module")
def cluster():
    """Head (1 CPU) + one worker node (1 CPU), job API on a free port, token auth on."""
    # Short path: Ray's unix sockets live under it (~107-byte limit).
    d = tempfile.mkdtemp(prefix="edc-", dir="/tmp")
    c = _local_cluster_module().LocalCluster(d)
    t0 = time.time()
    try:
        _script(d, "start", "1", "1", "--head-cpus", "1", "--dashboard-port", "0")
        TIMINGS["cluster_start_s"] = time.time() - t0
        assert c.alive() == ["head", "worker1"]
        yield c
    finally:
        t1 = time.time()
        try:
            _script(d, "stop")
        finally:
            c.stop()  # no-op when the CLI stopped it; a second chance when it failed
            TIMINGS["cluster_stop_s"] = time.time() - t1
            leftover = c.alive()
            shutil.rmtree(d, ignore_errors=True)
            print(f"\n[test_job_submit] timings: {json.dumps({k: round(v, 1) for k, v in TIMINGS.items()})}")
        assert not leftover, f"nodes still alive after stop: {leftover}"


def _env(c) -> dict[str, str]:
    env = {**os.environ, **c.env(), "RAY_API_SERVER_ADDRESS": c.dashboard_url}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def _overrides(data: Path, tmp: Path, name: str, **extra) -> list[str]:
    sets = {
        "data.train_path": data / "train", "data.val_path": data / "val",
        "model.kwargs.hidden": 32, "train.epochs": 1, "train.log_every_steps": 5,
        "run.name": name, "run.experiment_name": "tests",
        "run.storage_path": tmp / "ray_results",
        "run.tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}",
        **extra,
    }
    out = []
    for k, v in sets.items():
        out += ["--set", f"{k}={v}"]
    return out


def _submit(c, args: list[str], timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elastic_ddp.cli", "submit", CONFIG,
                           "--address", c.dashboard_url, *args],
                          cwd=ROOT, env=_env(c), capture_output=True, text=True, timeout=timeout)


def test_submit_refuses_a_bad_config_before_contacting_a_cluster():
    # Nothing listens on port 9: only local validation can answer, with exit 2.
    out = subprocess.run([sys.executable, "-m", "elastic_ddp.cli", "submit", CONFIG,
                          "--address", "http://127.0.0.1:9", "--set", "scaling.max_wrkers=3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "max_wrkers" in out.stderr


def test_prepare_makes_paths_absolute_only_for_a_loopback_cluster(tmp_path):
    from elastic_ddp.config import ConfigError
    from elastic_ddp.submit import prepare, remote_warnings

    cfg_path = str(ROOT / CONFIG)
    local, env, _ = prepare(cfg_path, ["train.epochs=1"], "http://127.0.0.1:8265", cwd=ROOT)
    assert local.startswith(f"python -m elastic_ddp.cli train {CONFIG} --set train.epochs=1")
    assert f"data.train_path={ROOT}/data/digits/train" in local
    assert f"run.storage_path={ROOT}/ray_results" in local
    assert env["working_dir"] == str(ROOT)

    remote, _, cfg = prepare(cfg_path, [], "http://ray-head.example:8265", cwd=ROOT)
    assert "--set" not in remote  # a remote cluster's paths are not this machine's
    assert any("run.storage_path" in w for w in remote_warnings(cfg))

    outside = tmp_path / "cfg.yaml"
    shutil.copy(cfg_path, outside)
    with pytest.raises(ConfigError, match="outside the uploaded working dir"):
        prepare(str(outside), [], "http://127.0.0.1:8265", cwd=ROOT)


def test_auth_headers_follow_rays_token_sources(tmp_path, monkeypatch):
    from elastic_ddp.submit import SubmitError, auth_headers

    for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(k, raising=False)
    assert auth_headers() == {}  # auth mode not asked for: send nothing
    tok = tmp_path / "tok"
    tok.write_text("abc123\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tok))
    assert auth_headers() == {"Authorization": "Bearer abc123"}
    monkeypatch.setenv("RAY_AUTH_TOKEN", "fromenv")  # Ray's precedence: the variable first
    assert auth_headers() == {"Authorization": "Bearer fromenv"}
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))
    with pytest.raises(SubmitError, match="RAY_AUTH_TOKEN_PATH"):
        auth_headers()


def test_job_api_requires_the_token(cluster):
    url = f"{cluster.dashboard_url}/api/jobs/"
    token = cluster.token_file.read_text().strip()

    def status(headers: dict) -> int:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert status({}) == 401
    assert status({"Authorization": "Bearer " + "0" * 64}) == 403
    assert status({"Authorization": f"Bearer {token}"}) == 200
    assert oct(cluster.token_file.stat().st_mode & 0o777) == "0o600"


def test_submit_wait_trains_on_the_two_node_cluster(cluster, digits_data, tmp_path):
    from elastic_ddp.checkpoint import load_state

    t0 = time.time()
    out = _submit(cluster, ["--wait", *_overrides(digits_data, tmp_path, "submit-e2e")])
    TIMINGS["job_1_epoch_s"] = time.time() - t0
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-5000:]
    assert "SUCCEEDED" in out.stdout

    ckpts = sorted((tmp_path / "ray_results" / "submit-e2e").glob("checkpoint_*"))
    assert ckpts, "no checkpoint written under run.storage_path"
    state = load_state(ckpts[-1])  # weights_only=True load + format check
    assert state["epoch"] == 1 and state["step"] > 0

    runs = mlflow_runs(tmp_path)
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    from mlflow.tracking import MlflowClient

    # The epoch-end validation was logged at the checkpoint's step ('step' itself is
    # logged every log_every_steps, so its last value may be a few steps earlier).
    val = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(run.info.run_id, "val_acc")
    assert val and val[-1].step == state["step"]
    assert json.loads(run.data.tags["elastic_ddp.world_sizes_seen"]) == [2]
    # Both nodes are still up: the job did not take the cluster down with it.
    assert cluster.alive() == ["head", "worker1"]


@pytest.mark.slow
def test_resubmission_resumes_the_same_mlflow_run(cluster, digits_data, tmp_path, monkeypatch):
    """Stop a job after its first checkpoint, submit the same config again: Ray Train
    restores the run from ``storage_path/name`` and the MLflow run continues."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    from elastic_ddp.checkpoint import load_state
    from elastic_ddp.submit import auth_headers

    name = "resume-e2e"
    sets = _overrides(digits_data, tmp_path, name, **{"train.epochs": 2,
                                                      "train.checkpoint_every_steps": 5})
    run_dir = tmp_path / "ray_results" / name
    t0 = time.time()
    out = _submit(cluster, ["--submission-id", "resume-1", *sets])
    assert out.returncode == 0, out.stdout + out.stderr

    for k, v in cluster.env().items():  # auth_headers reads the token path from the env
        monkeypatch.setenv(k, v)
    client = JobSubmissionClient(cluster.dashboard_url, headers=auth_headers())
    snapshot = run_dir / "checkpoint_manager_snapshot.json"

    def registered_step():
        """Step of the newest checkpoint Ray Train registered (what it will restore);
        a checkpoint_* dir can exist a moment before it is registered."""
        try:
            latest = json.loads(snapshot.read_text()).get("latest_checkpoint_result")
        except (OSError, ValueError):
            return None
        return int(latest["metrics"]["step"]) if latest else None

    deadline = time.time() + 900
    while registered_step() is None:
        status = client.get_job_status("resume-1")
        assert not status.is_terminal(), f"job ended ({status}) before its first checkpoint"
        assert time.time() < deadline, "no checkpoint within 900 s"
        time.sleep(0.5)
    TIMINGS["resume_first_checkpoint_s"] = time.time() - t0
    client.stop_job("resume-1")
    while not client.get_job_status("resume-1").is_terminal():
        time.sleep(0.5)
    assert client.get_job_status("resume-1") == JobStatus.STOPPED
    newest = registered_step()
    (first,) = mlflow_runs(tmp_path)
    assert first.info.status != "FINISHED"

    t1 = time.time()
    out = _submit(cluster, ["--wait", "--submission-id", "resume-2", *sets])
    TIMINGS["resume_second_submission_s"] = time.time() - t1
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-5000:]
    # Ray Train V2 handed the newest registered checkpoint of the stopped run to the
    # new workers (the rank logs print it when they start).
    resumed = set(re.findall(r"resume_step=(\w+)", log))
    assert resumed == {str(newest)}, f"resume steps in the log: {resumed}, expected {newest}"

    runs = mlflow_runs(tmp_path)
    assert [r.info.run_id for r in runs] == [first.info.run_id]
    assert runs[0].info.status == "FINISHED"
    from mlflow.tracking import MlflowClient

    client_ml = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    # One first-step marker per attempt, at the step it trained: 1, then newest + 1.
    starts = sorted(int(m.step) for m in client_ml.get_metric_history(first.info.run_id,
                                                                      "attempt_first_step_ts"))
    assert starts[0] == 1 and starts[-1] == newest + 1
    final = load_state(sorted(run_dir.glob("checkpoint_*"))[-1])
    assert final["epoch"] == 2
