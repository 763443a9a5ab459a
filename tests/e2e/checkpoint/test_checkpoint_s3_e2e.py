"""Asynchronous checkpoints on object storage in a real Ray job (``run.storage_path`` on the
tests' S3 server, the data on local disk): rank 1 dies between its background write and
its upload of the step-15 checkpoint (no manifest); the restart resumes from the step-10
checkpoint on S3 and the ledger shows no sample lost or repeated."""

from __future__ import annotations

import json
import uuid

import pytest

from conftest import digits_config
from elastic_ddp.config import Config
from elastic_ddp import train
from elastic_ddp.ledger import audit, format_audit
from elastic_ddp.run_state import Diagnostics

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def s3_env(s3_server):
    """This module's bucket, and the environment pointed at the S3 server before the
    module's Ray cluster starts (its workers inherit it)."""
    import boto3

    mp = pytest.MonkeyPatch()
    env = {"AWS_ENDPOINT_URL": s3_server, "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_EC2_METADATA_DISABLED": "true"}
    for k, v in env.items():
        mp.setenv(k, v)
    bucket = f"e2e-{uuid.uuid4().hex[:10]}"
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    client.create_bucket(Bucket=bucket)
    yield bucket, client
    mp.undo()


@pytest.mark.slow
def test_a_kill_before_the_upload_on_s3_resumes_from_the_previous_checkpoint(
        s3_env, ray_cluster, digits_data, tmp_path, mlflow_store):
    from elastic_ddp.checkpoint import MANIFEST
    from elastic_ddp.data.scan import read_sample_ids

    bucket, client = s3_env
    cfg = Config.from_dict(digits_config(digits_data, tmp_path, {
        "train": {"epochs": 1, "checkpoint_every_steps": 5, "log_every_steps": 5,
                  "async_checkpoint": True},
        "scaling": {"max_failures": 2, "collective_timeout_s": 30},
        "run": {"name": "s3-kill", "storage_path": f"s3://{bucket}/runs"}}))
    marker = tmp_path / "fired"
    s = train(cfg, progress=False, diagnostics=Diagnostics(
        ledger_dir=str(tmp_path / "ledger"),
        fault={"rank": 1, "at_step": 15, "where": "checkpoint_write", "marker": str(marker)}))
    assert json.loads(marker.read_text())["step"] == 15
    report = audit(tmp_path / "ledger", read_sample_ids(digits_data / "train"), 1)
    print(format_audit(report))
    assert report["ok"] and report["epochs"][0]["steps"] == 23
    assert [a["resumed_from"] for a in report["attempts"]] == [0, 10]
    (ev,) = [e for e in s.events if e["type"] == "failure"]
    assert ev["cause_rank"] == 1 and ev["cause_kind"] == "died", ev
    assert ev["resumed_from_checkpoint"].endswith("s3-kill/checkpoint_step00000010"), ev
    assert s.restarts == 1 and s.steps == 23
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="runs/s3-kill/")
            .get("Contents", [])]
    ckpts = {k.split("/")[2] for k in keys if k.split("/")[2].startswith("checkpoint_step")}
    manifests = {k.split("/")[2] for k in keys if k.endswith("/" + MANIFEST)}
    assert ckpts and ckpts == manifests, (ckpts, manifests)  # none left without its manifest
    assert not (tmp_path / "ray_results").exists()  # nothing of the run on local disk
