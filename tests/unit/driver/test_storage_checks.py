"""Bad object-storage input ends before anything starts: a bucket that does not exist, an
access the store denies, an endpoint where nothing listens or nothing answers, a server
that is not S3, no credentials at all, for the data paths and for ``run.storage_path``:
one line naming the field, the bucket and the store's answer, exit 2, within seconds, no
MLflow store, no Ray. The CLI runs as a user runs it, against a real S3 server (moto's,
and one with its authorization on for the denied access)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import digits_config

ELASTIC_DDP = str(Path(sys.executable).with_name("elastic-ddp"))


@pytest.fixture(autouse=True)
def _quiet_server():
    """The in-process S3 server logs each request to stderr, where the CLI's one line is
    looked for."""
    import logging

    log = logging.getLogger("werkzeug")
    level = log.level
    log.setLevel(logging.WARNING)
    yield
    log.setLevel(level)


def _run(tmp_path: Path, digits_data: Path, capsys, **over) -> tuple[int, str, float]:
    """``elastic-ddp train job.yaml`` in this process (the environment as the test set it);
    ``over``: ``train``/``val``/``storage`` paths. Returns (exit code, stderr, seconds)."""
    from elastic_ddp.driver.cli import main

    raw = digits_config(digits_data, tmp_path)
    raw["data"]["train_path"] = over.get("train", raw["data"]["train_path"])
    raw["data"]["val_path"] = over.get("val", raw["data"]["val_path"])
    raw["run"]["storage_path"] = over.get("storage", raw["run"]["storage_path"])
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(raw))
    t0 = time.monotonic()
    rc = main(["train", str(job), "--no-progress"])
    took = time.monotonic() - t0
    out, err = capsys.readouterr()
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "ray_results").exists()
    if "ray" in sys.modules:
        assert not sys.modules["ray"].is_initialized()
    return rc, err, took


def _one_line(rc: int, err: str) -> str:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("elastic-ddp: config error: "), err
    return lines[0]


@pytest.mark.parametrize("field", ["run.storage_path", "data.train_path", "data.val_path"])
def test_a_bucket_that_does_not_exist(tmp_path, digits_data, capsys, s3, field):
    uri = f"s3://{s3.name}-typo/runs"
    key = {"run.storage_path": "storage", "data.train_path": "train", "data.val_path": "val"}[field]
    line = _one_line(*_run(tmp_path, digits_data, capsys, **{key: uri})[:2])
    assert f"{field}={uri}: the bucket '{s3.name}-typo' does not exist at {s3.endpoint}" in line
    assert "HTTP 404" in line and f"aws s3 mb s3://{s3.name}-typo" in line


def test_a_good_bucket_passes_and_leaves_nothing(s3):
    from elastic_ddp.driver.storage_checks import check_s3

    check_s3(s3.uri("runs"), "run.storage_path", write=True)
    check_s3(s3.uri("data/train"), "data.train_path")
    assert s3.keys() == []  # the write probe was deleted


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nothing_listens_at_the_endpoint(tmp_path, digits_data, capsys, s3, monkeypatch):
    port = _free_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    rc, err, took = _run(tmp_path, digits_data, capsys, storage=s3.uri("runs"))
    line = _one_line(rc, err)
    assert f"run.storage_path={s3.uri('runs')}: the object store does not answer at " \
           f"http://127.0.0.1:{port} (connection refused" in line
    assert "AWS_ENDPOINT_URL" in line and took < 30


def test_an_endpoint_that_accepts_and_never_answers(tmp_path, digits_data, capsys, s3, monkeypatch):
    """A plain TCP server that accepts every connection and sends nothing: the request
    bound (ELASTIC_DDP_S3_REQUEST_TIMEOUT_S) ends the check, no hang."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                pass

    threading.Thread(target=accept, daemon=True).start()
    port = srv.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("ELASTIC_DDP_S3_REQUEST_TIMEOUT_S", "2")
    try:
        rc, err, took = _run(tmp_path, digits_data, capsys, train=s3.uri("digits/train"))
    finally:
        stop.set()
        for c in held:
            c.close()
        srv.close()
    line = _one_line(rc, err)
    assert f"data.train_path={s3.uri('digits/train')}: the object store does not answer at " \
           f"http://127.0.0.1:{port} (it accepts connections but sent no answer within 2 s" in line
    assert held and took < 30, took


def test_a_server_that_is_not_s3(tmp_path, digits_data, capsys, s3, monkeypatch):
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<html><body>a web page</body></html>")

        do_HEAD = do_GET

        def log_message(self, *a):
            pass

    web = HTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{web.server_address[1]}")
    try:
        line = _one_line(*_run(tmp_path, digits_data, capsys, storage=s3.uri("runs"))[:2])
    finally:
        web.shutdown()
    assert "is not the S3 API" in line or "does not answer as the S3 API" in line, line


def test_no_credentials(tmp_path, digits_data, capsys, s3, monkeypatch):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    line = _one_line(*_run(tmp_path, digits_data, capsys, train=s3.uri("digits/train"))[:2])
    assert f"data.train_path={s3.uri('digits/train')}: no AWS credentials found" in line
    assert "AWS_ACCESS_KEY_ID" in line


@pytest.fixture(scope="module")
def locked_s3():
    """A second moto S3 server with its authorization on (``INITIAL_NO_AUTH_ACTION_COUNT``:
    the first 3 requests, which make the bucket and a user, are let through), a bucket,
    and the keys of a user with no permission at all."""
    import boto3

    port = _free_port()
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="3")
    proc = subprocess.Popen([sys.executable, "-c", "import time; from moto.server import ThreadedMotoServer "
                             f"as T; T(ip_address='127.0.0.1', port={port}, verbose=False).start(); "
                             "time.sleep(3600)"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the second S3 server did not start"
                time.sleep(0.2)
        endpoint = f"http://127.0.0.1:{port}"
        kw = dict(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="admin",
                  aws_secret_access_key="admin")
        boto3.client("s3", **kw).create_bucket(Bucket="locked")
        iam = boto3.client("iam", **kw)
        iam.create_user(UserName="nobody")
        key = iam.create_access_key(UserName="nobody")["AccessKey"]
        yield endpoint, key["AccessKeyId"], key["SecretAccessKey"]
    finally:
        proc.kill()
        proc.wait()


def test_access_denied(tmp_path, digits_data, capsys, s3, monkeypatch, locked_s3):
    endpoint, key_id, secret = locked_s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    line = _one_line(*_run(tmp_path, digits_data, capsys, storage="s3://locked/runs")[:2])
    assert "run.storage_path=s3://locked/runs: access denied" in line and "HTTP 403" in line
    assert secret not in line and key_id not in line
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTAKEYOFTHESTORE")
    line = _one_line(*_run(tmp_path, digits_data, capsys, train="s3://locked/data")[:2])
    assert "data.train_path=s3://locked/data: access denied to the bucket 'locked'" in line


def test_a_mistyped_storage_bucket_as_a_user_runs_it(tmp_path, digits_data, s3):
    """The console command in its own process: one line, exit 2, no traceback."""
    raw = digits_config(digits_data, tmp_path)
    raw["run"]["storage_path"] = f"s3://{s3.name}x/runs"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(raw))
    env = {**os.environ, **s3.env}
    out = subprocess.run([ELASTIC_DDP, "train", str(job), "--no-progress"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"elastic-ddp: config error: run.storage_path=s3://{s3.name}x/runs: the bucket "
        f"'{s3.name}x' does not exist at {s3.endpoint} (HeadBucket answered HTTP 404); check the "
        f"bucket name in run.storage_path, or create the bucket first (aws s3 mb s3://{s3.name}x)"]
    assert not (tmp_path / "mlflow.db").exists()
