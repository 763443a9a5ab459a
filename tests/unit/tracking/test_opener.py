"""The MLflow helper process (``elastic_ddp.tracking.opener``) and the tracker's deferred
MLflow import: real helper processes, a real sqlite store. Fast tier: no Ray cluster.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import digits_config
from helpers import open_request
from elastic_ddp import tracking
from elastic_ddp.config import Config
from elastic_ddp.tracking.opener import RunOpener

ROOT = Path(__file__).resolve().parents[3]


def test_the_helper_opens_the_run_and_monitors_the_system_until_finish(digits_data, tmp_path,
                                                                       monkeypatch):
    # A sample a second (MLflow's knob, which the helper's monitor follows; 5 s unset).
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    cfg = Config.from_dict(digits_config(digits_data, tmp_path))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    opener = RunOpener(uri)
    opener.open(**open_request(cfg, uri, str(tmp_path / "ray")))
    out = opener.result()
    assert out["resumed"] is False and out["attempts"] == {} and out["ray_run_name"] == cfg.run.name
    assert opener.result() == out  # the same answer again (the driver's error path asks twice)
    run = tracking.run_info(uri, out["run_id"])
    assert run.info.status == "RUNNING"
    assert run.data.params["task"].endswith("CNNClassifier") and int(run.data.params["model.parameters"]) > 1000
    assert run.data.tags["elastic_ddp.data_skipped"] == "1"
    assert run.data.tags[tracking.opener.RAY_RUN_NAME_TAG] == cfg.run.name
    # MLflow's monitor logs its first values after one interval.
    deadline = time.time() + 30
    c = tracking.client(uri)
    while time.time() < deadline and not c.get_metric_history(out["run_id"], "system/cpu_utilization_percentage"):
        time.sleep(0.5)
    assert c.get_metric_history(out["run_id"], "system/cpu_utilization_percentage")
    assert opener._p.poll() is None  # still monitoring
    opener.finish()
    assert opener._p.returncode == 0


def test_a_cancelled_helper_opens_nothing_and_creates_no_store(tmp_path):
    db = tmp_path / "mlflow.db"
    # A driver that stops without a request (it died before sending one): its helper
    # reads the end of its stdin once MLflow is imported and exits by itself.
    orphan = RunOpener(f"sqlite:///{db}")
    orphan._p.stdin.close()
    # An input check failed: cancel() kills the helper in its MLflow import (which
    # takes far longer than this call) instead of waiting for the import to end.
    opener = RunOpener(f"sqlite:///{db}")
    opener.cancel()
    assert opener._p.returncode == -signal.SIGKILL
    # No timeout that a loaded machine could miss: the import is seconds there.
    assert orphan._p.wait(timeout=300) == 0
    assert not db.exists()


def test_the_helper_exits_when_the_driver_dies(digits_data, tmp_path):
    # A driver SIGKILLed mid-job (no finish()) must not leave a monitor running forever.
    cfg_file = tmp_path / "c.json"
    cfg_file.write_text(json.dumps(digits_config(digits_data, tmp_path)))
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from helpers import open_request
        from elastic_ddp.config import Config
        from elastic_ddp.tracking.opener import RunOpener
        cfg = Config.from_dict(json.load(open({str(cfg_file)!r})))
        uri = "sqlite:///{tmp_path / 'mlflow.db'}"
        o = RunOpener(uri)
        o.open(**open_request(cfg, uri, {str(tmp_path / 'ray')!r}))
        o.result()
        print(o._p.pid, flush=True)
        os._exit(0)
    """))
    p = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    helper = int(p.stdout.split()[-1])
    deadline = time.time() + 15
    while time.time() < deadline and _alive(helper):
        time.sleep(0.2)
    assert not _alive(helper)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_the_tracker_imports_mlflow_only_after_the_first_step(tmp_path, mlflow_store):
    # At a job's start the MLflow import would compete for the CPUs with the Ray Train
    # controller and the workers; until the first step the tracker only buffers.
    uri = mlflow_store
    run_id = tracking.client(uri).create_run(tracking.experiment_id(uri, "tests")).info.run_id
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys, time
        from elastic_ddp.tracking.tracker import JobTracker
        t = JobTracker({uri!r}, flush_period_s=0.1)
        t.log_metrics({{"train_loss": 2.0}}, step=0)
        t.attempt(enter=time.time(), world_size=2)
        time.sleep(1.0)
        before = "mlflow" in sys.modules
        t.bind({run_id!r}, attempts_before=3)
        a = t.start_attempt(2)
        t.attempt(first_step=time.time(), step=1)
        ok = t.flush(60)
        print(json.dumps({{"before": before, "after": "mlflow" in sys.modules, "flushed": ok, "attempts": a}}))
    """))
    p = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out == {"before": False, "after": True, "flushed": True,
                   "attempts": {"attempts": 4, "world_sizes": [2]}}
    hist = tracking.client(uri).get_metric_history(run_id, "train/loss")
    assert [h.value for h in hist] == [2.0]


@pytest.mark.slow
def test_a_sigterm_while_the_request_is_sent_still_leaves_the_run_answerable(digits_data, tmp_path):
    """The CLI's early SIGTERM raises in the main thread; landing while the request is
    written (a pyarrow pool thread alive after the scan takes the signal for the
    process), it is held until the request is sent and its reader started, so the driver
    can read the run it opened and close it as KILLED."""
    cfg = json.dumps(digits_config(digits_data, tmp_path))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = textwrap.dedent(f"""
        import json, os, signal, sys, threading, time
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]
        from helpers import open_request
        from elastic_ddp import tracking
        from elastic_ddp.config import Config
        from elastic_ddp.tracking import opener as mod

        class Stopped(Exception):
            pass

        def stop(signum, frame):
            raise Stopped()

        signal.signal(signal.SIGTERM, stop)
        request = open_request(Config.from_dict(json.loads({cfg!r})), {uri!r}, "ray")
        real_dump = mod.pickle.dump

        def dump_with_a_sigterm(*a, **kw):
            t = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGTERM))
            t.start(); t.join(); time.sleep(0.2)
            real_dump(*a, **kw)

        mod.pickle.dump = dump_with_a_sigterm
        opener = mod.RunOpener({uri!r})
        try:
            opener.open(**request)
            print("not stopped")
        except Stopped:
            run_id = opener.result()["run_id"]
            opener.finish()
            tracking.finish_run({uri!r}, run_id, ok=False, error="stopped", status="KILLED")
            print("stopped", run_id)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    word, run_id = p.stdout.split()
    assert word == "stopped"
    assert tracking.run_info(uri, run_id).info.status == "KILLED"
