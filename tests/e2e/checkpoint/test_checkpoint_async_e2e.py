"""Asynchronous checkpoints (``train.async_checkpoint``) in a real Ray job: rank 1 dies
inside the background write of the step-15 checkpoint (its shard cut short, no manifest);
the restart resumes from the step-10 checkpoint, the recovery record names it, and the
ledger shows no sample lost or repeated."""

from __future__ import annotations

import json

import pytest

from conftest import digits_config
from elastic_ddp.config import Config
from elastic_ddp import train
from elastic_ddp.ledger import audit, format_audit
from elastic_ddp.run_state import Diagnostics

pytestmark = pytest.mark.ray


@pytest.mark.slow
def test_a_kill_during_the_background_write_resumes_from_the_previous_checkpoint(
        ray_cluster, digits_data, tmp_path, mlflow_store):
    from elastic_ddp.checkpoint import MANIFEST
    from elastic_ddp.data.scan import read_sample_ids

    cfg = Config.from_dict(digits_config(digits_data, tmp_path, {
        "train": {"epochs": 1, "checkpoint_every_steps": 5, "log_every_steps": 5,
                  "async_checkpoint": True},
        "scaling": {"max_failures": 2, "collective_timeout_s": 30},
        "run": {"name": "async-kill"}}))
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
    # The restart is for the rank's death inside the write, not an error of the write.
    assert ev["cause_rank"] == 1 and ev["cause_kind"] == "died" and ev["signal"] == "SIGKILL", ev
    assert ev["resumed_at_step"] == 10, ev
    assert ev["resumed_from_checkpoint"].endswith("async-kill/checkpoint_step00000010"), ev
    assert s.restarts == 1 and s.steps == 23
    ckpts = sorted((tmp_path / "ray_results" / "async-kill").glob("checkpoint_step*"))
    assert ckpts and all((c / MANIFEST).is_file() for c in ckpts), ckpts
