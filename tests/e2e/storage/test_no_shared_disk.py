"""The digits job on nodes that share no disk with the driver (``nodisk_cluster``): its
data, its run storage (checkpoints, the lease) on the S3 server only; the MLflow store
is the driver's (the tracker runs on the head, beside the driver).

* ``test_local_paths_do_not_reach_the_nodes``: a job whose data and storage are paths
  only the driver has cannot train there; it must stop with an error, never hang.
* ``test_digits_on_object_storage_only``: the job trains to the usual validation accuracy
  (tests/e2e/tracking/test_train_e2e.py's bar) with nothing on a shared disk.
* ``test_kill_during_background_upload`` (slow): a training worker SIGKILLed while its
  checkpoint's objects are being uploaded (the fault proxy holds those PUTs a moment, and
  fires the kill at the first one): the job resumes from the newest committed checkpoint,
  the sample ledger is clean (0 lost, 0 repeated) and the final model equals the
  uninterrupted run's.

The ledger and the fault's marker are test diagnostics: they go to ``nodisk_cluster.shared``,
the one driver directory the nodes see.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Optional

import pytest
import torch

from conftest import digits_config, mlflow_runs
from elastic_ddp.config import Config
from elastic_ddp import train
from elastic_ddp.ledger import audit, format_audit
from elastic_ddp.run_state import Diagnostics
from helpers import _cluster_faults, train_ids

pytestmark = pytest.mark.ray

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


def _upload(s3, local: Path, prefix: str) -> str:
    """Every file under ``local`` to ``s3://<bucket>/<prefix>/...``; returns that URI."""
    for f in sorted(local.rglob("*")):
        if f.is_file():
            s3.client.upload_file(str(f), s3.name, f"{prefix}/{f.relative_to(local).as_posix()}")
    return s3.uri(prefix)


def _s3_job(s3, digits_data: Path, tmp: Path, name: str, scaling: Optional[dict] = None) -> Config:
    tmp.mkdir(parents=True, exist_ok=True)  # the driver's MLflow store lives there
    data = _upload(s3, digits_data, "digits")
    raw = digits_config(digits_data, tmp, {
        **DIGITS_FAST,
        "data": {"train_path": f"{data}/train", "val_path": f"{data}/val"},
        "run": {"name": name, "storage_path": s3.uri("runs")},
        "scaling": {**DIGITS_FAST["scaling"], **(scaling or {})},
    })
    return Config.from_dict(raw)


def _diag(cluster, name: str, **kw) -> tuple[Diagnostics, Path]:
    ledger = cluster.shared / f"{name}-{uuid.uuid4().hex[:8]}" / "ledger"
    return Diagnostics(ledger_dir=str(ledger), **kw), ledger


def _assert_ledger_clean(ledger: Path, data: Path, epochs: int = 3) -> dict:
    report = audit(ledger, train_ids(data), epochs)
    print(format_audit(report))
    for ep, e in report["epochs"].items():
        assert (e["repeated"], e["lost"], e["unknown"]) == (0, 0, 0), (ep, e)
    assert report["ok"]
    return report


@pytest.mark.slow
def test_local_paths_do_not_reach_the_nodes(nodisk_cluster, digits_data, tmp_path):
    """Data and storage under the driver's tmp dir: the workers, on nodes without that
    dir, cannot train; the job ends with an error naming the missing data file within
    minutes (no hang), its MLflow run FAILED."""
    raw = digits_config(digits_data, tmp_path, {**DIGITS_FAST, "run": {"name": "local-paths"},
                                                 "scaling": {**DIGITS_FAST["scaling"], "max_failures": 0}})
    t = time.time()
    with pytest.raises(BaseException) as err:
        train(Config.from_dict(raw), progress=False)
    print(f"failed after {time.time() - t:.1f} s: {type(err.value).__name__}: {str(err.value)[:2000]}")
    assert time.time() - t < 300
    # The first thing a worker touches is its data: the error names the driver's file.
    assert "FileNotFoundError" in str(err.value) and str(digits_data) in str(err.value), err.value
    assert [r.info.status for r in mlflow_runs(tmp_path)] == ["FAILED"]


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
        ["bash", str(Path(__file__).resolve().parents[3] / "cluster" / "mlflow_server.sh")],
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


def test_digits_on_object_storage_only(nodisk_cluster, digits_data, s3, tmp_path):
    """The digits job with its data, checkpoints and lease in the bucket and its MLflow
    run on ``cluster/mlflow_server.sh`` with ``--artifacts-destination s3://...``: it
    trains to the usual accuracy, and the run's artifacts (the event log, the summary,
    the model) land in the bucket and load back through the server."""
    from mlflow.tracking import MlflowClient

    cfg = _s3_job(s3, digits_data, tmp_path, "s3-only")
    diag, ledger = _diag(nodisk_cluster, "s3-only")
    with mlflow_server(tmp_path, s3.uri("mlflow"), s3.env) as tracking_uri:
        cfg = Config.from_dict({**cfg.model_dump(mode="json"),
                                "run": {**cfg.run.model_dump(mode="json"), "tracking_uri": tracking_uri}})
        t = time.time()
        s = train(cfg, diagnostics=diag, progress=False)
        print(f"[no shared disk] {time.time() - t:.1f} s, metrics {s.metrics}")
        assert s.steps == STEPS and s.restarts == 0
        assert s.metrics["val_acc"] >= MIN_VAL_ACC, s.metrics
        _assert_ledger_clean(ledger, digits_data)
        # Checkpoints and the lease went to the bucket; nothing to the driver's tmp dir.
        keys = s3.keys("runs/")
        assert any("/checkpoint_step" in k for k in keys), keys
        assert not (tmp_path / "ray_results").exists()
        client = MlflowClient(tracking_uri)
        run = client.get_run(s.run_id)
        assert run.info.status == "FINISHED"
        stored = s3.keys("mlflow/")
        for name in ("summary.json", "model/model.pt"):
            assert any(k.endswith(f"/{s.run_id}/artifacts/{name}") for k in stored), (name, stored)
        summary = json.loads(Path(client.download_artifacts(s.run_id, "summary.json", str(tmp_path))).read_text())
        assert summary["run_id"] == s.run_id and summary["steps"] == STEPS
        weights = torch.load(client.download_artifacts(s.run_id, "model/model.pt", str(tmp_path)),
                             weights_only=True)
        assert weights and all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point())


@pytest.mark.slow
def test_kill_during_background_upload(nodisk_cluster, digits_data, s3, s3_faults, tmp_path):
    from elastic_ddp.checkpoint.export import model_state

    base_cfg = _s3_job(s3, digits_data, tmp_path / "base", "base")
    base_diag, base_ledger = _diag(nodisk_cluster, "base")
    baseline = train(base_cfg, diagnostics=base_diag, progress=False)
    _assert_ledger_clean(base_ledger, digits_data)

    # The step-40 checkpoint's uploads are held 1.5 s each; at the first one a training
    # worker is SIGKILLed (the step loop goes on meanwhile: the upload is in the
    # background). The restart must come from the step-20 checkpoint, the newest one
    # committed (its manifest written last).
    cfg = _s3_job(s3, digits_data, tmp_path / "kill", "kill")
    diag, ledger = _diag(nodisk_cluster, "kill")
    s3_faults.add("PUT", r"^runs/kill/checkpoint_step00000040/", "delay", times=4, seconds=1.5)
    killed: list[dict] = []

    def kill_once(seen) -> None:
        if killed or seen.method != "PUT" or "checkpoint_step00000040/" not in seen.key:
            return
        workers = _cluster_faults().train_workers()
        if workers:
            victim = sorted(workers, key=lambda w: w["pid"])[-1]
            killed.append({**victim, "key": seen.key, "t": time.time()})
            os.kill(victim["pid"], signal.SIGKILL)

    s3_faults.on_request(lambda seen: threading.Thread(target=kill_once, args=(seen,)).start())
    s = train(cfg, diagnostics=diag, progress=False)
    print(f"killed {killed}; events {[e for e in s.events if e['type'] == 'failure']}")
    assert killed, "no checkpoint upload of step 40 was seen"
    report = _assert_ledger_clean(ledger, digits_data)
    assert s.steps == STEPS and s.restarts == 1
    resumed = report["attempts"][1]["resumed_from"]
    assert resumed in (20, 40), report["attempts"]  # 40 only if it committed before the kill
    committed = [k for k in s3.keys("runs/kill/") if k.endswith("manifest.json")]
    print(f"committed checkpoints: {committed}")
    got, ref = model_state(s.checkpoint_path), model_state(baseline.checkpoint_path)
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.allclose(got[k].float(), ref[k].float(), rtol=1e-5, atol=1e-6), k


@pytest.mark.slow
def test_throttled_checkpoint_upload_is_retried(nodisk_cluster, digits_data, s3, s3_faults, tmp_path):
    """503 SlowDown for the first two PUTs of every object of the step-20 checkpoint: the
    writer retries with backoff and the checkpoint commits; the job finishes untouched."""
    # A collective timeout that a loaded 2-core machine's slow step never reaches: the
    # test is about the throttled upload, which the writer's retries absorb.
    cfg = _s3_job(s3, digits_data, tmp_path, "throttled", {"collective_timeout_s": 120})
    diag, ledger = _diag(nodisk_cluster, "throttled")
    s3_faults.add("PUT", r"^runs/throttled/checkpoint_step00000020/.*distcp", "slowdown", times=4)
    s = train(cfg, diagnostics=diag, progress=False)
    assert s3_faults.count("PUT", r"checkpoint_step00000020/", "slowdown") == 4
    assert s.steps == STEPS and s.restarts == 0
    assert not [e for e in s.events if e["type"] == "failure"], s.events
    # The throttled checkpoint committed: its manifest was written, through the proxy
    # (keep_checkpoints prunes it before the job ends).
    assert s3_faults.count("PUT", r"^runs/throttled/checkpoint_step00000020/manifest\.json$") == 1
    _assert_ledger_clean(ledger, digits_data)


@pytest.mark.slow
def test_stalled_checkpoint_upload_is_bounded(nodisk_cluster, digits_data, s3, s3_faults, tmp_path):
    """Every PUT of the step-20 checkpoint's rank-1 shard is accepted and never answered:
    the step-20 checkpoint is never committed and the job never hangs: it finishes from
    the next checkpoints, or stops naming the rank, the step and the phase (the write
    itself gives up within the store's request bound and names the rank and the key)."""
    cfg = _s3_job(s3, digits_data, tmp_path, "stalled")
    diag, _ = _diag(nodisk_cluster, "stalled")
    s3_faults.add("PUT", r"^runs/stalled/checkpoint_step00000020/__1_0\.distcp", "stall", times=None,
                  seconds=900)
    result: dict = {}

    def run():
        try:
            result["summary"] = train(cfg, diagnostics=diag, progress=False)
        except BaseException as e:  # noqa: BLE001 - inspected below
            result["error"] = e

    t = time.time()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(600)
    elapsed = time.time() - t
    assert not th.is_alive(), f"the job hangs on a stalled upload after {elapsed:.0f} s"
    if "error" in result:
        msg = str(result["error"])
        # Rank 0 waits for rank 1 at the checkpoint's gather for scaling.collective_timeout_s
        # (30 s), less than the store's request bound (60 s, 5 attempts): the job stops on
        # the second same hang, naming the rank, the step and the phase (not the key).
        assert "rank 1" in msg and "step 20 (checkpoint)" in msg, msg
    assert s3_faults.count("PUT", r"checkpoint_step00000020/__1_0\.distcp", "stall") >= 1
    assert "runs/stalled/checkpoint_step00000020/manifest.json" not in s3.keys("runs/stalled/")
    if "summary" in result:
        text = " ".join(map(str, result["summary"].events))
        assert "checkpoint_step00000020/__1_0.distcp" in text, result["summary"].events


@pytest.mark.slow
def test_hf_lm_on_object_storage_only(nodisk_cluster, s3, tmp_path):
    """The Hugging Face example (experiments/examples/hf_lm) on the no-disk nodes, its data
    and checkpoints in the bucket: the tokenizer (a file of the driver's) travels inside
    the task, so no node reads the driver's path; a rank killed mid-epoch resumes from the
    bucket's newest checkpoint, every train document used once, the model learns."""
    import importlib.util
    import math

    from elastic_ddp.data.scan import read_sample_ids

    example = Path(__file__).resolve().parents[3] / "experiments" / "examples" / "hf_lm"
    spec = importlib.util.spec_from_file_location("hf_lm_prepare", example / "prepare.py")
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    data = tmp_path / "hf_lm"
    prepare.prepare(data, max_bytes=100_000)
    uri = _upload(s3, data, "hf_lm")
    cfg = Config.load(example / "config.yaml", [
        f"task.path={example / 'task.py'}:HFCausalLM", f"task.kwargs.tokenizer={data / 'tokenizer.json'}",
        f"data.train_path={uri}/train", f"data.val_path={uri}/val",
        f"run.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", f"run.storage_path={s3.uri('runs')}",
        "run.experiment_name=tests", "model.kwargs.dim=64", "model.kwargs.layers=1",
        "batch.global_batch_size=16", "batch.micro_batch_size=8", "train.checkpoint_every_steps=4",
        "train.log_every_steps=4", "optim.lr=0.005", "optim.warmup_steps=4",
        "scaling.cpus_per_worker=2", "scaling.torch_threads=1"])
    diag, ledger = _diag(nodisk_cluster, "hf-lm")
    marker = nodisk_cluster.shared / f"hf-lm-fired-{uuid.uuid4().hex[:8]}"
    diag = Diagnostics(ledger_dir=diag.ledger_dir,
                       fault={"rank": 1, "at_step": 9, "where": "step", "marker": str(marker)})
    s = train(cfg, diagnostics=diag, progress=False)
    ids = read_sample_ids(data / "train")
    print(f"[hf_lm, no shared disk] {s.metrics} steps {s.steps} restarts {s.restarts}")
    assert marker.exists() and s.restarts == 1 and s.steps == math.ceil(len(ids) / 16)
    report = audit(ledger, ids, 1)
    assert report["ok"], format_audit(report)
    assert [a["resumed_from"] for a in report["attempts"]] == [0, 8]
    assert s.metrics["val_loss"] < math.log(2048) - 0.6, s.metrics
    assert any("/checkpoint_step" in k for k in s3.keys("runs/"))
    assert not (tmp_path / "ray_results").exists()


@pytest.mark.slow
def test_twenty_kills_at_random_points_of_the_upload(nodisk_cluster, digits_data, s3, s3_faults, tmp_path):
    """20 SIGKILLs, each at a random request of a checkpoint's background upload (a shard,
    the run state or the manifest, the n-th PUT of the checkpoint with n drawn at random),
    one per attempt: every restart resumes from a committed checkpoint (none rejected as
    partial or damaged), the ledger is clean and the final model is the uninterrupted
    run's."""
    import random

    from elastic_ddp.checkpoint.export import model_state

    kills = 20
    job = {"train": {**DIGITS_FAST["train"], "epochs": 6, "checkpoint_every_steps": 5,
                     "async_checkpoint": True},
           "scaling": {**DIGITS_FAST["scaling"], "max_failures": kills + 2}}

    def cfg_for(name: str) -> Config:
        c = _s3_job(s3, digits_data, tmp_path / name, name)
        raw = c.model_dump(mode="json")
        raw["train"].update(job["train"])
        raw["scaling"].update(job["scaling"])
        return Config.from_dict(raw)

    base_diag, base_ledger = _diag(nodisk_cluster, "base20")
    baseline = train(cfg_for("base20"), diagnostics=base_diag, progress=False)
    _assert_ledger_clean(base_ledger, digits_data, epochs=6)

    # Every checkpoint PUT is held 0.2 s, so a kill lands while the upload is under way.
    s3_faults.add("PUT", r"^runs/kill20/checkpoint_step", "delay", times=None, seconds=0.2)
    rng = random.Random(0)
    state = {"ckpt": None, "n": 0, "target": rng.randint(1, 6), "armed_pids": None}
    killed: list[dict] = []
    lock = threading.Lock()

    def maybe_kill(seen) -> None:
        if seen.method != "PUT" or "/checkpoint_step" not in seen.key or not seen.key.startswith("runs/kill20/"):
            return
        ckpt = seen.key.split("/")[2]
        with lock:
            if len(killed) >= kills:
                return
            if ckpt != state["ckpt"]:
                state.update(ckpt=ckpt, n=0)
            state["n"] += 1
            if state["n"] != state["target"]:
                return
            workers = _cluster_faults().train_workers()
            pids = sorted(w["pid"] for w in workers)
            # One kill per attempt: the group must have been replaced since the last one.
            if not workers or (killed and set(pids) & set(killed[-1]["group"])):
                return
            victim = rng.choice(pids)
            killed.append({"pid": victim, "key": seen.key, "n": state["n"], "group": pids})
            state["target"] = rng.randint(1, 6)
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass

    s3_faults.on_request(lambda seen: threading.Thread(target=maybe_kill, args=(seen,)).start())
    diag, ledger = _diag(nodisk_cluster, "kill20")
    s = train(cfg_for("kill20"), diagnostics=diag, progress=False)
    print(f"{len(killed)} kills at: {[(k['key'].split('/', 2)[2], k['n']) for k in killed]}")
    assert len(killed) == kills, killed
    assert s.restarts >= kills
    assert not [e for e in s.events if e["type"] == "checkpoint_rejected"], s.events
    report = _assert_ledger_clean(ledger, digits_data, epochs=6)
    resumed = [a["resumed_from"] for a in report["attempts"][1:]]
    print(f"resumed from steps {resumed}")
    assert all(r % 5 == 0 for r in resumed), resumed  # checkpoint steps only
    got, ref = model_state(s.checkpoint_path), model_state(baseline.checkpoint_path)
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.allclose(got[k].float(), ref[k].float(), rtol=1e-5, atol=1e-6), k
