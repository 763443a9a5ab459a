"""A resumed run checked on the driver before Ray starts (``elastic_ddp.driver.resume``):
real checkpoints written by the checkpoint manager, a real sqlite MLflow store holding the
interrupted run, the CLI in this process. No Ray: a refused resume never starts it.

- every checkpoint damaged: exit 2 naming each bad file and ending with the fix, the
  MLflow run left KILLED with its own tags (resumable), nothing marked;
- a config that changes the model (or the order, or the run's length): exit 2 naming the
  field, old -> new, and the fix; one that changes the LR: one warning line, an event and
  a tag; a model whose code changed: refused naming the parameter;
- a damaged newest checkpoint: warned about once, as it is found, marked rejected, never
  tried again by a restore; the same checkpoint restored from a copy is used again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from conftest import digits_config
from elastic_ddp import tracking
from elastic_ddp.checkpoint import checkpoint_name
from elastic_ddp.checkpoint.manager import CheckpointManager
from elastic_ddp.checkpoint.layout import REJECTED
from elastic_ddp.config import Config
from elastic_ddp.driver.trainer_spec import storage_root as _storage_path
from elastic_ddp.driver.resume import CONFIG_CHANGES_TAG, ResumeError, check_resume
from elastic_ddp.run_state import data_identity
from elastic_ddp.tracking.opener import RAY_RUN_NAME_TAG

RUN = "resume-check"
FIX = "Restore the files from a copy, or start a new run (another run.name)"


def _cfg(data: Path, tmp: Path, extra: dict | None = None) -> Config:
    return Config.from_dict(digits_config(data, tmp, {"run": {"name": RUN}, **(extra or {})}))


def _fingerprint(cfg: Config) -> str:
    from elastic_ddp.data.scan import scan_parquet
    from elastic_ddp.tasks.loading import load_task

    return scan_parquet(cfg.data.train_path, load_task(cfg).input_columns(), "sample_id").fingerprint


def _model(cfg: Config):
    from elastic_ddp.tasks.loading import build_model, load_task

    return build_model(cfg, load_task(cfg))


def _checkpoints(cfg: Config, steps: list[int]) -> list[Path]:
    """The run's checkpoints at ``steps``, as one worker writes them (its config.json,
    its run state with the data identity), on the job's storage."""
    from elastic_ddp.parallel.strategies import build_strategy

    storage = _storage_path(cfg)
    mgr = CheckpointManager(storage, cfg.run.name, cfg.model_dump(mode="json"), 0, 1,
                            collective=False, log=lambda m: None)
    ident = data_identity(cfg, _fingerprint(cfg))
    for k in steps:
        torch.manual_seed(k)
        s = build_strategy(cfg, _model(cfg), torch.device("cpu"), 1)
        mgr.save(k, s, {"progress": {"step": k, "epoch": 0, "cursor": 64 * k, "samples_seen": 64 * k},
                        "counters": {}, "data": ident}, report=False)
    return [Path(storage) / cfg.run.name / checkpoint_name(k) for k in steps]


def _interrupted_run(cfg: Config) -> str:
    """The job's MLflow run as a Ctrl-C leaves it: KILLED, its error tag set."""
    uri = tracking.default_tracking_uri(cfg)
    run_id, resumed = tracking.open_run(cfg, _storage_path(cfg), uri)
    assert not resumed
    tracking.set_tags(uri, run_id, {RAY_RUN_NAME_TAG: cfg.run.name})
    tracking.finish_run(uri, run_id, ok=False, error="interrupted", status="KILLED")
    return run_id


def _found(cfg: Config, run_id: str) -> dict:
    run = tracking.run_info(tracking.default_tracking_uri(cfg), run_id)
    return {"run_id": run_id, "status": run.info.status, "ray_run_name": cfg.run.name,
            "params": dict(run.data.params),
            "tags": {k: v for k, v in run.data.tags.items() if k.startswith("elastic_ddp.")}}


def _train_cli(cfg: Config, tmp: Path, capsys, *overrides: str) -> tuple[int, str]:
    import ray

    from elastic_ddp.driver.cli import main

    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    args = ["train", str(path), "--no-progress"]
    for o in overrides:
        args += ["--set", o]
    rc = main(args)
    out, err = capsys.readouterr()
    assert not ray.is_initialized()  # refused before Ray
    return rc, out + err


def _unchanged(cfg: Config, run_id: str) -> None:
    run = tracking.run_info(tracking.default_tracking_uri(cfg), run_id)
    assert run.info.status == "KILLED", run.info.status
    assert run.data.tags.get("elastic_ddp.error") == "interrupted"


def test_every_checkpoint_damaged_is_refused_before_ray_naming_each_and_the_fix(
        digits_data, tmp_path, mlflow_store, capsys):
    cfg = _cfg(digits_data, tmp_path)
    run_id = _interrupted_run(cfg)
    ckpts = _checkpoints(cfg, [5, 10])
    (ckpts[0] / "__0_0.distcp").write_bytes(b"")                       # truncated to 0
    shard = ckpts[1] / "__0_0.distcp"
    shard.write_bytes(b"\0" * shard.stat().st_size)                     # zeroed, same size
    rc, console = _train_cli(cfg, tmp_path, capsys)
    assert rc == 2, console[-3000:]
    (line,) = [ln for ln in console.splitlines() if "resume refused" in ln]
    assert line.startswith(f"elastic-ddp: resume refused: no checkpoint of run '{RUN}' verifies: ")
    assert f"{ckpts[1]}: __0_0.distcp (xxh3_64 " in line and f"{ckpts[0]}: __0_0.distcp (0 bytes" in line
    assert line.endswith(FIX), line
    _unchanged(cfg, run_id)
    assert not list((tmp_path / "ray_results" / RUN).glob(f"*/{REJECTED}"))  # nothing marked


def test_a_changed_model_is_refused_naming_the_field_and_the_run_stays_resumable(
        digits_data, tmp_path, mlflow_store, capsys):
    cfg = _cfg(digits_data, tmp_path)
    run_id = _interrupted_run(cfg)
    _checkpoints(cfg, [5])
    rc, console = _train_cli(cfg, tmp_path, capsys, "model.kwargs={hidden: 64}")
    assert rc == 2, console[-3000:]
    (line,) = [ln for ln in console.splitlines() if "resume refused" in ln]
    assert f"run '{RUN}' cannot resume with this config" in line
    assert "in model.kwargs.hidden 32 -> 64;" in line, line
    assert "Resume it with its own config" in line and "or set another run.name" in line
    _unchanged(cfg, run_id)


def test_what_may_change_on_resume_is_warned_about_and_recorded(digits_data, tmp_path, mlflow_store,
                                                                 capsys):
    cfg = _cfg(digits_data, tmp_path)
    run_id = _interrupted_run(cfg)
    _checkpoints(cfg, [5, 10])
    found = _found(cfg, run_id)
    storage, fp = _storage_path(cfg), _fingerprint(cfg)
    ok = check_resume(cfg, found, storage, fp, lambda: _model(cfg))
    assert ok.step == 10 and ok.changes == {} and ok.events == [] and ok.tags == {}
    assert "warning" not in capsys.readouterr().err

    changed = _cfg(digits_data, tmp_path, {"optim": {"lr": 0.001}, "train": {"log_every_steps": 2}})
    out = check_resume(changed, found, storage, fp, lambda: _model(changed))
    assert out.changes == {"optim.lr": ("0.01", "0.001"), "train.log_every_steps": ("5", "2")}
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"elastic-ddp: warning: run '{RUN}' resumes from step 10 with a changed "
                           "config: optim.lr 0.01 -> 0.001, train.log_every_steps 5 -> 2;"), line
    (ev,) = out.events
    assert ev["type"] == "config_change" and ev["changes"]["optim.lr"] == ["0.01", "0.001"]
    assert out.tags == {CONFIG_CHANGES_TAG: "at step 10: optim.lr 0.01 -> 0.001, train.log_every_steps 5 -> 2"}

    for extra, needle in (({"train": {"epochs": 9}}, "train.epochs 4 -> 9"),
                          ({"optim": {"name": "sgd"}}, "optim.name adamw -> sgd"),
                          ({"batch": {"global_batch_size": 32}}, "batch.global_batch_size 64 -> 32")):
        with pytest.raises(ResumeError, match="cannot resume with this config") as e:
            check_resume(_cfg(digits_data, tmp_path, extra), found, storage, fp, lambda: _model(cfg))
        assert needle in str(e.value), str(e.value)
    # The order of the samples: refused, unless the epoch may restart.
    with pytest.raises(ResumeError, match=r"other data or another sample order \(data.shuffle_window_rows "
                                          r"65536 -> 4096\).*data.on_change=restart_epoch"):
        check_resume(_cfg(digits_data, tmp_path, {"data": {"shuffle_window_rows": 4096}}), found,
                     storage, fp, lambda: _model(cfg))
    restart = _cfg(digits_data, tmp_path, {"data": {"shuffle_window_rows": 4096, "on_change": "restart_epoch"}})
    out = check_resume(restart, found, storage, fp, lambda: _model(cfg))
    assert out.changes["data.shuffle_window_rows"] == ("65536", "4096")
    capsys.readouterr()


def test_a_run_without_a_checkpoint_is_compared_with_its_params(digits_data, tmp_path, mlflow_store):
    cfg = _cfg(digits_data, tmp_path)
    run_id = _interrupted_run(cfg)
    (tmp_path / "ray_results" / RUN).mkdir(parents=True)
    found = _found(cfg, run_id)
    with pytest.raises(ResumeError, match=r"its MLflow run .* in model.kwargs.hidden 32 -> 16;"):
        check_resume(_cfg(digits_data, tmp_path, {"model": {"kwargs": {"hidden": 16}}}), found,
                     _storage_path(cfg), _fingerprint(cfg), lambda: None)
    assert check_resume(cfg, found, _storage_path(cfg), _fingerprint(cfg), lambda: None).path is None


def test_a_model_whose_code_changed_is_refused_naming_the_parameter(digits_data, tmp_path, mlflow_store):
    cfg = _cfg(digits_data, tmp_path)
    run_id = _interrupted_run(cfg)
    _checkpoints(cfg, [5])
    other = _model(_cfg(digits_data, tmp_path, {"model": {"kwargs": {"hidden": 16}}}))  # the same config
    with pytest.raises(ResumeError, match=r"does not fit this job's model \(features.0.0.weight: "
                                          r"\[16, 1, 3, 3\] in the checkpoint, \[8, 1, 3, 3\] here;.*"
                                          r"or set another run.name$"):
        check_resume(cfg, _found(cfg, run_id), _storage_path(cfg), _fingerprint(cfg), lambda: other)


def test_a_damaged_newest_checkpoint_is_warned_about_once_and_never_tried_again(
        digits_data, tmp_path, mlflow_store, capfd):
    from elastic_ddp.parallel.strategies import build_strategy

    cfg = _cfg(digits_data, tmp_path)
    run_id = _interrupted_run(cfg)
    ckpts = _checkpoints(cfg, [5, 10])
    shard = ckpts[1] / "__0_0.distcp"
    good = shard.read_bytes()
    shard.write_bytes(b"\0" * len(good))
    args = (_found(cfg, run_id), _storage_path(cfg), _fingerprint(cfg), lambda: _model(cfg))
    out = check_resume(cfg, *args)
    assert out.path == str(ckpts[0]) and out.step == 5
    (line,) = capfd.readouterr().err.splitlines()
    assert line == (f"elastic-ddp: warning: checkpoint {ckpts[1]} fails its checksums: __0_0.distcp "
                    f"(xxh3_64 {line.split('xxh3_64 ')[1].split(',')[0]}, the manifest says "
                    f"{json.loads((ckpts[1] / 'manifest.json').read_text())['files']['__0_0.distcp']['xxh3_64']}); "
                    "trying the previous checkpoint")
    assert [e["type"] for e in out.events] == ["checkpoint_rejected"]
    assert json.loads((ckpts[1] / REJECTED).read_text())["bad_files"][0].startswith("__0_0.distcp (xxh3_64")
    # Again: no warning, no event; the workers' restore never tries it.
    again = check_resume(cfg, *args)
    assert again.path == str(ckpts[0]) and again.events == [] and capfd.readouterr().err == ""
    mgr = CheckpointManager(_storage_path(cfg), RUN, None, 0, 1, collective=False, log=lambda m: None)
    capfd.readouterr()
    state, path = mgr.restore(build_strategy(cfg, _model(cfg), torch.device("cpu"), 1))
    assert path == str(ckpts[0]) and state["progress"]["step"] == 5
    assert "fails its checksums" not in capfd.readouterr().err
    # Restored from a copy: it verifies in full again, its mark goes, it is the newest.
    shard.write_bytes(good)
    assert check_resume(cfg, *args).path == str(ckpts[1]) and not (ckpts[1] / REJECTED).exists()
    shutil.rmtree(ckpts[0])
