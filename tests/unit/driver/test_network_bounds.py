"""No unbounded wait on a network dependency: ``RAY_ADDRESS`` and the MLflow tracking
server each answer within ``ELASTIC_DDP_CONNECT_TIMEOUT_S`` or ``elastic-ddp train``
exits 2 with one line naming the address, what did not answer and the fix, in about
that time; and ``RAY_ADDRESS`` at the project's own loopback-only cluster trains.

Real servers on 127.0.0.1: a socket that listens and never accepts (the kernel completes
the TCP handshake, nothing ever answers: a frozen process), an HTTP/2 server that sends
its SETTINGS frame and then nothing (a GCS that stops answering after the handshake), an
``http.server`` whose handler sleeps, and real Ray clusters (``cluster/local_cluster.py``,
its GCS frozen with SIGSTOP). The CLI runs as a user runs it, in a subprocess."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from conftest import digits_config

REPO = Path(__file__).resolve().parents[3]
BOUND = 2.0  # ELASTIC_DDP_CONNECT_TIMEOUT_S in these tests
# What the CLI needs besides the wait itself: Python, torch and Ray imports, the scan, on
# a busy 2-core machine.
SLACK = 45.0


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@contextlib.contextmanager
def silent_listener() -> Iterator[int]:
    """A port that completes TCP handshakes (backlog) and never accepts or answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


@contextlib.contextmanager
def http2_then_silent() -> Iterator[int]:
    """An HTTP/2 server that answers the connection preface with its SETTINGS frame and
    then never answers a request (a GCS that hangs after the handshake)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            held.append(c)
            with contextlib.suppress(OSError):
                c.sendall(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join(2)
        for c in held:
            c.close()
        srv.close()


@contextlib.contextmanager
def slow_mlflow(delay_s: float) -> Iterator[int]:
    """An HTTP server that answers MLflow's experiment look-up as MLflow would, after
    ``delay_s`` seconds."""

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            time.sleep(delay_s)
            body = json.dumps({"error_code": "RESOURCE_DOES_NOT_EXIST"}).encode()
            with contextlib.suppress(OSError):
                self.send_response(404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()


def _train(tmp: Path, data: Path, env_extra: dict, extra: dict | None = None,
           timeout: float = 240) -> tuple[subprocess.CompletedProcess, float]:
    """``elastic-ddp train`` on the digits job, as a user runs it: (result, seconds)."""
    raw = digits_config(data, tmp, extra)
    path = tmp / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = dict(os.environ, PYTHONPATH=str(REPO), ELASTIC_DDP_CONNECT_TIMEOUT_S=str(BOUND))
    env.pop("RAY_ADDRESS", None)
    env.update(env_extra)
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "elastic_ddp", "train", str(path), "--no-progress"],
                       capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)
    return p, time.monotonic() - t


def _last_line(p: subprocess.CompletedProcess) -> str:
    lines = p.stderr.strip().splitlines()
    assert lines, (p.stdout[-2000:], p.stderr)
    return lines[-1]


def _nothing_started(tmp: Path) -> None:
    assert not (tmp / "ray_results").exists()
    assert not (tmp / "mlflow.db").exists() or _runs(tmp) == 0


def _runs(tmp: Path) -> int:
    import sqlite3

    with contextlib.closing(sqlite3.connect(tmp / "mlflow.db")) as c:
        try:
            return c.execute("select count(*) from runs").fetchone()[0]
        except sqlite3.OperationalError:
            return 0


# --------------------------------------------------------------------------- RAY_ADDRESS
@pytest.mark.parametrize("server, said", [
    pytest.param("closed", "refused the connection", marks=pytest.mark.slow),
    ("silent", f"accepted the connection but sent no answer within {BOUND:g} s"),
])
def test_a_ray_address_that_does_not_answer_exits_2_within_the_bound(
        tmp_path, digits_data, server, said):
    """A closed port, and one that accepts and never answers: exit 2, one line naming
    RAY_ADDRESS, the address, what did not answer and the fix; no traceback, no run, no
    storage; within the bound plus the CLI's own start."""
    with (silent_listener() if server == "silent" else contextlib.nullcontext(_closed_port())) as port:
        addr = f"127.0.0.1:{port}"
        p, took = _train(tmp_path, digits_data, {"RAY_ADDRESS": addr})
    assert p.returncode == 2, (p.stdout[-2000:], p.stderr)
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith(f"elastic-ddp: config error: RAY_ADDRESS={addr}: the Ray cluster at "
                           f"{addr} {said}"), line
    assert "ray start --head" in line and "ELASTIC_DDP_CONNECT_TIMEOUT_S" in line, line
    assert took < BOUND * 2 + SLACK, took
    _nothing_started(tmp_path)


def test_a_ray_cluster_that_hangs_after_the_handshake_exits_2_within_the_watchdog(
        tmp_path, digits_data):
    """A server that speaks HTTP/2 and never answers a call passes the address check;
    ``ray.init`` then waits on it inside Ray's C++ core. The watchdog ends the process at
    4 bounds with one elastic-ddp line (after Ray's own) naming the address and the fix."""
    with http2_then_silent() as port:
        addr = f"127.0.0.1:{port}"
        p, took = _train(tmp_path, digits_data, {"RAY_ADDRESS": addr})
    assert p.returncode == 2, (p.stdout[-2000:], p.stderr[-3000:])
    line = _last_line(p)
    assert line.startswith(f"elastic-ddp: RAY_ADDRESS={addr}: the Ray cluster at {addr} accepted "
                           f"the connection but the driver did not join it within {4 * BOUND:g} s"), line
    assert "ray start --head" in line and "Traceback" not in p.stderr
    assert took < 4 * BOUND + SLACK, took
    _nothing_started(tmp_path)


def test_a_bound_that_is_not_a_number_exits_2_naming_the_variable(tmp_path, digits_data):
    p, _ = _train(tmp_path, digits_data, {"RAY_ADDRESS": f"127.0.0.1:{_closed_port()}",
                                          "ELASTIC_DDP_CONNECT_TIMEOUT_S": "soon"})
    assert p.returncode == 2, p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert "ELASTIC_DDP_CONNECT_TIMEOUT_S='soon': not a positive number of seconds" in line, line


def test_a_loopback_only_cluster_is_told_from_one_on_every_interface():
    """Which 127.0.0.1 addresses the driver joins on loopback: a port that answers on
    127.0.0.1 and not at the host's address (where Ray would connect instead); one bound
    to every interface is left to Ray, and so is an address that is not loopback. On a
    host without a route (Ray keeps 127.0.0.1 itself) nothing is rewritten."""
    from elastic_ddp.compat.ray_local import host_address
    from elastic_ddp.driver.network_checks import loopback_only

    outside = host_address()
    with contextlib.ExitStack() as stack:
        ports = {}
        for bind in ("127.0.0.1", "0.0.0.0"):
            s = stack.enter_context(socket.socket())
            s.bind((bind, 0))
            s.listen(4)
            ports[bind] = s.getsockname()[1]
        rewritten = outside is not None and not outside.startswith("127.")
        assert loopback_only(f"127.0.0.1:{ports['127.0.0.1']}") is rewritten
        assert loopback_only(f"localhost:{ports['127.0.0.1']}") is rewritten
        assert loopback_only(f"127.0.0.1:{ports['0.0.0.0']}") is False
        if rewritten:
            assert loopback_only(f"{outside}:{ports['0.0.0.0']}") is False
        assert loopback_only(f"ray://127.0.0.1:{ports['127.0.0.1']}") is False


# --------------------------------------------------------------------------- MLflow
@pytest.mark.parametrize("server", ["silent", "slow"])
def test_a_tracking_server_that_does_not_answer_in_time_exits_2_before_any_work(
        tmp_path, digits_data, server):
    """A tracking server that accepts and never answers, and one that answers after the
    bound: exit 2, one line naming the field, the address and the fix, before Ray or the
    data scan; within the bound plus the CLI's start (MLflow's client would wait 120 s on
    each of 7 tries)."""
    cm = silent_listener() if server == "silent" else slow_mlflow(delay_s=BOUND + 10)
    with cm as port:
        uri = f"http://127.0.0.1:{port}"
        p, took = _train(tmp_path, digits_data, {}, {"run": {"tracking_uri": uri}})
    assert p.returncode == 2, (p.stdout[-2000:], p.stderr)
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith(f"elastic-ddp: config error: run.tracking_uri={uri}: the server at "
                           f"127.0.0.1:{port} accepted the connection but did not answer GET "
                           f"{uri}/api/2.0/mlflow/experiments/get-by-name within {BOUND:g} s"), line
    assert "mlflow server --host 127.0.0.1" in line and "ELASTIC_DDP_CONNECT_TIMEOUT_S" in line
    assert took < BOUND + SLACK, took
    assert "Parquet" not in p.stdout  # before the data scan
    _nothing_started(tmp_path)


def test_the_jobs_own_mlflow_requests_are_bounded(monkeypatch):
    """MLflow's knobs for the job's requests: set when unset, a person's value kept."""
    from elastic_ddp.driver.network_checks import MLFLOW_KNOBS, bound_mlflow_requests

    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "9")
    bound_mlflow_requests()
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == MLFLOW_KNOBS["MLFLOW_HTTP_REQUEST_TIMEOUT"]
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "9"


# --------------------------------------------------------------------------- real clusters
@contextlib.contextmanager
def local_cluster(workers: int, cpus: int) -> Iterator[dict]:
    """``cluster/local_cluster.py start`` (every listener on 127.0.0.1, token auth) in a
    short private dir (Ray's socket paths must stay under 108 bytes); stopped by its
    nodes' PIDs (``local_cluster.py stop``) on the way out."""
    d = Path("/tmp") / f"edc-nb{os.getpid()}"
    cmd = [sys.executable, str(REPO / "cluster" / "local_cluster.py"), "--dir", str(d)]
    try:
        subprocess.run([*cmd, "start", str(workers), str(cpus), "--dashboard-port", "0"],
                       check=True, capture_output=True, text=True, timeout=600)
        st = json.loads((d / "state.json").read_text())
        yield {"dir": d, "state": st, "address": f"127.0.0.1:{st['port']}",
               "env": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(d / "auth_token")}}
    finally:
        subprocess.run([*cmd, "stop"], capture_output=True, timeout=120)
        shutil.rmtree(d, ignore_errors=True)


def _gcs_pid(head_pid: int) -> int:
    from elastic_ddp.driver.local_ray import process_tree

    for pid in process_tree(head_pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == "gcs_server":
                return pid
    raise AssertionError(f"no gcs_server under pid {head_pid}")


@pytest.mark.slow
@pytest.mark.ray
def test_a_ray_cluster_whose_gcs_is_frozen_exits_2_within_the_bound(tmp_path, digits_data):
    """The head of a real cluster whose GCS stops answering (SIGSTOP: a frozen VM, a GC
    pause; the kernel still accepts connections for it): exit 2 within the bound, naming
    the address; then the same cluster, thawed, passes the check."""
    from elastic_ddp.driver.network_checks import check_ray_gcs

    with local_cluster(workers=0, cpus=1) as c:
        gcs = _gcs_pid(c["state"]["nodes"][0]["pid"])
        os.kill(gcs, signal.SIGSTOP)
        try:
            p, took = _train(tmp_path, digits_data, {"RAY_ADDRESS": c["address"], **c["env"]})
        finally:
            os.kill(gcs, signal.SIGCONT)
        check_ray_gcs(c["address"])  # thawed: it answers
    assert p.returncode == 2, (p.stdout[-2000:], p.stderr)
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith(f"elastic-ddp: config error: RAY_ADDRESS={c['address']}: the Ray "
                           f"cluster at {c['address']} accepted the connection but sent no "
                           f"answer within {BOUND:g} s"), line
    assert took < 2 * BOUND + SLACK, took
    _nothing_started(tmp_path)


@pytest.mark.ray
@pytest.mark.slow
def test_ray_address_of_the_projects_loopback_only_cluster_trains(tmp_path, digits_data):
    """``RAY_ADDRESS`` at ``cluster/local_cluster.py``'s GCS (127.0.0.1 only): Ray would
    swap in this host's address, where nothing listens, and wait forever; the driver joins
    on 127.0.0.1 and the digits job trains to its end, exit 0."""
    with local_cluster(workers=1, cpus=2) as c:
        p, took = _train(tmp_path, digits_data, {"RAY_ADDRESS": c["address"], **c["env"]},
                         {"train": {"epochs": 1},
                          "scaling": {"min_workers": 1, "max_workers": 1}}, timeout=420)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    assert "=== elastic-ddp summary ===" in p.stdout and "steps / epochs:   23 / 1.00" in p.stdout


def test_submit_to_a_job_api_that_never_answers_ends_within_the_bound(tmp_path):
    """``elastic-ddp submit --address`` at a port that accepts and never answers (Ray's
    job client sends its requests without a timeout): one line naming the address, what
    did not answer and the fix; exit 1 like any job API it cannot reach."""
    with silent_listener() as port:
        address = f"http://127.0.0.1:{port}"
        env = dict(os.environ, PYTHONPATH=str(REPO), ELASTIC_DDP_CONNECT_TIMEOUT_S=str(BOUND))
        t = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "elastic_ddp", "submit",
                            str(REPO / "experiments" / "configs" / "digits_cnn.yaml"),
                            "--address", address, "--set", "train.epochs=1"],
                           capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
        took = time.monotonic() - t
    assert p.returncode == 1, (p.stdout, p.stderr)
    line = _last_line(p)
    assert line.startswith(f"elastic-ddp: submit failed: cannot reach the Ray job API at {address}: "
                           f"accepted the connection but did not answer GET {address}/api/version "
                           f"within {BOUND:g} s"), line
    assert "Is the cluster up" in line and "Traceback" not in p.stderr
    assert took < BOUND + SLACK, took
