"""Failure causes named right, and deterministic user errors stopped on their first
attempt. The Ray Train controller's callbacks (``ElasticEvents`` + ``ControllerEvents``)
run in this process on a real tracker and sqlite store and judge real errors: DDP's
unused-parameter error from a real process group, a real ENOSPC from /dev/full, a rank
alive in another process whose position record says where it hangs. End to end (Ray): a
DDP job with an unused parameter exits 1 after one attempt naming
``parallel.find_unused_parameters``; a rank that hangs in its loss is named as the one
the collective waited for."""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import InProcess, digits_config, mlflow_runs

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture()
def controller(tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    from elastic_ddp.controller.events import ElasticEvents

    from elastic_ddp.controller.lifecycle import ControllerEvents
    from elastic_ddp.tracking import JobTracker

    uri = mlflow_store
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("c", artifact_location=str(tmp_path / "a")))
    events = ElasticEvents(InProcess(JobTracker(uri, run.info.run_id)), run_name="job",
                           storage=str(tmp_path / "ray_results"), collective_timeout_s=30)
    return events, ControllerEvents(events)


def _fail(events, ctrl, exceptions, workers=None, world_size=None):
    from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision

    events.workers = workers or {}
    events._last_world_size = world_size or len(events.workers) or len(exceptions)
    events.after_exception(None, exceptions)
    ctrl.before_controller_execute_failure_decision(FailureDecision.RETRY)
    return events.events[-1]


def _raised(fn, rank, step, phase="training step", drop_frames=1):
    """``fn()``'s exception as the worker reports it (``failures.located``); the test's
    own frames are dropped, as a worker's traceback starts in elastic-ddp's code."""
    from elastic_ddp.positions import located

    try:
        fn()
    except Exception as e:  # noqa: BLE001
        tb = e.__traceback__
        for _ in range(drop_frames):
            tb = tb.tb_next if tb is not None and tb.tb_next is not None else tb
        return located(e.with_traceback(tb), rank, {"phase": phase, "step": step, "epoch": 0})
    raise AssertionError("no error")


def _ddp_unused_parameter_error() -> str:
    """DDP's own error text, from a real one-rank gloo group and a model with an unused
    parameter (two steps)."""
    code = textwrap.dedent("""
        import tempfile, torch, torch.distributed as dist, torch.nn as nn
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
        class M(nn.Module):
            def __init__(s):
                super().__init__(); s.a = nn.Linear(2, 2); s.unused = nn.Linear(2, 2)
            def forward(s, x): return s.a(x)
        m = nn.parallel.DistributedDataParallel(M())
        try:
            for _ in range(2):
                m(torch.ones(1, 2)).sum().backward()
        except RuntimeError as e:
            print(e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "find_unused_parameters" in out, out
    return out.strip()


def test_ddps_unused_parameter_error_stops_on_the_first_attempt_naming_the_field(controller):
    from elastic_ddp.controller.events import DeterministicTrainingError

    events, ctrl = controller
    text = _ddp_unused_parameter_error()

    def raise_it():
        raise RuntimeError(text)
    errs = {r: _raised(raise_it, r, 2) for r in (0, 1)}
    with pytest.raises(DeterministicTrainingError) as e:
        _fail(events, ctrl, errs)
    msg = str(e.value)
    assert msg.startswith("not retried (the error says a restart cannot fix it): rank 0 failed at step 2"), msg
    assert "set parallel.find_unused_parameters=true" in msg and "task's code" not in msg, msg
    assert len(events.events) == 1 and events.events[0]["decision"] == "STOP (deterministic)"


@pytest.mark.parametrize("every_rank", [True, False])
def test_a_shape_error_on_every_rank_at_one_step_stops_at_once_on_one_rank_is_retried(controller, every_rank):
    import torch

    from elastic_ddp.controller.events import DeterministicTrainingError

    events, ctrl = controller
    ranks = (0, 1) if every_rank else (1,)

    def matmul():
        torch.ones(2, 5) @ torch.ones(4, 3)
    errs = {r: _raised(matmul, r, 4) for r in ranks}
    workers = {0: {"pid": 1}, 1: {"pid": 2}}
    if every_rank:
        with pytest.raises(DeterministicTrainingError) as e:
            _fail(events, ctrl, errs, workers)
        msg = str(e.value)
        assert "every rank raised the same shape/dtype error at step 4" in msg, msg
        assert "mat1 and mat2 shapes cannot be multiplied" in msg, msg
    else:
        ev = _fail(events, ctrl, errs, workers)
        assert ev["decision"] == "RETRY", ev


def test_a_full_disk_names_the_storage_path_and_stops(controller, tmp_path):
    """A real ENOSPC (writing /dev/full) in the checkpoint phase; the error carries no
    path, so the storage path is named."""
    from elastic_ddp.controller.events import DeterministicTrainingError

    events, ctrl = controller

    def write_full():
        with open("/dev/full", "wb") as f:
            f.write(b"\0" * 4096)
    err = _raised(write_full, 0, 6, "checkpoint")
    with pytest.raises(DeterministicTrainingError) as e:
        _fail(events, ctrl, {0: err}, {0: {"pid": 1}, 1: {"pid": 2}})
    msg = str(e.value)
    assert f"the storage at {tmp_path / 'ray_results'} is full (no space left on the device)" in msg, msg
    assert "set run.storage_path" in msg and "task's code" not in msg, msg


@pytest.mark.parametrize("code,what", [(errno.EDQUOT, "full (the disk quota is exceeded)"),
                                       (errno.EROFS, "read-only")])
def test_quota_and_read_only_errors_name_the_path_they_carry(controller, code, what):
    from elastic_ddp.controller.events import DeterministicTrainingError

    events, ctrl = controller
    path = "/mnt/ckpt/job/checkpoint_000004/state.pt.tmp"

    def fail():
        raise OSError(code, os.strerror(code), path)
    with pytest.raises(DeterministicTrainingError, match=f"the storage at {path} is {what.split(' (')[0]}"):
        _fail(events, ctrl, {0: _raised(fail, 0, 4, "checkpoint")})


def _live_rank(rank: int, step: int, run: str = "job") -> subprocess.Popen:
    """A live process whose position record says it is in ``training step`` ``step``."""
    code = textwrap.dedent(f"""
        import time
        from elastic_ddp.positions import Position
        p = Position({rank}, {run!r})
        p.at("training step", {step}, 0)
        print("at", flush=True)
        time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.stdout.readline().strip() == "at"
    return p


def test_a_collective_timeout_names_the_rank_that_did_not_arrive(controller):
    from elastic_ddp.positions import position_dir

    events, ctrl = controller
    hung = _live_rank(1, 7)
    try:
        def timeout():
            raise RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
                               "Timed out waiting 30000ms for recv operation to complete")
        ev = _fail(events, ctrl, {0: _raised(timeout, 0, 7)},
                   {0: {"pid": os.getpid(), "node_ip": "127.0.0.1"}, 1: {"pid": hung.pid, "node_ip": "127.0.0.1"}})
        assert ev["cause_rank"] == 1 and ev["cause_kind"] == "hung" and ev["step"] == 7, ev
        for needle in ("rank 1 did not arrive in the collective of step 7", f"pid {hung.pid}",
                       "still in its training step at step 7", "rank(s) 0 timed out waiting for it",
                       "scaling.collective_timeout_s=30"):
            assert needle in ev["cause"], (needle, ev["cause"])
        assert (position_dir() / f"pid{hung.pid}.json").exists()  # a live rank's record stays
    finally:
        hung.send_signal(signal.SIGKILL)
        hung.wait()


def test_hints_blame_the_task_only_for_errors_raised_in_its_code(controller, tmp_path):
    from elastic_ddp.controller.failures import classify, likely_cause

    user = tmp_path / "user_code" / "mytask.py"
    user.parent.mkdir()
    user.write_text("def loss():\n    raise ValueError('bad row')\n")
    sys.path.insert(0, str(user.parent))
    try:
        import mytask
    finally:
        sys.path.remove(str(user.parent))
    in_task = _raised(mytask.loss, 0, 3)
    assert in_task.origin == "task"
    from elastic_ddp.checkpoint import load_state

    in_library = _raised(lambda: load_state(str(tmp_path / "missing")), 0, 3, drop_frames=2)
    assert in_library.origin == "library"
    (t,), (lib,) = classify({0: in_task}), classify({0: in_library})
    assert "the task's code" in likely_cause(t)
    assert "not the task's code" in likely_cause(lib), likely_cause(lib)


# ------------------------------------------------------------------ end to end, real Ray
UNUSED_TASK = '''
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import elastic_ddp


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(64, 10)
        self.spare = nn.Linear(64, 10)          # never used: DDP's unused-parameter error

    def forward(self, x):
        return self.head(x)


class Digits(elastic_ddp.Task):
    columns = {"x": elastic_ddp.Column.list_of("float", length=64),
               "y": elastic_ddp.Column.integer(min=0, max=9)}

    def transform(self, batch, ctx):
        return {"image": np.stack(list(batch["x"])).astype(np.float32), "label": batch["y"]}

    def build_model(self):
        return Net()

    def loss(self, model, batch):
        return F.cross_entropy(model(batch["image"]), batch["label"], reduction="none")
'''


@pytest.mark.slow
@pytest.mark.ray  # starts its own local Ray in the subprocess
def test_a_ddp_job_with_an_unused_parameter_stops_after_one_attempt(tmp_path, digits_data):
    task = tmp_path / "user_code" / "unused_task.py"
    task.parent.mkdir(parents=True)
    task.write_text(textwrap.dedent(UNUSED_TASK))
    raw = digits_config(digits_data, tmp_path, {"train": {"epochs": 1, "max_steps": 10},
                                                "scaling": {"max_failures": 3}})
    raw["task"] = {"path": f"{task}:Digits", "kwargs": {}}
    raw["model"] = {"kwargs": {}}
    raw["data"]["val_path"] = None
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("RAY_ADDRESS", None)
    p = subprocess.run([sys.executable, "-m", "elastic_ddp", "train", str(cfg), "--no-progress"],
                       capture_output=True, text=True, timeout=500, env=env, cwd=tmp_path)
    assert p.returncode == 1, p.stderr[-3000:]
    line = p.stderr.strip().splitlines()[-1]
    assert "not retried (the error says a restart cannot fix it)" in line, line
    assert "set parallel.find_unused_parameters=true" in line and "task's code" not in line, line
    (run,) = mlflow_runs(tmp_path)
    assert run.info.status == "FAILED"
    assert run.data.tags.get("elastic_ddp.attempts") in (None, "1"), run.data.tags


HANG_TASK = UNUSED_TASK.replace('''        self.spare = nn.Linear(64, 10)          # never used: DDP's unused-parameter error
''', '').replace('''    def loss(self, model, batch):
''', '''    calls = 0

    def loss(self, model, batch):
        import time

        import torch.distributed as dist

        type(self).calls += 1
        if dist.is_initialized() and dist.get_rank() == 1 and type(self).calls == 3:
            time.sleep(600)                      # rank 1 hangs in its loss (every attempt)
''')


@pytest.mark.slow
@pytest.mark.ray  # starts its own local Ray in the subprocess
def test_a_rank_that_hangs_in_its_loss_is_named_not_the_rank_that_timed_out(tmp_path, digits_data):
    task = tmp_path / "user_code" / "hang_task.py"
    task.parent.mkdir(parents=True)
    task.write_text(textwrap.dedent(HANG_TASK))
    raw = digits_config(digits_data, tmp_path, {"train": {"epochs": 1, "max_steps": 10},
                                                "scaling": {"max_failures": 2, "collective_timeout_s": 10}})
    raw["task"] = {"path": f"{task}:Digits", "kwargs": {}}
    raw["model"] = {"kwargs": {}}
    raw["data"]["val_path"] = None
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("RAY_ADDRESS", None)
    p = subprocess.run([sys.executable, "-m", "elastic_ddp", "train", str(cfg), "--no-progress"],
                       capture_output=True, text=True, timeout=580, env=env, cwd=tmp_path)
    assert p.returncode == 1, p.stderr[-3000:]
    line = p.stderr.strip().splitlines()[-1]
    # Two attempts hang at the same step: stopped as deterministic, naming rank 1.
    assert "the same hang at the same step on two attempts in a row" in line, line
    assert re.search(r"rank 1 did not arrive in the collective of step \d+ .*still in its training "
                     r"step at step \d+ .*rank\(s\) 0 timed out waiting for it "
                     r"\(scaling.collective_timeout_s=10\)", line), line
    assert "likely cause: rank 1 was slow or stuck" in line, line
