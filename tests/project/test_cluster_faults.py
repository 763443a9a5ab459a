"""experiments/cluster_faults.py's teardown of a local cluster while a job still runs in
a thread of the driver (a test that failed with its job running on): the job's actors
are killed and its thread has ended before ``ray.shutdown()``, and the driver process
lives on. Why: Ray can end a process, exit status 1, when it is reached from a thread
after ``ray.shutdown()`` ("The core worker has already been shutdown ... The process
will exit"); a test session stopped that way, without its summary, after one failed
test. Whether a thread left running triggers it depends on where the thread is inside
Ray at that moment, so the test checks that no job thread is left, not the exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import sys, threading, time
    from pathlib import Path
    sys.path.insert(0, {experiments!r})
    sys.path.insert(0, {tests!r})
    from cluster_faults import local_cluster
    from conftest import digits_config
    from elastic_ddp import train
    from elastic_ddp.config import Config
    from elastic_ddp.data.prepare import prepare_digits
    from elastic_ddp.run_state import Diagnostics

    tmp = Path({tmp!r})
    prepare_digits(tmp / "data", num_files=1, val_fraction=0.2, seed=0)
    ledger = tmp / "ledger"
    cfg = Config.from_dict(digits_config(tmp / "data", tmp, {{
        "train": {{"epochs": 50}}, "scaling": {{"min_workers": 1, "max_workers": 1}}}}))
    out = {{}}

    def run():
        try:
            out["summary"] = train(cfg, progress=False, diagnostics=Diagnostics(
                ledger_dir=str(ledger), fault={{"rank": -1, "at_step": 0, "where": "none", "step_s": 0.2}}))
        except BaseException as e:
            out["error"] = type(e).__name__

    with local_cluster(1, 2, log_to_driver=False):
        th = threading.Thread(target=run, name="the-job", daemon=True)
        th.start()
        deadline = time.time() + 240
        while time.time() < deadline and th.is_alive() and not list(ledger.glob("attempt-*")):
            time.sleep(0.5)
        print("training:", bool(list(ledger.glob("attempt-*"))), "alive:", th.is_alive(), flush=True)
    time.sleep(5)  # a thread left inside Ray would have ended the process by now
    print("after the teardown: job alive", th.is_alive(), "ended with", out.get("error", "summary" in out), flush=True)
''')


@pytest.mark.slow
@pytest.mark.ray  # its own cluster: it runs in the serial pass
def test_a_cluster_torn_down_under_a_running_job_ends_the_job_not_the_driver(tmp_path):
    script = SCRIPT.format(experiments=str(ROOT / "experiments"), tests=str(ROOT / "tests"), tmp=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    print(p.stdout[-3000:], p.stderr[-3000:])
    assert "training: True alive: True" in p.stdout, p.stdout + p.stderr[-3000:]
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    assert "after the teardown: job alive False" in p.stdout, p.stdout
    assert "job thread(s) still running at the cluster's shutdown: their actors killed; 0 still alive" in p.stderr
