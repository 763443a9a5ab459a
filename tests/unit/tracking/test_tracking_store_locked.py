"""The MLflow store locked by another process for longer than MLflow's own busy timeout:
the tracker buffers and writes every metric once the lock is gone, counting the delayed
values and the outage, and the driver's closing calls wait instead of raising. A real
sqlite store and a real process holding ``BEGIN EXCLUSIVE``."""

from __future__ import annotations

import time

from helpers import hold_sqlite_lock


def test_a_locked_store_delays_metrics_and_the_drivers_calls_but_loses_nothing(tmp_path, capsys, mlflow_store):
    """The sqlite store locked for 25 s (longer than MLflow's own 20 s busy timeout):
    the tracker buffers and writes every metric later, counting each delayed value once
    and the outage's length; the driver's closing calls retry instead of raising."""
    from mlflow.tracking import MlflowClient

    from elastic_ddp import tracking
    from elastic_ddp.tracking import JobTracker

    db = tmp_path / "mlflow.db"
    uri = mlflow_store
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("t", artifact_location=str(tmp_path / "a"))).info.run_id
    tracker = JobTracker(uri, run_id, flush_period_s=0.2)
    tracker.log_metrics({"train_loss": 1.0}, 1)
    assert tracker.flush(30)
    lock = hold_sqlite_lock(db, 25)
    for step in range(2, 7):
        tracker.log_metrics({"train_loss": 1.0 / step, "lr": 0.1}, step)
        time.sleep(0.5)
    tracking.finish_run(uri, run_id, ok=True)   # waits out the lock, retrying
    released = float(lock.stdout.readline().split()[1])
    lock.wait(10)
    assert tracker.flush(60)
    snap = tracker.snapshot()
    assert snap["delayed"] == 10 and snap["dropped"] == 0 and snap["pending"] == 0, snap
    assert snap["unavailable_s"] >= 15 and "locked" in snap["last_error"], snap
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.end_time / 1000 >= released - 1
    assert [s for s, _ in tracking.metric_history(uri, run_id, "train/loss")] == [1, 2, 3, 4, 5, 6]
    assert "MLflow store unavailable (close run" in capsys.readouterr().err
