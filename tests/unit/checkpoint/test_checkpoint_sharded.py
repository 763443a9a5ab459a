"""Sharded checkpoints (``elastic_ddp.checkpoint.manager``, ``.restore``) on real gloo process groups
(torch.multiprocessing, no Ray): ddp, zero1 and fsdp write at world size 2, each rank its
own shard file, and resume at world sizes 1 and 3 on the uninterrupted curve; a file that
fails its checksum makes the restore fall back to the previous checkpoint, naming it.

The gloo jobs of one world size run one after another in one spawned process group (a
rank spends seconds importing torch, a job milliseconds); each builds its own strategy
and checkpoint manager in a directory of its own."""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic_ddp.checkpoint import CheckpointCorruptError, MANIFEST, checkpoint_name
from elastic_ddp.checkpoint.manager import CheckpointManager
from elastic_ddp.config import Config
from elastic_ddp.parallel.strategies import build_strategy
from elastic_ddp.tasks.loading import build_model, load_task
from helpers import exits_cleanly, start_ranks

RUN = "sharded"


def _cfg(strategy: str) -> Config:
    return Config.from_dict({
        "data": {"train_path": "unused"}, "task": {"kwargs": {"block_size": 16}},
        "model": {"name": "gpt", "kwargs": {"n_embd": 32, "n_head": 2, "n_layer": 2}},
        "optim": {"name": "adamw", "lr": 3e-3}, "parallel": {"strategy": strategy},
        "scaling": {"min_workers": 1, "max_workers": 3},
        "batch": {"global_batch_size": 12, "micro_batch_size": 12, "policy": "uneven"}})


def _steps(strategy, cfg, task, first: int, n: int, rank: int, ws: int) -> list[float]:
    """Steps first..first+n-1 on fixed global batches of 12 rows split evenly over ws."""
    losses = []
    for step in range(first, first + n):
        x = torch.randint(0, 256, (12, 17), generator=torch.Generator().manual_seed(1000 + step))
        per = 12 // ws
        loss_vec, _ = task.loss(strategy.model, {"tokens": x[rank * per:(rank + 1) * per]})
        (loss_vec.sum() * strategy.grad_divisor / 12).backward()  # the mean over 12 rows
        strategy.clip_grad_norm(1.0)
        strategy.optimizer.step()
        strategy.optimizer.zero_grad(set_to_none=True)
        t = torch.tensor([float(loss_vec.detach().sum())])
        if ws > 1:
            dist.all_reduce(t)
        losses.append(float(t) / 12)
    return losses


def _job(rank, ws, job, out):
    cfg = _cfg(job["strategy"])
    task = load_task(cfg)
    torch.manual_seed(0)
    strategy = build_strategy(cfg, build_model(cfg, task), torch.device("cpu"), ws)
    # "files": train.checkpoint_files_per_rank (DCP's thread_count), read from the config.
    mgr = CheckpointManager(out, RUN, {"c": 1, "train": {"checkpoint_files_per_rank": job.get("files", 1)}},
                            rank, ws, collective=ws > 1,
                            log=lambda m: None, strategy_name=job["strategy"])
    first = 0
    if job.get("restore"):
        run_state, _ = mgr.restore(strategy)
        first = run_state["progress"]["step"]
    if job.get("async_kill"):
        _async_then_kill(mgr, strategy, cfg, task, rank, ws, out)
    if job.get("async_twice"):
        _async_twice(mgr, strategy, cfg, task, rank, ws, out)
    losses = _steps(strategy, cfg, task, first, job["steps"], rank, ws)
    if job.get("save"):
        mgr.save(first + job["steps"], strategy, {"progress": {"step": first + job["steps"]}},
                 report=False)
    if rank == 0:
        torch.save(torch.tensor(losses), Path(out) / job["result"])


@exits_cleanly
def _worker(rank, ws, init_file, jobs, outs):
    torch.set_num_threads(1)
    # A file rendezvous: no port picked in the parent that another process could take
    # before rank 0 binds it.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws)
    try:
        for job, out in zip(jobs, outs):
            _job(rank, ws, job, out)
    finally:
        dist.destroy_process_group()


def _async_then_kill(mgr, strategy, cfg, task, rank, ws, out):
    """Steps 0-2, an asynchronous checkpoint at 3 while steps 3-5 train (polled each
    step), then one at 6 whose write rank 0 dies in (shard cut short, no manifest)."""
    import signal

    _steps(strategy, cfg, task, 0, 3, rank, ws)
    mgr.save(3, strategy, {"progress": {"step": 3}}, report=False, asynchronous=True)
    for k in range(3, 6):
        _steps(strategy, cfg, task, k, 1, rank, ws)
        mgr.poll()
    mgr.wait()

    def die(shard: str) -> None:
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
        Path(out, "killed").write_text(shard)
        os.kill(os.getpid(), signal.SIGKILL)

    mgr.save(6, strategy, {"progress": {"step": 6}}, report=False, asynchronous=True,
             fault_hook=die if rank == 0 else None)
    mgr.wait()
    raise AssertionError("rank 0 should have died inside the background write")


def _async_twice(mgr, strategy, cfg, task, rank, ws, out):
    """Asynchronous checkpoints at steps 3 and 6, a step training during each write (the
    process's stager copies into the same buffers both times); rank 0 writes
    ``twice.json``: per checkpoint, the largest difference between its model entries and
    the full model of its step, and between the two checkpoints' models."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from elastic_ddp.checkpoint.dcp_io import load_prefix

    def full() -> dict:
        sd = get_model_state_dict(strategy.module, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().clone() for k, v in sd.items()}

    expected, first = {}, 0
    for at in (3, 6):
        _steps(strategy, cfg, task, first, at - first, rank, ws)
        expected[at] = full()
        mgr.save(at, strategy, {"progress": {"step": at}}, report=False, asynchronous=True)
        _steps(strategy, cfg, task, at, 1, rank, ws)  # changes the state while the write runs
        mgr.wait()
        first = at + 1
    dist.barrier()
    if rank == 0:
        got = {at: load_prefix(str(Path(out) / RUN / checkpoint_name(at)), "model.")
               for at in (3, 6)}
        diff = {str(at): max((got[at][k] - v).abs().max().item() for k, v in expected[at].items())
                for at in (3, 6)}
        assert set(got[3]) == set(expected[3]), sorted(set(got[3]) ^ set(expected[3]))
        apart = max((got[6][k] - got[3][k]).abs().max().item() for k in got[3])
        Path(out, "twice.json").write_text(json.dumps({"diff": diff, "apart": apart}))
    dist.barrier()


def _start(ws: int, jobs: list[tuple[dict, Path]]) -> None:
    """``(job, its directory)`` pairs one after another in one spawned process group of
    ``ws`` ranks."""
    outs = [out for _, out in jobs]
    for out in outs:
        out.mkdir(parents=True, exist_ok=True)
    init = outs[0] / f"pg-{uuid.uuid4().hex}"
    start_ranks(_worker, (ws, str(init), [j for j, _ in jobs], [str(o) for o in outs]), ws)


def _run_jobs(ws: int, jobs: list[tuple[dict, Path]]) -> list[torch.Tensor]:
    """:func:`_start`; each job's losses."""
    _start(ws, jobs)
    return [torch.load(out / job["result"], weights_only=True) for job, out in jobs]


def _run(ws: int, job: dict, out: Path) -> torch.Tensor:
    return _run_jobs(ws, [(job, out)])[0]


STRATEGIES = ["ddp", "zero1", "fsdp"]
#: The strategies' checkpoints, and one of ddp's written in 3 files per rank
#: (``train.checkpoint_files_per_rank``).
KINDS = [*STRATEGIES, "ddp-files3"]
FILES = {"ddp-files3": 3, "ddp-files2": 2}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[torch.Tensor, dict, dict]:
    """At world size 2, in one process group: plain ddp 6 steps uninterrupted (the
    reference), each strategy's checkpoint written after 3 steps, two asynchronous
    checkpoints each (fsdp, ddp), and last an fsdp run whose rank 0 dies inside its
    second asynchronous write; then each strategy's checkpoint resumed at world sizes 1
    and 3 (steps 3..5): (reference, {strategy: (its directory, {ws: losses})},
    {"twice": {strategy: its directory}, "killed": the killed run's directory})."""
    base = tmp_path_factory.mktemp("sharded")
    dirs = {st: base / st for st in KINDS}
    twice = {st: base / f"twice-{st}" for st in ("fsdp", "ddp", "ddp-files2")}
    killed = base / "killed"
    jobs = ([({"strategy": "ddp", "steps": 6, "result": "ref.pt"}, base / "ref")]
            + [({"strategy": st.split("-")[0], "files": FILES.get(st, 1), "steps": 3, "save": True,
                 "result": "a.pt"}, d) for st, d in dirs.items()]
            + [({"strategy": st.split("-")[0], "files": FILES.get(st, 1), "steps": 0, "async_twice": True,
                 "result": "x.pt"}, d) for st, d in twice.items()]
            + [({"strategy": "fsdp", "steps": 0, "async_kill": True, "result": "x.pt"}, killed)])
    with pytest.raises(mp.ProcessExitedException):
        _start(2, jobs)
    ref = torch.load(base / "ref" / "ref.pt", weights_only=True)
    resumed: dict = {st: {} for st in KINDS}
    for ws in (1, 3):
        got = _run_jobs(ws, [({"strategy": st.split("-")[0], "steps": 3, "restore": True, "result": f"r{ws}.pt"}, d)
                             for st, d in dirs.items()])
        for st, losses in zip(KINDS, got):
            resumed[st][ws] = losses
    return (ref, {st: (dirs[st], resumed[st]) for st in KINDS},
            {"twice": twice, "killed": killed})


@pytest.mark.parametrize("strategy", KINDS)
def test_written_at_2_by_every_rank_resumes_at_1_and_3(written, strategy):
    reference = written[0]
    out, resumed = written[1][strategy]
    d = out / RUN / checkpoint_name(3)
    manifest = json.loads((d / MANIFEST).read_text())
    shards = sorted(f for f in manifest["files"] if f.endswith(".distcp"))
    # Each rank wrote its own part (in train.checkpoint_files_per_rank files); none holds
    # the whole state.
    files = FILES.get(strategy, 1)
    assert shards == [f"__{r}_{i}.distcp" for r in (0, 1) for i in range(files)], manifest["files"]
    sizes = [sum(manifest["files"][f]["bytes"] for f in shards if f.startswith(f"__{r}_")) for r in (0, 1)]
    assert max(sizes) < 0.75 * sum(sizes), f"one rank wrote most of the state: {sizes}"
    assert manifest["world_size"] == 2 and manifest["step"] == 3
    for ws in (1, 3):
        got = resumed[ws]
        rel = ((got - reference[3:]).abs() / reference[3:]).max().item()
        assert rel <= 1e-4, f"{strategy} written at 2, resumed at {ws}: drifts by {rel:.2e}"


def test_a_kill_during_an_asynchronous_write_leaves_the_previous_checkpoint(written):
    """The fixture's killed run: its rank 0 died inside the write of step 6's
    asynchronous checkpoint; a restart at world size 2 resumes from step 3's."""
    reference, out = written[0], written[2]["killed"]
    assert (out / "killed").exists()
    torn = out / RUN / checkpoint_name(6)
    assert torn.is_dir() and not (torn / MANIFEST).exists()
    # The restart point is step 3's checkpoint, written while steps 3-5 trained: its
    # content is step 3's state (staged before the loop moved on).
    got = _run(2, {"strategy": "fsdp", "steps": 3, "restore": True, "result": "r.pt"}, out)
    rel = ((got - reference[3:]).abs() / reference[3:]).max().item()
    assert rel <= 1e-4, f"resumed from the asynchronous checkpoint: drifts by {rel:.2e}"
    assert not torn.exists(), "the torn checkpoint should be removed at the restore"


def test_each_asynchronous_checkpoint_holds_its_own_steps_state(written):
    """The staging buffers are reused from one asynchronous checkpoint to the next (one
    stager per process): each checkpoint must still hold the state of its own step, not
    the previous one's and not one changed by the step that trains during its write
    (the fixture's runs with asynchronous checkpoints at steps 3 and 6; one of them in 2
    files per rank)."""
    for strategy, out in written[2]["twice"].items():
        got = json.loads((out / "twice.json").read_text())
        assert got["diff"] == {"3": 0.0, "6": 0.0}, (strategy, got)
        assert got["apart"] > 0, f"{strategy}: checkpoints 3 and 6 hold the same model"
        files = json.loads((out / RUN / checkpoint_name(6) / MANIFEST).read_text())["files"]
        shards = sorted(f for f in files if f.endswith(".distcp"))
        assert shards == [f"__{r}_{i}.distcp" for r in (0, 1) for i in range(FILES.get(strategy, 1))], files


def test_export_writes_the_model_alone_loadable_in_plain_pytorch(tmp_path):
    """``elastic-ddp export`` as a user runs it: one file, ``torch.load(weights_only=True)``
    into the task's model, the same loss as the trained model; the optimizer state is
    not in it."""
    import subprocess

    cfg = _cfg("ddp")
    task = load_task(cfg)
    mgr, _ = _single(tmp_path, [2])
    torch.manual_seed(2)
    want = build_model(cfg, task)
    out = tmp_path / "model.pt"
    p = subprocess.run([sys.executable, "-m", "elastic_ddp", "export",
                        str(tmp_path / RUN / checkpoint_name(2)), str(out)],
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr
    assert "torch.distributed is disabled" not in p.stderr and "Warning" not in p.stderr, p.stderr
    sd = torch.load(out, weights_only=True)
    assert set(sd) == set(want.state_dict()), "only the model's entries"
    model = build_model(cfg, task)
    model.load_state_dict(sd)
    x = torch.randint(0, 256, (6, 17), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(task.loss(model, {"tokens": x})[0], task.loss(want, {"tokens": x})[0])
    bad = subprocess.run([sys.executable, "-m", "elastic_ddp", "export", str(tmp_path),
                          str(tmp_path / "m2.pt")], capture_output=True, text=True, timeout=300,
                         check=False)
    assert bad.returncode == 2 and "not an elastic-ddp checkpoint directory" in bad.stderr
    assert not (tmp_path / "m2.pt").exists()


def test_a_legacy_state_pt_checkpoint_still_restores_and_exports(tmp_path):
    """Format elastic-ddp/2 (one state.pt): a run resumes across the change of format."""
    from elastic_ddp.checkpoint.export import model_state

    cfg = _cfg("ddp")
    torch.manual_seed(4)
    old = build_strategy(cfg, build_model(cfg, load_task(cfg)), torch.device("cpu"), 1)
    d = tmp_path / RUN / checkpoint_name(4)
    d.mkdir(parents=True)
    torch.save({"format": "elastic-ddp/2", **old.full_state(0), "progress": {"step": 4},
                "counters": {}, "data": {}}, d / "state.pt")
    (d / MANIFEST).write_text(json.dumps({"state_bytes": (d / "state.pt").stat().st_size,
                                          "format": "elastic-ddp/2"}))
    mgr, fresh = _single(tmp_path / "other", [])
    mgr.storage = str(tmp_path)
    run_state, path = mgr.restore(fresh)
    assert run_state["progress"]["step"] == 4 and path == str(d)
    want = old.module.state_dict()
    assert all(torch.equal(want[k], v) for k, v in fresh.module.state_dict().items())
    assert all(torch.equal(want[k], v) for k, v in model_state(d).items())


def _single(tmp_path: Path, steps: list[int]):
    """Checkpoints of one process (no process group) at ``steps``; a fresh strategy."""
    cfg = _cfg("ddp")
    mgr = CheckpointManager(str(tmp_path), RUN, None, 0, 1, collective=False, log=lambda m: None)
    for k in steps:
        torch.manual_seed(k)
        s = build_strategy(cfg, build_model(cfg, load_task(cfg)), torch.device("cpu"), 1)
        mgr.save(k, s, {"progress": {"step": k}}, report=False)
    torch.manual_seed(99)
    return mgr, build_strategy(cfg, build_model(cfg, load_task(cfg)), torch.device("cpu"), 1)


def test_a_single_process_save_and_load_warn_of_nothing_and_hide_no_other_warning(tmp_path):
    """DCP warns on every load and save without a process group, even one asked for
    (no_dist=True): a save, a restore and an export of one process show no such line;
    the filter holds only around those calls."""
    import warnings

    from elastic_ddp.checkpoint.dcp_io import single_process
    from elastic_ddp.checkpoint.export import model_state

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mgr, fresh = _single(tmp_path, [2])
        mgr.restore(fresh)
        model_state(tmp_path / RUN / checkpoint_name(2))
        with single_process():
            warnings.warn("another warning", UserWarning)
        warnings.warn("torch.distributed is disabled, unavailable or uninitialized, assuming "
                      "the intent is to load in a single process.", UserWarning)
    shown = [str(w.message) for w in seen]
    assert [m for m in shown if "torch.distributed is disabled" in m or m == "another warning"] == [
        "another warning", "torch.distributed is disabled, unavailable or uninitialized, "
        "assuming the intent is to load in a single process."], shown


def test_unreported_checkpoints_past_the_newest_k_are_removed_and_the_newest_restores(tmp_path):
    # A partial quorum's lead writes unreported checkpoints (manifest reported: false),
    # which Ray Train's num_to_keep never removes: prune_unreported keeps the newest K.
    mgr, fresh = _single(tmp_path, [2, 4, 6, 8, 10])
    base = tmp_path / RUN
    assert all(json.loads((d / MANIFEST).read_text())["reported"] is False for d in base.iterdir())
    removed = mgr.prune_unreported(2)
    assert sorted(Path(p).name for p in removed) == [checkpoint_name(k) for k in (2, 4, 6)]
    assert sorted(d.name for d in base.iterdir()) == [checkpoint_name(k) for k in (8, 10)]
    assert mgr.prune_unreported(2) == []
    run_state, path = mgr.restore(fresh)
    assert run_state["progress"]["step"] == 10 and path.endswith(checkpoint_name(10))


def _flip_a_weight(shard: Path, step: int) -> str:
    """Negate one of step ``step``'s model tensors where it lies in ``shard``: the file
    keeps its size and still loads (only the checksum can tell); returns the key."""
    torch.manual_seed(step)
    cfg = _cfg("ddp")
    sd = build_model(cfg, load_task(cfg)).state_dict()
    key = max(sd, key=lambda k: sd[k].numel())
    data = shard.read_bytes()
    raw = sd[key].numpy().tobytes()
    assert raw in data, "the tensor's bytes should be in the shard"
    # Every copy: a weight tied to another (the GPT's embedding and head) is stored twice.
    shard.write_bytes(data.replace(raw, (-sd[key]).numpy().tobytes()))
    return key


@pytest.mark.parametrize("damage", ["zeroed", "truncated", "flipped"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, capfd, damage):
    from elastic_ddp.checkpoint.dcp_io import load_prefix

    mgr, fresh = _single(tmp_path, [2, 4])
    shard = tmp_path / RUN / checkpoint_name(4) / "__0_0.distcp"
    size = shard.stat().st_size
    if damage == "zeroed":
        shard.write_bytes(b"\0" * size)  # the same size: only the checksum can tell
    elif damage == "truncated":
        with open(shard, "r+b") as f:
            f.truncate(size // 2)
    else:
        # The damaged checkpoint loads without an error (the restore reads it while
        # hashing it): the check must still come before the state is used.
        key = _flip_a_weight(shard, 4)
        loaded = load_prefix(str(shard.parent), "model.")
        torch.manual_seed(4)
        cfg = _cfg("ddp")
        assert torch.equal(loaded[key], -build_model(cfg, load_task(cfg)).state_dict()[key])
    run_state, path = mgr.restore(fresh)
    assert run_state["progress"]["step"] == 2 and path.endswith(checkpoint_name(2))
    err = capfd.readouterr().err
    want_err = f"checkpoint {tmp_path / RUN / checkpoint_name(4)} fails its checksums: __0_0.distcp ("
    assert want_err + ("xxh3_64 " if damage != "truncated" else f"{size // 2} bytes") in err, err
    # The restored weights are step 2's, exactly.
    torch.manual_seed(2)
    cfg = _cfg("ddp")
    want = build_model(cfg, load_task(cfg)).state_dict()
    assert all(torch.equal(want[k], v) for k, v in fresh.module.state_dict().items())


def test_the_manifest_names_its_algorithm_and_each_files_xxh3_and_each_shards_blocks(tmp_path):
    import xxhash

    _single(tmp_path, [2])
    d = tmp_path / RUN / checkpoint_name(2)
    manifest = json.loads((d / MANIFEST).read_text())
    assert manifest["checksum"] == "xxh3_64"
    on_disk = sorted(p.name for p in d.iterdir() if p.name != MANIFEST)
    assert sorted(manifest["files"]) == on_disk, (manifest["files"], on_disk)
    from elastic_ddp.checkpoint.checksum import BLOCK

    for name, rec in manifest["files"].items():
        data = (d / name).read_bytes()
        want = {"bytes": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data)}
        if name.endswith(".distcp"):  # a shard: the XXH3 of each block too
            want["xxh3_64_blocks"] = "".join(xxhash.xxh3_64_hexdigest(data[i:i + BLOCK])
                                             for i in range(0, len(data), BLOCK))
        assert rec == want, name


def _as_crc32_manifest(d: Path) -> None:
    """Rewrite the manifest of checkpoint ``d`` as elastic-ddp wrote them before XXH3: no
    ``checksum`` field, each file's ``zlib.crc32``."""
    import zlib

    manifest = json.loads((d / MANIFEST).read_text())
    del manifest["checksum"]
    manifest["files"] = {n: {"bytes": (d / n).stat().st_size, "crc32": zlib.crc32((d / n).read_bytes())}
                         for n in manifest["files"]}
    (d / MANIFEST).write_text(json.dumps(manifest, indent=1))


def test_a_crc32_manifest_still_verifies_and_loads(tmp_path, capfd):
    mgr, fresh = _single(tmp_path, [2, 4])
    for k in (2, 4):
        _as_crc32_manifest(tmp_path / RUN / checkpoint_name(k))
    _flip_a_weight(tmp_path / RUN / checkpoint_name(4) / "__0_0.distcp", 4)
    run_state, path = mgr.restore(fresh)
    assert run_state["progress"]["step"] == 2 and path.endswith(checkpoint_name(2))
    assert f"{checkpoint_name(4)} fails its checksums: __0_0.distcp (crc32 " in capfd.readouterr().err
    torch.manual_seed(2)
    cfg = _cfg("ddp")
    want = build_model(cfg, load_task(cfg)).state_dict()
    assert all(torch.equal(want[k], v) for k, v in fresh.module.state_dict().items())


def test_a_checksum_algorithm_unknown_to_this_version_is_not_trusted(tmp_path):
    mgr, fresh = _single(tmp_path, [2])
    m = tmp_path / RUN / checkpoint_name(2) / MANIFEST
    m.write_text(m.read_text().replace('"checksum": "xxh3_64"', '"checksum": "blake9"'))
    with pytest.raises(CheckpointCorruptError, match=r"__0_0.distcp \(checksum algorithm 'blake9' unknown"):
        mgr.restore(fresh)


def test_no_checkpoint_that_verifies_is_refused_naming_each_bad_file(tmp_path):
    mgr, fresh = _single(tmp_path, [2])
    bad = tmp_path / RUN / checkpoint_name(2) / "run_state.json"
    bad.write_text(bad.read_text().replace('"step": 2', '"step": 7'))  # same length
    with pytest.raises(CheckpointCorruptError, match=r"checkpoint_step00000002: run_state.json \(xxh3_64"):
        mgr.restore(fresh)


def test_a_replicated_state_is_cut_into_disjoint_balanced_shares():
    """``replicated_share``: each rank keeps a disjoint share of the replicated tensors
    (their union is the whole state), balanced by bytes, the same cut on every rank;
    non-tensor values and the parts not named stay whole on every rank."""
    from elastic_ddp.checkpoint.shares import REPLICATED_PARTS, replicated_share

    model = {f"w{i}": torch.zeros(n) for i, n in enumerate([1000, 600, 500, 300, 200, 100, 40])}
    optim = {"state.w0.exp_avg": torch.zeros(1000), "state.w0.step": torch.tensor(3.0),
             "param_groups.w0.lr": 0.1}
    state = {"model": model, "optim": optim, "comm_hook": {"k": torch.zeros(5)}}
    for ws in (2, 3):
        shares = [replicated_share(state, REPLICATED_PARTS["ddp"], r, ws) for r in range(ws)]
        for part in ("model", "optim"):
            tensors = [{k for k, v in s[part].items() if isinstance(v, torch.Tensor)} for s in shares]
            assert set().union(*tensors) == {k for k, v in state[part].items()
                                             if isinstance(v, torch.Tensor)}
            assert sum(map(len, tensors)) == len(set().union(*tensors)), f"{part}: shares overlap"
        assert all(s["optim"]["param_groups.w0.lr"] == 0.1 for s in shares)
        assert all(s["comm_hook"] is state["comm_hook"] for s in shares)
        nbytes = [sum(v.numel() * v.element_size() for part in ("model", "optim")
                      for v in s[part].values() if isinstance(v, torch.Tensor)) for s in shares]
        assert max(nbytes) <= sum(nbytes) / ws + 1000 * 4, f"world size {ws}: unbalanced {nbytes}"
    zero = replicated_share(state, REPLICATED_PARTS["zero1"], 1, 2)
    assert zero["optim"] == optim and len(zero["model"]) < len(model)
    assert replicated_share(state, REPLICATED_PARTS.get("fsdp", ()), 1, 2) == state


def test_the_kept_stager_still_stages_after_a_close():
    """Some torch releases' ``async_save`` close the stager they are given after its save;
    a closed ``DefaultStager`` fails its next stage with ``KeyError: <class 'type'>`` (the
    second asynchronous checkpoint of a run, seen on torch 2.11 with CUDA). The process's
    kept stager must survive that close and stage again, values and types intact."""
    from elastic_ddp.checkpoint.inflight import _stager

    stager = _stager(torch.device("cpu"))
    state = {"w": torch.arange(6.0).reshape(2, 3), "meta": {"cls": int, "lr": [1e-3, 2], "name": "x"}}
    first = stager.stage(state)
    stager.close()
    state["w"].add_(1.0)
    second = stager.stage(state)
    assert torch.equal(second["w"], torch.arange(6.0).reshape(2, 3) + 1.0)
    assert second["meta"] == {"cls": int, "lr": [1e-3, 2], "name": "x"}
    assert first["w"].data_ptr() == second["w"].data_ptr(), "the staging buffer was not reused"


def test_a_checkpoint_a_restore_rejects_is_a_console_notice_and_never_tried_again(tmp_path, capfd):
    """Rejected in the workers' restore (one the driver did not hash: over 1 GiB, on an
    object store, or damaged after the driver's check): the tracker gets the event with
    its warning, which the driver's progress display prints as it arrives (a notice), and
    the checkpoint is marked rejected: the next restore neither tries it nor warns again."""
    from conftest import InProcess
    from elastic_ddp.checkpoint.layout import REJECTED, complete_checkpoints, incomplete_checkpoints
    from elastic_ddp.tracking import JobTracker, TrackerClient

    mgr, fresh = _single(tmp_path, [2, 4])
    tracker = JobTracker(f"sqlite:///{tmp_path / 'mlflow.db'}")  # unbound: nothing written
    mgr.tracker = TrackerClient(InProcess(tracker))
    bad = tmp_path / RUN / checkpoint_name(4)
    (bad / "__0_0.distcp").write_bytes(b"\0" * (bad / "__0_0.distcp").stat().st_size)
    assert mgr.restore(fresh)[1].endswith(checkpoint_name(2))
    (note,) = tracker.get_notices()
    assert note["kind"] == "checkpoint_rejected"
    assert note["message"].startswith(f"checkpoint {bad} fails its checksums: __0_0.distcp (xxh3_64 ")
    assert note["message"].endswith("; trying the previous checkpoint")
    assert json.loads((bad / REJECTED).read_text())["bad_files"][0].startswith("__0_0.distcp")
    capfd.readouterr()
    assert mgr.restore(fresh)[1].endswith(checkpoint_name(2))
    assert "fails its checksums" not in capfd.readouterr().err and len(tracker.get_notices()) == 1
    # Kept (evidence), out of every listing a restore or the final model reads.
    assert [p for _, p in complete_checkpoints(str(tmp_path), RUN)] == [str(tmp_path / RUN / checkpoint_name(2))]
    assert incomplete_checkpoints(str(tmp_path), RUN, 2) == [] and bad.is_dir()
    # Pruned once as many good checkpoints as are kept are newer (never a good one for it).
    assert mgr.prune_unreported(1) == []
    mgr.save(6, fresh, {"progress": {"step": 6}}, report=False)
    assert mgr.prune_unreported(1) == [str(tmp_path / RUN / checkpoint_name(2)), str(bad)]
