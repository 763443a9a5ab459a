"""A Ray Train worker of a ``data.reader: dataloader`` job killed with SIGKILL (as the
fault and soak tests kill them, as the OOM killer does): its DataLoader forkserver and
workers end within seconds, and the job restarts and finishes. Before, each killed
trainer left its forkserver (parent pid 1) and its workers, ~360 MB each, running.
A real local Ray cluster, a real job, a real signal."""

from __future__ import annotations

import os
import signal
import textwrap
import threading
import time

import pytest

from conftest import alive_train_workers, digits_config
from test_data_wait_warning import SLOW_TASK
from test_data_workers import gone_within, processes
from elastic_ddp.config import Config
from elastic_ddp import train


def _reading_trainer() -> tuple[int, int, list[int]] | None:
    """(a Ray Train worker, its forkserver, the forkserver's workers) once one reads."""
    procs = processes()
    for pid in alive_train_workers():
        servers = [p for p, (pp, _, cmd) in procs.items() if pp == pid and "forkserver import main" in cmd]
        for s in servers:
            workers = [p for p, (pp, st, _) in procs.items() if pp == s and st != "Z"]
            if len(workers) == 2:
                return pid, s, workers
    return None


@pytest.mark.slow
def test_a_killed_trainer_leaves_no_forkserver_or_data_workers(ray_cluster, digits_data, tmp_path,
                                                               mlflow_store):
    task_file = tmp_path / "slow_task.py"
    task_file.write_text(textwrap.dedent(SLOW_TASK))
    raw = digits_config(digits_data, tmp_path, {
        # Windows of 128 rows: several rounds per epoch, so each attempt's DataLoader
        # workers start after its first step (the first round is read in the trainer's
        # process).
        "data": {"reader": "dataloader", "shuffle_window_rows": 128}, "run": {"name": "forkserver-kill"},
        "train": {"epochs": 1, "checkpoint_every_steps": 5}, "scaling": {"max_failures": 1}})
    raw["task"]["path"] = f"{task_file}:SlowDigits"
    raw["model"].pop("name")
    raw["task"]["kwargs"]["sleep_per_loss"] = 0.2  # 23 steps of at least 0.4 s
    result: dict = {}

    def run():
        try:
            result["summary"] = train(Config.from_dict(raw), progress=False)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            result["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    found = None
    deadline = time.monotonic() + 300
    while found is None and th.is_alive() and time.monotonic() < deadline:
        found = _reading_trainer()
        time.sleep(0.2)
    assert found is not None, result
    trainer, server, workers = found
    os.kill(trainer, signal.SIGKILL)
    t0 = time.monotonic()
    left = gone_within([server, *workers], 10)
    assert left == [], {p: processes().get(p) for p in left}
    print(f"forkserver and {len(workers)} workers gone {time.monotonic() - t0:.1f} s after the kill")
    th.join(600)
    assert not th.is_alive()
    if "error" in result:
        raise result["error"]
    assert result["summary"].restarts == 1 and result["summary"].steps == 23
