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

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "cluster" / "local_cluster.py"
CONFIG = "experiments/configs/digits_cnn.yaml"
TIMINGS: dict[str, float] = {}
# Directory of the checkout copy the end-to-end submission runs from. `submit` quotes the
# paths it generates (tests/unit/driver/test_submit_prepare.py: "proj #2", spaces, ?, @, :), but the
# trainer cannot run in such a directory yet: launcher._run_dir_exists builds
# f"file://{storage}", which pyarrow refuses to parse with a space and cuts at "#".
E2E_CHECKOUT = "proj #2"

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
    return subprocess.run([sys.executable, "-m", "elastic_ddp", "submit", CONFIG,
                           "--address", c.dashboard_url, *args],
                          cwd=ROOT, env=_env(c), capture_output=True, text=True, timeout=timeout)


def test_submit_refuses_a_bad_config_before_contacting_a_cluster():
    # Nothing listens on port 9: only local validation can answer, with exit 2.
    out = subprocess.run([sys.executable, "-m", "elastic_ddp", "submit", CONFIG,
                          "--address", "http://127.0.0.1:9", "--set", "scaling.max_wrkers=3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "max_wrkers" in out.stderr


def test_auth_headers_follow_rays_token_sources(tmp_path, monkeypatch):
    from elastic_ddp.driver.submit import SubmitError, auth_headers

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


@pytest.mark.slow
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


def _checkout(parent: Path, data: Path) -> Path:
    """A copy of this checkout under ``parent`` (what a job needs), with ``data/digits``
    linked to the prepared data set, so the config's relative paths mean something."""
    parent.mkdir(parents=True)
    for rel in ("elastic_ddp", "experiments/configs", "cluster"):
        shutil.copytree(ROOT / rel, parent / rel, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".rayignore", parent / ".rayignore")
    (parent / "data").mkdir()
    (parent / "data" / "digits").symlink_to(data)
    return parent


@pytest.mark.slow
def test_every_listener_of_the_cluster_is_on_loopback(cluster):
    """Every TCP listener of every process of both nodes (GCS, raylets, dashboard, agents,
    client server, metrics servers, workers) is on 127.0.0.0/8, and none of the processes
    with a fixed default port (GCS 6379, dashboard 8265 and its metrics 44227, Ray client
    10001, autoscaler metrics 44217, dashboard agent 52365) is on it; the cluster dir is
    private, the token file 0600. (Ports the OS picks at bind time may equal another
    process's default by chance; what collides between instances is a process on its own
    default.)"""
    from elastic_ddp.driver.local_ray import listeners

    found = listeners(cluster.pids())
    names = {name for _, name, _, _ in found}
    assert {"gcs_server", "raylet"} <= names, names
    assert cluster.listeners_outside_loopback() == []
    defaults = {"gcs_server": {6379}, "dashboard/dashboard.py": {8265, 44227},
                "ray.util.client.server": {10001}, "autoscaler/_private/monitor.py": {44217},
                "DashboardAgent": {52365}}
    seen, on_default = set(), []
    for pid, _, _, port in found:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        for role, ports in defaults.items():
            if role in cmd:
                seen.add(role)
                if port in ports:
                    on_default.append((role, port))
    assert seen == set(defaults), f"processes not found: {set(defaults) - seen}"
    assert on_default == []
    st = cluster.dir.stat()
    assert st.st_uid == os.getuid() and oct(st.st_mode & 0o777) == "0o700"
    assert oct(cluster.token_file.stat().st_mode & 0o777) == "0o600"


@pytest.mark.slow
def test_submit_wait_trains_on_the_two_node_cluster(cluster, digits_data, tmp_path):
    """The CLI run from another directory on a config of another checkout: the checkout
    is found from the config, its relative data/storage paths and the default MLflow
    store are made absolute against it (not against the current directory)."""
    from elastic_ddp.checkpoint.export import read_run_state

    root = _checkout(tmp_path / E2E_CHECKOUT / "repo", digits_data)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    sets = ["--set", "model.kwargs.hidden=32", "--set", "train.epochs=1", "--set", "train.log_every_steps=5",
            "--set", "run.name=submit-e2e", "--set", "run.experiment_name=tests"]
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "elastic_ddp", "submit",
                          str(root / CONFIG), "--address", cluster.dashboard_url, "--wait", *sets],
                         cwd=elsewhere, env=_env(cluster), capture_output=True, text=True, timeout=1200)
    TIMINGS["job_1_epoch_s"] = time.time() - t0
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-5000:]
    assert "SUCCEEDED" in out.stdout

    ckpts = sorted((root / "ray_results" / "submit-e2e").glob("checkpoint_*"))
    assert ckpts, "no checkpoint written under the checkout's ray_results"
    state = read_run_state(ckpts[-1])
    assert state["progress"]["epoch"] == 1 and state["progress"]["step"] > 0
    assert not list(elsewhere.iterdir())  # nothing landed in the submitter's directory

    runs = mlflow_runs(root)
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    from mlflow.tracking import MlflowClient

    # The epoch-end validation was logged at the checkpoint's step ('step' itself is
    # logged every log_every_steps, so its last value may be a few steps earlier).
    val = MlflowClient(f"sqlite:///{root / 'mlflow.db'}").get_metric_history(run.info.run_id, "val/acc")
    assert val and val[-1].step == state["progress"]["step"]
    assert json.loads(run.data.tags["elastic_ddp.world_sizes_seen"]) == [2]
    assert run.data.params["data.train_path"] == str((root / "data" / "digits" / "train").resolve())
    # Both nodes are still up: the job did not take the cluster down with it.
    assert cluster.alive() == ["head", "worker1"]


def _documented_ray_job_submit() -> str:
    """The raw `ray job submit` line of cluster/runtime_env.yaml's header, joined."""
    lines = [ln[1:].strip() for ln in (ROOT / "cluster" / "runtime_env.yaml").read_text().splitlines()
             if ln.startswith("#")]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("ray job submit"))
    cmd = []
    for ln in lines[start:]:
        cmd.append(ln.removesuffix("\\").strip())
        if not ln.endswith("\\"):
            break
    return " ".join(cmd)


# slow: 30 s; test_submit_wait_trains_on_the_two_node_cluster submits on the same cluster.
@pytest.mark.slow
def test_documented_ray_job_submit_line_trains(cluster, digits_data, tmp_path):
    """The `ray job submit` line documented in cluster/runtime_env.yaml, run by bash from
    the root of a checkout with data/digits prepared: only the address is this test
    cluster's, and two overrides keep the job short."""
    cmd = _documented_ray_job_submit()
    readme = (ROOT / "cluster" / "README.md").read_text().replace("\\\n", " ")
    assert " ".join(cmd.split()) in " ".join(readme.split()), "cluster/README.md shows another line"
    assert "--address http://127.0.0.1:8265" in cmd
    cmd = cmd.replace("http://127.0.0.1:8265", cluster.dashboard_url)
    cmd += " --set train.epochs=1 --set model.kwargs.hidden=16 --set run.name=documented-line"
    root = _checkout(tmp_path / "repo", digits_data)
    env = _env(cluster)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # this venv's `ray`
    out = subprocess.run(["bash", "-c", cmd], cwd=root, env=env, capture_output=True, text=True,
                         timeout=1200)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-5000:]
    assert "succeeded" in log.lower()
    (run,) = mlflow_runs(root, experiment_name="elastic-ddp")
    assert run.info.status == "FINISHED"
    assert sorted((root / "ray_results" / "documented-line").glob("checkpoint_*"))


@pytest.mark.slow
def test_credentials_in_the_submitters_env_stay_out_of_the_job(cluster, tmp_path):
    """A tracking URI with a password in the submitter's environment appears nowhere in
    what the cluster stores about the job (runtime env, entrypoint, metadata: what
    `ray job list` shows to anyone holding the token)."""
    from ray.job_submission import JobSubmissionClient

    from elastic_ddp.driver.submit import auth_headers

    secret = "pw-7d1e-never-shown"
    env = {**_env(cluster), "MLFLOW_TRACKING_URI": f"https://alice:{secret}@mlflow.example.com"}
    out = subprocess.run([sys.executable, "-m", "elastic_ddp", "submit", CONFIG,
                          "--address", cluster.dashboard_url, "--submission-id", "secret-check",
                          "--set", f"run.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                          "--set", "train.epochs=1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "carries credentials, so it is not sent" in out.stderr
    old = {k: os.environ.get(k) for k in cluster.env()}
    os.environ.update(cluster.env())  # auth_headers reads the token path from the env
    try:
        client = JobSubmissionClient(cluster.dashboard_url, headers=auth_headers())
        deadline = time.time() + 300
        while str(client.get_job_status("secret-check")) == "PENDING" and time.time() < deadline:
            time.sleep(0.5)
        # With a job driver connected, the cluster still listens on loopback only.
        assert cluster.listeners_outside_loopback() == []
        client.stop_job("secret-check")
        stored = json.dumps([j.model_dump() if hasattr(j, "model_dump") else vars(j) for j in client.list_jobs()],
                            default=str)
        listed = subprocess.run([str(Path(sys.executable).parent / "ray"), "job", "list",
                                 "--address", cluster.dashboard_url],
                                env=_env(cluster), capture_output=True, text=True, timeout=120)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert "secret-check" in stored and "secret-check" in listed.stdout, listed.stderr
    assert secret not in stored and "alice" not in stored
    assert secret not in listed.stdout + listed.stderr


@pytest.mark.slow
def test_resubmission_resumes_the_same_mlflow_run(cluster, digits_data, tmp_path, monkeypatch):
    """Stop a job after its first checkpoint, submit the same config again: Ray Train
    restores the run from ``storage_path/name`` and the MLflow run continues."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    from elastic_ddp.checkpoint.export import read_run_state
    from elastic_ddp.driver.submit import auth_headers

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

    def attempts_written():
        """The first submission's tracker wrote its worker-group count to the run (its
        first write waits for the first step and MLflow's import in the tracker actor)."""
        runs = mlflow_runs(tmp_path)
        return bool(runs) and "elastic_ddp.attempts" in runs[0].data.tags

    deadline = time.time() + 900
    while registered_step() is None or not attempts_written():
        status = client.get_job_status("resume-1")
        assert not status.is_terminal(), f"job ended ({status}) before its first checkpoint"
        assert time.time() < deadline, "no checkpoint within 900 s"
        time.sleep(0.5)
    TIMINGS["resume_first_checkpoint_s"] = time.time() - t0
    client.stop_job("resume-1")
    while not client.get_job_status("resume-1").is_terminal():
        time.sleep(0.5)
    assert client.get_job_status("resume-1") == JobStatus.STOPPED
    # The newest committed checkpoint (its manifest written): the one Ray Train registered,
    # or one the stop itself committed after it (the driver's SIGTERM asks for one).
    committed = [int(c.name.rsplit("step", 1)[1]) for c in run_dir.glob("checkpoint_step*")
                 if (c / "manifest.json").is_file()]
    newest = max(committed)
    assert newest >= registered_step(), (committed, registered_step())
    (first,) = mlflow_runs(tmp_path)
    # `ray job stop` gave the driver time (RAY_JOB_STOP_WAIT_TIME_S of the runtime env) to
    # commit its checkpoint and close its run.
    assert first.info.status == "KILLED", first.info.status

    t1 = time.time()
    out = _submit(cluster, ["--wait", "--submission-id", "resume-2", *sets])
    TIMINGS["resume_second_submission_s"] = time.time() - t1
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-5000:]

    runs = mlflow_runs(tmp_path)
    assert [r.info.run_id for r in runs] == [first.info.run_id]
    assert runs[0].info.status == "FINISHED"
    from mlflow.tracking import MlflowClient

    client_ml = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    # The new workers resumed from the newest committed checkpoint of the stopped run: the
    # resume event of the run's summary names the step resumed at.
    events = json.loads(Path(client_ml.download_artifacts(
        first.info.run_id, "summary.json", str(tmp_path))).read_text())["events"]
    resumed = [e for e in events if e.get("type") == "resume"]
    assert [e.get("resumed_at_step") for e in resumed] == [newest], events
    assert "did not close its run" not in resumed[0]["cause"], resumed
    # The second submission's worker group counted after the first's (the run's tags).
    tags = client_ml.get_run(first.info.run_id).data.tags
    assert int(tags["elastic_ddp.attempts"]) >= 2, tags
    final = read_run_state(sorted(run_dir.glob("checkpoint_*"))[-1])
    assert final["progress"]["epoch"] == 2
