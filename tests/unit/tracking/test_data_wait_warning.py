"""The data-wait warning: when the training step waits for its data, the console and the
MLflow run say so once per run, with the fix (``elastic_ddp.tracking.data_wait``, raised
by the tracker, printed by the driver's ``ProgressDisplay``): one short console line (the
numbers, the first fix, the troubleshooting section with the others), the full text in
the run's tag and ``warnings/data_wait.txt``.

Fast, no Ray: the watch's rule (median of the last 5 logged windows above 10 %; one
spike is not enough; once only; a restart starts the window again; never in a run that
had it), the tracker's record of it, and the troubleshooting section the line names.

Ray: two CLI jobs on digits, on a real local cluster with a real sqlite MLflow store. A
task whose transform sleeps 20 ms per training row (its data is slower than its step)
prints the warning exactly once with the fix and tags the run; the same task without
the sleep in its transform, whose step takes a few tens of ms (its loss sleeps), on the
default windows (read ahead of the steps), does neither.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import digits_config, mlflow_runs
from helpers.slow_task import SLOW_TASK
from elastic_ddp.tracking.data_wait import DATA_WAIT_TAG, DOC, THRESHOLD, WINDOW, DataWaitWatch

FIXES = ("more CPUs", "data.read_tasks", "data.task_cpus", "CPU-only node", "data.read_ahead_mib",
         "data.block_rows")


def _feed(watch: DataWaitWatch, fracs, start: int = 2, every: int = 2) -> list[tuple[int, str]]:
    fired = []
    for i, f in enumerate(fracs):
        step = start + i * every
        msg = watch.add({"data_wait_frac": f, "step_time_s": 0.1, "train_loss": 1.0}, step)
        if msg is not None:
            fired.append((step, msg))
    return fired


def test_fires_once_when_the_median_of_five_windows_is_above_the_threshold():
    assert (THRESHOLD, WINDOW) == (0.10, 5)
    watch = DataWaitWatch()
    fired = _feed(watch, [0.5, 0.4, 0.3, 0.6, 0.35, 0.7, 0.8, 0.9])
    assert len(fired) == 1
    step, msg = fired[0]
    assert step == 10                                     # the fifth logged window
    assert "40% of step time" in msg and "steps 2-10" in msg and "threshold is 10%" in msg
    assert all(f in msg for f in FIXES), msg
    assert watch.fired["data_wait_frac"] == pytest.approx(0.4)
    # The console line: the numbers, the first fix, where the others are; a few hundred
    # characters, not the whole paragraph.
    line = watch.fired["message"]
    assert "40% of step time" in line and "steps 2-10" in line and "threshold 10%" in line
    assert "First fix: more read and transform processes per rank (data.read_tasks)" in line
    assert line.endswith(f"more fixes: {DOC}") and len(line) < 350 < len(msg), (len(line), len(msg))


def test_the_line_names_a_troubleshooting_section_that_exists():
    doc, anchor = DOC.split("#")
    headings = [ln.lstrip("#").strip() for ln in (Path(__file__).resolve().parents[3] / doc)
                .read_text().splitlines() if ln.startswith("#")]
    # GitHub's anchor of a heading: lower case, spaces to '-', punctuation dropped.
    anchors = {"".join(c for c in h.lower().replace(" ", "-") if c.isalnum() or c in "-_") for h in headings}
    assert anchor in anchors, headings


def test_a_step_bound_run_with_pipeline_starts_does_not_fire():
    # One window in five pays an epoch's pipeline start (or a restart's): the median
    # stays low. Fewer than five windows never fire. Records without the key are ignored.
    watch = DataWaitWatch()
    assert not _feed(watch, [0.9, 0.01, 0.02, 0.01, 0.03, 0.95, 0.02, 0.01, 0.02, 0.01])
    assert watch.add({"val_loss": 1.0}, 30) is None
    assert not _feed(DataWaitWatch(), [0.9, 0.9, 0.9, 0.9])
    # Exactly at the threshold is not above it.
    assert not _feed(DataWaitWatch(), [THRESHOLD] * 8)


def test_a_run_that_had_the_warning_does_not_get_it_again():
    # A resumed run whose tag says an earlier submission gave it (tracking.opener).
    watch = DataWaitWatch()
    watch.given()
    assert not _feed(watch, [0.9] * 10)


def test_a_restart_starts_the_window_again():
    watch = DataWaitWatch()
    assert not _feed(watch, [0.5, 0.5, 0.5], start=2)           # steps 2, 4, 6
    assert not _feed(watch, [0.5, 0.5], start=4)                # re-logged from step 4
    assert len(_feed(watch, [0.5, 0.5, 0.5], start=8)) == 1     # five since the restart
    with pytest.raises(ValueError):
        DataWaitWatch(threshold=1.5)


def test_the_tracker_keeps_the_warning_once_as_a_notice(tmp_path):
    from elastic_ddp.tracking.tracker import JobTracker

    t = JobTracker(f"sqlite:///{tmp_path / 'mlflow.db'}")       # unbound: nothing is written
    for step in range(2, 30, 2):
        t.log_metrics({"data_wait_frac": 0.6, "step_time_s": 0.2, "train_loss": 1.0}, step)
    notes = t.snapshot()["notices"]
    assert [n["kind"] for n in notes] == ["data_wait"] and notes[0]["step"] == 10
    assert t.get_notices(1) == [] and t.get_notices(0) == notes
    assert "waits for its data" in notes[0]["message"]
    # The run's tag in a real store: test_a_run_slower_in_its_data_than_its_step_says_so_once.


# --------------------------------------------------------------------------- Ray
def _run_cli(data: Path, tmp: Path, name: str, sleep_per_row: float, data_cfg: dict,
             capsys, sleep_per_loss: float = 0.0) -> tuple[str, object, list[float]]:
    from elastic_ddp.driver.cli import main

    task_file = tmp / "user_code" / "slow_task.py"
    task_file.parent.mkdir(parents=True, exist_ok=True)
    task_file.write_text(textwrap.dedent(SLOW_TASK))
    raw = digits_config(data, tmp, {
        "train": {"epochs": 1, "log_every_steps": 2, "checkpoint_every_steps": 100},
        "data": data_cfg, "run": {"name": name}})
    raw["task"]["path"] = f"{task_file}:SlowDigits"
    raw["model"].pop("name")                       # the task builds the model
    raw["task"]["kwargs"]["sleep_per_row"] = sleep_per_row
    raw["task"]["kwargs"]["sleep_per_loss"] = sleep_per_loss
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    rc = main(["train", str(path), "--no-progress"])
    out, err = capsys.readouterr()
    print(out[-2000:], err[-4000:])
    assert rc == 0
    (run,) = [r for r in mlflow_runs(tmp) if r.data.tags.get("mlflow.runName") == name]
    from mlflow.tracking import MlflowClient

    fracs = [m.value for m in MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
             .get_metric_history(run.info.run_id, "worker/data_wait_frac")]
    return out + err, run, sorted(fracs)


@pytest.mark.slow
def test_a_run_slower_in_its_data_than_its_step_says_so_once(ray_cluster, digits_data, tmp_path, capsys):
    # Small windows: the sleeping transform paces every step, not only the first.
    console, run, fracs = _run_cli(digits_data, tmp_path, "data-bound", 0.02,
                                   {"block_rows": 32, "shuffle_window_rows": 64}, capsys)
    lines = [ln for ln in console.splitlines() if "waits for its data" in ln]
    assert len(lines) == 1, console[-4000:]
    assert lines[0].startswith("elastic-ddp: warning: the training step waits for its data")
    assert "data.read_tasks" in lines[0] and lines[0].endswith(DOC) and len(lines[0]) < 400, lines[0]
    # The run's tag holds the whole text: every fix, the same numbers.
    tag = run.data.tags.get(DATA_WAIT_TAG, "")
    assert all(f in tag for f in FIXES), run.data.tags
    share = lines[0].split("data_wait is ")[1].split(" ")[0]
    assert f"data_wait is {share} of step time" in tag, (lines[0], tag)
    assert len(fracs) >= WINDOW and fracs[len(fracs) // 2] > THRESHOLD, fracs


@pytest.mark.slow
def test_a_step_bound_run_does_not_warn(ray_cluster, digits_data, tmp_path, capsys):
    # The default windows: each rank's pipeline reads ahead of its steps. The step takes
    # a few tens of ms (its loss sleeps): a step of the digits CNN alone takes about a
    # millisecond, where a scheduling hiccup of the shared cores is a tenth of the step.
    console, run, fracs = _run_cli(digits_data, tmp_path, "step-bound", 0.0, {}, capsys,
                                   sleep_per_loss=0.03)
    assert "waits for its data" not in console, console[-4000:]
    assert DATA_WAIT_TAG not in run.data.tags
    assert len(fracs) >= WINDOW and fracs[len(fracs) // 2] < THRESHOLD, fracs
