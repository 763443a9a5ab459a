"""One live job per run (``elastic_ddp.driver.lease``): a second job of the same ``run.name`` in
the same storage is refused at once (exit 2, one line naming the live job's host, pid and
start, and the fix) without touching the MLflow store; a lease whose holder died or
stopped heartbeating is taken over; two processes opening runs on a fresh sqlite store at
the same moment both succeed. Real processes, real files, a real MLflow store; the CLI
jobs run on a real local Ray."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from conftest import digits_config, mlflow_runs

REPO = Path(__file__).resolve().parents[3]


def _holder(storage: Path, name: str) -> subprocess.Popen:
    """A process that takes the lease of ``name`` and holds it until killed; it prints
    "held" once it has it."""
    code = textwrap.dedent(f"""
        import sys, time
        from elastic_ddp.driver.lease import RunLease
        RunLease({str(storage)!r}, {name!r}).acquire()
        print("held", flush=True)
        time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_live_holder_refuses_a_second_job_and_a_killed_one_is_taken_over_at_once(tmp_path):
    from elastic_ddp.driver.lease import RunBusyError, RunLease

    p = _holder(tmp_path, "job")
    try:
        t = time.monotonic()
        with pytest.raises(RunBusyError) as e:
            RunLease(str(tmp_path), "job").acquire()
        assert time.monotonic() - t < 5  # at once, not after a timeout
        msg = str(e.value)
        for needle in (f"run.name='job' in {tmp_path} is in use by a live job on host "
                       f"{socket.gethostname()}, pid {p.pid}, since ", "set another run.name",
                       "or wait for that job to end"):
            assert needle in msg, msg
        assert "\n" not in msg
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    # Its process is gone: the next job takes the lease over without waiting for staleness.
    lease = RunLease(str(tmp_path), "job").acquire()
    try:
        assert lease.took_over["pid"] == p.pid
        assert f"pid {p.pid}" in lease.describe_takeover() and "which is gone" in lease.describe_takeover()
        rec = json.loads((tmp_path / ".leases" / "job.json").read_text())
        assert rec["pid"] == os.getpid()
    finally:
        lease.release()
    assert not (tmp_path / ".leases").exists()  # released: nothing left behind


def test_a_holder_elsewhere_is_live_while_it_heartbeats_and_stale_after(tmp_path):
    from elastic_ddp.driver.lease import STALE_S, RunBusyError, RunLease

    d = tmp_path / ".leases"
    d.mkdir()
    now = time.time()
    rec = {"host": "other-host.example", "pid": 4242, "pid_start": None, "since": now - 3600,
           "heartbeat": now - 1, "run": "job"}
    (d / "job.json").write_text(json.dumps(rec))
    with pytest.raises(RunBusyError, match="host other-host.example, pid 4242"):
        RunLease(str(tmp_path), "job").acquire()
    rec["heartbeat"] = now - STALE_S - 1
    (d / "job.json").write_text(json.dumps(rec))
    lease = RunLease(str(tmp_path), "job").acquire()
    assert lease.took_over["host"] == "other-host.example"
    # Not known to be gone (another host): the takeover says the lease was stale.
    line = lease.describe_takeover()
    assert "whose lease is stale (no heartbeat for" in line and "gone" not in line, line
    lease.release()


def test_a_paused_holder_is_taken_over_as_stale_not_gone(tmp_path):
    """A holder on this host whose process lives but has stopped heartbeating (SIGSTOP: a
    suspended laptop, a frozen VM) is taken over once stale, and the line says so."""
    from elastic_ddp.driver.lease import STALE_S, RunLease

    p = _holder(tmp_path, "job")
    try:
        p.send_signal(signal.SIGSTOP)
        path = tmp_path / ".leases" / "job.json"
        rec = json.loads(path.read_text())
        rec["heartbeat"] = time.time() - STALE_S - 1  # as if paused that long
        path.write_text(json.dumps(rec))
        lease = RunLease(str(tmp_path), "job").acquire()
        try:
            line = lease.describe_takeover()
            assert f"pid {p.pid}" in line and "whose lease is stale" in line, line
            assert "gone" not in line, line
        finally:
            lease.release()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()


def test_the_holder_renews_its_heartbeat(tmp_path, monkeypatch):
    from elastic_ddp.driver import lease as lease_module
    from elastic_ddp.driver.lease import STALE_S, RunLease

    # A renewal well inside the staleness limit, as the module sets them.
    assert lease_module.HEARTBEAT_S * 3 <= STALE_S
    # The beat thread reads the period at each wait: 0.5 s instead of 5 s keeps the test
    # to a second or two of sleep.
    monkeypatch.setattr(lease_module, "HEARTBEAT_S", 0.5)
    beat = lease_module.HEARTBEAT_S
    lease = RunLease(str(tmp_path), "job").acquire()
    try:
        first = json.loads((tmp_path / ".leases" / "job.json").read_text())["heartbeat"]
        time.sleep(beat * 2 + 1)
        later = json.loads((tmp_path / ".leases" / "job.json").read_text())["heartbeat"]
        assert later >= first + beat, (first, later)
    finally:
        lease.release()


def test_two_processes_opening_runs_on_a_fresh_sqlite_store_both_succeed(tmp_path):
    """The first MLflow open of a new sqlite file creates its tables: two at once
    collided (``table _alembic_tmp_experiments already exists``)."""
    # One interpreter imports what the open imports, then forks an opener process per
    # (store, job): six real processes that meet on their stores with the imports done,
    # for the cost of one import.
    code = textwrap.dedent("""
        import json, os, sys, time
        from elastic_ddp.config import Config
        from elastic_ddp.tracking import open_run
        import mlflow.store.tracking.sqlalchemy_store  # what the open imports, before the start
        roots = json.loads(sys.argv[1])
        print("ready", flush=True)
        start = float(sys.stdin.readline())
        children = {}
        for root in roots:
            for name in ("job0", "job1"):
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        cfg = Config.from_dict({"data": {"train_path": root}, "model": {"name": "mlp"},
                                                "run": {"name": name, "experiment_name": "tests",
                                                        "tracking_uri": f"sqlite:///{root}/mlflow.db",
                                                        "storage_path": root}})
                        time.sleep(max(0.0, start - time.time()))  # all at the same moment
                        print(root, name, open_run(cfg, root, cfg.run.tracking_uri)[0], flush=True)
                        code = 0
                    except BaseException:
                        import traceback
                        traceback.print_exc()
                    finally:
                        os._exit(code)
                children[pid] = (root, name)
        failed = [children[pid] for pid in children if os.waitpid(pid, 0)[1] != 0]
        print("failed", json.dumps(failed), flush=True)
        sys.exit(1 if failed else 0)
    """)
    # Three pairs at once, each on a fresh store of its own: a collision is a matter of
    # timing, so one pair could pass by luck.
    roots = [tmp_path / f"t{trial}" for trial in range(3)]
    for root in roots:
        root.mkdir()
    p = subprocess.Popen([sys.executable, "-c", code, json.dumps([str(r) for r in roots])],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    # Once the imports are done, one start time half a second ahead for all: a fixed lead
    # for the imports idles on an idle machine and can be too short on a busy one, where
    # the two opens of a pair would no longer meet.
    assert p.stdout.readline().strip() == "ready"
    p.stdin.write(f"{time.time() + 0.5}\n")
    p.stdin.flush()
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, (out, err[-3000:])
    assert out.splitlines()[-1] == "failed []", out
    for root in roots:
        assert len(mlflow_runs(root)) == 2


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
