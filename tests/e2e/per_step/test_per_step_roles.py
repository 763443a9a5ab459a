"""Rank roles in per-step fault tolerance (``elastic_ddp.roles``) on a real local Ray
cluster: with world rank 0 SIGKILLed mid-epoch, the lead is participant 0 of the step's
quorum (the survivor while rank 0 is out), so the MLflow run holds validation metrics at
every epoch end and, at every step, the train loss of the whole global batch (the
replicas' shares summed over the quorum), not one replica's share; and the job trains
bit for bit the steps of the uninterrupted run."""

from __future__ import annotations

import math
import time

import pytest
import torch

from conftest import digits_config, mlflow_runs
from elastic_ddp.checkpoint.dcp_io import load_prefix
from elastic_ddp.config import Config
from elastic_ddp.data.scan import read_sample_ids
from elastic_ddp import train
from elastic_ddp.driver.preflight import job_spec, prepare
from elastic_ddp.ledger import audit
from elastic_ddp.run_state import Diagnostics
from helpers import ledger_files, one_thread_steps

# Each step at least STEP_S: the survivor is still training when the replacement (a new
# Ray worker process: seconds) arrives. 45 steps an epoch (1,437 rows / 32): killed before
# step 40, world rank 0 is out of the quorum when epoch 1 ends at step 45.
STEP_S = 0.05
EPOCHS = 3
KILL_AT = 40
JOB = {"batch": {"global_batch_size": 32, "micro_batch_size": 16},
       "train": {"epochs": EPOCHS, "log_every_steps": 1, "checkpoint_every_steps": 50},
       "scaling": {"fault_tolerance": "per_step", "min_workers": 1, "max_workers": 2,
                   "max_failures": 3, "health_check_interval_s": 0.2}}


def _history(tmp, run_id: str, key: str) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


@pytest.mark.slow
def test_metrics_flow_from_the_quorum_while_world_rank_0_is_dead(ray_cluster, digits_data, tmp_path):
    cfg = Config.from_dict(digits_config(digits_data, tmp_path, JOB))
    ledger = tmp_path / "ledger"
    per_epoch = math.ceil(len(read_sample_ids(digits_data / "train")) / 32)
    fault = {"rank": 0, "at_step": KILL_AT, "where": "step", "marker": str(tmp_path / "fired"),
             "step_s": STEP_S}
    s = train(cfg, progress=False, diagnostics=Diagnostics(ledger_dir=str(ledger), fault=fault))
    assert (tmp_path / "fired").exists() and s.steps == per_epoch * EPOCHS
    assert audit(ledger, read_sample_ids(digits_data / "train"), EPOCHS)["ok"]
    # Epoch 1's last step was committed by the survivor alone (world rank 0 was out).
    alone = {r["commit"] for _, recs in ledger_files(ledger) for r in recs
             if "commit" in r and r["n"] == 1}
    assert per_epoch in alone, sorted(alone)
    runs = mlflow_runs(tmp_path)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    run_id = runs[0].info.run_id

    # Validation at every epoch end, also the one reached while world rank 0 was dead.
    ends = {per_epoch * (e + 1) for e in range(EPOCHS)}
    for key in ("val/loss", "val/acc"):
        assert set(_history(tmp_path, run_id, key)) == ends, key

    # The reference: the same job uninterrupted at world size 1 (restart mode's step, the
    # arithmetic of a quorum of one, without torchft), in this process. A step's
    # arithmetic does not depend on the quorum's size (its rows are cut into the same
    # shards at every world size: tests/test_exact_world_sizes*.py), so the job ends with
    # its model bit for bit. A one-process replay in plain torch (one 32-row batch, not
    # two 16-row shards) is not a reference over 135 steps: its float32 rounding differs
    # by ~1e-7 a step, and Adam's steps amplify that to 2e-3 of the loss by step 131.
    plain = Config.from_dict(digits_config(digits_data, tmp_path, {
        **JOB, "scaling": {**JOB["scaling"], "fault_tolerance": "restart"}}))
    ref_loss: list[float] = []
    ref = one_thread_steps(job_spec(plain, prepare(plain), tracker=None, t0=time.time(),
                                    storage=str(tmp_path / "ref")), s.steps, losses=ref_loss)
    model = load_prefix(s.checkpoint_path, "model.")
    assert sorted(model) == sorted(ref["model"])
    for k, v in ref["model"].items():
        assert torch.equal(model[k], v), f"model {k}: max abs diff {(model[k] - v).abs().max().item():.2e}"

    # The train loss at every step is the mean over the step's whole global batch: the
    # uninterrupted run's loss of that step. Not bit for bit: the job's row sums ride in
    # the float32 gradient all-reduce, the reference sums them in float64 (measured:
    # within 6e-8 relative; one replica's half of the batch differs by percents).
    loss = _history(tmp_path, run_id, "train/loss")
    assert set(loss) == set(range(1, s.steps + 1))
    worst = max(abs(loss[k] - ref_loss[k - 1]) / ref_loss[k - 1] for k in loss)
    print(f"\n[per_step roles] train/loss vs the uninterrupted run: worst relative difference {worst:.2e}")
    for k in sorted(loss):
        assert loss[k] == pytest.approx(ref_loss[k - 1], rel=1e-6), k
