"""Bitwise across a real resize (docs/design.md, "Bitwise across world sizes"), on a real
local Ray cluster: a ``per_step`` job's replica is SIGKILLed mid-epoch, the survivor
commits steps alone (a quorum of 1) and the replacement heals from it and joins (a
quorum of 2 again); the final checkpoint's model and optimizer state must be
``torch.equal`` to the same job trained uninterrupted, here by the product's ``Trainer``
at world size 1 in this process (tests/e2e/resume/test_exact_world_sizes.py: world size 1 and 2
train bitwise alike). The quorum-of-1 steps run the world-size-1 arithmetic through
torchft's all-reduce; the healing hands the live state over torchft's transport.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from conftest import digits_config
from elastic_ddp.checkpoint.dcp_io import load_prefix
from elastic_ddp.config import Config
from elastic_ddp.data.scan import read_sample_ids
from elastic_ddp import train
from elastic_ddp.driver.preflight import job_spec, prepare
from elastic_ddp.ledger import audit
from elastic_ddp.run_state import Diagnostics
from helpers import ledger_files, one_thread_steps

pytestmark = pytest.mark.ray

# As tests/e2e/per_step/test_fault_tolerance.py: every step takes at least STEP_S, so the survivor is
# still training when the replacement (a new Ray worker process: seconds) arrives.
STEP_S = 0.05
EPOCHS = 8
JOB = {"model": {"kwargs": {"hidden": 16, "dropout": 0.1}},
       "batch": {"global_batch_size": 32, "micro_batch_size": 8},
       "train": {"epochs": EPOCHS, "log_every_steps": 5, "checkpoint_every_steps": 20},
       "scaling": {"fault_tolerance": "per_step", "min_workers": 1, "max_workers": 2,
                   "max_failures": 3, "health_check_interval_s": 0.2, "torch_threads": 1}}


@pytest.mark.slow
def test_per_step_quorum_2_1_2_ends_bitwise_as_the_uninterrupted_run(ray_cluster, digits_data, tmp_path):
    cfg = Config.from_dict(digits_config(digits_data, tmp_path, JOB))
    ledger = tmp_path / "ledger"
    steps = math.ceil(len(read_sample_ids(digits_data / "train")) / 32) * EPOCHS
    s = train(cfg, progress=False, diagnostics=Diagnostics(ledger_dir=str(ledger), fault={
        "rank": 0, "at_step": 6, "where": "step", "marker": str(tmp_path / "fired"), "step_s": STEP_S}))
    assert (tmp_path / "fired").exists() and s.steps == steps
    assert audit(ledger, read_sample_ids(digits_data / "train"), EPOCHS)["ok"]
    # The quorum changed: steps committed by one replica alone, and by two after them.
    commits = [(r["commit"], r["n"]) for _, recs in ledger_files(ledger) for r in recs if "commit" in r]
    alone = [k for k, n in commits if n == 1]
    assert alone and any(n == 2 and k > max(alone) for k, n in commits), commits

    # The same job uninterrupted at world size 1 (restart mode's step: the arithmetic of
    # a quorum of one, without torchft), in this process.
    plain = Config.from_dict(digits_config(digits_data, tmp_path, {
        **JOB, "scaling": {**JOB["scaling"], "fault_tolerance": "restart"}}))
    ref = one_thread_steps(job_spec(plain, prepare(plain), tracker=None, t0=time.time(),
                                    storage=str(tmp_path / "ref")), steps)
    model = load_prefix(s.checkpoint_path, "model.")
    assert sorted(model) == sorted(ref["model"])
    for k, v in ref["model"].items():
        assert torch.equal(model[k], v), f"model {k}: max abs diff {(model[k] - v).abs().max().item():.2e}"
    optim = load_prefix(s.checkpoint_path, "optim.")
    names = [n for n, _ in torch.nn.Module.named_parameters(_module(cfg))]
    for i, state in ref["optimizer"]["state"].items():
        for k, v in state.items():
            assert torch.equal(optim[f"state.{names[i]}.{k}"], v), f"optimizer {names[i]}.{k}"


def _module(cfg):
    from elastic_ddp.tasks.loading import build_model, load_task

    return build_model(cfg, load_task(cfg))
