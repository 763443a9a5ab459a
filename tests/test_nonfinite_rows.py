"""A step skipped for a non-finite loss names the rows that made it (fast tier, no Ray):
the product's Trainer at world size 1 over real Parquet with one NaN feature row."""
from __future__ import annotations

import time

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
