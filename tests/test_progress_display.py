"""The driver's progress poller (``driver.report.ProgressDisplay``) on a real local Ray:
it never starts Ray again. A Ray call made after ``ray.shutdown()`` would auto-init a new
connection (to the newest local cluster, or a new one) that nobody shuts down, and the
next ``ray.init`` of the process then fails ("called ray.init twice").
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.ray


def test_the_poller_makes_no_ray_call_after_shutdown_or_after_its_exit():
    import ray

    from elastic_ddp.driver.local_ray import init_local_ray
    from elastic_ddp.driver.report import ProgressDisplay

    @ray.remote(num_cpus=0)
    class Tracker:  # the two calls the poller makes, answering at once
        def get_notices(self, since: int = 0):
            return []

        def progress(self):
            return {"step": 0}

    if ray.is_initialized():
        ray.shutdown()
    init_local_ray(num_cpus=1)
    try:
        # A display whose block has not ended when Ray is shut down (a job abandoned in a
        # thread): its poller must not reconnect.
        open_display = ProgressDisplay(Tracker.remote(), 100, period=0.05)
        open_display.__enter__()
        time.sleep(1.0)  # it polls
        ray.shutdown()
        time.sleep(1.0)  # twenty more periods
        assert not ray.is_initialized(), "the poller started Ray again after ray.shutdown()"
        open_display.__exit__(None, None, None)

        # A display that has exited makes no call even while Ray runs.
        init_local_ray(num_cpus=1)
        tracker = Tracker.remote()
        with ProgressDisplay(tracker, 100, period=0.05) as d:
            time.sleep(0.5)
        assert d._closed and not d._thread.is_alive()
        assert d._ask("progress", timeout=5) is None  # closed: not asked
    finally:
        ray.shutdown()
    time.sleep(0.5)
    assert not ray.is_initialized()
