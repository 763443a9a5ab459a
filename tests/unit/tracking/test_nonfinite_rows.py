"""A step skipped for a non-finite loss names the rows that made it (fast tier, no Ray):
the product's Trainer at world size 1 over real Parquet with one NaN feature row; the
rows located in their files; the tracker's console warning (once per kind) and the MLflow
run's record of every row, in a real store. The same through a Ray job:
test_failures_e2e.test_odd_paths_mixed_files_a_nan_row_one_val_row_and_a_killed_rank."""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import pytest
import torch

from helpers import mixed_dataset, small_config


def _trainer(tmp_path, nan_id: int, extra: dict):
    from elastic_ddp.config import Config
    from elastic_ddp.driver.preflight import job_spec, prepare
    from elastic_ddp.ledger import LedgerWriter
    from elastic_ddp.worker.trainer import Trainer

    mixed_dataset(tmp_path / "data" / "train", x_fill={nan_id: float("nan")})
    raw = small_config(tmp_path / "data", tmp_path, extra)
    raw["data"].pop("val_path", None)
    cfg = Config.from_dict(raw)
    job = job_spec(cfg, prepare(cfg), tracker=None, t0=time.time(), storage=str(tmp_path / "ray_results"))
    t = Trainer(job, 0, 1, torch.device("cpu"))
    t.ledger = LedgerWriter(None, 0, None, 1, t.ft.ledger_mode)  # off
    return t


def test_a_skipped_step_names_the_row_with_a_nan_loss(tmp_path, capsys):
    t = _trainer(tmp_path, 21, {"train": {"max_nonfinite_steps": 3}})
    for _ in range(t.n_train // 16):
        t.train_step()
    out = capsys.readouterr().out
    assert t.counters.skipped_steps == 1, out
    assert "non-finite gradient, step skipped" in out
    assert "rank 0's rows with a non-finite loss: sample_id 21" in out, out


def test_the_non_finite_error_names_the_rows(tmp_path):
    from elastic_ddp.worker.trainer import NonFiniteError

    t = _trainer(tmp_path, 5, {"train": {"max_nonfinite_steps": 1}})
    with pytest.raises(Exception) as e:
        for _ in range(t.n_train // 16):
            t.train_step()
    err = e.value.__cause__ if not isinstance(e.value, NonFiniteError) else e.value
    assert isinstance(err, NonFiniteError), repr(e.value)
    assert "sample_id 5" in str(err) and "train.max_nonfinite_steps" in str(err), str(err)


def test_the_summary_lists_the_world_sizes_in_order_and_its_skipped_steps():
    from elastic_ddp.driver.report import Summary, format_summary

    s = Summary(run_id="r", tracking_uri="sqlite:///x.db", experiment_id="1", metrics={"val_loss": 1.0},
                steps=10, epochs=1, wall_s=5.0, world_sizes_seen=[2, 1, 2], restarts=2, goodput=0.5,
                skipped_steps=1)
    out = format_summary(s)
    assert "world sizes seen: 2 -> 1 -> 2   restarts: 2" in out, out
    assert "skipped steps:    1 (non-finite gradient)" in out, out


def test_a_log_window_of_skipped_steps_only_logs_no_train_loss(tmp_path):
    """A window whose every step was skipped has no applied rows: it logs no train loss
    (a 0.0 would be a loss the model never had); a window of applied steps logs one."""
    from elastic_ddp.metrics import StepWindow

    t = _trainer(tmp_path, 21, {"train": {"max_nonfinite_steps": 3}})
    seen = []
    for _ in range(t.n_train // 16):
        t.window = StepWindow()
        before = t.counters.skipped_steps
        t.train_step()
        seen.append((t.counters.skipped_steps > before, t.window.reduce(1, torch.device("cpu"))))
    assert [skipped for skipped, _ in seen].count(True) == 1
    for skipped, m in seen:
        assert ("train_loss" in m) is not skipped and ("train_acc" in m) is not skipped, m
        assert "lr" in m and "samples_per_s" in m


def test_the_rows_are_located_in_their_files(tmp_path):
    """Ids to (file relative to the data set, row in it) through the row groups' id
    ranges; an id the data set does not hold is left out."""
    import pyarrow.parquet as pq

    from elastic_ddp.data.scan import locate_ids, scan_parquet
    from helpers import task_columns

    root = tmp_path / "data" / "train"
    mixed_dataset(root)
    info = scan_parquet(root, dict(task_columns()))
    where = locate_ids(info, [21, 40, 63, 10_000])
    assert where == {21: ("b/part-1.parquet", 5), 40: ("y=7/part-2.parquet", 8),
                     63: ("c/part-3.parquet", 15)}, where
    for i, (f, row) in where.items():
        assert pq.read_table(root / f)["sample_id"][row].as_py() == i
    assert locate_ids(scan_parquet(root / "b" / "part-1.parquet", dict(task_columns())), [21]) == \
        {21: ("part-1.parquet", 5)}


def _report(step, epoch, rank, ids, losses, where=None):
    from elastic_ddp.tracking.nonfinite import row_report

    return row_report(step, epoch, rank, 16, "sample_id", ids, losses, where)


def test_the_console_warns_once_per_kind_and_the_run_lists_every_row(tmp_path, mlflow_store):
    """Three reports (a NaN row in two epochs, an infinite one between): one console
    notice per kind, naming the row, its file and what was done; the MLflow run counts
    every report (worker/nonfinite_loss_rows), sums them up in its tag and lists each in
    warnings/nonfinite_rows.json."""
    from mlflow.tracking import MlflowClient

    from elastic_ddp.tracking import JobTracker
    from elastic_ddp.tracking.nonfinite import NONFINITE_TAG

    client = MlflowClient(mlflow_store)
    run_id = client.create_run(client.create_experiment("t", artifact_location=str(tmp_path / "a"))).info.run_id
    tr = JobTracker(mlflow_store, run_id)
    tr.nonfinite_rows(_report(3, 1, 0, [21], [float("nan")], {21: ("b/part-1.parquet", 5)}))
    tr.nonfinite_rows(_report(4, 1, 1, [40], [float("inf")]))
    tr.nonfinite_rows(_report(7, 2, 0, [21], [float("nan")], {21: ("b/part-1.parquet", 5)}))
    notes = tr.get_notices(0)
    assert [n["kind"] for n in notes] == ["nonfinite_loss_nan", "nonfinite_loss_inf"], notes
    first = notes[0]["message"]
    assert first.startswith("step 3 (epoch 1): sample_id 21 (b/part-1.parquet row 5) had a NaN loss "
                            "(rank 0); the step was skipped on every rank, so none of its 16 rows "
                            "updated the model"), first
    assert "worker/nonfinite_loss_rows" in first and "warnings/nonfinite_rows.json" in first
    assert "sample_id 40 had a infinite loss" not in notes[1]["message"]
    assert notes[1]["message"].startswith("step 4 (epoch 1): sample_id 40 had an infinite loss"), notes[1]

    assert tr.flush(30)
    run = client.get_run(run_id)
    assert run.data.tags[NONFINITE_TAG].startswith(
        "3 row(s) with a non-finite loss, their steps skipped: sample_id 21, 40"), run.data.tags
    hist = client.get_metric_history(run_id, "worker/nonfinite_loss_rows")
    assert sorted((m.step, m.value) for m in hist) == [(3, 1.0), (4, 2.0), (7, 3.0)]
    with tempfile.TemporaryDirectory() as d:
        rows = json.loads(Path(client.download_artifacts(run_id, "warnings/nonfinite_rows.json", d)).read_text())
    assert rows == [
        {"step": 3, "epoch": 1, "rank": 0, "sample_id": 21, "loss": "nan", "file": "b/part-1.parquet", "row": 5},
        {"step": 4, "epoch": 1, "rank": 1, "sample_id": 40, "loss": "inf"},
        {"step": 7, "epoch": 2, "rank": 0, "sample_id": 21, "loss": "nan", "file": "b/part-1.parquet", "row": 5}]


def test_the_summary_names_the_rows_of_its_skipped_steps():
    from elastic_ddp.driver.report import Summary, format_summary, nonfinite_summary

    rows = [{"step": s, "epoch": 1, "rank": 0, "sample_id": i, "loss": "nan"}
            for s, i in [(3, 21), (5, 40), (9, 21)] + [(11 + k, 100 + k) for k in range(8)]]
    nf = nonfinite_summary(rows, "sample_id")
    assert nf == {"reported": 11, "distinct": 10, "ids": [21, 40, 100, 101, 102, 103, 104, 105],
                  "id_column": "sample_id"}
    s = Summary(run_id="r", tracking_uri="sqlite:///x.db", experiment_id="1", metrics={}, steps=20,
                epochs=1, wall_s=5.0, world_sizes_seen=[2], restarts=0, goodput=0.5,
                skipped_steps=11, nonfinite=nf)
    assert ("skipped steps:    11 (non-finite gradient; rows with a non-finite loss: sample_id 21, 40, "
            "100, 101, 102, 103, 104, 105 and 2 more, each in the run's warnings/nonfinite_rows.json)"
            ) in format_summary(s), format_summary(s)
