"""What every worker receives from the driver (``elastic_ddp.worker.entry.load_job``): the
job the launcher builds (``driver.launcher.job_spec``), carried by Ray Train as bytes, with
the driver's validated ``Config`` itself in it. Fast tier: the ``TorchTrainer`` is built,
not fitted (no Ray cluster).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import digits_config
from elastic_ddp.config import Config


def _shipped(digits_data, tmp_path):
    """The driver's config and the ``train_loop_config`` its ``TorchTrainer`` carries."""
    from elastic_ddp.driver.launcher import build_trainer, job_spec
    from elastic_ddp.driver.preflight import prepare

    cfg = Config.from_dict(digits_config(digits_data, tmp_path, {"scaling": {"use_gpu": False}}))
    job = job_spec(cfg, prepare(cfg, None), None, 0.0, str(tmp_path / "ray_results"))
    return cfg, build_trainer(cfg, job, None).train_run_context.train_loop_config


def test_the_workers_receive_the_drivers_validated_config(digits_data, tmp_path):
    from elastic_ddp.worker.entry import load_job

    cfg, loop_config = _shipped(digits_data, tmp_path)
    job = load_job(loop_config)
    # A copy of the driver's object (pickled), of the same type and values: no JSON dict
    # on the way, nothing for the worker to validate again.
    assert type(job.config) is Config and job.config is not cfg
    assert job.config == cfg
    assert json.dumps(job.config.model_dump(mode="json")) == json.dumps(cfg.model_dump(mode="json"))


def test_the_worker_entry_refuses_a_config_that_is_not_a_config(digits_data, tmp_path):
    from ray import cloudpickle

    from elastic_ddp.worker.entry import load_job

    cfg, loop_config = _shipped(digits_data, tmp_path)
    job = cloudpickle.loads(loop_config["job"])
    as_json = dataclasses.replace(job, config=cfg.model_dump(mode="json"))
    with pytest.raises(TypeError, match="JobSpec.config is a dict; the driver hands the workers its validated"):
        load_job({"job": cloudpickle.dumps(as_json)})
