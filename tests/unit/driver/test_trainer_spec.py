"""What the job's ``TorchTrainer`` gets (``driver.trainer_spec.trainer_spec``), decided from
the config and the Ray release's compat plan alone: no Ray, no writes to ``os.environ``."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from conftest import digits_config
from elastic_ddp.compat.versions import ray_plan
from elastic_ddp.config import Config
from elastic_ddp.driver import trainer_spec as ts

TESTED, UNTESTED = "2.60.0", "2.61.0"


def _spec(tmp_path, scaling: dict, version: str = TESTED, gpus: float = 0.0):
    cfg = Config.from_dict(digits_config(tmp_path, tmp_path, {"scaling": scaling}))
    return ts.trainer_spec(cfg, ray_plan(version), ts.storage_root(cfg), cluster_gpus=gpus)


def test_an_elastic_restart_job_on_a_tested_ray(tmp_path, monkeypatch):
    before = dict(os.environ)
    spec = _spec(tmp_path, {"min_workers": 1, "max_workers": 4, "max_failures": 5,
                            "health_check_interval_s": 2.0, "preemption_checkpoint": True})
    assert dict(os.environ) == before  # pure: nothing written
    assert spec.num_workers == (1, 4) and spec.torch_config == "process_group" and spec.backend == "gloo"
    assert not spec.use_gpu and spec.resources_per_worker == {"CPU": 1}
    assert dict(spec.env) == {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2.0",
                              "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "25.0"}  # elastic: 25 s
    # A notice becomes a checkpoint: Ray Train's preemption watcher runs (restart mode).
    assert spec.preemption and spec.notice_line is None
    assert dict(spec.env_defaults)["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "1"
    assert spec.max_failures == 5 and spec.controller_failure_limit == 15
    events = dict(spec.events)
    assert events["preemption"] and events["grow_checkpoint_timeout_s"] is not None
    assert events["storage"] == spec.storage == str(tmp_path / "ray_results")
    assert events["run_name"] == spec.run_name == "test-digits" and spec.controller_events
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_workers = 2


def test_a_per_step_job_on_an_untested_ray(tmp_path):
    spec = _spec(tmp_path, {"min_workers": 2, "max_workers": 3, "fault_tolerance": "per_step",
                            "preemption_checkpoint": True, "max_failures": 1}, version=UNTESTED)
    # max_workers replica groups of one worker each, on torchft's backend config.
    assert spec.num_workers == 3 and spec.torch_config == "torchft"
    # Stock Ray Train: no preemption support, said in one line; no watcher, no
    # controller callback of elastic-ddp's, no grow checkpoint (per-step mode).
    assert not spec.preemption and spec.notice_line.startswith(f"elastic-ddp: Ray {UNTESTED} has no")
    assert dict(spec.env_defaults)["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "0"
    assert not spec.controller_events and dict(spec.events)["grow_checkpoint_timeout_s"] is None
    assert spec.controller_failure_limit == 10
    fixed = _spec(tmp_path, {"max_failures": -1})
    assert fixed.num_workers == 2 and fixed.controller_failure_limit == -1
    assert dict(fixed.env)["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "600.0"


def test_use_gpu_auto_follows_the_clusters_gpus(tmp_path):
    on = _spec(tmp_path, {"use_gpu": "auto", "gpus_per_worker": 1}, gpus=2)
    assert on.use_gpu and on.backend == "nccl" and on.resources_per_worker == {"CPU": 1, "GPU": 1}
    off = _spec(tmp_path, {"use_gpu": "auto", "gpus_per_worker": 1}, gpus=0)
    assert not off.use_gpu and off.backend == "gloo" and off.resources_per_worker == {"CPU": 1}


def test_apply_env_keeps_a_persons_value_and_replaces_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(ts, "_env_written", {})
    for name in ("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "7")  # a person's
    per_step = _spec(tmp_path, {"fault_tolerance": "per_step", "min_workers": 1})
    ts.apply_env(per_step)
    assert os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "0"
    assert os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] == "7"
    assert os.environ["RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"] == "60"
    # A restart-mode job after it in the same process gets its watcher back.
    ts.apply_env(_spec(tmp_path, {"preemption_checkpoint": True}))
    assert os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "1"
    assert os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] == "7"


def test_the_spec_is_built_without_importing_ray(tmp_path):
    raw = digits_config(tmp_path, tmp_path)
    code = f"""
import json, sys
from elastic_ddp.compat.versions import ray_plan
from elastic_ddp.config import Config
from elastic_ddp.driver.trainer_spec import storage_root, trainer_spec
cfg = Config.from_dict(json.loads({json.dumps(raw)!r}))
spec = trainer_spec(cfg, ray_plan({TESTED!r}), storage_root(cfg))
print(json.dumps({{"ray": "ray" in sys.modules, "workers": spec.num_workers}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"ray": False, "workers": 2}
