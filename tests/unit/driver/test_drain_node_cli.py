"""``elastic-ddp drain-node`` refuses what it cannot drain, in one line, exit 2, at once:
no Ray node in the container (the hook run in a pod without ``ray start``), an unknown
``--node-id``, a deadline under a second. The eviction itself: tests/e2e/preemption/test_eviction_e2e.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

CLI = str(Path(sys.executable).parent / "elastic-ddp")


def _run(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    out = subprocess.run([*prefix, CLI, "drain-node", *args], capture_output=True, text=True, timeout=60)
    out.elapsed = time.monotonic() - t0
    return out


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="a mount namespace of its own needs root and util-linux's unshare")
def test_a_container_without_a_ray_node_is_refused_by_name():
    # A fresh mount namespace: whatever raylets run on this machine are not "in" it.
    out = _run("--self", "--deadline", "30", prefix=("unshare", "--mount", "--propagation", "private"))
    assert out.returncode == 2, out
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("elastic-ddp: drain-node: no Ray node runs in this container"), line
    assert out.elapsed < 30, out.elapsed


def test_an_unknown_node_id_and_a_deadline_under_a_second_are_refused():
    out = _run("--node-id", "ab" * 28, "--deadline", "30")
    assert out.returncode == 2 and f"no Ray node {'ab' * 28} runs on this host" in out.stderr, out
    out = _run("--self", "--deadline", "0")
    assert out.returncode == 2 and "--deadline must be at least 1 second" in out.stderr, out


def test_self_and_node_id_are_one_choice():
    out = _run("--deadline", "30")
    assert out.returncode == 2 and "one of the arguments --self --node-id is required" in out.stderr, out
