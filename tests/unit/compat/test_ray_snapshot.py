"""Ray Train's checkpoint list (``checkpoint_manager_snapshot.json``) against checkpoints
that are gone or incomplete (``elastic_ddp.compat.ray_snapshot``): such entries are taken
off the list, the rest stays as Ray Train wrote it and loads in Ray Train's own model;
its pruning skips a listed directory that is gone instead of failing."""

from __future__ import annotations

import json

import pyarrow.fs as pafs
import pytest

from elastic_ddp.compat.ray_snapshot import SNAPSHOT, drop_missing_checkpoints, skip_missing_deletes


def _entry(name: str, step: int) -> dict:
    return {"checkpoint_dir_name": name, "metrics": {"step": step}}


def _snapshot(run) -> dict:
    names = [f"checkpoint_step0000000{k}" for k in (4, 6, 8)]
    for n in names:
        (run / n).mkdir(parents=True)
        (run / n / "manifest.json").write_text("{}")
    state = {"ray_version": "2.60.0",
             "checkpoint_results": [_entry(n, k) for n, k in zip(names, (4, 6, 8))],
             "checkpoint_report_indices": [3, 5, 7],
             "latest_checkpoint_result": _entry(names[2], 8),
             "pending_training_results": [], "pending_validation_specs": [],
             "current_report_index": 8,
             "validated_checkpoint_dir_names": [names[0]],
             "timed_out_validation_checkpoint_dir_names": [],
             "failed_validation_checkpoint_dir_names": []}
    (run / SNAPSHOT).write_text(json.dumps(state))
    return state


def test_gone_and_incomplete_checkpoints_are_taken_off_ray_trains_list(tmp_path):
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import _CheckpointManagerState

    run = tmp_path / "run"
    before = _snapshot(run)
    import shutil

    shutil.rmtree(run / "checkpoint_step00000004")  # pruned by a job that lost the lease
    (run / "checkpoint_step00000008" / "manifest.json").unlink()  # a write cut short
    gone = drop_missing_checkpoints(pafs.LocalFileSystem(), str(run))
    assert gone == ["checkpoint_step00000004", "checkpoint_step00000008"]
    after = json.loads((run / SNAPSHOT).read_text())
    assert [r["checkpoint_dir_name"] for r in after["checkpoint_results"]] == ["checkpoint_step00000006"]
    assert after["checkpoint_report_indices"] == [5]
    assert after["latest_checkpoint_result"]["checkpoint_dir_name"] == "checkpoint_step00000006"
    assert after["validated_checkpoint_dir_names"] == []
    assert after["current_report_index"] == before["current_report_index"]
    _CheckpointManagerState.parse_obj(after)  # still Ray Train's format
    # A list whose checkpoints are all there is left as it was (not even rewritten).
    mtime = (run / SNAPSHOT).stat().st_mtime_ns
    assert drop_missing_checkpoints(pafs.LocalFileSystem(), str(run)) == []
    assert (run / SNAPSHOT).stat().st_mtime_ns == mtime


def test_no_snapshot_or_an_unreadable_one_is_left_alone(tmp_path):
    assert drop_missing_checkpoints(pafs.LocalFileSystem(), str(tmp_path)) == []
    (tmp_path / SNAPSHOT).write_text("{not json")
    assert drop_missing_checkpoints(pafs.LocalFileSystem(), str(tmp_path)) == []
    assert (tmp_path / SNAPSHOT).read_text() == "{not json"


def test_ray_trains_pruning_skips_a_listed_directory_that_is_gone(tmp_path, capsys):
    from ray.train.v2._internal.execution.checkpoint import checkpoint_manager as cm

    # Ray Train's own function, also where another test of this process (the controller
    # callbacks' set-up) has wrapped it already.
    current = cm.delete_fs_path
    original = getattr(current, "__wrapped__", current)
    cm.delete_fs_path = original
    try:
        with pytest.raises(FileNotFoundError, match="Path not found"):
            original(fs=pafs.LocalFileSystem(), fs_path=str(tmp_path / "gone"))
        skip_missing_deletes()
        cm.delete_fs_path(fs=pafs.LocalFileSystem(), fs_path=str(tmp_path / "gone"))
        assert "is gone already; its deletion skipped" in capsys.readouterr().out
        (tmp_path / "there").mkdir()
        cm.delete_fs_path(fs=pafs.LocalFileSystem(), fs_path=str(tmp_path / "there"))
        assert not (tmp_path / "there").exists()
    finally:
        cm.delete_fs_path = current


@pytest.mark.ray
@pytest.mark.slow  # a job killed, then resumed: about 2 minutes
def test_a_run_whose_listed_checkpoint_was_removed_resumes_from_the_newest_left(tmp_path, digits_data):
    """The CLI as a user runs it: a job killed after some checkpoints, the newest one that
    Ray Train lists removed (a cleanup, another job's pruning); the same command resumes
    from the newest left, saying which it took off the list, and finishes (Ray Train alone
    fails its controller on the snapshot: exit 1)."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import yaml

    from conftest import digits_config, mlflow_runs

    raw = digits_config(digits_data, tmp_path, {
        "scaling": {"min_workers": 1, "max_workers": 1},
        "train": {"epochs": 1, "max_steps": 200, "checkpoint_every_steps": 2, "log_every_steps": 2},
        "run": {"name": "listed"}})
    raw["data"]["val_path"] = None
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "elastic_ddp", "train", str(cfg), "--no-progress"]
    run = tmp_path / "ray_results" / "listed"
    a = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)

    def listed() -> list[str]:
        try:
            state = json.loads((run / SNAPSHOT).read_text())
        except (OSError, ValueError):
            return []
        return [r["checkpoint_dir_name"] for r in state["checkpoint_results"]]

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(listed()) < 2:
        time.sleep(0.2)
    a.send_signal(signal.SIGKILL)
    a.communicate()
    names = listed()
    assert len(names) >= 2, "no two checkpoints listed before the kill"
    time.sleep(1)
    names = listed()
    shutil.rmtree(run / names[-1])
    b = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=400)
    assert b.returncode == 0, b.stderr[-3000:]
    assert (f"checkpoint {names[-1]} listed by Ray Train but gone or incomplete: taken off its "
            "list") in b.stdout, b.stdout[-3000:]
    assert "(resumed)" in b.stdout
    runs = mlflow_runs(tmp_path)
    assert [r.info.status for r in runs] == ["FINISHED"], [r.info.status for r in runs]
