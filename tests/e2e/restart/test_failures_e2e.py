"""Inputs and failures that real jobs meet, end to end: real Ray jobs (the module's local
cluster, 2 gloo workers), real Parquet files, real sqlite MLflow stores, real SIGKILLs.
Cases are combined into few jobs, since each job pays Ray Train's start-up; the Ray-free
tests of the same behaviours are in the modules named for them (test_storage_paths,
test_scan_schema, test_validation_checks, test_failure_classification, test_ledger_audit,
test_data_fingerprint, test_tracking_store_locked, test_run_names, test_metric_names).

Default suite:
- one job on a storage path and data path with ' ', '#' and '?' and the run name
  'sweep #2', over files that differ in nullability, list child names and integer width
  plus a 'y=7/' directory, with a NaN row, one validation row for two workers, and rank 1
  SIGKILLed at step 3: it resumes from step 2 and finishes, the NaN step skipped by every
  rank, the failure's cause the dead rank;
- a rank killed at the same step on every attempt: stopped after two;
- a dead rank's position read on its node by a pinned task;
- a deleted MLflow experiment (exit 2) and Ctrl-C while Ray starts or during training
  (exit 130, run KILLED); the same command then resumes the interrupted one, its resume
  a recovery event of the run.
Slow (``-m slow``): a CLI job through a 25 s tracking-store lock; an fsdp job stopped by
consecutive inf steps, then resumed on changed data (refused, or the epoch restarted);
an error in evaluation and in the data read, each stopped after two attempts; ids
renumbered under a checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from conftest import global_order_ids, mlflow_runs
from helpers import (hold_sqlite_lock, mixed_dataset, sigkilled_rank, small_config,
                     write_rows)
from elastic_ddp.checkpoint.export import model_state
from elastic_ddp.driver.cli import main
from elastic_ddp.config import Config
from elastic_ddp import TrainingError, train
from elastic_ddp.ledger import audit, format_audit
from elastic_ddp.run_state import Diagnostics


def _client(tmp: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")


def _artifact(tmp: Path, run_id: str, path: str):
    with tempfile.TemporaryDirectory() as d:
        return json.loads(Path(_client(tmp).download_artifacts(run_id, path, d)).read_text())


def _cli(tmp: Path, raw: dict, capsys, *extra) -> tuple[int, str, str]:
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    rc = main(["train", str(path), "--no-progress", *extra])
    out, err = capsys.readouterr()
    print(out[-3000:], err[-3000:])
    return rc, out, err


def _assert_refused_before_work(rc: int, err: str, name: str, step: int) -> None:
    """A resume on changed training rows is refused by the driver before Ray starts
    (docs/checkpoints.md): exit 2, one line naming the checkpoint, the field and the
    fixes (Ray's log lines of the test's earlier job may share ``err``)."""
    assert rc == 2, err
    (line,) = [ln for ln in err.splitlines() if "resume refused" in ln]
    for needle in (f"elastic-ddp: resume refused: run '{name}'", f"checkpoint at step {step}",
                   "written on other data", "data.train_path", "data.on_change=restart_epoch",
                   "run.name"):
        assert needle in line, (needle, line)


# ----------------------------------- odd paths, mixed files, a NaN row, a killed rank
@pytest.mark.slow
def test_odd_paths_mixed_files_a_nan_row_one_val_row_and_a_killed_rank(ray_cluster, tmp_path, mlflow_store,
                                                                       capsys):
    base = tmp_path / "work #1 ?a b"
    data = base / "data #3 ?x"
    nan_id = 21
    ids = mixed_dataset(data / "train", x_fill={nan_id: float("nan")})
    # 65 rows: each epoch's last step holds 1 row, so rank 1's share of it is empty.
    write_rows(data / "train" / "d" / "tail.parquet", [64])
    ids.append(64)
    write_rows(data / "val" / "part-0.parquet", [1000])          # 1 val row, 2 workers
    storage = base / "ray results #1 ?q"
    raw = small_config(data, tmp_path, {
        "train": {"epochs": 2, "checkpoint_every_steps": 2, "log_every_steps": 1},
        "run": {"name": "sweep #2", "storage_path": str(storage)}})
    ledger = tmp_path / "ledger"
    marker = tmp_path / "fired"
    s = train(Config.from_dict(raw), diagnostics=Diagnostics(ledger_dir=str(ledger), fault={"rank": 1, "at_step": 3, "where": "step", "marker": str(marker)}), progress=False)
    assert marker.exists() and s.steps == 10, s

    # Checkpoints went to the directory named, and the restart resumed from them.
    ckpts = sorted((storage / "sweep #2").glob("checkpoint_step*"))
    assert ckpts and Path(s.checkpoint_path) == ckpts[-1], (ckpts, s.checkpoint_path)
    report = audit(ledger, ids, 2)
    print(format_audit(report))
    assert report["ok"], format_audit(report)
    assert [a["resumed_from"] for a in report["attempts"]] == [0, 2]

    # The cause is rank 1's death (signal, node, step), not rank 0's gloo error; the
    # restart counters and tag say 1.
    (ev,) = [e for e in s.events if e["type"] == "failure"]
    assert ev["cause_rank"] == 1 and ev["cause_kind"] == "died" and ev["step"] == 3, ev
    assert ev["signal"] == "SIGKILL" and ev["node"] == "127.0.0.1" and ev["pid"], ev
    assert "Connection" not in ev["cause"] and ev["last_checkpoint_step"] == 2, ev
    assert s.restarts == 1
    run = _client(tmp_path).get_run(s.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["elastic_ddp.restarts"] == "1" and run.data.tags["elastic_ddp.attempts"] == "2"

    # The NaN row's step was skipped by every rank, in both epochs, counted apart in the
    # ledger and in MLflow; the weights stayed finite.
    skipped = [e for e in report["epochs"].values() if e["skipped"]]
    assert len(skipped) == 2 and all(nan_id in e["skipped_ids"] for e in skipped), report["epochs"]
    assert all(a["skips_agree"] for a in report["attempts"])
    assert all(e["lost"] == 0 and e["repeated"] == 0 for e in report["epochs"].values())
    assert s.skipped_steps == 2
    hist = _client(tmp_path).get_metric_history(s.run_id, "worker/skipped_samples")
    assert max(m.value for m in hist) == sum(e["skipped"] for e in skipped)
    weights = model_state(s.checkpoint_path)
    assert all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point())
    # The console said so once, naming the row and its file; the run lists each skip of it.
    err = capsys.readouterr().err
    warned = [ln for ln in err.splitlines() if "had a NaN loss" in ln]
    assert len(warned) == 1 and warned[0].startswith("elastic-ddp: warning: step "), err[-3000:]
    assert "sample_id 21 (b/part-1.parquet row 5) had a NaN loss" in warned[0], warned
    assert "the step was skipped on every rank" in warned[0], warned
    assert run.data.tags["elastic_ddp.warning.nonfinite_loss"].endswith(
        "their steps skipped: sample_id 21; each in warnings/nonfinite_rows.json"), run.data.tags
    rows = _artifact(tmp_path, s.run_id, "warnings/nonfinite_rows.json")
    assert {r["epoch"] for r in rows} == {1, 2} and {r["sample_id"] for r in rows} == {nan_id}, rows
    assert all(r["file"] == "b/part-1.parquet" and r["row"] == 5 and r["loss"] == "nan" for r in rows)
    assert s.nonfinite["ids"] == [nan_id], s.nonfinite

    # The mixed files trained (labels from the files, never 7 from 'y=7/'), and
    # one validation row for two workers gave a finite validation loss.
    assert math.isfinite(s.metrics["val_loss"]) and s.metrics["val_acc"] in (0.0, 1.0), s.metrics


# ------------------------------------------------- a locked tracking store, skipped entries
# slow; test_tracking_store_locked holds the same 25 s lock on the tracker itself (default tier).
@pytest.mark.slow
def test_a_cli_job_finishes_through_a_25s_tracking_store_lock(ray_cluster, tmp_path, capsys):
    """Another process holds BEGIN EXCLUSIVE on the sqlite store for 25 s from step 3 on:
    the job finishes, every metric is in MLflow, the summary reports the delay. The CLI
    printed once what the scan did not read, and the run records it."""
    data = tmp_path / "data"
    for i in range(6):
        write_rows(data / "train" / f"part-{i}.parquet", range(16 * i, 16 * i + 16))
    elsewhere = tmp_path / "elsewhere"
    write_rows(elsewhere / "part-6.parquet", range(96, 112))
    write_rows(elsewhere / "part-7.parquet", range(112, 128))
    (data / "train" / "linked").symlink_to(elsewhere, target_is_directory=True)
    write_rows(data / "train" / ".staging" / "part-8.parquet", range(900, 916))
    (data / "train" / "_SUCCESS").write_text("")
    write_rows(data / "val" / "part-0.parquet", range(1000, 1008))
    raw = small_config(data, tmp_path, {
        # A checkpoint every step: each waits for the controller's poll (~0.5 s), so the
        # job is still training when the lock starts and ends inside it.
        "train": {"epochs": 2, "checkpoint_every_steps": 1, "log_every_steps": 1},
        "run": {"name": "locked"}})
    db = tmp_path / "mlflow.db"
    lock: dict = {}

    def lock_mid_run():
        deadline = time.time() + 400
        while time.time() < deadline:
            try:
                with sqlite3.connect(db, timeout=1) as c:
                    step = c.execute("SELECT max(step) FROM metrics WHERE key='train/loss'").fetchone()[0]
            except sqlite3.Error:
                step = None
            if step is not None and step >= 3:
                lock["t"] = time.time()
                p = hold_sqlite_lock(db, 25)
                lock["released"] = float(p.stdout.readline().split()[1])
                p.wait(10)
                return
            time.sleep(0.2)

    th = threading.Thread(target=lock_mid_run, daemon=True)
    th.start()
    rc, out, err = _cli(tmp_path, raw, capsys)
    th.join(60)
    assert rc == 0, err
    assert "released" in lock, "the lock never started"
    (run,) = mlflow_runs(tmp_path)
    assert run.info.status == "FINISHED"
    # Every step's metrics reached the store, also those logged while it was locked.
    hist = _client(tmp_path).get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in hist) == list(range(1, 17)), sorted(m.step for m in hist)
    during = [m for m in hist if lock["t"] <= m.timestamp / 1000 <= lock["released"]]
    assert during, "no step was logged while the store was locked"
    summary = _artifact(tmp_path, run.info.run_id, "summary.json")
    assert summary["tracking"]["delayed"] >= len(during) and summary["tracking"]["dropped"] == 0
    assert summary["tracking"]["unavailable_s"] >= 10, summary["tracking"]
    assert "tracking:" in out and "metric values delayed" in out
    # What the scan skipped: printed once, before training; recorded in the run.
    assert out.count("entries not read") == 1 and out.index("entries not read") < out.index("summary")
    for needle in (".staging/: hidden", "_SUCCESS: hidden", "8 Parquet file(s) read"):
        assert needle in out, (needle, out)
    skipped = _artifact(tmp_path, run.info.run_id, "data/skipped.json")
    assert any(".staging" in s for s in skipped["train"]) and run.data.tags["elastic_ddp.data_skipped"] == "2"


# ------------------------------------------------------- the same death on every attempt
@pytest.mark.slow
def test_a_rank_killed_at_the_same_step_every_attempt_stops_after_two(ray_cluster, tmp_path, mlflow_store):
    """Rank 1 is SIGKILLed inside step 3 on every attempt (as the OOM killer does): two
    attempts, not max_failures + 1; the error names the step, the rank and memory; the
    MLflow run is FAILED."""
    data = tmp_path / "data"
    write_rows(data / "train" / "part-0.parquet", range(64))
    write_rows(data / "val" / "part-0.parquet", range(100, 104))
    raw = small_config(data, tmp_path, {"scaling": {"max_failures": 3}, "run": {"name": "oom"}})
    marker = tmp_path / "fired"
    with pytest.raises(TrainingError) as e:
        train(Config.from_dict(raw), progress=False,
              diagnostics=Diagnostics(fault={"rank": 1, "at_step": 3, "where": "kill_always", "marker": str(marker)}))
    msg = str(e.value)
    print(msg)
    assert len(marker.read_text().splitlines()) == 2, marker.read_text()
    for needle in ("the same death at the same step on two attempts", "rank 1 died at step 3",
                   "SIGKILL", "memory", "marked FAILED"):
        assert needle in msg, (needle, msg)
    (run,) = mlflow_runs(tmp_path)
    assert run.info.status == "FAILED" and "rank 1 died at step 3" in run.data.tags["elastic_ddp.error"]
    events = [ev for ev in _artifact(tmp_path, run.info.run_id, "events/events.json")
              if ev["type"] == "failure"]
    assert [ev["decision"] for ev in events] == ["RETRY", "STOP (deterministic)"], events


# ----------------------------------------- non-finite steps, then data changed on resume
# slow: 40 s; the skip decision, its audit and the fingerprint check have Ray-free tests.
@pytest.mark.slow
def test_inf_steps_stop_then_a_resume_on_changed_data_is_refused_or_restarts_the_epoch(
        ray_cluster, tmp_path, capsys):
    """16 rows, 2 per step, fsdp, one validation row. Steps 3 and 4 hold inf rows: two
    non-finite steps in a row stop the job (exit 1, FAILED, not retried) after the
    step-3 checkpoint. The user fixes the rows and adds 8: the resubmission is refused
    before Ray starts (the checkpoint's cursor belongs to other data; exit 2, one line
    naming the field and the choices; the run left as it was), and with
    data.on_change=restart_epoch it keeps the weights, restarts the epoch and finishes
    with every id once per epoch."""
    data = tmp_path / "data"
    part = data / "train" / "part-0.parquet"
    write_rows(part, range(16))
    write_rows(data / "val" / "part-0.parquet", [1000])
    raw = small_config(data, tmp_path, {
        "parallel": {"strategy": "fsdp"},
        "batch": {"global_batch_size": 2, "micro_batch_size": 1, "policy": "fixed_global"},
        "train": {"epochs": 2, "checkpoint_every_steps": 1, "log_every_steps": 1,
                  "max_nonfinite_steps": 2},
        "scaling": {"max_failures": 3}, "run": {"name": "changed"}})
    order = global_order_ids(Config.from_dict(raw), data / "train", 0)
    inf_ids = {int(i): float("inf") for i in order[4:8]}                # steps 3 and 4
    write_rows(part, range(16), x_fill=inf_ids)

    rc, out, err = _cli(tmp_path, raw, capsys)
    assert rc == 1, err
    for needle in ("not retried", "failed at step 4", "NonFiniteError", "2 consecutive steps",
                   "train.max_nonfinite_steps"):
        assert needle in err, (needle, err)
    (run,) = mlflow_runs(tmp_path)
    assert run.info.status == "FAILED"
    first = [e for e in _artifact(tmp_path, run.info.run_id, "events/events.json") if e["type"] == "failure"]
    assert len(first) == 1 and first[0]["decision"] == "STOP (deterministic)", first

    write_rows(part, range(16))                                          # rows fixed
    write_rows(data / "train" / "part-1.parquet", range(16, 24))         # 8 rows added
    ckpts = sorted(p.name for p in (tmp_path / "ray_results" / "changed").glob("checkpoint_*"))
    rc, out, err = _cli(tmp_path, raw, capsys)
    _assert_refused_before_work(rc, err, "changed", 3)
    (again,) = mlflow_runs(tmp_path)  # the same run, left as it was
    assert again.info.run_id == run.info.run_id and again.info.status == "FAILED"
    assert again.data.tags.get("elastic_ddp.error") == run.data.tags.get("elastic_ddp.error")
    assert [e for e in _artifact(tmp_path, run.info.run_id, "events/events.json")
            if e["type"] == "failure"] == first
    assert sorted(p.name for p in (tmp_path / "ray_results" / "changed").glob("checkpoint_*")) == ckpts

    raw["data"]["on_change"] = "restart_epoch"
    raw["train"]["checkpoint_every_steps"] = 100
    ledger = tmp_path / "ledger"
    s = train(Config.from_dict(raw), diagnostics=Diagnostics(ledger_dir=str(ledger)), progress=False)
    report = audit(ledger, range(24), 2)
    print(format_audit(report))
    assert report["ok"] and [a["resumed_from"] for a in report["attempts"]] == [3]
    assert report["epochs"][0]["steps"] == 12 and s.steps == 3 + 12 + 12
    (run,) = mlflow_runs(tmp_path)
    assert run.info.run_id == s.run_id and run.info.status == "FINISHED"
    assert math.isfinite(s.metrics["val_loss"])                          # 1 val row, fsdp
    # Step 3's skip is in the step-3 checkpoint's counters (step 4's never committed).
    assert s.restarts == 1 and s.skipped_steps == 1


def test_a_dead_ranks_position_is_read_on_its_node_by_a_pinned_task(ray_cluster):
    """The controller reads a dead rank's position on the rank's node: directly on its
    own node, else by a zero-CPU task pinned there (forced here: one node)."""
    import ray

    from elastic_ddp.positions import position_dir, read_position

    pid = sigkilled_rank(1, 7, run="pinned")
    pos = read_position(ray.get_runtime_context().get_node_id(), pid, force_task=True)
    assert pos["step"] == 7 and pos["phase"] == "training step" and pos["rank"] == 1, pos
    assert pos["run"] == "pinned" and not (position_dir() / f"pid{pid}.json").exists()


# ------------------------------------------------------------- driver set-up and Ctrl-C
def test_a_deleted_experiment_exits_2_with_the_fix_and_creates_no_run(ray_cluster, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    data = tmp_path / "data"
    write_rows(data / "train" / "part-0.parquet", range(32))
    write_rows(data / "val" / "part-0.parquet", range(100, 104))
    raw = small_config(data, tmp_path)
    client = MlflowClient(raw["run"]["tracking_uri"])
    exp = client.create_experiment("tests")
    client.delete_experiment(exp)
    rc, out, err = _cli(tmp_path, raw, capsys)
    assert rc == 2, err
    for needle in ("config error", "run.experiment_name='tests'", f"experiment {exp}", "deleted",
                   f"mlflow experiments restore --experiment-id {exp}", "another name"):
        assert needle in err, (needle, err)
    assert client.search_runs([exp]) == [] and client.get_experiment(exp).lifecycle_stage == "deleted"


@pytest.mark.ray  # starts its own local Ray in the subprocess
def test_ctrl_c_while_ray_starts_leaves_no_running_run(tmp_path):
    """The job's MLflow run opens beside ray.init; a Ctrl-C (or any failure) before Ray is
    up must not leave it RUNNING: it is closed (KILLED) and the CLI exits 130."""
    data = tmp_path / "data"
    write_rows(data / "train" / "part-0.parquet", range(32))
    write_rows(data / "val" / "part-0.parquet", range(100, 104))
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(small_config(data, tmp_path)))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    p = subprocess.Popen([sys.executable, "-m", "elastic_ddp", "train", str(cfg), "--no-progress"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    db = tmp_path / "mlflow.db"
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        try:
            with sqlite3.connect(db, timeout=1) as c:
                if c.execute("SELECT count(*) FROM runs").fetchone()[0]:
                    break
        except sqlite3.Error:
            pass
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=120)
    print(out[-3000:])
    assert p.returncode == 130, out[-3000:]
    (run,) = mlflow_runs(tmp_path)
    assert run.info.status == "KILLED", run.info.status
    assert out.strip().endswith(f"elastic-ddp: interrupted (MLflow run {run.info.run_id} KILLED, "
                                "checkpoints kept); run the same command to resume it"), out[-3000:]


SLOW_LOSS_TASK = """
import time

from elastic_ddp.tasks.vision import CNNClassifier


class SlowLoss(CNNClassifier):
    '''The digits CNN whose loss takes 50 ms more: a job of 80 steps long enough to
    interrupt.'''

    def loss(self, model, batch):
        time.sleep(0.05)
        return super().loss(model, batch)
"""


@pytest.mark.slow
@pytest.mark.ray  # starts its own local Ray in the subprocess
def test_ctrl_c_during_training_exits_130_closes_the_run_killed_and_the_same_command_resumes(tmp_path):
    """A Ctrl-C in fit() (where Ray Train's own SIGINT handler would sys.exit(0), ending
    the command with status 1 and no word) aborts the controller, closes the run KILLED,
    and the CLI says "interrupted", names the run and how to resume, and exits 130. The
    same command then resumes the run from its checkpoint and finishes it; the resume is
    a recovery event of the run (summary line, events/recovery.json, recovery_s): the
    seconds from the command's start to its first step, the step it resumed at and the
    steps recomputed past it."""
    data = tmp_path / "data"
    write_rows(data / "train" / "part-0.parquet", range(32))
    write_rows(data / "val" / "part-0.parquet", range(100, 104))
    task = tmp_path / "user" / "slow_loss.py"
    task.parent.mkdir()
    task.write_text(SLOW_LOSS_TASK)
    raw = small_config(data, tmp_path, {
        "train": {"epochs": 40, "checkpoint_every_steps": 5, "log_every_steps": 1}})
    raw["task"]["path"] = f"{task}:SlowLoss"
    raw["model"] = {"kwargs": {"hidden": 8}}
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "elastic_ddp", "train", str(cfg)]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in p.stdout:  # progress lines, off a terminal: one every few seconds
        lines.append(line)
        if "step" in line and "/" in line and "epoch" in line:
            break
    assert p.poll() is None, "".join(lines)[-3000:]
    p.send_signal(signal.SIGINT)
    out = "".join(lines) + p.communicate(timeout=120)[0]
    print(out[-3000:])
    assert p.returncode == 130, out[-3000:]
    (run,) = mlflow_runs(tmp_path)
    assert run.info.status == "KILLED", run.info.status
    assert (f"elastic-ddp: interrupted (MLflow run {run.info.run_id} KILLED, checkpoints kept); "
            "run the same command to resume it") in out, out[-3000:]
    last_step = int(run.data.tags["elastic_ddp.last_step"])
    assert 0 < last_step < 80, last_step

    t_resume = time.time()
    again = subprocess.run(cmd + ["--no-progress"], env=env, capture_output=True, text=True, timeout=600)
    print(again.stdout[-3000:], again.stderr[-3000:])
    assert again.returncode == 0, again.stderr[-3000:]
    (run2,) = mlflow_runs(tmp_path)
    assert run2.info.run_id == run.info.run_id and run2.info.status == "FINISHED"
    summary = _artifact(tmp_path, run.info.run_id, "summary.json")
    (ev,) = [e for e in summary["events"] if e["type"] == "resume"]
    assert ev["cause"] == "interrupted" and ev["previous_status"] == "KILLED", ev
    # Resumed from a committed checkpoint: the cadence's (every 5 steps) or the one the
    # interrupted driver's stop committed at its last step's boundary (nothing recomputed).
    assert ev["last_step_seen"] == last_step, ev
    assert ev["resumed_at_step"] % 5 == 0 or ev["resumed_at_step"] == last_step, ev
    assert ev["resumed_at_step"] <= last_step and ev["steps_recomputed"] == last_step - ev["resumed_at_step"], ev
    assert 0 < ev["recovery_s"] < time.time() - t_resume and ev["t"] >= t_resume - 1, ev
    assert (f"  event: resume cause=interrupted recovery_s={ev['recovery_s']} "
            f"steps_recomputed={ev['steps_recomputed']}") in again.stdout, again.stdout[-3000:]
    table = _artifact(tmp_path, run.info.run_id, "events/recovery.json")
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    assert [(r["type"], r["recovery_s"], r["steps_recomputed"]) for r in rows] == [
        ("resume", ev["recovery_s"], ev["steps_recomputed"])], rows
    hist = _client(tmp_path).get_metric_history(run.info.run_id, "recovery_s")
    assert [(m.step, m.value) for m in hist] == [(ev["resumed_at_step"], ev["recovery_s"])], hist
    assert "elastic_ddp.last_step" not in run2.data.tags


# -------------------------------------- slow: errors in evaluation and the read, renumbered ids
EVAL_TASK = """
from elastic_ddp.tasks.vision import CNNClassifier


class BrokenEval(CNNClassifier):
    def evaluate(self, model, batch):
        out = super().evaluate(model, batch)
        return {"loss": out["loss"], "top5": out["top5"]}        # KeyError: no such metric
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["evaluation", "data read"])
def test_an_error_in_evaluation_or_the_data_read_stops_after_two_attempts(ray_cluster, tmp_path, where):
    """A task whose evaluate() fails, or a Parquet file whose footer is fine but whose
    second row group is corrupt (the scan passes, the read fails): the same error at the
    same step on two attempts stops the job, naming the phase and the step."""
    data = tmp_path / "data"
    write_rows(data / "train" / "part-0.parquet", range(32))
    write_rows(data / "train" / "part-1.parquet", range(32, 64))
    write_rows(data / "val" / "part-0.parquet", range(100, 104))
    raw = small_config(data, tmp_path, {"scaling": {"max_failures": 3}, "run": {"name": "det"}})
    if where == "evaluation":
        task = tmp_path / "user" / "broken.py"
        task.parent.mkdir()
        task.write_text(EVAL_TASK)
        raw["task"]["path"] = f"{task}:BrokenEval"
        raw["model"] = {"kwargs": {"hidden": 8}}
    else:
        corrupt_row_group(data / "train" / "part-1.parquet", 1, "y")
    with pytest.raises(TrainingError) as e:
        train(Config.from_dict(raw), progress=False)
    msg = str(e.value)
    print(msg)
    assert "the same error at the same step on two attempts" in msg and f"({where})" in msg, msg
    (run,) = mlflow_runs(tmp_path)
    assert run.info.status == "FAILED"
    events = [ev for ev in _artifact(tmp_path, run.info.run_id, "events/events.json") if ev["type"] == "failure"]
    assert [ev["decision"] for ev in events] == ["RETRY", "STOP (deterministic)"], events
    assert all(ev["phase"] == where for ev in events), events


def corrupt_row_group(path: Path, group: int, column: str) -> None:
    """Overwrite the data pages of ``column`` in row group ``group`` with garbage: the
    footer (all the scan reads of that column) stays valid."""
    md = pq.ParquetFile(path).metadata
    rg = md.row_group(group)
    col = next(rg.column(i) for i in range(rg.num_columns) if rg.column(i).path_in_schema == column)
    start = col.dictionary_page_offset or col.data_page_offset
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(b"\xff" * col.total_compressed_size)


@pytest.mark.slow
def test_a_resume_on_renumbered_ids_is_refused(ray_cluster, tmp_path, capsys):
    """Sibling of the rows-added case: the file rewritten with the same number of rows
    but renumbered ids under a checkpoint is refused the same way."""
    data = tmp_path / "data"
    part = data / "train" / "part-0.parquet"
    write_rows(part, range(16))
    write_rows(data / "val" / "part-0.parquet", [1000])
    raw = small_config(data, tmp_path, {
        "batch": {"global_batch_size": 2, "micro_batch_size": 1, "policy": "fixed_global"},
        "train": {"checkpoint_every_steps": 1}, "scaling": {"max_failures": 0},
        "run": {"name": "renumbered"}})
    with pytest.raises(TrainingError):
        train(Config.from_dict(raw), progress=False,
              diagnostics=Diagnostics(fault={"rank": 0, "at_step": 4, "where": "error", "marker": str(tmp_path / "m")}))
    (run,) = mlflow_runs(tmp_path)
    write_rows(part, range(100, 116))
    rc, out, err = _cli(tmp_path, raw, capsys)
    _assert_refused_before_work(rc, err, "renumbered", 3)
    (again,) = mlflow_runs(tmp_path)
    assert again.info.run_id == run.info.run_id and again.info.status == run.info.status == "FAILED"
