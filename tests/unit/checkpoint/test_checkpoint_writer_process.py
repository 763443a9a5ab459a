"""The asynchronous checkpoint serialised in a process of its own (``train.checkpoint_writer:
process``), on real gloo process groups (no Ray) and real DCP: for ddp and fsdp, on local
disk and on the tests' S3 server, a checkpoint written while a step trains commits with
its manifest (every shard's records, block checksums included) and restores the state
the thread's writer restores; the writer is a child process of the rank, at a nice value
10 above it; a writer killed between checkpoints is replaced at the next one, which commits."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic_ddp.checkpoint import MANIFEST, checkpoint_name
from elastic_ddp.checkpoint.manager import CheckpointManager
from elastic_ddp.config import Config
from elastic_ddp.checkpoint.state import model_optimizer_state
from helpers import exits_cleanly, gpt_checkpoint_config, start_ranks, write_gathered
from elastic_ddp.parallel.strategies import build_strategy
from elastic_ddp.tasks.loading import build_model, load_task

RUN = "writerrun"


def _cfg(strategy: str) -> Config:
    return gpt_checkpoint_config(strategy)


def _sums(strategy) -> dict:
    out = {}
    for part, d in model_optimizer_state(strategy).items():
        for k, v in d.items():
            if isinstance(v, torch.Tensor):
                v = v.full_tensor() if hasattr(v, "full_tensor") else v
                out[f"{part}.{k}"] = float(v.double().sum())
    return out


def _step(strategy, task, rank: int, ws: int, seed: int) -> None:
    x = torch.randint(0, 256, (12, 17), generator=torch.Generator().manual_seed(seed))
    per = 12 // ws
    loss_vec, _ = task.loss(strategy.model, {"tokens": x[rank * per:(rank + 1) * per]})
    loss_vec.sum().backward()
    strategy.optimizer.step()
    strategy.optimizer.zero_grad(set_to_none=True)


def _job(rank, ws, job, out):
    cfg = _cfg(job["strategy"])
    task = load_task(cfg)

    def fresh():
        torch.manual_seed(0)
        return build_strategy(cfg, build_model(cfg, task), torch.device("cpu"), ws)

    strategy = fresh()
    conf = {"train": {"checkpoint_writer": job["writer"], "checkpoint_files_per_rank": job.get("files", 1)}}
    mgr = CheckpointManager(job["storage"], RUN, conf, rank, ws, collective=True,
                            strategy_name=job["strategy"])
    _step(strategy, task, rank, ws, 1)
    mgr.save(1, strategy, {"progress": {"step": 1}}, report=False, asynchronous=True)
    _step(strategy, task, rank, ws, 2)  # trains while the write runs
    mgr.poll()
    mgr.wait()
    result: dict = {"writer_nice": None}
    if job["writer"] == "process":
        from elastic_ddp.checkpoint import writer_process

        proc = writer_process._CHILD[0]
        with open(f"/proc/{proc.pid}/stat") as f:
            child = int(f.read().rsplit(")", 1)[1].split()[16])
        with open("/proc/self/stat") as f:
            me = int(f.read().rsplit(")", 1)[1].split()[16])
        result.update(writer_nice=child - me, writer_pid=proc.pid, pid=os.getpid())
    if job.get("kill_writer"):
        # The writer process dies (rank 1's) between checkpoints: the next checkpoint
        # fails in one line on every rank, training goes on, the one after commits.
        import signal

        from elastic_ddp.checkpoint import writer_process

        first = writer_process._CHILD[0].pid
        if rank == 1:
            os.kill(first, signal.SIGKILL)
            writer_process._CHILD[0].join(10)
        dist.barrier()
        lines: list[str] = []
        mgr.log = lines.append
        mgr.save(3, strategy, {"progress": {"step": 3}}, report=False, asynchronous=True)
        _step(strategy, task, rank, ws, 3)
        mgr.wait()
        mgr.save(4, strategy, {"progress": {"step": 4}}, report=False, asynchronous=True)
        mgr.wait()
        result["failed"] = [ln for ln in lines if "checkpoint write failed" in ln]
        result["writers"] = [first, writer_process._CHILD[0].pid]
        result["before"] = _sums(strategy)
    restored = fresh()
    CheckpointManager(job["storage"], RUN, conf, rank, ws, collective=True,
                      strategy_name=job["strategy"]).restore(restored)
    result["sums"] = _sums(restored)
    if rank == 0:  # the files the manifest names (on object storage too)
        from elastic_ddp.checkpoint.layout import read_manifest, run_dir

        fs, run = run_dir(job["storage"], RUN)
        result["files"] = sorted(read_manifest(fs, f"{run}/{checkpoint_name(1)}")["files"])
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


@pytest.fixture(scope="module")
def written(s3_server, tmp_path_factory):
    import boto3

    out = tmp_path_factory.mktemp("wproc")
    env = {"AWS_ENDPOINT_URL": s3_server, "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_EC2_METADATA_DISABLED": "true"}
    bucket = f"wp-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    jobs = []
    for s in ("ddp", "fsdp"):
        for w in ("thread", "process"):
            jobs.append({"strategy": s, "writer": w, "storage": str(out / w / s),
                         "result": f"{s}-{w}.json"})
        # On S3, each rank's part in 2 files (train.checkpoint_files_per_rank).
        jobs.append({"strategy": s, "writer": "process", "storage": f"s3://{bucket}/{s}", "files": 2,
                     "result": f"{s}-process-s3.json"})
    jobs.append({"strategy": "ddp", "writer": "process", "storage": str(out / "killed"),
                 "kill_writer": True, "result": "killed.json"})
    start_ranks(_worker, (2, str(out / f"pg-{uuid.uuid4().hex}"), env, jobs, str(out)), 2)
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_process_writer_commits_what_the_thread_writer_commits(written, strategy):
    thread = json.loads((written / f"{strategy}-thread.json").read_text())
    for name in ("process", "process-s3"):
        got = json.loads((written / f"{strategy}-{name}.json").read_text())
        for r in range(2):
            assert got[r]["sums"] == thread[r]["sums"], (name, r)
            assert got[r]["writer_nice"] == 10 and got[r]["writer_pid"] != got[r]["pid"], got[r]
    manifest = json.loads((written / "process" / strategy / RUN / checkpoint_name(1) / MANIFEST)
                          .read_text())
    shards = [n for n in manifest["files"] if n.endswith(".distcp")]
    assert sorted(shards) == ["__0_0.distcp", "__1_0.distcp"], manifest["files"]
    assert all(manifest["files"][n]["xxh3_64_blocks"] for n in shards)
    s3_shards = [n for n in json.loads((written / f"{strategy}-process-s3.json").read_text())[0]["files"]
                 if n.endswith(".distcp")]
    assert s3_shards == ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"], s3_shards


def test_a_writer_process_found_dead_is_replaced_and_the_next_checkpoints_commit(written):
    got = json.loads((written / "killed.json").read_text())
    assert got[0]["failed"] == [], got[0]["failed"]
    first, then = got[1]["writers"]
    assert first != then, got[1]["writers"]  # rank 1's writer: a new process
    assert got[0]["writers"][0] == got[0]["writers"][1]  # rank 0's: the same one
    for r in range(2):
        assert got[r]["sums"] == got[r]["before"], r  # the restore: step 4's checkpoint
    run = written / "killed" / RUN
    assert (run / checkpoint_name(3) / MANIFEST).exists() and (run / checkpoint_name(4) / MANIFEST).exists()
