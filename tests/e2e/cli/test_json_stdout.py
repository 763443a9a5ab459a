"""``elastic-ddp train --json``: standard output is the JSON document and nothing else,
whatever else writes to file descriptor 1 during the job.

The job runs as a user runs it (the ``elastic-ddp`` command, stdout piped) with eight
workers on one node, where Ray's raylet warns from the driver's thread that more worker
processes started than its start-up concurrency expects (``WARNING: 8 PYTHON worker
processes have been started ...``, in colour), and a user task module that prints at
import through ``print`` and through a raw ``os.write(1, ...)``, as a C++ library does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import TASK, user_config, write_task

TASK_THAT_PRINTS = (
    "import os\n"
    "print('hello from the task module')\n"
    "os.write(1, b'a raw line on file descriptor 1\\n')\n"
) + TASK


def _cli() -> list[str]:
    exe = Path(sys.executable).with_name("elastic-ddp")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "elastic_ddp"]


# Eight workers: about 110 s on a busy 2-core machine (the slow tier); two: the task
# module's writes alone, in the default suite.
@pytest.mark.ray
@pytest.mark.parametrize("workers", [2, pytest.param(8, marks=pytest.mark.slow)])
def test_json_stdout_is_one_document(digits_data, tmp_path, workers):
    task = write_task(tmp_path, TASK_THAT_PRINTS)
    raw = user_config(digits_data, tmp_path, task, {
        # Workers on one node: fractional CPUs, so that eight fit any machine.
        "scaling": {"min_workers": workers, "max_workers": workers, "cpus_per_worker": 0.25},
        "data": {"partitions": 8},
        "batch": {"global_batch_size": 64, "micro_batch_size": 8},
        "train": {"epochs": 1, "max_steps": 3, "checkpoint_every_steps": 100},
    })
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "ELASTIC_DDP_RAY_LOGS")}
    p = subprocess.run([*_cli(), "train", str(cfg), "--json", "--no-progress"],
                       capture_output=True, text=True, timeout=540, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    # Exactly one JSON document: json.loads refuses anything before or after it.
    summary = json.loads(p.stdout)
    assert summary["steps"] == 3 and summary["run_id"], summary
    assert "\x1b[" not in p.stdout
    # What was printed still shows, on stderr: the task module's lines, the config, the
    # run line (and, on a machine with fewer cores than workers, Ray's raylet warning).
    for line in ("hello from the task module", "a raw line on file descriptor 1",
                 "elastic-ddp config", f"MLflow run {summary['run_id']}"):
        assert line in p.stderr, p.stderr[-3000:]
    if "worker processes have been started" in p.stderr:
        print("Ray's raylet warning went to stderr")
