"""The compat seam's version guard (``elastic_ddp.compat.versions``): on a Ray release the
overrides were tested on the launcher builds elastic-ddp's trainer; on any other, stock
Ray Train for each part an override skips, after one warning line naming what is skipped.

Fast tier: the trainer is built, not fitted (no Ray cluster). Ray tier: a job on the
stock path with a rank SIGKILLed mid-step resumes with every sample once per epoch.
"""

from __future__ import annotations

import dataclasses

import pytest

from conftest import digits_config
from elastic_ddp.compat import versions
from elastic_ddp.compat.versions import OVERRIDES, TESTED_RAY, ray_plan, release_key
from elastic_ddp.config import Config

UNTESTED = "2.61.0"


def _build(digits_data, tmp_path, extra=None):
    from elastic_ddp.driver.launcher import build_trainer, job_spec
    from elastic_ddp.driver.preflight import prepare

    raw = digits_config(digits_data, tmp_path, {"scaling": {"use_gpu": False}, **(extra or {})})
    cfg = Config.from_dict(raw)
    job = job_spec(cfg, prepare(cfg, None), None, 0.0, str(tmp_path / "ray_results"))
    return build_trainer(cfg, job, None)


def _parts(trainer) -> dict:
    """What the trainer runs: its class, backend config, callbacks (ours and Ray's)."""
    from ray.train.torch import TorchConfig, TorchTrainer

    return {"stock_class": type(trainer) is TorchTrainer,
            "ray_torch_config": isinstance(trainer.train_run_context.backend_config, TorchConfig),
            "callbacks": sorted(type(c).__name__ for c in trainer.train_run_context.run_config.callbacks),
            "defaults": {type(c).__name__ for c in trainer._create_default_callbacks()}}


@pytest.fixture()
def untested_ray(monkeypatch):
    """The installed Ray reports a release no override was tested on; the once-per-process
    warning is re-armed."""
    import ray

    monkeypatch.setattr(ray, "__version__", UNTESTED)
    monkeypatch.setattr(versions, "_warned", set())
    return UNTESTED


def test_each_override_applies_on_the_releases_it_was_tested_on_and_none_elsewhere():
    newest = max(TESTED_RAY, key=release_key)
    for v in TESTED_RAY:
        plan = ray_plan(v)
        # An override tested on fewer releases (newer Ray Train code) is skipped elsewhere.
        assert plan.skipped == tuple(o for o in OVERRIDES if v not in o.tested), v
        assert all(plan.applies(o.key) == (v in o.tested) for o in OVERRIDES)
        assert (plan.warning is None) == (plan.skipped == ()), v
        if plan.skipped:  # a tested release: the line names the parts and where they ran
            assert plan.warning.startswith(f"elastic-ddp: warning: on Ray {v}, running"), plan.warning
            assert all(f"{o.name} (tested on Ray " in plan.warning for o in plan.skipped), plan.warning
    assert ray_plan(newest).skipped == ()
    major, minor, _ = newest.split(".")
    later, patch = f"{major}.{int(minor) + 1}.0", f"{major}.{minor}.9"
    for v in (later, patch, newest + ".post1", "2.55.1", "3.0.0.dev0"):
        plan = ray_plan(v)
        assert plan.applied == () and not any(plan.applies(o.key) for o in OVERRIDES), v
        assert plan.warning.startswith(f"elastic-ddp: warning: Ray {v} is not a release"), plan.warning
        assert "\n" not in plan.warning
        assert all(o.name in plan.warning for o in OVERRIDES)
    with pytest.raises(KeyError, match="no compat override 'controler_host'"):
        ray_plan(newest).applies("controler_host")


def test_the_readme_names_each_override_skipped_on_a_supported_release_and_where():
    # A supported release that skips an override warns on every job; README.md's Ray
    # range note is where a user reads what such a job does without it.
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    start = readme.index("\nRay 2.56 to 2.60 (")
    note = " ".join(readme[start:readme.index("\n`make setup`", start)].split())
    oldest = min(TESTED_RAY, key=release_key)
    for o in OVERRIDES:
        missing = sorted(set(TESTED_RAY) - set(o.tested), key=release_key)
        if missing:
            first, last = missing[0].rsplit(".", 1)[0], missing[-1].rsplit(".", 1)[0]
            assert first == oldest.rsplit(".", 1)[0], (o.key, missing)  # skipped from the oldest on
            assert f"On Ray {first} to {last} that line names" in note, (o.key, note)
            assert o.name.split(" (")[0] in note, (o.key, note)


def test_the_installed_ray_is_a_tested_release():
    # The guard is what a Ray upgrade trips: a Ray in this environment that the overrides
    # were not tested on fails here (then: run tests/e2e/restart/test_ray_versions.py against it and
    # extend compat.versions), rather than running untested overrides.
    import ray

    assert ray_plan().warning is None, ray.__version__


def test_a_tested_ray_builds_elastic_ddps_trainer_without_a_warning(digits_data, tmp_path, capsys):
    parts = _parts(_build(digits_data, tmp_path))
    assert not parts["stock_class"] and not parts["ray_torch_config"]
    assert parts["callbacks"] == ["ControllerEvents", "ElasticEvents"]
    assert not {"DatasetsCallback", "PlacementGroupCleanerCallback"} & parts["defaults"]
    assert capsys.readouterr().err == ""


def test_an_untested_ray_builds_stock_ray_train_with_one_warning_line(digits_data, tmp_path, capsys,
                                                                      untested_ray):
    first = _parts(_build(digits_data, tmp_path))
    second = _parts(_build(digits_data, tmp_path))  # a sweep's next trial: no second line
    for parts in (first, second):
        assert parts["stock_class"] and parts["ray_torch_config"]
        assert parts["callbacks"] == ["ElasticEvents"]  # the public UserCallback only
        assert {"DatasetsCallback", "PlacementGroupCleanerCallback",
                "BackendSetupCallback"} <= parts["defaults"]
    err = capsys.readouterr().err.splitlines()
    assert err == [ray_plan(untested_ray).warning], err


def test_an_override_tested_on_fewer_releases_is_the_only_one_skipped(digits_data, tmp_path, capsys,
                                                                       untested_ray, monkeypatch):
    # The others list the (pretended) installed release as tested; the process-group
    # backend does not: Ray's TorchConfig, everything else elastic-ddp's.
    monkeypatch.setattr(versions, "OVERRIDES", tuple(
        o if o.key == "process_group_backend" else dataclasses.replace(o, tested=o.tested + (untested_ray,))
        for o in OVERRIDES))
    parts = _parts(_build(digits_data, tmp_path))
    assert parts["ray_torch_config"] and not parts["stock_class"]
    assert parts["callbacks"] == ["ControllerEvents", "ElasticEvents"]
    (line,) = capsys.readouterr().err.splitlines()
    backend = next(o.name for o in OVERRIDES if o.key == "process_group_backend")
    assert line.endswith(f"without: {backend}") and "as shipped for these parts" in line, line


@pytest.mark.slow
@pytest.mark.ray
def test_a_job_on_the_stock_path_resumes_a_killed_rank_exactly(ray_cluster, digits_data, tmp_path,
                                                               capfd, untested_ray):
    from elastic_ddp.data.scan import read_sample_ids
    from elastic_ddp import train
    from elastic_ddp.ledger import audit, format_audit
    from elastic_ddp.run_state import Diagnostics

    raw = digits_config(digits_data, tmp_path, {"train": {"epochs": 2, "checkpoint_every_steps": 5}})
    ledger, marker = tmp_path / "ledger", tmp_path / "fired"
    s = train(Config.from_dict(raw), progress=False, diagnostics=Diagnostics(
        ledger_dir=str(ledger), fault={"rank": 1, "at_step": 12, "where": "step", "marker": str(marker)}))
    assert marker.exists() and s.steps == 46, s
    report = audit(ledger, read_sample_ids(digits_data / "train"), 2)
    print(format_audit(report))
    assert report["ok"], format_audit(report)
    assert [a["resumed_from"] for a in report["attempts"]] == [0, 10]
    assert all(e["lost"] == 0 and e["repeated"] == 0 for e in report["epochs"].values())
    # The Ray version's line (the job may also warn about other things, e.g. its data wait).
    warnings = [line for line in capfd.readouterr().err.splitlines()
                if "elastic-ddp: warning: Ray " in line]
    assert warnings == [ray_plan(untested_ray).warning], warnings


def test_the_seam_still_imports_and_runs_where_ray_lacks_the_internals_it_overrides(monkeypatch):
    # On a release that moved Ray Train's internal callback module or dropped Ray's
    # multi-node flag, the stock path must still get as far as Ray's own code: the
    # controller's events module imports (ControllerEvents is left out by the guard) and
    # the local Ray's flag switch does nothing.
    import subprocess
    import sys

    code = ("import sys, ray.train  # Ray's own modules are loaded first: they import it too\n"
            "sys.modules['ray.train.v2._internal.execution.callback'] = None\n"
            "from elastic_ddp.controller.events import ElasticEvents\n"
            "from elastic_ddp.controller.lifecycle import ControllerEvents\n"
            "print(ControllerEvents.__mro__[1].__module__)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "elastic_ddp.compat.ray_train", p.stderr[-2000:]

    from ray._private import ray_constants

    from elastic_ddp.compat.ray_local import cluster_mode

    monkeypatch.delattr(ray_constants, "ENABLE_RAY_CLUSTER")
    with cluster_mode(True):
        assert not hasattr(ray_constants, "ENABLE_RAY_CLUSTER")


def test_rays_death_messages_are_read_on_a_tested_ray_only(untested_ray, monkeypatch):
    # On a release whose message formats were not tested, no cause is read from them.
    import ray

    from elastic_ddp.compat.ray_errors import how_it_died, where_it_died

    text = ("The actor died unexpectedly before finishing this task. ip: 10.0.0.7 pid: 4242 "
            "Task was killed due to the node running low on memory.")
    assert how_it_died(text) == ("the process died", "") and where_it_died(text) == ("", None)
    monkeypatch.setattr(ray, "__version__", max(TESTED_RAY, key=release_key))
    assert how_it_died(text)[0].startswith("killed by Ray's memory monitor")
    assert where_it_died(text) == ("10.0.0.7", 4242)


def test_mlflows_scheme_list_is_used_on_a_tested_mlflow_only(monkeypatch):
    from elastic_ddp.compat.mlflow_store import tracking_store_schemes
    from elastic_ddp.config import ConfigError
    from elastic_ddp.driver.preflight import check_tracking_scheme

    assert "sqlite" in tracking_store_schemes()
    with pytest.raises(ConfigError, match="no tracking store for the scheme 'htp'"):
        check_tracking_scheme("htp://mlflow:5000")
    monkeypatch.setattr(versions, "TESTED_MLFLOW", ())
    assert tracking_store_schemes() is None
    check_tracking_scheme("htp://mlflow:5000")  # MLflow names it when the run opens


def test_torchs_compress_hook_and_its_public_mirror_reduce_alike(tmp_path):
    # The guard uses torch's private _compress_hook on a tested torch (it exists there);
    # the mirror that serves elsewhere gives the same gradients (a gloo group of one).
    import subprocess
    import sys

    from elastic_ddp.compat import torch_ddp

    assert torch_ddp._PRIVATE is not None, "a tested torch without _compress_hook: extend the guard"
    code = f"""
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from elastic_ddp.compat import torch_ddp
dist.init_process_group("gloo", init_method="file://{tmp_path}/pg", rank=0, world_size=1)
grads = []
for hook in (torch_ddp._PRIVATE, torch_ddp.public_compress_hook):
    torch.manual_seed(0)
    m = DDP(torch.nn.Linear(8, 3))
    def bf16(state, bucket, h=hook):
        return h(torch.bfloat16, state, bucket)
    m.register_comm_hook(None, bf16)
    m(torch.randn(4, 8)).square().sum().backward()
    grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
assert torch.equal(grads[0], grads[1]), grads
print("ok")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]
