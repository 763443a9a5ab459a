"""The run lease on S3 (``elastic_ddp.driver.lease`` + ``lease_s3``) against the real S3
server (moto's, on loopback): jobs racing for a free lease, or for a stale one, end with
exactly one holder every time (conditional writes: ``If-None-Match: *``, ``If-Match``);
a holder whose record was taken over neither heartbeats over nor deletes the new one; a
missing bucket is one line naming it; a store without exclusive create says so once."""

from __future__ import annotations

import json
import multiprocessing
import threading
import time

import pytest

from elastic_ddp.config import ConfigError
from elastic_ddp.driver.lease import STALE_S, RunBusyError, RunLease


def _race(storage: str, name: str, n: int) -> tuple[list, list]:
    """``n`` threads acquire the lease of ``name`` at one instant: (holders, refusals)."""
    gate = threading.Barrier(n)
    won, lost, errors = [], [], []
    leases = [RunLease(storage, name) for _ in range(n)]  # clients built before the gate

    def go(lease):
        gate.wait()
        try:
            won.append(lease.acquire())
        except RunBusyError as e:
            lost.append(e)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(x,)) for x in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return won, lost


def test_jobs_racing_for_a_free_lease_on_s3_leave_exactly_one_holder(s3):
    storage = s3.uri("runs")
    for i in range(20):
        won, lost = _race(storage, f"job{i}", 6)
        assert len(won) == 1 and len(lost) == 5, (i, len(won), len(lost))
        rec = json.loads(s3.client.get_object(Bucket=s3.name, Key=f"runs/.leases/job{i}.json")["Body"].read())
        assert rec["since"] == won[0].record["since"]
        won[0].release()
        assert s3.keys(f"runs/.leases/job{i}") == [], "released: nothing left behind"


def _stale(s3, name: str) -> dict:
    now = time.time()
    rec = {"host": "other-host.example", "pid": 4242, "pid_start": None, "since": now - 3600,
           "heartbeat": now - STALE_S - 5, "run": name}
    s3.client.put_object(Bucket=s3.name, Key=f"runs/.leases/{name}.json", Body=json.dumps(rec).encode())
    return rec


def test_jobs_racing_to_take_over_a_stale_lease_on_s3_leave_exactly_one_holder(s3):
    storage = s3.uri("runs")
    for i in range(12):
        _stale(s3, f"old{i}")
        won, lost = _race(storage, f"old{i}", 6)
        assert len(won) == 1 and len(lost) == 5, (i, len(won), len(lost))
        assert won[0].took_over["host"] == "other-host.example"
        won[0].release()


def _proc_race(storage, env, names, gate, out):
    import os

    os.environ.update(env)
    from elastic_ddp.driver.lease import RunBusyError, RunLease

    for name in names:
        lease = RunLease(storage, name)
        gate.wait()
        try:
            lease.acquire()
            out.put((name, os.getpid()))
            gate.wait()  # every process has tried before the holder lets go
            lease.release()
        except RunBusyError:
            gate.wait()


def test_processes_racing_for_a_lease_on_s3_leave_exactly_one_holder(s3):
    ctx = multiprocessing.get_context("spawn")
    gate, out = ctx.Barrier(3), ctx.Queue()
    names = [f"p{i}" for i in range(10)]
    procs = [ctx.Process(target=_proc_race, args=(s3.uri("runs"), s3.env, names, gate, out))
             for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
        assert p.exitcode == 0, p.exitcode
    got = {}
    while not out.empty():
        name, pid = out.get()
        got.setdefault(name, []).append(pid)
    assert {n: len(v) for n, v in got.items()} == {n: 1 for n in names}, got


def test_a_holder_taken_over_writes_nothing_over_the_new_holder(s3, monkeypatch):
    from elastic_ddp.driver import lease as lease_module

    monkeypatch.setattr(lease_module, "HEARTBEAT_S", 0.3)
    a = RunLease(s3.uri("runs"), "job").acquire()
    key = "runs/.leases/job.json"
    first = json.loads(s3.client.get_object(Bucket=s3.name, Key=key)["Body"].read())
    time.sleep(1.0)
    beat = json.loads(s3.client.get_object(Bucket=s3.name, Key=key)["Body"].read())
    assert beat["heartbeat"] > first["heartbeat"], "the holder renews its heartbeat"
    # Another job's record replaces it (as a takeover of a job that looked stale does).
    other = {**_stale(s3, "job"), "heartbeat": time.time(), "host": "b.example"}
    s3.client.put_object(Bucket=s3.name, Key=key, Body=json.dumps(other).encode())
    time.sleep(1.0)
    a.release()
    now = json.loads(s3.client.get_object(Bucket=s3.name, Key=key)["Body"].read())
    assert now == other, "the old holder overwrote or deleted the new holder's record"
    assert not a._thread.is_alive()


def test_a_missing_bucket_is_one_line_naming_it(s3):
    with pytest.raises(ConfigError) as e:
        RunLease(f"s3://no-such-bucket-{s3.name}/runs", "job").acquire()
    msg = str(e.value)
    assert "\n" not in msg and f"no-such-bucket-{s3.name}" in msg and "NoSuchBucket" in msg, msg
    assert "run.storage_path=" in msg


def test_a_store_without_exclusive_create_warns_once(capsys):
    a = RunLease("mock:///runs", "job").acquire()
    a.release()
    b = RunLease("mock:///runs", "job2").acquire()
    b.release()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mock:// has no exclusive create" in err[0], err


def test_a_create_that_reaches_the_store_late_does_not_overwrite_the_holder(s3):
    """The race a write-then-read-back lease cannot exclude: job B found no lease, and
    its write reaches the store only after job A created the lease and read it back. B's
    write is conditional, so the store refuses it; B is refused, A's record stays."""
    storage = s3.uri("runs")
    b = RunLease(storage, "late")
    a = RunLease(storage, "late")
    sent = threading.Event()

    def slow_put(request, **_):
        if threading.current_thread().name == "job-b" and request.method == "PUT":
            sent.set()
            time.sleep(1.5)  # A creates the lease meanwhile

    b.s3.client.meta.events.register("before-send.s3.PutObject", slow_put)
    out = {}

    def run_b():
        try:
            out["b"] = b.acquire()
        except RunBusyError as e:
            out["b"] = e

    t = threading.Thread(target=run_b, name="job-b")
    try:
        t.start()
        assert sent.wait(30)
        a.acquire()
        t.join(60)
    finally:
        b.s3.client.meta.events.unregister("before-send.s3.PutObject", slow_put)
    assert isinstance(out["b"], RunBusyError), out
    rec = json.loads(s3.client.get_object(Bucket=s3.name, Key="runs/.leases/late.json")["Body"].read())
    assert rec["since"] == a.record["since"], "the late write replaced the holder's record"
    a.release()


@pytest.mark.slow  # about 2 minutes: a digits job on a local Ray with its storage on S3
@pytest.mark.ray  # the job that wins starts its own local Ray
def test_two_cli_jobs_of_one_run_on_s3_storage_one_trains_the_other_is_refused(tmp_path, digits_data, s3):
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from conftest import digits_config, mlflow_runs

    raw = digits_config(digits_data, tmp_path, {
        "scaling": {"min_workers": 1, "max_workers": 1},
        "train": {"epochs": 1, "max_steps": 20, "checkpoint_every_steps": 10, "log_every_steps": 2},
        "run": {"name": "twin", "storage_path": s3.uri("runs")}})
    raw["data"]["val_path"] = None
    cfg = tmp_path / "twin.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    env = dict(os.environ, **s3.env, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
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
