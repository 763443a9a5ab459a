"""One live job per run (``elastic_ddp.driver.lease``): a second job of the same ``run.name`` in
the same storage is refused at once (exit 2, one line naming the live job's host, pid and
start, and the fix) without touching the MLflow store; a lease whose holder died or
stopped heartbeating is taken over; two processes opening runs on a fresh sqlite store at
the same moment both succeed. Real processes, real files, a real MLflow store.

On S3 (``lease_s3``, the real S3 server: moto's, on loopback): jobs racing for a free
lease, or for a stale one, end with exactly one holder every time (conditional writes:
``If-None-Match: *``, ``If-Match``); a holder whose record was taken over neither
heartbeats over nor deletes the new one; a missing bucket is one line naming it; a store
without exclusive create says so once.

The CLI jobs that meet a lease: tests/e2e/resume/test_lease_jobs.py.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import mlflow_runs
from elastic_ddp.config import ConfigError
from elastic_ddp.driver.lease import STALE_S, RunBusyError, RunLease

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


# --------------------------------------------------------------------------- on S3
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
