"""``checkpoint.store_reader.StoreReader`` on the real S3 server (moto's, on loopback): a
checkpoint written by ``CheckpointManager`` at world size 2 (gloo) and uploaded to S3
loads the keys asked for, equal to DCP's own ``FileSystemReader`` on the local copy, and
fetches only their bytes; two gloo ranks each restoring their share from S3 read at most
1.1 x that share."""

from __future__ import annotations

import functools
import json
import os
import sys
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic_ddp.checkpoint import checkpoint_name
from elastic_ddp.checkpoint.store_reader import METADATA, StoreReader, files_of, load_keys
from helpers import start_ranks

RUN = "reader"


def _cfg():
    from elastic_ddp.config import Config

    return Config.from_dict({
        "data": {"train_path": "unused"}, "task": {"kwargs": {"block_size": 16}},
        "model": {"name": "gpt", "kwargs": {"n_embd": 48, "n_head": 2, "n_layer": 2}},
        "optim": {"name": "adamw", "lr": 3e-3}, "parallel": {"strategy": "ddp"},
        "scaling": {"min_workers": 1, "max_workers": 2},
        "batch": {"global_batch_size": 4, "micro_batch_size": 4, "policy": "uneven"}})


def _strategy(ws: int, seed: int):
    from elastic_ddp.parallel.strategies import build_strategy
    from elastic_ddp.tasks.loading import build_model, load_task

    cfg = _cfg()
    task = load_task(cfg)
    torch.manual_seed(seed)
    s = build_strategy(cfg, build_model(cfg, task), torch.device("cpu"), ws)
    x = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(seed))
    loss_vec, _ = task.loss(s.model, {"tokens": x})
    loss_vec.sum().backward()  # one step: the optimizer has state (Adam's moments)
    s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    return s


def _exits_cleanly(fn):
    @functools.wraps(fn)
    def run(*args):
        fn(*args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return run


@_exits_cleanly
def _rank(rank, ws, init_file, job, env):
    os.environ.update(env)  # the forkserver's children start with its environment
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws)
    try:
        # The job's locals (the DDP strategy's reducer holds the process group) go before
        # the group: freed after it, the reducer's is the group's last reference and its
        # destructor joins gloo's threads holding the GIL, which a thread still freeing a
        # finished collective's tensor waits for (a hang).
        _rank_job(rank, ws, job)
    finally:
        dist.destroy_process_group()


def _rank_job(rank, ws, job):
    """What the rank does (``job["do"]``: save, else load its share), in its process group."""
    from elastic_ddp.checkpoint.manager import CheckpointManager
    from elastic_ddp.checkpoint.shares import REPLICATED_PARTS, replicated_share
    from elastic_ddp.checkpoint.state import model_optimizer_state

    if job["do"] == "save":
        s = _strategy(ws, 1)  # the same seed on both ranks: a replicated (ddp) state
        mgr = CheckpointManager(job["out"], RUN, None, rank, ws, collective=True,
                                log=lambda m: None)
        mgr.save(1, s, {"progress": {"step": 1}}, report=False)
        return
    from torch.distributed.checkpoint import load as dcp_load

    s = _strategy(ws, 7)  # another state, overwritten by the load
    state = model_optimizer_state(s)
    mine = replicated_share(state, REPLICATED_PARTS["ddp"], rank, ws)
    reader = StoreReader(job["uri"])
    dcp_load(mine, storage_reader=reader)
    want = torch.load(job["want"], weights_only=True)
    flat = {f"{p}.{k}": v for p in ("model", "optim") for k, v in mine[p].items()
            if isinstance(v, torch.Tensor)}
    equal = all(torch.equal(v, want[k]) for k, v in flat.items())
    Path(job["out"], f"rank{rank}.json").write_text(json.dumps(
        {"bytes": reader.bytes_read, "requests": reader.requests, "equal": equal,
         # every entry the rank loads: the optimizer's non-tensor values (learning
         # rates, betas) are stored items too
         "keys": sorted(f"{p}.{k}" for p in ("model", "optim") for k in mine[p])}))


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """A ddp checkpoint of world size 2 (every rank writes its share of the replicated
    state), on local disk."""
    out = tmp_path_factory.mktemp("store_reader")
    start_ranks(_rank, (2, str(out / f"pg-{uuid.uuid4().hex}"), {"do": "save", "out": str(out)}, {}), 2)
    return out / RUN / checkpoint_name(1)


def _upload(local: Path, s3, key: str) -> str:
    import pyarrow.fs as pafs

    from elastic_ddp.paths import uri_to_filesystem

    fs, path = uri_to_filesystem(s3.uri(key))
    pafs.copy_files(str(local), path, destination_filesystem=fs)
    return s3.uri(key)


def _reference(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, read by DCP's own FileSystemReader."""
    from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata
    from torch.distributed.checkpoint import load as dcp_load

    from elastic_ddp.checkpoint.dcp_io import single_process

    meta = FileSystemReader(str(d)).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if isinstance(m, TensorStorageMetadata)}
    with single_process():
        dcp_load(state, storage_reader=FileSystemReader(str(d)), no_dist=True)
    return state


def _item_bytes(d: Path, keys) -> int:
    meta = StoreReader(str(d)).read_metadata()
    return sum(info.length for idx, info in meta.storage_data.items() if idx.fqn in keys)


def test_a_subset_of_keys_from_s3_reads_only_their_bytes(written, s3):
    uri = _upload(written, s3, "runs/job/ckpt")
    ref = _reference(written)
    reader = StoreReader(uri)
    got = load_keys(uri, "model.", reader=reader)
    model_keys = {k for k in ref if k.startswith("model.")}
    assert {f"model.{k}" for k in got} == model_keys
    assert all(torch.equal(v, ref[f"model.{k}"]) for k, v in got.items())
    # Only the model's items were fetched (and the index): not the optimizer's moments,
    # which sit in the same two shard files.
    meta_bytes = (written / METADATA).stat().st_size
    share = _item_bytes(written, model_keys)
    shards = sum(f.stat().st_size for f in written.glob("*.distcp"))
    assert reader.bytes_read - meta_bytes <= 1.1 * share, (reader.bytes_read, share)
    assert reader.bytes_read - meta_bytes >= share
    assert share < shards / 2, "the model should be under half of the shards' bytes"
    assert reader.files == {METADATA, *files_of(reader.read_metadata(), "model.")}
    assert len(reader.files) == 3, "the model was spread over both ranks' shards"

    # One key alone: one ranged read (plus the index).
    one = sorted(model_keys)[0]
    r1 = StoreReader(uri)
    got1 = load_keys(uri, one, reader=r1)
    assert list(got1) == [""] and torch.equal(got1[""], ref[one])
    assert r1.bytes_read - meta_bytes == _item_bytes(written, {one}) and r1.requests == 2


def test_a_local_directory_and_a_missing_or_short_file(written, tmp_path):
    import shutil

    ref = _reference(written)
    got = load_keys(written, "optim.")
    assert {f"optim.{k}" for k in got} == {k for k in ref if k.startswith("optim.")}
    assert all(torch.equal(v, ref[f"optim.{k}"]) for k, v in got.items())
    cut = tmp_path / "cut"
    shutil.copytree(written, cut)
    shard = cut / "__0_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 3)
    with pytest.raises(BaseException, match="shorter than its index says"):
        load_keys(cut, "")


def test_two_ranks_restore_their_shares_from_s3_each_reading_its_share(written, s3, tmp_path):
    uri = _upload(written, s3, "runs/job/ckpt2")
    torch.save(_reference(written), tmp_path / "want.pt")
    job = {"do": "load", "uri": uri, "out": str(tmp_path), "want": str(tmp_path / "want.pt")}
    start_ranks(_rank, (2, str(tmp_path / f"pg-{uuid.uuid4().hex}"), job, s3.env), 2)
    meta_bytes = (written / METADATA).stat().st_size
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["equal"], f"rank {rank} loaded other values"
        share = _item_bytes(written, set(r["keys"]))
        assert share > 0
        assert r["bytes"] - meta_bytes <= 1.1 * share, (rank, r["bytes"], share)
