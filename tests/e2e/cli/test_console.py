"""What a person sees on the console when the output is piped to a file: no Ray-internal
lines (they go to Ray's session logs), no colour codes, the progress as sparse plain
lines with epochs counted from 1. A real driver process (subprocess, stdout and stderr
piped) starts a real local Ray through the launcher's ``init_ray`` and polls a real
actor with the launcher's ``ProgressDisplay``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

DRIVER = textwrap.dedent("""
    import time, ray
    from elastic_ddp.config import Config
    from elastic_ddp.driver.launcher import init_ray
    from elastic_ddp.driver.report import ProgressDisplay
    cfg = Config.from_dict({"data": {"train_path": "x"}, "model": {"name": "cnn"},
                            "scaling": {"min_workers": 1, "max_workers": 1}})
    init_ray(cfg)

    @ray.remote(num_cpus=0)
    class Tracker:  # the JobTracker's progress() contract: the latest raw metrics
        def __init__(self):
            self.t0 = time.time()
        def progress(self):
            step = min(40, int((time.time() - self.t0) * 20) + 1)
            return {"step": step, "epoch": 1 + (step - 1) // 20, "train_loss": 1.0 / step,
                    "samples_per_s": 100.0, "world_size": 1}

    tracker = Tracker.remote()
    ray.get(tracker.progress.remote())
    with ProgressDisplay(tracker, total_steps=40, period=0.1):
        time.sleep(3.5)
    from elastic_ddp.driver.local_ray import DRIVER_LOG
    logs = ray._private.worker._global_node.get_logs_dir_path()
    print("DRIVER_LOG=" + logs + "/" + DRIVER_LOG)
    ray.shutdown()
""")


def _run(env_extra: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "ELASTIC_DDP_RAY_LOGS")}
    env.update(env_extra)
    env.pop("TERM", None)
    return subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.slow
@pytest.mark.ray
def test_piped_console_has_no_ray_lines_and_no_colour_codes():
    p = _run({})
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr
    assert "\x1b[" not in out, out  # no ANSI escape codes off a terminal
    lines = [ln for ln in out.splitlines() if ln.strip()]
    log_line = [ln for ln in lines if ln.startswith("DRIVER_LOG=")]
    progress = [ln for ln in lines if not ln.startswith("DRIVER_LOG=")]
    # Only the progress lines: nothing from Ray (no "Token authentication", no
    # "Started a local Ray instance", no "(pid=...)" worker prefixes).
    assert progress and all(re.fullmatch(r"epoch [12] step \d+/40 loss \S+ 100 samples/s "
                                         r"world_size 1", ln) for ln in progress), out
    assert len(progress) <= 11  # sparse: about one line per tenth of the run
    assert progress[0].startswith("epoch 1 ")  # epochs counted from 1
    # What Ray said went to its session logs instead.
    driver_log = open(log_line[0].split("=", 1)[1]).read()
    assert "Started a local Ray instance" in driver_log


@pytest.mark.slow
@pytest.mark.ray
def test_ray_logs_flag_brings_rays_lines_back():
    p = _run({"ELASTIC_DDP_RAY_LOGS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Started a local Ray instance" in p.stdout + p.stderr


@pytest.mark.slow
@pytest.mark.ray
def test_a_jobs_console_counts_its_files_and_shows_no_torch_warning(tmp_path):
    """A whole ``elastic-ddp train`` as a user runs it, on a one-file data set: the run's
    line says "1 file", and the driver's single-process checkpoint read (the final
    model) prints no torch warning before the summary."""
    import yaml

    from helpers import small_config, write_rows

    data = tmp_path / "data"
    write_rows(data / "train" / "part-0.parquet", range(32))
    write_rows(data / "val" / "part-0.parquet", range(100, 104))
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(small_config(data, tmp_path, {
        "scaling": {"min_workers": 1, "max_workers": 1}})))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "ELASTIC_DDP_RAY_LOGS")}
    p = subprocess.run([sys.executable, "-m", "elastic_ddp", "train", str(cfg), "--no-progress"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "32 train rows in 1 file; 2 steps" in p.stdout, p.stdout
    assert "MLflow run:" in p.stdout, p.stdout  # the summary
    assert "torch.distributed is disabled" not in p.stdout + p.stderr, p.stderr
    assert "UserWarning" not in p.stdout + p.stderr, p.stderr
