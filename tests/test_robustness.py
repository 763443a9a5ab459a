"""Issue #13 without a Ray cluster: real inputs people hit, each a class of failure, each
ending in a finished job or a clear error before any work is lost. Real Parquet files,
real sqlite MLflow stores, real processes killed by real signals; the Ray end-to-end
jobs for the same items are in tests/test_failures_e2e.py.

Items: 1 storage/data paths with URI characters, 2 the scan and the reader agree on the
schema, 3 the validation split checked like training, 4 deterministic failures stopped
with step/rank/cause, 5 skipped non-finite steps in the ledger audit, 6 driver set-up
errors up front, 7 the data fingerprint, 8 what the scan skipped shown by the CLI,
9 tracking outages retried, 10 the cause of a failure and error fingerprints.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import digits_config, mlflow_runs
from elastic_ddp.driver.cli import main
from elastic_ddp.data.scan import DataError, scan_parquet

# ------------------------------------------------------------------------ data helpers
ROW = 64  # an 8x8 image per row


def write_rows(path: Path, ids, *, x_type=pa.float32(), y_type=pa.int64(), child: str = "item",
               nullable: bool = True, labels=None, x_fill=None, seed: int = 0) -> Path:
    """A digits-like Parquet file (``sample_id``, ``x``: 64 numbers, ``y``: a class):
    ``child`` names the list's child field (writers use ``item`` or ``element``),
    ``nullable=False`` declares every column ``not null``, ``x_fill`` maps an id to the
    value of all its pixels (e.g. NaN), ``labels`` overrides ``y``."""
    ids = [int(i) for i in ids]
    rng = np.random.default_rng(seed + (ids[0] if ids else 0))
    xs = rng.random((len(ids), ROW)).astype(np.float32)
    for k, i in enumerate(ids):
        if x_fill and i in x_fill:
            xs[k, :] = x_fill[i]
    ys = [i % 3 for i in ids] if labels is None else list(labels)
    schema = pa.schema([pa.field("sample_id", pa.int64(), nullable=nullable),
                        pa.field("x", pa.list_(pa.field(child, x_type)), nullable=nullable),
                        pa.field("y", y_type, nullable=nullable)])
    table = pa.table({"sample_id": pa.array(ids, pa.int64()),
                      "x": pa.array([list(map(float, r)) for r in xs], pa.list_(pa.field(child, x_type))),
                      "y": pa.array(ys, y_type)}, schema=schema)
    path.parent.mkdir(parents=True, exist_ok=True)
    # use_compliant_nested_type=False keeps the child name as given in the file.
    pq.write_table(table, path, use_compliant_nested_type=False, row_group_size=8)
    return path


def mixed_dataset(root: Path, ids_per_file: int = 16, x_fill=None) -> list[int]:
    """Files that differ in what a careless scan misses: nullability (``not null`` in one
    file), the list child name (``element``/``item``), the label's integer width (int32
    in one file), and a directory named like a Hive partition key of the label column
    (``y=7/``). ``x_fill``: see :func:`write_rows`. Returns the ids written."""
    k = ids_per_file
    write_rows(root / "a" / "part-0.parquet", range(0, k), nullable=False, x_fill=x_fill)
    write_rows(root / "b" / "part-1.parquet", range(k, 2 * k), child="element", x_fill=x_fill)
    write_rows(root / "y=7" / "part-2.parquet", range(2 * k, 3 * k), x_fill=x_fill)
    write_rows(root / "c" / "part-3.parquet", range(3 * k, 4 * k), y_type=pa.int32(), x_fill=x_fill)
    return list(range(4 * k))


def task_columns(num_classes: int = 3):
    from elastic_ddp.tasks.vision import CNNClassifier

    return CNNClassifier("x", "y", num_classes, [1, 8, 8]).input_columns()


def _cli(tmp: Path, raw: dict, capsys, *extra) -> tuple[int, str, str]:
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    rc = main(["train", str(path), "--no-progress", *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def _nothing_started(tmp: Path) -> None:
    assert mlflow_runs(tmp) == [] and not (tmp / "ray_results").exists()
    if "ray" in sys.modules:
        assert not sys.modules["ray"].is_initialized()


def small_config(data: Path, tmp: Path, extra: dict | None = None) -> dict:
    raw = digits_config(data, tmp, {
        "task": {"kwargs": {"num_classes": 3}},
        "model": {"kwargs": {"hidden": 8}},
        "batch": {"global_batch_size": 16, "micro_batch_size": 8, "policy": "uneven"},
        "train": {"epochs": 1, "checkpoint_every_steps": 2, "log_every_steps": 1},
    })
    from conftest import _deep_update

    return _deep_update(raw, extra or {})


# --------------------------------------------------- 4 and 10. what failed, and where
def _sigkilled_rank(rank: int, step: int, run: str = "job") -> int:
    """A real process that records its position at ``step`` (as a rank does) and is
    killed by SIGKILL; returns its pid (its position record stays behind)."""
    code = textwrap.dedent(f"""
        import os, signal
        from elastic_ddp.positions import Position
        p = Position({rank}, {run!r})
        p.at("data read", {step}, 0)
        p.at("training step", {step}, 0)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code])
    assert proc.wait(timeout=120) == -signal.SIGKILL
    return proc.pid


def _actor_died(pid: int):
    """Ray Train's view of a rank whose process vanished: the health check failed with
    the ActorDiedError Ray builds from the raylet's report (its own message text)."""
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    ctx = ActorDiedErrorContext(
        error_message="The actor is dead because its worker process has died. Worker exit type: "
                      "SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection "
                      "error code 2. End of file. Some common causes include: (1) the process was "
                      "killed by the OOM killer due to high memory usage",
        pid=pid, node_ip_address="127.0.0.1", class_name="RayTrainWorker", actor_id=os.urandom(16))
    return WorkerHealthCheckFailedError("Worker health check failed.", ActorDiedError(ctx))


def _gloo_peer_error(step: int, port: int):
    from elastic_ddp.positions import located

    inner = RuntimeError(f"[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                         f"closed by peer [127.0.0.1]:{port}. This is typically caused by a remote "
                         "worker crashing.")
    return located(inner, 0, {"phase": "training step", "step": step, "epoch": 0})


@pytest.fixture()
def controller(tmp_path):
    """ElasticEvents + ControllerEvents writing into a real tracker and sqlite store (the
    controller's callbacks, called in Ray Train's order, in this process)."""
    from mlflow.tracking import MlflowClient
    from test_events import InProcess

    from elastic_ddp.controller.events import ControllerEvents, ElasticEvents
    from elastic_ddp.tracking import JobTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("c", artifact_location=str(tmp_path / "a")))
    events = ElasticEvents(InProcess(JobTracker(uri, run.info.run_id)), run_name="job")
    return events, ControllerEvents(events)


def _fail(events, ctrl, exceptions, workers=None):
    from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision

    events.workers = workers or {}
    events.after_exception(None, exceptions)
    ctrl.before_controller_execute_failure_decision(FailureDecision.RETRY)
    return events.events[-1]


def test_a_rank_killed_at_the_same_step_twice_is_stopped_as_memory(controller):
    """Rank 1 SIGKILLed at step 3 on two attempts (an OOM kill): the first is retried
    with rank 1 as the cause (not rank 0's 'Connection closed by peer'), with its signal,
    node and step read from its position record; the second stops the job naming the
    step, the rank and memory."""
    from elastic_ddp.controller.events import DeterministicTrainingError
    from elastic_ddp.positions import position_dir

    events, ctrl = controller
    pid = _sigkilled_rank(1, 3)
    ev = _fail(events, ctrl, {0: _gloo_peer_error(3, 41779), 1: _actor_died(pid)},
               {0: {"pid": os.getpid(), "node_ip": "127.0.0.1"}, 1: {"pid": pid, "node_ip": "127.0.0.1"}})
    assert ev["cause_rank"] == 1 and ev["cause_kind"] == "died" and ev["step"] == 3, ev
    assert ev["signal"] == "SIGKILL" and ev["node"] == "127.0.0.1" and ev["pid"] == pid
    assert "rank 1 died at step 3" in ev["cause"] and "Connection closed" not in ev["cause"]
    assert not (position_dir() / f"pid{pid}.json").exists()  # read once, then removed
    pid2 = _sigkilled_rank(1, 3)
    with pytest.raises(DeterministicTrainingError) as e:
        _fail(events, ctrl, {0: _gloo_peer_error(3, 52311), 1: _actor_died(pid2)},
              {1: {"pid": pid2, "node_ip": "127.0.0.1"}})
    msg = str(e.value)
    for needle in ("same death at the same step", "rank 1 died at step 3", "SIGKILL", "memory",
                   "127.0.0.1"):
        assert needle in msg, (needle, msg)
    assert events.events[-1]["decision"] == "STOP (deterministic)"


def test_deaths_at_different_steps_are_retried(controller):
    events, ctrl = controller
    for step in (3, 9, 15):  # a flaky node, not a deterministic failure
        pid = _sigkilled_rank(0, step)
        ev = _fail(events, ctrl, {0: _actor_died(pid)}, {0: {"pid": pid, "node_ip": "127.0.0.1"}})
        assert ev["decision"] == "RETRY" and ev["step"] == step


@pytest.mark.parametrize("phase,error,needle", [
    ("evaluation", KeyError("'logits'"), "evaluate()"),
    # A Ray Data read task's error reaches the rank as a RayTaskError whose text names
    # the read task's pid and node address: different on every attempt.
    ("data read", None, "Parquet file"),  # the message is the read error, not the task's pid
    ("metrics", RuntimeError("Gloo all_reduce failed: [127.0.0.1]:{port} size mismatch 9 vs 8"),
     "metrics"),
    ("training step", ValueError("bad pixel at worker pid={port}"), "task's code"),
])
def test_the_same_error_in_any_phase_twice_is_deterministic(controller, phase, error, needle):
    """Errors raised in evaluation, in the data read, in metric logging and in a step
    carry the step; the same one twice (addresses, ports and pids differing) stops the
    job with the step, the rank, the phase and the likely cause."""
    from elastic_ddp.controller.events import DeterministicTrainingError
    from elastic_ddp.positions import located

    events, ctrl = controller

    def err(port):
        if error is None:
            from ray.exceptions import RayTaskError

            cause = OSError("Couldn't deserialize thrift: don't know what type: \n"
                            "Deserializing page header failed.")
            ip = f"10.0.0.{port % 200}"
            tb = (f"\x1b[36mray::ReadElasticDDPWindows->MapBatches(TaskTransform)()\x1b[39m "
                  f"(pid={port}, ip={ip})\n  File \"ingest.py\", line 51\nOSError: ...")
            return RayTaskError("ReadElasticDDPWindows->MapBatches(TaskTransform)", tb, cause,
                                pid=port, ip=ip).as_instanceof_cause()
        return type(error)(str(error.args[0]).format(port=port))

    ev = _fail(events, ctrl, {1: located(err(40001), 1, {"phase": phase, "step": 6, "epoch": 0})})
    assert ev["decision"] == "RETRY" and ev["step"] == 6 and ev["phase"] == phase
    with pytest.raises(DeterministicTrainingError) as e:
        _fail(events, ctrl, {1: located(err(40777), 1, {"phase": phase, "step": 6, "epoch": 0})})
    msg = str(e.value)
    assert "same error at the same step" in msg and "rank 1 failed at step 6" in msg, msg
    assert needle in msg and "\x1b" not in msg, msg
    if error is None:
        assert "OSError: Couldn't deserialize thrift" in msg and "ReadElasticDDPWindows" in msg, msg


@pytest.mark.parametrize("make", ["data_changed", "non_finite", "data_error"])
def test_fatal_errors_are_not_retried_even_once(controller, make):
    from elastic_ddp.data.scan import DataError as DE
    from elastic_ddp.controller.events import DeterministicTrainingError
    from elastic_ddp.positions import located
    from elastic_ddp.worker.trainer import DataChangedError, NonFiniteError, StepError

    events, ctrl = controller
    if make == "data_changed":
        e = located(DataChangedError("the checkpoint at step 3 was written on other data"), 0,
                    {"phase": "restore", "step": 3, "epoch": 0})
    elif make == "non_finite":
        try:
            try:
                raise NonFiniteError("3 consecutive steps had a non-finite loss")
            except NonFiniteError as inner:
                raise StepError("step 9 (epoch 0, rank 0): NonFiniteError: ...") from inner
        except StepError as outer:
            e = located(outer, 0, {"phase": "training step", "step": 9, "epoch": 0})
    else:
        e = located(DE("/d/a.parquet: column 'x' missing"), 1, {"phase": "data read", "step": 1, "epoch": 0})
    assert e.fatal
    # It crosses the process boundary as the controller receives it.
    import pickle

    e = pickle.loads(pickle.dumps(e))
    with pytest.raises(DeterministicTrainingError, match="not retried"):
        _fail(events, ctrl, {e.rank: e})


def test_error_fingerprints_ignore_addresses_ports_pids_and_ids():
    from elastic_ddp.controller.failures import normalise

    a = ("RayTaskError(OSError): ray::Read() (pid=1234, ip=10.0.0.7) Connection reset by peer "
         "[10.0.0.7]:41779 actor_id 3f2a9c0d1e5b7a6c01000000 at 2026-11-30 13:03:14,866 /tmp/tmpab12x/f")
    b = ("RayTaskError(OSError): ray::Read() (pid=99, ip=10.0.0.8) Connection reset by peer "
         "[10.0.0.8]:5512 actor_id 0badc0ffee0ddf0001000000 at 2026-12-01 01:00:00,001 /tmp/tmpzz9/f")
    assert normalise(a) == normalise(b)
    assert normalise("bad value 7 in column y") != normalise("bad value 8 in column y")


def test_a_worker_group_error_after_the_budget_names_the_dead_rank_not_the_peer():
    from ray.train.v2.api.exceptions import WorkerGroupError

    from elastic_ddp.controller.failures import describe_training_error

    e = WorkerGroupError("...", {0: _gloo_peer_error(3, 4242), 1: _actor_died(4321)})
    msg = describe_training_error(e)
    assert msg.startswith("rank 1 died") and "SIGKILL" in msg and "max_failures" in msg, msg


# --------------------------------------------------------- 5. skipped steps, audited
def _ledger(d: Path, attempt: str, rank: int, rows: list[dict], ws: int = 2, resumed: int = 0):
    with open(d / f"attempt-{1 + rank}-{attempt}-rank{rank}.jsonl", "w") as f:
        f.write(json.dumps({"header": True, "attempt": attempt, "rank": rank, "world_size": ws,
                            "resumed_from": resumed, "t": 1.0}) + "\n")
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_the_audit_counts_skipped_samples_as_skipped_and_checks_every_rank_agrees(tmp_path):
    from elastic_ddp.ledger import audit

    _ledger(tmp_path, "a", 0, [{"epoch": 0, "step": 1, "ids": [0, 1]},
                               {"epoch": 0, "step": 2, "ids": [4], "skipped": True}])
    _ledger(tmp_path, "a", 1, [{"epoch": 0, "step": 1, "ids": [2, 3]},
                               {"epoch": 0, "step": 2, "ids": [5], "skipped": True}])
    r = audit(tmp_path, range(6), 1)
    e = r["epochs"][0]
    assert r["ok"] and e["lost"] == 0 and e["repeated"] == 0
    assert e["skipped"] == 2 and e["skipped_ids"] == [4, 5] and e["skipped_steps"] == [2]
    # One rank skipping alone is the defect the one decision prevents: not ok.
    _ledger(tmp_path, "a", 1, [{"epoch": 0, "step": 1, "ids": [2, 3]},
                               {"epoch": 0, "step": 2, "ids": [5]}])
    bad = audit(tmp_path, range(6), 1)
    assert not bad["ok"] and not bad["attempts"][0]["skips_agree"]


# ------------------------------------------------------------ 6. driver set-up errors
@pytest.mark.parametrize("name,needle", [
    ("x" * 300, "is 300 bytes long, the longest allowed is 200"),
    ("é" * 101, "is 202 bytes long, the longest allowed is 200"),
    ("nightly/2024", "contains '/'"),
    ("a\tb", "contains '\\t'"),
    ("..", "names no directory of its own"),
])
def test_run_names_ray_or_the_file_system_refuse_exit_2(tmp_path, capsys, name, needle):
    """A 300-character run.name killed Ray Train's controller in its constructor (the run
    directory is one file-name component, 255 bytes at most); '/' and control characters
    are refused the same way, up front, naming the longest name allowed."""
    data = tmp_path / "data"
    write_rows(data / "train" / "part-0.parquet", range(32))
    write_rows(data / "val" / "part-0.parquet", range(100, 104))
    rc, out, err = _cli(tmp_path, small_config(data, tmp_path), capsys, "--set", f"run.name={name}")
    assert rc == 2 and out == "", err
    assert "config error" in err and "run.name" in err and needle in err, err
    assert "200 bytes" in err
    _nothing_started(tmp_path)


METRIC_TASK = """
import torch.nn.functional as F
from elastic_ddp.tasks.vision import CNNClassifier


class Topk(CNNClassifier):
    def loss(self, model, batch):
        logits = model(batch["x"])
        return (F.cross_entropy(logits, batch["y"], reduction="none"),
                {"acc@1": (logits.argmax(-1) == batch["y"]).float()})
"""


def test_a_metric_name_mlflow_refuses_exits_2_up_front(tmp_path, capsys):
    """A task metric named 'acc@1' was refused by MLflow in the tracker, which retried the
    whole buffer forever (no metric of the job reached the store): now exit 2 naming it."""
    data = tmp_path / "data"
    write_rows(data / "train" / "part-0.parquet", range(32))
    write_rows(data / "val" / "part-0.parquet", range(100, 104))
    task = tmp_path / "user" / "topk.py"
    task.parent.mkdir()
    task.write_text(METRIC_TASK)
    raw = small_config(data, tmp_path)
    raw["task"]["path"] = f"{task}:Topk"
    raw["model"] = {"kwargs": {"hidden": 8}}
    rc, out, err = _cli(tmp_path, raw, capsys)
    assert rc == 2 and "task error" in err and "'acc@1'" in err and "rename it" in err, err
    _nothing_started(tmp_path)


def test_the_tracker_drops_what_the_store_refuses_and_writes_the_rest(tmp_path):
    """Safety net behind the up-front check: a value MLflow refuses is dropped (counted,
    warned) instead of blocking every later metric in a retry loop."""
    from mlflow.tracking import MlflowClient

    from elastic_ddp import tracking
    from elastic_ddp.tracking import JobTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("t", artifact_location=str(tmp_path / "a"))).info.run_id
    tracker = JobTracker(uri, run_id, flush_period_s=0.2)
    tracker.log_metrics({"train_loss": 0.5, "train_acc@1": 0.9}, 1)
    tracker.log_metrics({"train_loss": 0.4}, 2)
    assert tracker.flush(30)
    snap = tracker.snapshot()
    assert snap["dropped"] == 1 and "acc@1" in snap["last_error"], snap
    assert tracking.metric_history(uri, run_id, "train/loss") == [(1, 0.5), (2, 0.4)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_ray_address_nothing_answers_at_exits_2_after_printing_what_the_scan_skipped(
        tmp_path, capsys, monkeypatch):
    """RAY_ADDRESS naming a dead cluster made ray.init wait for minutes: now exit 2 at
    once, saying what to do. Before that, the CLI has printed the config and, once, what
    the scan did not read (items 6 and 8), and no MLflow run exists."""
    data = tmp_path / "data"
    write_rows(data / "train" / "part-0.parquet", range(32))
    elsewhere = tmp_path / "elsewhere"
    write_rows(elsewhere / "part-1.parquet", range(32, 48))
    (data / "train" / "linked").symlink_to(elsewhere, target_is_directory=True)
    (data / "train" / "again").symlink_to(elsewhere, target_is_directory=True)
    write_rows(data / "train" / "_tmp" / "part-9.parquet", range(900, 908))
    (data / "train" / "README.txt").write_text("notes")
    write_rows(data / "val" / "part-0.parquet", range(100, 104))
    port = _free_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    t = time.time()
    rc, out, err = _cli(tmp_path, small_config(data, tmp_path), capsys)
    assert rc == 2 and time.time() - t < 60, (rc, err)
    assert f"RAY_ADDRESS=127.0.0.1:{port}" in err and "ray start --head" in err, err
    assert "elastic-ddp config" in out
    assert out.count("entries not read") == 1, out
    for needle in ("2 Parquet file(s) read", "_tmp/: hidden", "README.txt: not *.parquet",
                   "same directory as another path (symlink)"):
        assert needle in out, (needle, out)
    _nothing_started(tmp_path)


# ------------------------------------------------------------ 9. tracking outages
def hold_sqlite_lock(db: Path, seconds: float) -> subprocess.Popen:
    """Another process holding ``BEGIN EXCLUSIVE`` on the sqlite file for ``seconds``
    (it prints 'locked' once it holds the lock)."""
    code = textwrap.dedent(f"""
        import sqlite3, sys, time
        c = sqlite3.connect({str(db)!r}, timeout=60, isolation_level=None)
        c.execute("BEGIN EXCLUSIVE")
        print("locked", flush=True)
        time.sleep({seconds})
        c.execute("COMMIT")
        print("released", time.time(), flush=True)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_a_locked_store_delays_metrics_and_the_drivers_calls_but_loses_nothing(tmp_path, capsys):
    """The sqlite store locked for 25 s (longer than MLflow's own 20 s busy timeout):
    the tracker buffers and writes every metric later, counting each delayed value once
    and the outage's length; the driver's closing calls retry instead of raising."""
    from mlflow.tracking import MlflowClient

    from elastic_ddp import tracking
    from elastic_ddp.tracking import JobTracker

    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("t", artifact_location=str(tmp_path / "a"))).info.run_id
    tracker = JobTracker(uri, run_id, flush_period_s=0.2)
    tracker.log_metrics({"train_loss": 1.0}, 1)
    assert tracker.flush(30)
    lock = hold_sqlite_lock(db, 25)
    for step in range(2, 7):
        tracker.log_metrics({"train_loss": 1.0 / step, "lr": 0.1}, step)
        time.sleep(0.5)
    tracking.finish_run(uri, run_id, ok=True)   # waits out the lock, retrying
    released = float(lock.stdout.readline().split()[1])
    lock.wait(10)
    assert tracker.flush(60)
    snap = tracker.snapshot()
    assert snap["delayed"] == 10 and snap["dropped"] == 0 and snap["pending"] == 0, snap
    assert snap["unavailable_s"] >= 15 and "locked" in snap["last_error"], snap
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.end_time / 1000 >= released - 1
    assert [s for s, _ in tracking.metric_history(uri, run_id, "train/loss")] == [1, 2, 3, 4, 5, 6]
    assert "MLflow store unavailable (close run" in capsys.readouterr().err


def test_the_tracker_counts_restarts_across_submissions():
    from elastic_ddp.tracking import JobTracker

    t = JobTracker("sqlite:////nonexistent/x.db", "r", attempts_before=2, world_sizes_before=[2, 1])
    assert t.start_attempt(2) == {"attempts": 3, "world_sizes": [2, 1, 2]}
    assert t._tags["elastic_ddp.attempts"] == "3"
    # Nothing left for its writer thread, which would otherwise try this store (there is
    # no run "r") when its deferral ends, in whatever test runs then.
    with t._lock:
        t._tags.clear()
