"""The experiment scripts stay runnable: the torchrun baseline of the overhead benchmark
runs on real Parquet under real ``torchrun`` (no Ray) and trains the job it claims to."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import pycode_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_torchrun_baseline_runs_the_same_job(pycode_data, tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(pycode_config(pycode_data, tmp_path)))
    torchrun = Path(sys.executable).with_name("torchrun")
    out = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node=2",
         str(ROOT / "experiments" / "torchrun_baseline.py"), str(cfg),
         "--warmup-steps", "2", "--set", "train.max_steps=6"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("BASELINE_RESULT "))
    res = json.loads(line.split(" ", 1)[1])
    assert res["world_size"] == 2 and res["steps"] == 6
    assert res["samples_per_s"] > 0 and 0 <= res["data_wait_frac"] < 1
    # A byte-level model starts near ln(256) = 5.55 nats and must be learning by step 6.
    assert 0 < res["last_loss"] < 5.5, res


def test_the_restart_cpu_figure_counts_a_childs_cpu_in_its_window_only():
    """``experiments/cpu_windows.TreeCpu`` (bench_recovery's CPU per restart): a child
    process that spins for about a second of CPU is counted in the window that holds it,
    under its kind, and not in a window before it started."""
    import os
    import time

    sys.path.insert(0, str(ROOT / "experiments"))
    from cpu_windows import TreeCpu

    cpu = TreeCpu(os.getpid(), interval_s=0.05)
    t0 = time.time()
    time.sleep(0.3)
    t1 = time.time()
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass\ntime.sleep(0.3)"
    subprocess.run([sys.executable, "-c", "import sys; exec(sys.argv[1])", spin, "JobTracker"], timeout=60)
    t2 = time.time()
    cpu.stop()
    got = cpu.by_kind([(t0, t1), (t1, t2)])
    assert 0.8 < got["tracker"][1] < 1.5 and got.get("tracker", [0.0])[0] == 0.0, got
    assert got["all"][1] >= got["tracker"][1], got
