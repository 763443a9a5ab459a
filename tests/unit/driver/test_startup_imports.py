"""What the driver's dry run and the Ray Train controller import: start-up cost that is
on the path from the command to the first step (docs/benchmarks.md, "Start-up").

Each check runs in a fresh interpreter, since this one has imported everything. Fast
tier: no Ray cluster starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import digits_config
from elastic_ddp.config import Config
from elastic_ddp.tasks import dry_run, loading

ROOT = Path(__file__).resolve().parents[3]


def _fresh(code: str, tmp: Path) -> dict:
    """Run ``code`` in a new interpreter; it prints one JSON line last."""
    script = tmp / "probe.py"
    script.write_text(textwrap.dedent(code))
    p = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_dry_run_of_a_small_model_does_not_import_torch_dynamo(digits_data, tmp_path):
    # The meta device's kernels for the initializers and most ops import torch._dynamo
    # (about a second of the driver's start-up); a small model runs on the CPU instead.
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump(digits_config(digits_data, tmp_path)))
    out = _fresh(f"""
        import json, sys
        from elastic_ddp.config import Config
        from elastic_ddp.driver.preflight import prepare
        cfg = Config.load({str(cfg_file)!r})
        p = prepare(cfg, None)
        print(json.dumps({{"dynamo": "torch._dynamo" in sys.modules, "n": p.dry_run.n_params,
                           "keys": sorted(p.sample["train"])}}))
    """, tmp_path)
    assert out["dynamo"] is False
    cfg = Config.load(cfg_file)
    task = loading.load_task(cfg)
    assert out["n"] == sum(p.numel() for p in loading.build_model(cfg, task).parameters())
    assert "sample_id" in out["keys"] and len(out["keys"]) > 1  # the dry run ran: a transformed row


def test_a_model_over_the_cpu_limit_is_still_dry_run_on_the_meta_device(digits_data, tmp_path, monkeypatch):
    from elastic_ddp.data.scan import scan_parquet

    cfg = Config.from_dict(digits_config(digits_data, tmp_path))
    task = loading.load_task(cfg)
    info = scan_parquet(cfg.data.train_path, task.input_columns(), "sample_id")
    devices = []
    real = loading.build_model

    def spy(c, t):
        import torch

        devices.append(str(torch.empty(0).device))
        return real(c, t)

    monkeypatch.setattr(dry_run, "build_model", spy)
    # Two builds: the count on the meta device, the dry run on the CPU (its module kept,
    # for the final MLflow model).
    small = dry_run.preflight(cfg, task, info, None)
    assert devices == ["meta", "cpu"]
    n = sum(p.numel() for p in small.model.parameters())
    assert small.n_params == n and {p.device.type for p in small.model.parameters()} == {"cpu"}
    devices.clear()
    # One build: the dry run runs on the count's meta-device model; nothing is kept.
    monkeypatch.setattr(dry_run, "CPU_DRY_RUN_PARAMS", 10)
    large = dry_run.preflight(cfg, task, info, None)
    assert devices == ["meta"] and large.model is None and large.n_params == n


def test_the_ray_train_controller_unpickles_its_arguments_without_torch(digits_data, tmp_path):
    # The controller process unpickles the trainer's run context (train_loop_config,
    # backend config) and callbacks when it starts; torch there costs a second or more
    # before any worker exists.
    from ray import cloudpickle

    from elastic_ddp.driver.launcher import build_trainer, job_spec
    from elastic_ddp.driver.preflight import prepare

    cfg = Config.from_dict(digits_config(digits_data, tmp_path, {"scaling": {"use_gpu": False}}))
    p = prepare(cfg, None)
    task, train_info = p.task, p.train_info
    job = job_spec(cfg, p, None, 0.0, str(tmp_path / "ray_results"))
    trainer = build_trainer(cfg, job, None)
    blob = tmp_path / "controller_args.pkl"
    blob.write_bytes(cloudpickle.dumps((trainer.train_run_context, trainer._create_default_callbacks())))
    out = _fresh(f"""
        import json, sys
        from ray import cloudpickle
        ctx, callbacks = cloudpickle.loads(open({str(blob)!r}, "rb").read())
        started = "torch" in sys.modules
        # After a failure the controller's events callback looks up the newest stored
        # checkpoint: between the failure and the restart, no torch either.
        sink = next(c.sink for c in callbacks if type(c).__name__ == "ControllerEvents")
        step = sink._stored_step()
        print(json.dumps({{"torch": started, "torch_after_failure": "torch" in sys.modules, "step": step,
                           "backend": ctx.backend_config.backend,
                           "job_bytes": isinstance(ctx.train_loop_config["job"], bytes)}}))
    """, tmp_path)
    assert out == {"torch": False, "torch_after_failure": False, "step": 0, "backend": "gloo", "job_bytes": True}
    # No Ray Train datasets callback (its DatasetManager actor is one more process at
    # every worker-group start) and no placement-group cleaner; Ray Train's others stay.
    # (Whether Ray still calls what compat/ overrides is the version guard's business:
    # tests/unit/compat/test_compat_versions.py.)
    from ray.train.v2._internal.callbacks.backend_setup import BackendSetupCallback
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    names = {type(c).__name__ for c in trainer._create_default_callbacks()}
    assert DatasetsCallback.__name__ not in names and BackendSetupCallback.__name__ in names
    assert PlacementGroupCleanerCallback.__name__ not in names
    # What the workers get back is the whole job.
    back = cloudpickle.loads(trainer.train_run_context.train_loop_config["job"])
    assert back.train.num_rows == train_info.num_rows and type(back.task) is type(task)


def test_the_process_group_backend_mirrors_functions_ray_still_has():
    # elastic_ddp.compat.ray_backend does on the workers what these Ray functions do (the
    # variables and the device are compared with Ray's in tests/unit/compat/test_ray_trainer.py); a
    # Ray upgrade that renames or re-signs them must fail here, for the mirror's review.
    import inspect

    from ray.train.torch import config as ray_torch

    for name, params in (("_setup_torch_process_group", {"backend", "world_rank", "world_size",
                                                         "init_method", "timeout_s"}),
                         ("_set_torch_distributed_env_vars", set()),
                         ("_shutdown_torch", {"destroy_process_group"})):
        fn = getattr(ray_torch, name)
        assert params <= set(inspect.signature(fn).parameters), name
    from elastic_ddp.compat.ray_backend import ProcessGroupConfig

    with pytest.raises(ValueError, match="backend='hccl'"):
        ProcessGroupConfig(backend="hccl")
    assert ProcessGroupConfig(backend="nccl").to_dict()["backend"] == "nccl"


def test_the_controller_host_serves_every_method_ray_calls_on_its_controller_and_barrier():
    # elastic_ddp.compat.ray_controller_host.ControllerHost stands for Ray Train's TrainController and
    # SynchronizationActor actors; a Ray upgrade that adds a public method to either must
    # fail here (then: forward it, or list it as in-process only).
    import inspect

    from ray.train.v2._internal.execution.checkpoint.sync_actor import SynchronizationActor
    from ray.train.v2._internal.execution.controller import TrainController
    from ray.train.v2._internal.execution.worker_group import state, worker_group

    from elastic_ddp.compat.ray_controller_host import FORWARDED, SYNC_METHODS, ControllerHost

    def public(cls) -> set[str]:
        return {n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}

    in_process_only = {"get_state", "get_worker_group"}  # the controller's own callbacks
    assert public(TrainController) == set(FORWARDED) | in_process_only
    # SYNC_METHODS: every supported release's methods (2.60 added three).
    assert public(SynchronizationActor.__ray_actor_class__) <= set(SYNC_METHODS)
    assert set(FORWARDED) | set(SYNC_METHODS) <= set(dir(ControllerHost))
    # The two names the host replaces inside Ray Train's worker group modules.
    assert callable(worker_group.SynchronizationActor.options) and callable(state._shutdown_sync_actor)
