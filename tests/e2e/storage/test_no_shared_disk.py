"""Nodes that share no disk with the driver (``nodisk_cluster``, experiments/nodisk.py).

The cluster is what it claims: on its worker nodes a file the driver just wrote under
the test's tmp dir or under ``/tmp`` is not there, while a value passed through Ray
arrives, the code and the virtualenv are there, and a task reaches the S3 server with
the endpoint and credentials the node was started with. Training workers never land on
the head.

The digits job on it: its data, its run storage (checkpoints, the lease) on the S3
server only; the MLflow store is the driver's (the tracker runs on the head, beside the
driver).

* ``test_local_paths_do_not_reach_the_nodes``: a job whose data and storage are paths
  only the driver has cannot train there; it must stop with an error, never hang.
* ``test_digits_on_object_storage_only``: the job trains to the usual validation accuracy
  (tests/e2e/tracking/test_train_e2e.py's bar) with nothing on a shared disk.

The checkpoint uploads' faults on this cluster: tests/e2e/checkpoint/test_checkpoint_upload_faults.py.

The ledger and the fault's marker are test diagnostics: they go to ``nodisk_cluster.shared``,
the one driver directory the nodes see.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest
import ray
import torch

from conftest import digits_config, mlflow_runs
from elastic_ddp.config import Config
from elastic_ddp import train
from elastic_ddp.ledger import audit, format_audit
from elastic_ddp.run_state import Diagnostics
from helpers.nodisk import DIGITS_FAST, MIN_VAL_ACC, STEPS, mlflow_server
from helpers.nodisk import assert_ledger_clean as _assert_ledger_clean, diag as _diag, s3_job as _s3_job
from helpers.nodisk import upload as _upload

pytestmark = pytest.mark.ray


def _worker_nodes() -> list[str]:
    return [n["NodeID"] for n in ray.nodes()
            if n["Alive"] and "node:__internal_head__" not in n["Resources"]]


def _on(node_id: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=False)


@ray.remote(num_cpus=1, max_retries=0)
def _look(paths: list[str], value: bytes) -> dict:
    import elastic_ddp

    out = {}
    for p in paths:
        try:
            with open(p, "rb") as f:
                out[p] = f.read()
        except FileNotFoundError:
            out[p] = "FileNotFoundError"
    return {"paths": out, "value": value, "code": os.path.exists(elastic_ddp.__file__),
            "python": os.path.exists(os.sys.executable), "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "endpoint": os.environ.get("AWS_ENDPOINT_URL"),
            "home": sorted(os.listdir(Path.home())) if Path.home().is_dir() else []}


def test_driver_paths_are_absent_on_the_nodes(nodisk_cluster, tmp_path):
    print(f"cluster start: {nodisk_cluster.start_s:.1f} s")
    token = uuid.uuid4().hex.encode()
    mine = [tmp_path / "data" / "part-0.parquet", Path(f"/tmp/nodisk-{os.getpid()}-{token[:8].decode()}")]
    for p in mine:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(token)
    try:
        nodes = _worker_nodes()
        assert len(nodes) == 2
        got = ray.get([_look.options(scheduling_strategy=_on(n)).remote([str(p) for p in mine], token)
                       for n in nodes], timeout=120)
    finally:
        mine[1].unlink()
    for g in got:
        assert g["paths"] == {str(p): "FileNotFoundError" for p in mine}, g
        assert g["value"] == token and g["code"] and g["python"]
    assert sorted(g["node"] for g in got) == sorted(nodes)
    # $HOME is hidden too, but for the interpreter's installation where it lies there.
    home = Path.home().resolve()
    image = {Path(k).relative_to(home).parts[0] for k in nodisk_cluster.nodisk_kept
             if home in Path(k).parents}
    assert all(set(g["home"]) <= image for g in got), ([g["home"] for g in got], image)
    # The same read on the head (in the driver's namespace) finds the files: the test
    # above fails for the nodes' want of a shared disk, not for a wrong path.
    head = next(n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"])
    mine[1].write_bytes(token)
    try:
        here = ray.get(_look.options(num_cpus=0, scheduling_strategy=_on(head)).remote(
            [str(p) for p in mine], token), timeout=120)
    finally:
        mine[1].unlink()
    assert here["paths"] == {str(p): token for p in mine}


def test_the_shared_diagnostics_dir_is_seen_by_the_nodes(nodisk_cluster):
    """``<basetemp>/shared`` (ledger, markers) is the one driver directory the nodes see."""
    p = nodisk_cluster.shared / f"probe-{uuid.uuid4().hex}"
    p.write_bytes(b"seen")
    (got,) = ray.get([_look.options(scheduling_strategy=_on(_worker_nodes()[0])).remote([str(p)], b"")])
    assert got["paths"][str(p)] == b"seen"


def test_a_node_writes_to_s3(nodisk_cluster, s3, s3_faults):
    @ray.remote(num_cpus=1, max_retries=0)
    def write(uri: str, body: bytes) -> str:
        from pyarrow import fs

        filesystem, path = fs.FileSystem.from_uri(uri)  # endpoint etc. from the environment
        with filesystem.open_output_stream(path) as f:
            f.write(body)
        return os.environ["AWS_ENDPOINT_URL"]

    body = os.urandom(1000)
    endpoints = ray.get([write.options(scheduling_strategy=_on(n)).remote(s3.uri(f"from-{i}"), body)
                         for i, n in enumerate(_worker_nodes())], timeout=120)
    # The nodes inherited the endpoint of `ray start`'s environment: the fault proxy in
    # front of the session's S3 server, which saw their writes.
    assert endpoints == [s3_faults.endpoint] * 2
    assert sorted(s3.keys()) == ["from-0", "from-1"]
    assert s3.client.get_object(Bucket=s3.name, Key="from-1")["Body"].read() == body
    assert s3_faults.count("*", r"^from-[01]$") >= 2


def test_no_training_worker_fits_on_the_head(nodisk_cluster):
    head = next(n for n in ray.nodes() if "node:__internal_head__" in n["Resources"])
    assert head["Resources"].get("CPU", 0) == 0
    assert sum(n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]) == 4


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
