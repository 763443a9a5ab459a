"""A resumed run keeps what its earlier submissions recorded: the real MLflow helper
process reopens the run in a real sqlite store, and a real tracker (in this process, as
the actor runs it) writes the next submission's records after the earlier ones.

- ``events/events.json`` and ``events/attempts.json`` hold every submission's entries;
  the previous submission's end (FAILED, its error) is a ``submission_end`` event, and
  the ``elastic_ddp.error`` tag is gone from the reopened run (a run that then finishes
  carries no stale error);
- the data-wait warning given by an earlier submission is not given again;
- ``warnings/nonfinite_rows.json`` lists the rows of every submission;
- the next submission's ``resume`` event names how the previous one ended and the step
  it had logged, and gets a recovery as a restart does (the same through a real Ctrl-C:
  test_failures_e2e.test_ctrl_c_during_training_exits_130_closes_the_run_killed_and_the_same_command_resumes).
"""

from __future__ import annotations

import json

import pytest

from conftest import digits_config
from helpers import open_request
from elastic_ddp import tracking
from elastic_ddp.config import Config
from elastic_ddp.tracking.data_wait import DATA_WAIT_TAG
from elastic_ddp.tracking.history import read_records
from elastic_ddp.tracking.opener import RunOpener
from elastic_ddp.tracking.tracker import JobTracker


def _open(cfg: Config, uri: str, storage: str) -> dict:
    opener = RunOpener(uri)
    opener.open(**open_request(cfg, uri, storage), system_metrics=False)
    try:
        return opener.result()
    finally:
        opener.finish()


def _submission(uri: str, opened: dict, step: int, data_bound: bool = False) -> JobTracker:
    """One submission's tracker: a worker-group start, a failure event, metrics; written."""
    t = JobTracker(uri, opened["run_id"], **opened["attempts"], history=opened["history"],
                   data_wait_given=opened["data_wait_given"])
    t.attempt(enter=1.0 + step, ready=2.0 + step, world_size=2)
    t.event({"type": "failure", "t": 10.0 + step, "index": 0, "cause": f"rank 1 died at step {step}"})
    for s in range(2, 14, 2):
        t.log_metrics({"data_wait_frac": 0.6 if data_bound else 0.0, "step_time_s": 0.2,
                       "train_loss": 1.0}, step + s)
    assert t.flush(30)
    return t


def test_a_resumed_run_appends_to_its_events_and_drops_the_stale_error(digits_data, tmp_path, mlflow_store):
    cfg = Config.from_dict(digits_config(digits_data, tmp_path))
    uri, storage = mlflow_store, str(tmp_path / "ray")
    first = _open(cfg, uri, storage)
    assert first["history"] == {} and first["data_wait_given"] is False
    t1 = _submission(uri, first, 10, data_bound=True)
    assert [n["kind"] for n in t1.snapshot()["notices"]] == ["data_wait"]
    tracking.finish_run(uri, first["run_id"], ok=False, error="training failed: rank 1 died at step 10",
                        status="FAILED")

    second = _open(cfg, uri, storage)
    assert second["resumed"] and second["run_id"] == first["run_id"]
    run = tracking.run_info(uri, second["run_id"])
    assert "elastic_ddp.error" not in run.data.tags and run.info.status == "RUNNING"
    assert second["data_wait_given"] is True and DATA_WAIT_TAG in run.data.tags
    # The previous end is an event of the run, written before its tag was removed.
    kept = read_records(uri, second["run_id"])["events"]
    assert [e["type"] for e in kept] == ["failure", "submission_end"]
    assert kept[1]["status"] == "FAILED" and kept[1]["cause"] == "training failed: rank 1 died at step 10"

    t2 = _submission(uri, second, 30, data_bound=True)
    assert t2.snapshot()["notices"] == []          # the run had its data-wait warning
    records = read_records(uri, second["run_id"])
    assert [(e["type"], e.get("cause")) for e in records["events"]] == [
        ("failure", "rank 1 died at step 10"), ("submission_end", "training failed: rank 1 died at step 10"),
        ("failure", "rank 1 died at step 30")]
    assert [a["enter"] for a in records["attempts"]] == [11.0, 31.0]
    # The summary's events are this submission's (the recovery table appends per submission).
    assert [e["cause"] for e in t2.snapshot()["events"]] == ["rank 1 died at step 30"]
    tracking.finish_run(uri, second["run_id"], ok=True)
    run = tracking.run_info(uri, second["run_id"])
    assert run.info.status == "FINISHED" and "elastic_ddp.error" not in run.data.tags
    assert json.loads(json.dumps(records["events"]))  # plain JSON


def test_reading_the_records_draws_no_progress_bar(digits_data, tmp_path, mlflow_store, capfd):
    cfg = Config.from_dict(digits_config(digits_data, tmp_path))
    opened = _open(cfg, mlflow_store, str(tmp_path / "ray"))
    _submission(mlflow_store, opened, 10)
    capfd.readouterr()
    assert len(read_records(mlflow_store, opened["run_id"])["events"]) == 1
    out, err = capfd.readouterr()
    assert "Downloading artifacts" not in out + err, err


def test_a_resume_is_a_recovery_event_from_its_start_to_its_first_step(digits_data, tmp_path, mlflow_store):
    """The previous submission closed KILLED at logged step 13 (``close_failed``'s tags);
    the next one reopens the run and resumes from the checkpoint of step 10: its resume
    event takes the cause and the step, and its recovery is the seconds from its start to
    its first step, 3 steps recomputed. A previous submission that never closed its run
    leaves the steps recomputed unknown."""
    from elastic_ddp.driver.report import recovery_events
    from elastic_ddp.tracking.history import LAST_STEP_TAG, resume_event

    cfg = Config.from_dict(digits_config(digits_data, tmp_path))
    uri, storage = mlflow_store, str(tmp_path / "ray")
    first = _open(cfg, uri, storage)
    _submission(uri, first, 0)
    tracking.finish_run(uri, first["run_id"], ok=False, error="interrupted", status="KILLED",
                        tags={LAST_STEP_TAG: 13})
    second = _open(cfg, uri, storage)
    assert LAST_STEP_TAG not in tracking.run_info(uri, second["run_id"]).data.tags
    end = second["history"]["events"][-1]
    assert (end["type"], end["status"], end["last_step_seen"]) == ("submission_end", "KILLED", 13), end
    t = 1_796_000_000.0
    ev = resume_event(second["history"], t)
    assert ev == {"type": "resume", "t": t, "last_step_seen": 13, "cause": "interrupted",
                  "previous_status": "KILLED"}, ev
    tr = JobTracker(uri, second["run_id"], history=second["history"])
    tr.event(ev)
    tr.attempt(enter=t + 20.0, ready=t + 24.0, world_size=2, resumed_from=10, committed_s=4.0)
    tr.attempt(first_step=t + 25.5, step=11)
    (rec,) = recovery_events(tr.snapshot())
    assert (rec["type"], rec["recovery_s"], rec["resumed_at_step"], rec["steps_recomputed"]) == \
        ("resume", 25.5, 10, 3), rec

    unknown = resume_event({"events": [{"type": "failure", "t": 1.0}]}, t)
    assert unknown["last_step_seen"] is None and "did not close its run" in unknown["cause"], unknown
    (rec,) = recovery_events({"events": [unknown], "attempts": tr.snapshot()["attempts"]})
    assert rec["recovery_s"] == 25.5 and rec["steps_recomputed"] is None, rec


@pytest.mark.slow
def test_a_resumed_run_keeps_the_earlier_rows_with_a_non_finite_loss(digits_data, tmp_path, mlflow_store):
    """warnings/nonfinite_rows.json lists the rows of every submission, and the count
    metric goes on from the earlier ones."""
    from mlflow.tracking import MlflowClient

    from elastic_ddp.tracking.nonfinite import row_report

    cfg = Config.from_dict(digits_config(digits_data, tmp_path))
    uri, storage = mlflow_store, str(tmp_path / "ray")
    first = _open(cfg, uri, storage)
    t1 = JobTracker(uri, first["run_id"], history=first["history"])
    t1.nonfinite_rows(row_report(3, 1, 0, 16, "sample_id", [21], [float("nan")]))
    assert t1.flush(30)
    tracking.finish_run(uri, first["run_id"], ok=False, error="interrupted", status="KILLED")

    second = _open(cfg, uri, storage)
    t2 = JobTracker(uri, second["run_id"], history=second["history"])
    t2.nonfinite_rows(row_report(9, 2, 1, 16, "sample_id", [40], [float("inf")]))
    assert t2.flush(30)
    rows = read_records(uri, second["run_id"])["nonfinite"]
    assert [(r["step"], r["sample_id"], r["loss"]) for r in rows] == [(3, 21, "nan"), (9, 40, "inf")], rows
    hist = MlflowClient(uri).get_metric_history(second["run_id"], "worker/nonfinite_loss_rows")
    assert sorted((m.step, m.value) for m in hist) == [(3, 1.0), (9, 2.0)], hist
