"""A global batch larger than the training split: the job would run one step per epoch
without a word; the driver warns once, naming both numbers and the fix, after the scan.
The CLI runs in this process against a ``RAY_ADDRESS`` nothing answers at, so it ends
(exit 2) right after the checks, before any Ray or MLflow start."""

from __future__ import annotations

import socket

import pytest

from helpers import nothing_started, run_cli, small_config, write_rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("global_batch,warned", [(5000, True), (32, False), (16, False)])
def test_a_global_batch_over_the_training_rows_is_warned_once(tmp_path, capsys, monkeypatch,
                                                              global_batch, warned):
    data = tmp_path / "data"
    write_rows(data / "train" / "part-0.parquet", range(32))
    write_rows(data / "val" / "part-0.parquet", range(100, 104))
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{_free_port()}")
    raw = small_config(data, tmp_path, {"batch": {"global_batch_size": global_batch}})
    rc, out, err = run_cli(tmp_path, raw, capsys)
    assert rc == 2 and "RAY_ADDRESS=" in err, err  # the checks passed; then no Ray
    warning = ("elastic-ddp: warning: batch.global_batch_size=5000 is more than the 32 training "
               "rows: every epoch is one step of all 32 rows; set batch.global_batch_size to at "
               "most 32, or train on more data")
    assert err.splitlines().count(warning) == (1 if warned else 0), err
    assert ("warning: batch.global_batch_size" in err) == warned, err
    nothing_started(tmp_path)


def test_under_scale_lr_the_largest_world_sizes_batch_counts(tmp_path, capsys, monkeypatch):
    """``scale_lr``: 12 rows a rank (24 / min_workers 2) make 48 rows a step at 4
    workers, more than 32; the fix is a global_batch_size whose step at 4 fits."""
    data = tmp_path / "data"
    write_rows(data / "train" / "part-0.parquet", range(32))
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{_free_port()}")
    raw = small_config(data, tmp_path, {
        "data": {"val_path": None},
        "batch": {"global_batch_size": 24, "micro_batch_size": 12, "policy": "scale_lr"},
        "scaling": {"min_workers": 2, "max_workers": 4}})
    rc, out, err = run_cli(tmp_path, raw, capsys)
    assert rc == 2, err
    assert ("elastic-ddp: warning: batch.global_batch_size=24 (48 rows a step at 4 workers, "
            "batch.policy=scale_lr) is more than the 32 training rows: every epoch is one step "
            "of all 32 rows; set batch.global_batch_size to at most 16, or train on more "
            "data") in err.splitlines(), err
