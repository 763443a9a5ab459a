"""The experiment scripts stay runnable: the torchrun baseline of the overhead benchmark
runs on real Parquet under real ``torchrun`` (no Ray) and trains the job it claims to."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import pycode_config

ROOT = Path(__file__).resolve().parents[1]


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
