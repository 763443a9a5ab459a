"""The driver's progress poller (``driver.report.ProgressDisplay``) on a real local Ray:
it never starts Ray again. A Ray call made after ``ray.shutdown()`` would auto-init a new
connection (to the newest local cluster, or a new one) that nobody shuts down, and the
next ``ray.init`` of the process then fails ("called ray.init twice").

The scenario runs in a fresh Python process: the test process itself has Ray's
auto-connect off (conftest), which would hide the reconnect.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[3]

SCENARIO = textwrap.dedent("""
    import time
    import ray
    from elastic_ddp.driver.local_ray import init_local_ray
    from elastic_ddp.driver.report import ProgressDisplay

    @ray.remote(num_cpus=0)
    class Tracker:  # the two calls the poller makes, answering at once
        def get_notices(self, since=0):
            return []

        def progress(self):
            return {"step": 0}

    init_local_ray(num_cpus=1)
    # A display whose block has not ended when Ray is shut down (a job abandoned in a
    # thread): its poller must not reconnect.
    open_display = ProgressDisplay(Tracker.remote(), 100, period=0.05)
    open_display.__enter__()
    time.sleep(1.0)  # it polls
    ray.shutdown()
    time.sleep(1.0)  # twenty more periods
    print("after shutdown, initialized:", ray.is_initialized(), flush=True)
    open_display.__exit__(None, None, None)
    ray.shutdown()

    # A display that has exited makes no call even while Ray runs.
    init_local_ray(num_cpus=1)
    with ProgressDisplay(Tracker.remote(), 100, period=0.05) as d:
        time.sleep(0.5)
    print("after exit, thread alive:", d._thread.is_alive(), "answer:", d._ask("progress", timeout=5), flush=True)
    ray.shutdown()
""")


@pytest.mark.slow
def test_the_poller_makes_no_ray_call_after_shutdown_or_after_its_exit():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_AUTO_CONNECT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *sys.path])
    p = subprocess.run([sys.executable, "-c", SCENARIO], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert "after shutdown, initialized: False" in p.stdout, \
        "the poller started Ray again after ray.shutdown():\n" + p.stdout + p.stderr[-2000:]
    assert p.returncode == 0, p.stderr[-3000:]
    assert "after exit, thread alive: False answer: None" in p.stdout, p.stdout + p.stderr[-2000:]
