"""The no-shared-disk jobs' pieces (``nodisk_cluster``): the digits recipe and its bar,
a job whose data and run storage are in the test's bucket, its diagnostics in the one
directory the nodes see, the sample ledger's audit, and ``cluster/mlflow_server.sh`` as
a tracking server with its artifacts in the bucket."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Optional

from conftest import digits_config
from elastic_ddp.config import Config
from elastic_ddp.ledger import audit, format_audit
from elastic_ddp.run_state import Diagnostics
from helpers import train_ids


# tests/e2e/tracking/test_train_e2e.py's digits recipe and bar (val_acc 0.93-0.97 over seeds 0-4).
DIGITS_FAST = {
    "model": {"kwargs": {"hidden": 64}},
    "optim": {"lr": 0.01, "warmup_steps": 20},
    "batch": {"global_batch_size": 32, "micro_batch_size": 8},
    "train": {"epochs": 3, "log_every_steps": 5, "checkpoint_every_steps": 20, "keep_checkpoints": 2},
    # One worker per no-disk node (2 CPUs each); the head has none.
    "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 2, "torch_threads": 1,
                "max_failures": 2, "use_gpu": False, "collective_timeout_s": 30},
}
MIN_VAL_ACC = 0.9
STEPS = 45 * 3  # ceil(1437 / 32) a epoch


def upload(s3, local: Path, prefix: str) -> str:
    """Every file under ``local`` to ``s3://<bucket>/<prefix>/...``; returns that URI."""
    for f in sorted(local.rglob("*")):
        if f.is_file():
            s3.client.upload_file(str(f), s3.name, f"{prefix}/{f.relative_to(local).as_posix()}")
    return s3.uri(prefix)


def s3_job(s3, digits_data: Path, tmp: Path, name: str, scaling: Optional[dict] = None) -> Config:
    tmp.mkdir(parents=True, exist_ok=True)  # the driver's MLflow store lives there
    data = upload(s3, digits_data, "digits")
    raw = digits_config(digits_data, tmp, {
        **DIGITS_FAST,
        "data": {"train_path": f"{data}/train", "val_path": f"{data}/val"},
        "run": {"name": name, "storage_path": s3.uri("runs")},
        "scaling": {**DIGITS_FAST["scaling"], **(scaling or {})},
    })
    return Config.from_dict(raw)


def diag(cluster, name: str, **kw) -> tuple[Diagnostics, Path]:
    ledger = cluster.shared / f"{name}-{uuid.uuid4().hex[:8]}" / "ledger"
    return Diagnostics(ledger_dir=str(ledger), **kw), ledger


def assert_ledger_clean(ledger: Path, data: Path, epochs: int = 3) -> dict:
    report = audit(ledger, train_ids(data), epochs)
    print(format_audit(report))
    for ep, e in report["epochs"].items():
        assert (e["repeated"], e["lost"], e["unknown"]) == (0, 0, 0), (ep, e)
    assert report["ok"]
    return report


@contextlib.contextmanager
def mlflow_server(tmp: Path, artifacts: str, env: dict[str, str]):
    """``cluster/mlflow_server.sh`` on a free loopback port, its database under ``tmp`` and
    its artifacts at ``artifacts`` (the server proxies them: the job needs no
    credentials for them); yields its URI once ``/health`` answers (180 s bound: the server imports for a while on a loaded machine)."""
    import socket
    import subprocess
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(tmp / "mlflow-server.log", "wb")
    proc = subprocess.Popen(
        ["bash", str(Path(__file__).resolve().parents[2] / "cluster" / "mlflow_server.sh")],
        cwd=tmp, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, **env, "MLFLOW_PORT": str(port), "MLFLOW_WORKERS": "1",
             "MLFLOW_ARTIFACTS_DESTINATION": artifacts})
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.time() < deadline, \
                (tmp / "mlflow-server.log").read_text()[-3000:]
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except Exception:  # noqa: BLE001 - a server that ignores SIGTERM
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)
        log.close()
