"""Sharded checkpoints on object storage (the tests' S3 server, moto's, on 127.0.0.1), on
real gloo process groups (torch.multiprocessing, no Ray), real DCP:

- an asynchronous save to ``s3://`` trains while its write and upload run, commits with
  its manifest written last, and leaves no local staging directory;
- an upload the store refuses (a proxy in front of the server answers rank 1's shard
  with ``403 AccessDenied``) fails that checkpoint in one line naming the rank, the key
  and the store's error; training goes on and the previous checkpoint restores;
- a rank killed between its write and its upload leaves no manifest: the restore (at
  another world size, 3) falls back to the previous complete checkpoint, removes the
  torn one, and trains on the curve of the uninterrupted run on local disk;
- a restore reads about its share of the checkpoint from the store (a proxy per rank
  counts the bytes of its GET responses), not the whole checkpoint.

The ranks of one world size run their jobs one after another in one spawned process
group (a rank spends seconds importing torch, a job under a second)."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic_ddp.checkpoint import MANIFEST, checkpoint_name
from elastic_ddp.checkpoint.manager import CheckpointManager
from elastic_ddp.config import Config
from elastic_ddp.parallel.strategies import build_strategy
from elastic_ddp.tasks.loading import build_model, load_task
from helpers import exits_cleanly, gpt_checkpoint_config, start_ranks, write_gathered
from helpers.s3_proxy import S3Proxy

RUN = "s3run"


def _cfg(strategy: str) -> Config:
    return gpt_checkpoint_config(strategy)


def _steps(strategy, task, first: int, n: int, rank: int, ws: int) -> list[float]:
    """Steps first..first+n-1 on fixed global batches of 12 rows split evenly over ws."""
    losses = []
    for step in range(first, first + n):
        x = torch.randint(0, 256, (12, 17), generator=torch.Generator().manual_seed(1000 + step))
        per = 12 // ws
        loss_vec, _ = task.loss(strategy.model, {"tokens": x[rank * per:(rank + 1) * per]})
        (loss_vec.sum() * strategy.grad_divisor / 12).backward()
        strategy.clip_grad_norm(1.0)
        strategy.optimizer.step()
        strategy.optimizer.zero_grad(set_to_none=True)
        t = torch.tensor([float(loss_vec.detach().sum())])
        if ws > 1:
            dist.all_reduce(t)
        losses.append(float(t) / 12)
    return losses


def _job(rank, ws, job, out):
    endpoint = job.get("endpoint")
    if endpoint:  # this job's S3 endpoint (a proxy of its own per rank, where a list)
        os.environ["AWS_ENDPOINT_URL"] = endpoint[rank] if isinstance(endpoint, list) else endpoint
    if job.get("tmpdir"):  # where this job's ranks stage their uploads
        os.environ["TMPDIR"] = tempfile.tempdir = job["tmpdir"]
    cfg = _cfg(job["strategy"])
    task = load_task(cfg)
    torch.manual_seed(0)
    strategy = build_strategy(cfg, build_model(cfg, task), torch.device("cpu"), ws)
    lines: list[str] = []
    mgr = CheckpointManager(job["storage"], RUN, {"c": 1}, rank, ws, collective=ws > 1,
                            log=lines.append, strategy_name=job["strategy"])
    result: dict = {"losses": []}
    first = 0
    if job.get("restore"):
        run_state, path = mgr.restore(strategy)
        first = run_state["progress"]["step"]
        result.update(restored=path, read_bytes=mgr.read_bytes)
    if job.get("async_at"):
        # An asynchronous checkpoint at each step of async_at, training a step during
        # each write (polled, as the step loop does), then waited for.
        for at in job["async_at"]:
            result["losses"] += _steps(strategy, task, first, at - first, rank, ws)
            hook = None
            if job.get("kill_at") == at and rank == 0:
                def hook(shard: str) -> None:  # between this rank's write and its upload
                    Path(out, "killed").write_text(shard)
                    os.kill(os.getpid(), signal.SIGKILL)
            mgr.save(at, strategy, {"progress": {"step": at}}, report=False, asynchronous=True,
                     fault_hook=hook)
            result["losses"] += _steps(strategy, task, at, 1, rank, ws)
            mgr.poll()
            mgr.wait()
            first = at + 1
        if job.get("kill_at"):
            raise AssertionError("rank 0 should have died between its write and its upload")
    result["losses"] += _steps(strategy, task, first, job.get("steps", 0), rank, ws)
    result["log"] = lines
    write_gathered(result, rank, ws, Path(out, job["result"]))


@exits_cleanly
def _worker(rank, ws, init_file, env, jobs, out):
    os.environ.update(env)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws)
    try:
        for job in jobs:
            _job(rank, ws, job, out)
    finally:
        dist.destroy_process_group()


def _run(ws: int, env: dict, jobs: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    start_ranks(_worker, (ws, str(out / f"pg-{uuid.uuid4().hex}"), env, jobs, str(out)), ws)


def _result(out: Path, name: str) -> list[dict]:
    return json.loads((out / name).read_text())


@pytest.fixture(scope="module")
def s3_runs(s3_server, tmp_path_factory):
    """At world size 2, in one process group: the uninterrupted run on local disk (6
    steps); on bucket ``fail`` (through a proxy that refuses rank 1's shard of step 6)
    asynchronous checkpoints at steps 3 and 6; a restore from it through a proxy per
    rank; last, on bucket ``kill`` the same checkpoints, rank 0 killed before its upload
    at step 6. At world size 3: the restore from ``kill`` and 3 steps."""
    import boto3

    out = tmp_path_factory.mktemp("s3ck")
    staging = {k: out / f"tmp-{k}" for k in ("fail", "kill")}
    for d in staging.values():
        d.mkdir()
    env = {"AWS_ENDPOINT_URL": s3_server, "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_EC2_METADATA_DISABLED": "true"}
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    tag = uuid.uuid4().hex[:8]
    buckets = {k: f"ck-{k}-{tag}" for k in ("fail", "kill")}
    for b in buckets.values():
        client.create_bucket(Bucket=b)
    refuse = S3Proxy(s3_server)
    refuse.fail(rf"/{buckets['fail']}/runs/{RUN}/{checkpoint_name(6)}/__1_0\.distcp", 403,
                "AccessDenied", "Access Denied")
    counted = [S3Proxy(s3_server) for _ in range(2)]
    try:
        fail = {"tmpdir": str(staging["fail"])}
        with pytest.raises(mp.ProcessExitedException):
            _run(2, env, [
                {"strategy": "ddp", "storage": str(out / "local"), "steps": 6, "result": "ref.json",
                 **fail},
                {"strategy": "ddp", "storage": f"s3://{buckets['fail']}/runs", "async_at": [3, 6],
                 "endpoint": refuse.url, "steps": 1, "result": "fail.json", **fail},
                {"strategy": "ddp", "storage": f"s3://{buckets['fail']}/runs", "restore": True,
                 "endpoint": [p.url for p in counted], "result": "bytes.json", **fail},
                {"strategy": "fsdp", "storage": f"s3://{buckets['kill']}/runs", "endpoint": s3_server,
                 "async_at": [3, 6], "kill_at": 6, "result": "never.json",
                 "tmpdir": str(staging["kill"])},
            ], out)
        torn_keys = [o["Key"] for o in client.list_objects_v2(
            Bucket=buckets["kill"], Prefix=f"runs/{RUN}/{checkpoint_name(6)}/").get("Contents", [])]
        left = [p.name for p in staging["kill"].iterdir()]
        # The restart: restore at world size 3, then train, a checkpoint at step 7 (whose
        # staging removes the killed ranks' leftovers).
        _run(3, {**env, "TMPDIR": str(staging["kill"])}, [
            {"strategy": "fsdp", "storage": f"s3://{buckets['kill']}/runs", "restore": True,
             "async_at": [7], "result": "resumed.json"}], out)
        keys = {b: [o["Key"] for o in client.list_objects_v2(Bucket=n).get("Contents", [])]
                for b, n in buckets.items()}
    finally:
        refuse.stop()
        for p in counted:
            p.stop()
    yield {"out": out, "keys": keys, "killed_left": left, "torn_keys": torn_keys, "refused": refuse.failed,
           "counted": [p.got_bytes for p in counted], "staging": staging, "client": client,
           "buckets": buckets}


def _ckpt_keys(keys: list[str], step: int) -> set[str]:
    prefix = f"runs/{RUN}/{checkpoint_name(step)}/"
    return {k[len(prefix):] for k in keys if k.startswith(prefix)}


def test_an_asynchronous_save_to_s3_commits_with_its_manifest_and_stages_nothing_left(s3_runs):
    got = _ckpt_keys(s3_runs["keys"]["fail"], 3)
    assert {MANIFEST, ".metadata", "__0_0.distcp", "__1_0.distcp", "run_state.json",
            "config.json"} <= got, got
    body = s3_runs["client"].get_object(Bucket=s3_runs["buckets"]["fail"],
                                        Key=f"runs/{RUN}/{checkpoint_name(3)}/{MANIFEST}")["Body"].read()
    manifest = json.loads(body)
    assert manifest["step"] == 3 and manifest["world_size"] == 2
    assert set(manifest["files"]) == got - {MANIFEST} - {""}, (manifest["files"], got)
    # Every rank removed its staging directory, after the failed upload as after the good
    # ones; a killed rank's is removed by the next save on the node.
    def staged(names):
        return [n for n in names if n.startswith("elastic-ddp-")]

    assert not staged(p.name for p in s3_runs["staging"]["fail"].iterdir())
    # rank 0's, and rank 1's where the kill ended it before its upload did
    assert 1 <= len(staged(s3_runs["killed_left"])) <= 2, s3_runs["killed_left"]
    assert not staged(p.name for p in s3_runs["staging"]["kill"].iterdir())


def test_a_refused_upload_fails_its_checkpoint_in_one_line_and_training_goes_on(s3_runs):
    out = s3_runs["out"]
    assert s3_runs["refused"], "the proxy refused nothing: the upload never reached it"
    r0, r1 = _result(out, "fail.json")
    # Steps 0-2, 3 (during the write at 3), 4-5, 6 (during the failed write at 6), 7.
    assert len(r0["losses"]) == 8 and r0["losses"] == r1["losses"]
    (line,) = [ln for ln in r0["log"] if "checkpoint write failed" in ln]
    key = f"{s3_runs['buckets']['fail']}/runs/{RUN}/{checkpoint_name(6)}/__1_0.distcp"
    assert "rank 1" in line and key in line, line
    assert "Access Denied" in line or "ACCESS_DENIED" in line, line
    assert "previous checkpoint stays the restart point" in line, line
    assert "\n" not in line
    assert MANIFEST not in _ckpt_keys(s3_runs["keys"]["fail"], 6)
    b0, b1 = _result(out, "bytes.json")
    assert b0["restored"].endswith(checkpoint_name(3)), b0["restored"]


def test_a_restore_from_s3_reads_about_its_share_not_the_whole_checkpoint(s3_runs):
    out = s3_runs["out"]
    body = s3_runs["client"].get_object(Bucket=s3_runs["buckets"]["fail"],
                                        Key=f"runs/{RUN}/{checkpoint_name(3)}/{MANIFEST}")["Body"].read()
    files = json.loads(body)["files"]
    total = sum(r["bytes"] for r in files.values())
    small = sum(r["bytes"] for n, r in files.items() if not n.endswith(".distcp"))
    shares = [files[f"__{r}_0.distcp"]["bytes"] for r in range(2)]
    entries = _non_tensor_bytes(s3_runs, f"runs/{RUN}/{checkpoint_name(3)}")
    counted = s3_runs["counted"]
    reported = [r["read_bytes"] for r in _result(out, "bytes.json")]
    print(f"checkpoint {total} B, shares {shares}, small {small}; read per rank "
          f"(proxy) {counted}, (manager) {reported}")
    for rank in range(2):
        # Its share, the small files, and the non-tensor entries (learning rates, betas:
        # every rank reads them all, wherever DCP's dedup put them).
        assert counted[rank] <= 1.1 * shares[rank] + small + entries, (rank, counted, shares, small, entries)
        assert counted[rank] < 0.75 * total, (rank, counted, total)
        assert reported[rank] <= counted[rank]


def _non_tensor_bytes(s3_runs, prefix: str) -> int:
    """Bytes of the checkpoint's non-tensor entries (from its DCP ``.metadata``)."""
    import tempfile

    from torch.distributed.checkpoint import BytesStorageMetadata, FileSystemReader

    body = s3_runs["client"].get_object(Bucket=s3_runs["buckets"]["fail"],
                                        Key=f"{prefix}/.metadata")["Body"].read()
    with tempfile.TemporaryDirectory() as d:
        Path(d, ".metadata").write_bytes(body)
        meta = FileSystemReader(d).read_metadata()
    plain = {k for k, m in meta.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata)}
    return sum(info.length for idx, info in meta.storage_data.items() if idx.fqn in plain)


def test_a_rank_killed_before_its_upload_leaves_no_manifest_and_the_restore_falls_back(s3_runs):
    out = s3_runs["out"]
    assert (out / "killed").exists()
    torn = {k.rsplit("/", 1)[-1] for k in s3_runs["torn_keys"]}
    assert MANIFEST not in torn and "__0_0.distcp" not in torn, torn
    resumed = _result(out, "resumed.json")
    assert all(r["restored"].endswith(checkpoint_name(3)) for r in resumed), resumed
    ref = torch.tensor(_result(out, "ref.json")[0]["losses"])
    got = torch.tensor(resumed[0]["losses"][:3])
    rel = ((got - ref[3:]).abs() / ref[3:]).max().item()
    assert rel <= 1e-4, f"fsdp written at 2 on S3, resumed at 3: drifts by {rel:.2e} from local ddp"
    # The restore removed the torn checkpoint (no manifest) from the bucket; the one
    # written at world size 3 after it is complete.
    assert not _ckpt_keys(s3_runs["keys"]["kill"], 6)
    assert {MANIFEST, "__2_0.distcp"} <= _ckpt_keys(s3_runs["keys"]["kill"], 7)


def test_listing_and_the_drivers_resume_check_on_s3_read_manifests_not_shards(s3, monkeypatch):
    """In this process (one writer, no process group): checkpoints at steps 2, 4 and 6 on
    the S3 server, step 6's manifest removed (a write cut short). The listing and the
    driver's check before a resume read the manifests and stat the objects (a proxy
    counts the bytes they GET: under one shard's size); a shard cut short makes the
    check fall back to the previous checkpoint."""
    from elastic_ddp.checkpoint.layout import complete_checkpoints
    from elastic_ddp.driver.resume import newest_that_verifies

    cfg = _cfg("ddp")
    task = load_task(cfg)
    strategy = build_strategy(cfg, build_model(cfg, task), torch.device("cpu"), 1)
    storage = s3.uri("runs")
    mgr = CheckpointManager(storage, RUN, {"c": 1}, 0, 1, collective=False, log=lambda m: None)
    for step in (2, 4, 6):
        mgr.save(step, strategy, {"progress": {"step": step}}, report=False)
    prefix = f"runs/{RUN}/"
    s3.client.delete_object(Bucket=s3.name, Key=f"{prefix}{checkpoint_name(6)}/{MANIFEST}")
    shard = s3.client.head_object(Bucket=s3.name, Key=f"{prefix}{checkpoint_name(4)}/__0_0.distcp")
    proxy = S3Proxy(s3.endpoint)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        assert [k for k, _ in complete_checkpoints(storage, RUN)] == [4, 2]
        path, manifest, events = newest_that_verifies(storage, RUN)
        assert path.endswith(checkpoint_name(4)) and manifest["step"] == 4 and not events
        assert proxy.got_bytes < shard["ContentLength"] / 4, (proxy.got_bytes, shard["ContentLength"])
        # Step 4's shard cut short: the check names it and falls back to step 2.
        key = f"{prefix}{checkpoint_name(4)}/__0_0.distcp"
        body = s3.client.get_object(Bucket=s3.name, Key=key)["Body"].read()
        s3.client.put_object(Bucket=s3.name, Key=key, Body=body[: len(body) // 2])
        path, manifest, events = newest_that_verifies(storage, RUN)
        assert path.endswith(checkpoint_name(2)), path
        assert [e["checkpoint"].endswith(checkpoint_name(4)) for e in events] == [True]
        assert "__0_0.distcp" in events[0]["bad_files"][0]
    finally:
        proxy.stop()


def test_a_synchronous_save_the_store_refuses_stops_with_one_line_and_no_manifest(s3, monkeypatch,
                                                                                   tmp_path):
    """One writer, no process group: the store answers the shard's upload with 503
    SlowDown past the client's retries; the save raises one line naming the rank, the
    key and the store's error, writes no manifest, removes what it wrote and its
    staging directory."""
    from elastic_ddp.checkpoint.layout import complete_checkpoints
    from elastic_ddp.checkpoint.upload import CheckpointWriteError

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    cfg = _cfg("ddp")
    task = load_task(cfg)
    strategy = build_strategy(cfg, build_model(cfg, task), torch.device("cpu"), 1)
    proxy = S3Proxy(s3.endpoint)
    proxy.fail(r"/__0_0\.distcp", 503, "SlowDown", "Please reduce your request rate.")
    lines: list[str] = []
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        mgr = CheckpointManager(s3.uri("runs"), RUN, {"c": 1}, 0, 1, collective=False,
                                log=lines.append)
        with pytest.raises(CheckpointWriteError) as e:
            mgr.save(2, strategy, {"progress": {"step": 2}}, report=False)
    finally:
        proxy.stop()
    msg = str(e.value)
    assert "\n" not in msg and "rank 0" in msg and "__0_0.distcp" in msg and "SLOW_DOWN" in msg.upper().replace(" ", "_"), msg
    assert len(proxy.failed) > 1, "the client did not retry a 503"
    assert lines and "previous checkpoint stays the restart point" in lines[0]
    assert not s3.keys(f"runs/{RUN}/checkpoint_"), s3.keys(f"runs/{RUN}/")
    assert complete_checkpoints(s3.uri("runs"), RUN) == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("elastic-ddp-")]
