"""A tracking server that is down (``run.tracking_uri: http://127.0.0.1:<closed port>``,
or the same in ``MLFLOW_TRACKING_URI``): the command exits 2 with one line naming the URI,
the field it came from and the fix, before Ray starts and before any run or store file
exists; a sweep too, before its parent run. The CLI runs as a user runs it."""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import digits_config

REPO = Path(__file__).resolve().parents[3]


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _cli(args: list[str], env_extra: dict, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), **env_extra)
    env.pop("RAY_ADDRESS", None)
    # The timeout guards the "no hang": MLflow's own retries of a refused server run
    # for minutes.
    return subprocess.run([sys.executable, "-m", "elastic_ddp", *args], capture_output=True,
                          text=True, timeout=240, env=env, cwd=cwd)


@pytest.mark.parametrize("where", ["config", "env"])
@pytest.mark.parametrize("cmd", ["train", "sweep"])
def test_a_tracking_server_that_is_down_exits_2_naming_the_uri(tmp_path, digits_data, where, cmd):
    uri = f"http://127.0.0.1:{_closed_port()}"
    raw = digits_config(digits_data, tmp_path)
    env = {}
    if where == "config":
        raw["run"]["tracking_uri"] = uri
        field = "run.tracking_uri"
    else:
        raw["run"]["tracking_uri"] = None
        env["MLFLOW_TRACKING_URI"] = uri
        field = "MLFLOW_TRACKING_URI"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    extra = ["--world-sizes", "1"] if cmd == "sweep" else []
    p = _cli([cmd, str(path), "--no-progress" if cmd == "train" else "--verbose", *extra], env, tmp_path)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    line = lines[0]
    assert line.startswith(f"elastic-ddp: config error: {field}={uri}: the MLflow tracking store "
                           "does not answer at 127.0.0.1:"), line
    assert "Connection refused" in line and "mlflow server" in line and "sqlite" in line, line
    assert "Traceback" not in p.stderr
    # Nothing started, nothing written: no Ray results, no local store, no artifacts.
    assert not (tmp_path / "ray_results").exists()
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()
    assert "elastic-ddp: run" not in p.stdout  # the launcher's line once a run is open


def test_a_local_store_is_not_refused_by_the_check(tmp_path):
    from elastic_ddp.driver.preflight import check_tracking_store

    for uri in (f"sqlite:///{tmp_path}/m.db", f"file://{tmp_path}/mlruns", str(tmp_path / "mlruns"),
                "databricks"):
        check_tracking_store(uri)  # no connection attempted, no error
    assert list(tmp_path.iterdir()) == []


def test_a_server_that_accepts_and_never_answers_is_refused_within_the_bound(tmp_path, monkeypatch):
    """A server that takes the connection but does not answer the HTTP request within
    ``ELASTIC_DDP_CONNECT_TIMEOUT_S`` is refused (MLflow's client would wait 120 s on each
    of 7 tries), in about that time; a closed database port is refused too."""
    import time

    from elastic_ddp.config import ConfigError
    from elastic_ddp.driver.preflight import check_tracking_store

    monkeypatch.setenv("ELASTIC_DDP_CONNECT_TIMEOUT_S", "0.5")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    t = time.monotonic()
    try:
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port} accepted the connection but "
                                              "did not answer GET"):
            check_tracking_store(f"http://127.0.0.1:{port}/")
    finally:
        srv.close()
    assert time.monotonic() - t < 3
    with pytest.raises(ConfigError, match="postgresql"):
        check_tracking_store(f"postgresql://u:p@127.0.0.1:{_closed_port()}/db")


@pytest.mark.parametrize("where", ["config", "env"])
def test_a_scheme_mlflow_has_no_store_for_exits_2_naming_the_field_and_the_schemes(tmp_path, where):
    """``htp://`` (a typo of http): one config-error line naming the field, the scheme and
    those MLflow accepts, exit 2, before the data scan, MLflow or Ray start (the data
    path here does not exist: a later check would say so instead)."""
    raw = digits_config(tmp_path / "no-data", tmp_path)
    env = {}
    if where == "config":
        raw["run"]["tracking_uri"], field = "htp://foo", "run.tracking_uri"
    else:
        raw["run"]["tracking_uri"], field = None, "MLFLOW_TRACKING_URI"
        env["MLFLOW_TRACKING_URI"] = "htp://foo"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    p = _cli(["train", str(path), "--no-progress"], env, tmp_path)
    assert p.returncode == 2, (p.stdout, p.stderr)
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith(f"elastic-ddp: config error: {field}='htp://foo': MLflow has no "
                           "tracking store for the scheme 'htp'; use one of file:, sqlite:"), line
    assert "http:, https:" in line and "Traceback" not in p.stderr
    assert not (tmp_path / "ray_results").exists() and not (tmp_path / "mlflow.db").exists()
    assert p.stdout == ""


def test_submit_refuses_the_scheme_before_contacting_the_cluster(tmp_path):
    from elastic_ddp.config import ConfigError
    from elastic_ddp.driver.submit import prepare

    with pytest.raises(ConfigError, match=r"run.tracking_uri='htp://mlflow:5000': MLflow has no "
                                          r"tracking store for the scheme 'htp'"):
        prepare(str(REPO / "experiments/configs/digits_cnn.yaml"),
                ["run.tracking_uri=htp://mlflow:5000"], "http://10.0.0.1:8265", environ={})


def test_the_accepted_schemes_are_mlflows():
    """The schemes the check accepts without importing MLflow are those the installed
    MLflow registers as tracking stores (less Unity Catalog's, which refuse to be one)."""
    from mlflow.tracking._tracking_service import utils

    from elastic_ddp.driver.preflight import accepted_schemes

    registered = set(utils._tracking_store_registry._registry) - {"", "databricks-uc", "uc"}
    assert set(accepted_schemes()) == registered


def test_a_sqlite_store_in_a_missing_directory_is_refused_and_not_created(tmp_path):
    raw = digits_config(tmp_path / "no-data", tmp_path)
    missing = tmp_path / "no" / "such"
    raw["run"]["tracking_uri"] = f"sqlite:///{missing}/m.db"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    p = _cli(["train", str(path), "--no-progress"], {}, tmp_path)
    assert p.returncode == 2, (p.stdout, p.stderr)
    (line,) = p.stderr.strip().splitlines()
    assert line == (f"elastic-ddp: config error: run.tracking_uri=sqlite:///{missing}/m.db: cannot "
                    f"create the MLflow database m.db (the directory {missing} does not exist); "
                    f"create the directory first (mkdir -p {missing}), or point run.tracking_uri "
                    "at a directory you can write"), line
    assert not (tmp_path / "no").exists() and not (tmp_path / "ray_results").exists()


@contextlib.contextmanager
def _http_server(directory: Path, handler=None):
    """A real ``python -m http.server`` (serving ``directory``) on a loopback port, in a
    thread; yields its base URL."""
    import functools

    handler = handler or functools.partial(http.server.SimpleHTTPRequestHandler,
                                           directory=str(directory))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("where", ["config", "env"])
def test_an_http_server_that_is_not_mlflow_exits_2_naming_the_field_and_status(tmp_path, digits_data,
                                                                                 where):
    """A plain ``python -m http.server`` at the tracking URI: it answers (404, an HTML
    page), so the connection check passes; MLflow's client would fail on its first
    request, after the scan, with a traceback. One config-error line, exit 2, before
    Ray, the MLflow run or the lease."""
    site = tmp_path / "site"
    site.mkdir()
    raw = digits_config(digits_data, tmp_path)
    with _http_server(site) as uri:
        env = {}
        if where == "config":
            raw["run"]["tracking_uri"], field = uri, "run.tracking_uri"
        else:
            raw["run"]["tracking_uri"], field = None, "MLFLOW_TRACKING_URI"
            env["MLFLOW_TRACKING_URI"] = uri
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(raw))
        p = _cli(["train", str(path), "--no-progress"], env, tmp_path)
    assert p.returncode == 2, (p.stdout, p.stderr)
    (line,) = p.stderr.strip().splitlines()
    port = uri.rsplit(":", 1)[1]
    assert line.startswith(
        f"elastic-ddp: config error: {field}={uri}: the server at 127.0.0.1:{port} is not an "
        f"MLflow tracking server (GET {uri}/api/2.0/mlflow/experiments/get-by-name answered "
        "HTTP 404, text/html, not MLflow's JSON); point "
        f"{field} at an MLflow tracking server (mlflow server --host 127.0.0.1 --port {port}"), line
    assert "sqlite: URI" in line and "Traceback" not in p.stderr
    assert not (tmp_path / "ray_results").exists() and not (tmp_path / "mlflow.db").exists()
    assert "elastic-ddp: run" not in p.stdout


def test_a_web_page_answering_200_is_refused(tmp_path):
    """A server answering every path with 200 and an HTML page (a web app's catch-all, a
    login page behind a redirect) is not MLflow either."""
    from elastic_ddp.config import ConfigError
    from elastic_ddp.driver.preflight import check_tracking_store

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<html><body>Welcome</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    with _http_server(tmp_path, Page) as uri:
        with pytest.raises(ConfigError, match=r"run.tracking_uri=http://127.0.0.1:\d+/app: the server "
                                              r".* answered HTTP 200, text/html, not MLflow's JSON"):
            check_tracking_store(uri + "/app")


def test_a_server_that_cannot_be_judged_passes(tmp_path):
    """401/403 (the probe sends no credentials) and 5xx (a proxy whose MLflow is down:
    MLflow's own retries say so) are left to MLflow."""
    from elastic_ddp.driver.preflight import check_tracking_store

    codes = iter([401, 403, 503])

    class Status(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(next(codes))

        def log_message(self, *args):
            pass

    with _http_server(tmp_path, Status) as uri:
        for _ in range(3):
            check_tracking_store(uri)


@pytest.mark.slow
def test_a_real_mlflow_server_passes(tmp_path, _made_store):
    """``mlflow server`` on a loopback port, with and without a trailing slash."""
    import shutil

    from elastic_ddp.driver.preflight import check_tracking_store

    shutil.copyfile(_made_store, tmp_path / "m.db")
    port = _closed_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{tmp_path}/m.db",
                             "--default-artifact-root", str(tmp_path / "artifacts"),
                             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path,
                            start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=2).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "mlflow server did not start"
                time.sleep(0.3)
        check_tracking_store(uri)
        check_tracking_store(uri + "/")
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
