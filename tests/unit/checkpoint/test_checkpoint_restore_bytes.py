"""A restore at another world size reads about its share of a checkpoint, verified: a
checkpoint written at 2 ranks (ddp and fsdp) on local disk, and its files copied as they
are to the tests' S3 server (the save to S3 is test_checkpoint_s3's), restored at 1 and
at 3 on real gloo process groups (no Ray), each rank's bytes read
measured outside the reader (local disk: the process's ``rchar``, which gloo's sockets
do not add to; S3: a proxy per rank counting the bytes of its GET responses) against
its share, the checkpoint's bytes / world size; and a flipped byte in a part a rank reads
fails the restore naming the file and the bytes.

The ranks of one world size run their jobs one after another in one spawned process
group (a rank spends seconds importing torch, a job under a second)."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic_ddp.checkpoint import MANIFEST, checkpoint_name
from elastic_ddp.checkpoint.manager import CheckpointManager
from elastic_ddp.config import Config
from elastic_ddp.parallel.strategies import build_strategy
from elastic_ddp.tasks.loading import build_model, load_task
from helpers import exits_cleanly, start_ranks, write_gathered
from helpers.s3_proxy import S3Proxy

RUN = "bytesrun"
STRATEGIES = ("ddp", "fsdp")


def _cfg(strategy: str) -> Config:
    # 7.3M parameters in one block (few tensors, wide ones, as in a large model): 88 MB
    # of model and Adam state, tensors of up to 9 MB.
    return Config.from_dict({
        "data": {"train_path": "unused"}, "task": {"kwargs": {"block_size": 16}},
        "model": {"name": "gpt", "kwargs": {"n_embd": 768, "n_head": 2, "n_layer": 1}},
        "optim": {"name": "adamw", "lr": 3e-3}, "parallel": {"strategy": strategy},
        "scaling": {"min_workers": 1, "max_workers": 3},
        "batch": {"global_batch_size": 12, "micro_batch_size": 12, "policy": "uneven"}})


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("rchar"))


def _job(rank, ws, job, out):
    endpoint = job.get("endpoint")
    if endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint[rank] if isinstance(endpoint, list) else endpoint
    cfg = _cfg(job["strategy"])
    task = load_task(cfg)
    torch.manual_seed(0)
    strategy = build_strategy(cfg, build_model(cfg, task), torch.device("cpu"), ws)
    mgr = CheckpointManager(job["storage"], RUN, {"c": 1}, rank, ws, collective=ws > 1,
                            strategy_name=job["strategy"])
    result: dict = {}
    if job.get("restore"):
        before = _rchar()
        try:
            mgr.restore(strategy)
            result["error"] = None
        except Exception as e:  # noqa: BLE001 - the damaged checkpoint's line
            result["error"] = str(e)
        result.update(rchar=_rchar() - before, read_bytes=mgr.read_bytes)
    else:
        x = torch.randint(0, 256, (12, 17), generator=torch.Generator().manual_seed(1))
        per = 12 // ws
        loss_vec, _ = task.loss(strategy.model, {"tokens": x[rank * per:(rank + 1) * per]})
        loss_vec.sum().backward()
        strategy.optimizer.step()
        mgr.save(1, strategy, {"progress": {"step": 1}}, report=False)
    result["model"] = {k: float(v.double().sum()) for k, v in
                       __import__("elastic_ddp.checkpoint.state", fromlist=["x"])
                       .model_optimizer_state(strategy)["model"].items()
                       if isinstance(v, torch.Tensor) and not hasattr(v, "full_tensor")}
    write_gathered(result, rank, ws, Path(out, job["result"]))


@exits_cleanly
def _worker(rank, ws, init_file, env, jobs, out):
    os.environ.update(env)
    torch.set_num_threads(1)
    # What a restore imports is imported before the first one is measured (rchar counts
    # the reads of module files too).
    import elastic_ddp.checkpoint.restore  # noqa: F401
    import elastic_ddp.checkpoint.verified_read  # noqa: F401
    import pyarrow.fs  # noqa: F401
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws)
    try:
        for job in jobs:
            _job(rank, ws, job, out)
    finally:
        dist.destroy_process_group()


def _run(ws: int, env: dict, jobs: list[dict], out: Path) -> None:
    start_ranks(_worker, (ws, str(out / f"pg-{uuid.uuid4().hex}"), env, jobs, str(out)), ws)


@pytest.fixture(scope="module")
def restored(s3_server, tmp_path_factory):
    """Checkpoints written at 2 (ddp, fsdp; local and S3), restored at 1 and at 3:
    ``{(strategy, where, ws): [per-rank result]}``, the checkpoints' bytes, the proxies'."""
    import boto3

    out = tmp_path_factory.mktemp("rbytes")
    env = {"AWS_ENDPOINT_URL": s3_server, "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_EC2_METADATA_DISABLED": "true"}
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    bucket = f"rb-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    where = {"local": str(out / "local"), "s3": f"s3://{bucket}/runs"}
    storage = {(s, w): f"{where[w]}/{s}" for s in STRATEGIES for w in where}
    _run(2, env, [{"strategy": s, "storage": storage[s, "local"], "result": f"w-{s}-local.json"}
                  for s in STRATEGIES], out)
    # The same checkpoints on S3: their files put as they are (an upload through the
    # checkpoint writer costs seconds per 44 MB shard on the tests' server).
    for f in sorted(p for p in (out / "local").rglob("*") if p.is_file()):
        client.upload_file(str(f), bucket, f"runs/{f.relative_to(out / 'local').as_posix()}")
    # A copy of each with a byte flipped inside a tensor of the shard of rank 1, restored
    # at 1 after the measured restores (the shard holds nothing else there).
    for s in STRATEGIES:
        bad = out / "bad" / s
        shutil.copytree(storage[s, "local"], bad)
        shard = bad / RUN / checkpoint_name(1) / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    results, counted = {}, {}
    for ws in (1, 3):
        proxies = {(s, r): S3Proxy(s3_server) for s in STRATEGIES for r in range(ws)}
        try:
            jobs = [{"strategy": s, "storage": storage[s, w], "restore": True,
                     "result": f"r-{s}-{w}-{ws}.json",
                     **({"endpoint": [proxies[s, r].url for r in range(ws)]} if w == "s3" else {})}
                    for s in STRATEGIES for w in where]
            if ws == 1:
                jobs += [{"strategy": s, "storage": str(out / "bad" / s), "restore": True,
                          "result": f"bad-{s}.json"} for s in STRATEGIES]
            _run(ws, env, jobs, out)
        finally:
            for p in proxies.values():
                p.stop()
        counted.update({(s, ws): [proxies[s, r].got_bytes for r in range(ws)] for s in STRATEGIES})
        for s in STRATEGIES:
            for w in where:
                results[s, w, ws] = json.loads((out / f"r-{s}-{w}-{ws}.json").read_text())
    totals = {}
    for s in STRATEGIES:
        m = json.loads((out / "local" / s / RUN / checkpoint_name(1) / MANIFEST).read_text())
        totals[s] = sum(r["bytes"] for r in m["files"].values())
    written = {s: json.loads((out / f"w-{s}-local.json").read_text()) for s in STRATEGIES}
    damaged = {s: json.loads((out / f"bad-{s}.json").read_text()) for s in STRATEGIES}
    yield {"results": results, "counted": counted, "totals": totals, "written": written,
           "damaged": damaged}


@pytest.mark.parametrize("ws", [1, 3])
@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_restore_at_another_world_size_reads_its_share_verified(restored, strategy, where, ws):
    res = restored["results"][strategy, where, ws]
    share = restored["totals"][strategy] / ws
    measured = ([r["rchar"] for r in res] if where == "local"
                else restored["counted"][strategy, ws])
    print(f"{strategy} {where} at {ws}: share {share:.0f} B; read per rank {measured} "
          f"(the reader's count {[r['read_bytes'] for r in res]})")
    assert all(r["error"] is None for r in res), res
    for rank in range(ws):
        assert measured[rank] <= 1.1 * share, (rank, measured, share)
        assert res[rank]["read_bytes"] <= 1.1 * share, (rank, res, share)
    if strategy == "ddp":  # the model as written (fsdp's shards are DTensors: left out)
        assert res[0]["model"] == restored["written"][strategy][0]["model"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_flipped_byte_in_a_part_read_at_another_world_size_fails_the_restore(
        restored, strategy):
    """The checkpoint written at 2, a byte flipped in the middle of rank 1's shard,
    restored at 1: the restore fails naming the file, its checksum and the bytes."""
    (r,) = restored["damaged"][strategy]
    assert r["error"] and "__1_0.distcp (xxh3_64 " in r["error"], r
    assert "of bytes" in r["error"] and "the manifest says" in r["error"], r
