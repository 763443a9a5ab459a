"""Per-step mode (``scaling.fault_tolerance: per_step``) losing every replica at once, as
a node hosting both or a rack's power loss does: both replicas SIGKILLed together. No
replica is left to heal from, so the job restarts the whole group from the newest
checkpoint, as restart mode does, counted against ``scaling.max_failures``; the run
finishes with the ledger clean (every sample once per epoch, no committed step lost).

A real local Ray cluster (the ``ray_cluster`` fixture), the job in this process, the
workers found in the GCS actor table and killed with SIGKILL."""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from conftest import alive_train_workers, digits_config, mlflow_runs
from elastic_ddp.config import Config
from elastic_ddp.data.scan import read_sample_ids
from elastic_ddp import train
from elastic_ddp.ledger import audit, format_audit
from elastic_ddp.run_state import Diagnostics
from helpers import replicas_together, wait_until

EPOCHS = 2
# Slower steps (sleep only), so that the kill lands mid-run after a checkpoint.
SLOW = {"rank": -1, "at_step": 0, "where": "none", "step_s": 0.1}
JOB = {"batch": {"global_batch_size": 64, "micro_batch_size": 32},
       "train": {"epochs": EPOCHS, "log_every_steps": 2, "checkpoint_every_steps": 8},
       "scaling": {"fault_tolerance": "per_step", "min_workers": 1, "max_workers": 2,
                   "max_failures": 1, "health_check_interval_s": 0.2}}


@pytest.mark.slow
def test_every_replica_killed_at_once_restarts_the_group_from_the_newest_checkpoint(
        ray_cluster, digits_data, tmp_path):
    cfg = Config.from_dict(digits_config(digits_data, tmp_path, JOB))
    ledger = tmp_path / "ledger"
    steps = math.ceil(len(read_sample_ids(digits_data / "train")) / 64) * EPOCHS
    result: dict = {}

    def run():
        try:
            result["summary"] = train(cfg, progress=False,
                                      diagnostics=Diagnostics(ledger_dir=str(ledger), fault=SLOW))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            result["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    run_dir = Path(cfg.run.storage_path) / cfg.run.name
    # Both replicas in one quorum, and a checkpoint committed.
    wait_until(lambda: not th.is_alive() or (replicas_together(ledger)
                                             and any(run_dir.glob("checkpoint_step*/manifest.json"))), 300)
    assert th.is_alive(), result
    pids = alive_train_workers()
    assert len(pids) == 2, pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    t_kill = time.time()
    th.join(600)
    assert not th.is_alive(), "training did not finish in 10 minutes"
    if "error" in result:
        raise result["error"]
    s = result["summary"]
    print(json.dumps(s.events, indent=1, default=str))
    assert s.steps == steps and s.restarts >= 1, (s.steps, s.restarts)
    # The failure is recorded with its dead ranks, and training resumed from a checkpoint.
    fails = [e for e in s.events if e["type"] == "failure"]
    assert fails and set(fails[0].get("failed_ranks") or []) <= {0, 1}, fails
    report = audit(ledger, read_sample_ids(digits_data / "train"), EPOCHS)
    print(format_audit(report), report["problems"])
    assert report["ok"] and not report["problems"], report["problems"]
    assert all(e["lost"] == 0 and e["repeated"] == 0 for e in report["epochs"].values())
    # New replicas (both) started after the kill and committed steps.
    heads = [json.loads(f.read_text().splitlines()[0]) for f in ledger.glob("*.jsonl")]
    assert len([h for h in heads if h.get("t", 0) > t_kill]) >= 2, heads
    runs = mlflow_runs(tmp_path)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
