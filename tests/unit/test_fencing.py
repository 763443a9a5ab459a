"""Fencing tokens for the run's lease (``elastic_ddp.fencing``), on local disk and on a real
S3 server: a job whose lease was taken over (it stopped heartbeating: paused, cut off)
finds the newer generation at its next write and writes nothing more: no checkpoint
claimed or committed, none pruned, no metric written to its MLflow run. Real files, a
real S3 server (moto's, on loopback), real checkpoints and a real MLflow store."""

from __future__ import annotations

import json
import os
import pickle
import time

import pytest
import torch

from elastic_ddp.driver.lease import STALE_S, RunLease
from elastic_ddp.fencing import Fence, FencedError, lease_location

RUN = "fenced"


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "runs")
    return request.getfixturevalue("s3").uri("runs")


def _pause(lease: RunLease) -> None:
    """``lease``'s holder as if paused past the staleness limit: no more heartbeats, and
    its record's last one ``STALE_S`` seconds old."""
    lease._stop.set()
    lease._thread.join(timeout=10)
    fs, path = lease_location(lease.storage, lease.name)
    with fs.open_input_stream(path) as f:
        rec = json.loads(f.read().decode().strip())
    rec["heartbeat"] = time.time() - STALE_S - 1
    with fs.open_output_stream(path) as f:
        f.write(json.dumps(rec).encode())


def _take_over(storage: str) -> tuple[RunLease, RunLease]:
    """Job A takes the lease, is paused, job B takes the run over: (A, B)."""
    a = RunLease(storage, RUN).acquire()
    _pause(a)
    b = RunLease(storage, RUN).acquire()
    return a, b


def test_a_takeover_makes_a_newer_generation_that_fences_the_old_holder(storage):
    from elastic_ddp.positions import is_fatal

    a = RunLease(storage, RUN).acquire()
    fence_a = a.fence()
    assert fence_a.lost() is None and a.lost() is None
    fence_a.check("a write")  # its own lease: no error
    _pause(a)
    b = RunLease(storage, RUN).acquire()
    try:
        assert b.took_over["generation"] == fence_a.generation
        assert b.fence().generation > fence_a.generation
        # A's workers and tracker hold a pickled copy: it reads the record itself.
        copy = pickle.loads(pickle.dumps(fence_a))
        taken = copy.lost()
        assert taken is not None and taken["generation"] == b.fence().generation
        with pytest.raises(FencedError) as e:
            copy.check("the checkpoint of step 8")
        msg = str(e.value)
        assert msg.startswith("the checkpoint of step 8 not written: run 'fenced' was taken over "
                              f"by another job (host {b.record['host']}, pid {os.getpid()}, at "), msg
        assert f"lease generation {b.fence().generation}" in msg and "\n" not in msg
        assert is_fatal(e.value)  # a worker that raises it is not restarted
        assert a.lost()["generation"] == b.fence().generation  # the driver's own check
        assert b.fence().lost() is None
        a.release()  # the fenced job's release leaves the new holder's record alone
        assert b.fence().lost() is None and b.lost() is None
    finally:
        b.release()


def test_the_heartbeat_finds_the_takeover_and_says_so_once(tmp_path, monkeypatch):
    """The driver's heartbeat is where a job that was paused notices: ``on_lost`` is
    called with the new holder's record, and the heartbeat writes nothing over it."""
    from elastic_ddp.driver import lease as lease_module

    monkeypatch.setattr(lease_module, "HEARTBEAT_S", 0.2)
    a = RunLease(str(tmp_path), RUN).acquire()
    seen = []
    a.on_lost = seen.append
    fs, path = lease_location(str(tmp_path), RUN)
    rec = json.loads(open(path).read())
    # Another job's record in its place (as a takeover while A was paused writes it).
    other = {**rec, "host": "b.example", "pid": 4242, "generation": rec["generation"] + 1,
             "heartbeat": time.time()}
    os.unlink(path)
    with open(path, "w") as f:
        f.write(json.dumps(other))
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [r["host"] for r in seen] == ["b.example"]
    time.sleep(0.5)
    assert json.loads(open(path).read()) == other and len(seen) == 1
    a.release()
    assert json.loads(open(path).read()) == other


def _cfg():
    from elastic_ddp.config import Config

    return Config.from_dict({
        "data": {"train_path": "unused"}, "task": {"kwargs": {"block_size": 16}},
        "model": {"name": "gpt", "kwargs": {"n_embd": 32, "n_head": 2, "n_layer": 2}},
        "optim": {"name": "adamw", "lr": 3e-3}, "scaling": {"min_workers": 1, "max_workers": 1},
        "batch": {"global_batch_size": 12, "micro_batch_size": 12, "policy": "uneven"}})


def test_a_fenced_job_commits_no_checkpoint_and_prunes_none(storage):
    from elastic_ddp.checkpoint.layout import complete_checkpoints
    from elastic_ddp.checkpoint.manager import CheckpointManager
    from elastic_ddp.parallel.strategies import build_strategy
    from elastic_ddp.paths import uri_to_filesystem
    from elastic_ddp.tasks.loading import build_model, load_task

    cfg = _cfg()
    strategy = build_strategy(cfg, build_model(cfg, load_task(cfg)), torch.device("cpu"), 1)
    a = RunLease(storage, RUN).acquire()
    mgr_a = CheckpointManager(storage, RUN, None, 0, 1, collective=False, log=lambda m: None,
                              fence=a.fence())
    for step in (2, 4):  # unreported, as a partial quorum's: prune_unreported's to remove
        mgr_a.save(step, strategy, {"progress": {"step": step}}, report=False)
    _pause(a)
    b = RunLease(storage, RUN).acquire()
    try:
        with pytest.raises(FencedError, match=r"^the checkpoint of step 6 not written: run 'fenced' "
                                              r"was taken over"):
            mgr_a.save(6, strategy, {"progress": {"step": 6}}, report=False)
        with pytest.raises(FencedError, match="the pruning of unreported checkpoints not written"):
            mgr_a.prune_unreported(keep=1)
        assert [k for k, _ in complete_checkpoints(storage, RUN)] == [4, 2]
        fs, base = uri_to_filesystem(storage)
        import pyarrow.fs as pafs

        names = [i.base_name for i in fs.get_file_info(pafs.FileSelector(f"{base}/{RUN}"))]
        assert not any("step00000006" in n for n in names), names  # not even claimed
        # The job that holds the lease writes and prunes as before.
        mgr_b = CheckpointManager(storage, RUN, None, 0, 1, collective=False, log=lambda m: None,
                                  fence=b.fence())
        mgr_b.save(6, strategy, {"progress": {"step": 6}}, report=False)
        assert len(mgr_b.prune_unreported(keep=1)) == 2
        assert [k for k, _ in complete_checkpoints(storage, RUN)] == [6]
    finally:
        a.release()
        b.release()


def test_a_fenced_tracker_writes_no_metric_to_the_run(tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    from elastic_ddp.tracking.store import metric_key
    from elastic_ddp.tracking.tracker import JobTracker

    client = MlflowClient(mlflow_store)
    run_id = client.create_run(client.create_experiment("fencing")).info.run_id
    a = RunLease(str(tmp_path), RUN).acquire()
    tracker = JobTracker(mlflow_store, flush_period_s=0.2)
    tracker.bind(run_id, fence=a.fence())
    tracker.log_metrics({"train_loss": 1.0}, 2)
    assert tracker.flush(30) and tracker.fenced is None
    _pause(a)
    b = RunLease(str(tmp_path), RUN).acquire()
    try:
        tracker.log_metrics({"train_loss": 0.5}, 4)
        tracker.set_tags({"elastic_ddp.status": "x"})
        assert tracker.flush(30)
        assert tracker.fenced is not None and tracker.fenced["generation"] == b.fence().generation
        hist = client.get_metric_history(run_id, metric_key("train_loss"))
        assert [m.step for m in hist] == [2]
        assert "elastic_ddp.status" not in client.get_run(run_id).data.tags
        assert tracker.dropped >= 1
    finally:
        a.release()
        b.release()


def test_a_lease_without_a_record_or_unreadable_is_not_taken_for_a_loss(tmp_path):
    """A node that does not see the storage path, or a released lease: not fenced (the
    driver's heartbeat judges those)."""
    fence = Fence(str(tmp_path / "nowhere"), RUN, {"generation": 5, "host": "h", "pid": 1})
    assert fence.lost() is None
    fence.check("anything")


def test_a_lease_record_removed_under_the_job_fences_it_with_a_line_that_says_so(tmp_path, monkeypatch):
    from elastic_ddp.driver import lease as lease_module
    from elastic_ddp.fencing import taken_over_line

    monkeypatch.setattr(lease_module, "HEARTBEAT_S", 0.2)
    a = RunLease(str(tmp_path), RUN).acquire()
    seen = []
    a.on_lost = seen.append
    os.unlink(lease_location(str(tmp_path), RUN)[1])
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.1)
    assert seen == [{"removed": True}] and a.lost() == {"removed": True}
    assert taken_over_line(RUN, a.lost()).startswith("run 'fenced' lost its lease while this job")
    a.release()
