"""Parallel strategies on real gloo process groups (torch.multiprocessing, no Ray):
ddp / zero1 / fsdp and the comm hooks train the same model to the same loss, and a
zero1 / fsdp checkpoint written at world size 2 resumes at world sizes 1 and 3.

The jobs run in three process groups, one per world size (2, then 1 and 3), one job
after another: a spawned rank spends seconds importing torch, the jobs milliseconds
each. Every job seeds its own model and builds its own strategy, so it trains as it
would in a group of its own. The tests assert on the saved results.

The end-to-end Ray runs of every strategy live in experiments/strategies.py.
"""

from __future__ import annotations

import functools
import os
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic_ddp.config import Config
from elastic_ddp.parallel.strategies import build_strategy, powersgd_start_step, zero_memory_bytes
from elastic_ddp.tasks.loading import build_model as _build_model
from elastic_ddp.tasks.loading import load_task
from helpers import start_ranks


def build_model(cfg: Config):
    """The config's model through its task, as the trainer builds it."""
    return _build_model(cfg, load_task(cfg))


def per_sample_loss(model, cfg: Config, x, y):
    """The task's per-sample loss of a batch: (loss [B], metrics)."""
    batch = {"tokens": x} if cfg.model.name == "gpt" else {"x": x, "y": y}
    return load_task(cfg).loss(model, batch)


def _cfg(strategy: str = "ddp", hook: str = "none", model: str = "gpt", optim: str = "adamw",
         sync_bn: bool = True, keep_params: bool = False) -> Config:
    if model == "gpt":
        task = {"kwargs": {"block_size": 16}}
        net = {"n_embd": 32, "n_head": 2, "n_layer": 2}
    else:
        task = {"kwargs": {"input_shape": [1, 8, 8]}}
        net = {"batch_norm": model == "cnn", "hidden": 8}
    return Config.from_dict({
        "data": {"train_path": "unused"},
        "task": task,
        "model": {"name": model, "kwargs": net},
        "optim": {"name": optim, "lr": 3e-3},
        "parallel": {"strategy": strategy, "comm_hook": hook, "powersgd_start_iter": 2,
                     "powersgd_rank": 2, "fsdp_keep_params_between_fwd_bwd": keep_params,
                     "sync_batchnorm": model == "cnn" and sync_bn},
        "scaling": {"min_workers": 1, "max_workers": 3},
        "batch": {"global_batch_size": 12, "micro_batch_size": 4, "policy": "uneven"},
    })


def _batch(cfg: Config, step: int, rank: int, ws: int):
    """The step's global batch of 12 rows, cut evenly over ranks (12 divides 1, 2, 3)."""
    g = torch.Generator().manual_seed(1000 + step)
    if cfg.model.name == "gpt":
        x = torch.randint(0, 256, (12, 17), generator=g)
        y = None
    else:
        x = torch.rand(12, 64, generator=g)
        y = torch.randint(0, 10, (12,), generator=g)
    per = 12 // ws
    sl = slice(rank * per, (rank + 1) * per)
    return x[sl], (y[sl] if y is not None else None)


def _train(strategy, cfg, steps, rank, ws, start_step=0, micro=2):
    losses = []
    for step in range(start_step, start_step + steps):
        x, y = _batch(cfg, step, rank, ws)
        if micro == 2:
            parts = [(x[: len(x) // 2], None if y is None else y[: len(x) // 2]),
                     (x[len(x) // 2:], None if y is None else y[len(x) // 2:])]
        else:
            parts = [(x, y)]
        total = 0.0
        for i, (xm, ym) in enumerate(parts):  # two micro-steps: no_sync on the first
            with strategy.maybe_no_sync(i == len(parts) - 1):
                loss_vec, _ = per_sample_loss(strategy.model, cfg, xm, ym)
                (loss_vec.sum() * strategy.grad_divisor / 12).backward()  # the mean over 12 rows
            total += float(loss_vec.detach().sum())
        strategy.clip_grad_norm(1.0)
        strategy.optimizer.step()
        strategy.optimizer.zero_grad(set_to_none=True)
        t = torch.tensor([total])
        dist.all_reduce(t)
        losses.append(float(t) / 12)
    return losses



def _exits_cleanly(fn):
    """Every spawned rank body ends with ``os._exit(0)`` once it returned: torch's C++
    threads (gloo's) can still be joinable when the interpreter's static destructors run,
    and std::terminate then aborts (SIGABRT) a rank whose work is done and saved. An
    exception still propagates, so torch's spawn reports it as before."""
    @functools.wraps(fn)
    def run(*args):
        fn(*args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return run


def _train_job(rank, ws, job, out_dir):
    cfg = _cfg(**job["cfg"])
    torch.manual_seed(0)
    strategy = build_strategy(cfg, build_model(cfg), torch.device("cpu"), ws)
    if job.get("load"):
        strategy.load_full_state(torch.load(Path(out_dir) / job["load"], weights_only=True))
    if job.get("expect_optimizer"):
        assert type(strategy.optimizer).__name__ == job["expect_optimizer"], type(strategy.optimizer)
    if job.get("expect_syncbn") is not None:
        kinds = {type(m).__name__ for m in strategy.module.modules()}
        # On CPU the switch converts to GlobalBatchNorm (nn.SyncBatchNorm is GPU-only).
        assert ("GlobalBatchNorm" in kinds) == job["expect_syncbn"], kinds
    losses = _train(strategy, cfg, job["steps"], rank, ws, job.get("start_step", 0),
                    job.get("micro", 2))
    state = strategy.full_state(rank)  # collective on every rank
    if rank == 0:
        torch.save({"losses": torch.tensor(losses), **state}, Path(out_dir) / job["save"])


def _probe_fsdp_reshard(rank, ws, job, out_dir):
    """After one forward (before backward), is a transformer block's weight still a
    sharded DTensor, for each setting of fsdp_keep_params_between_fwd_bwd?"""
    seen = {}
    for keep in (False, True):
        cfg = _cfg("fsdp", keep_params=keep)
        torch.manual_seed(0)
        strategy = build_strategy(cfg, build_model(cfg), torch.device("cpu"), ws)
        x, y = _batch(cfg, 0, rank, ws)
        loss_vec, _ = per_sample_loss(strategy.model, cfg, x, y)
        block = strategy.module.blocks[0]
        seen[keep] = type(next(block.parameters())).__name__
        loss_vec.sum().backward()
    if rank == 0:
        torch.save(seen, Path(out_dir) / job["save"])


def _checksum_job(rank, ws, job, out_dir):
    from elastic_ddp.parallel.strategies import check_params_equal as _check_params_equal

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    _check_params_equal(model, step=1)  # identical on both ranks: passes
    if rank == 1:
        with torch.no_grad():
            model.bias[0] += 1e-3  # a silent divergence on one rank
    try:
        _check_params_equal(model, step=2)
        outcome = "no error"
    except RuntimeError as e:
        outcome = str(e)
    (Path(out_dir) / f"{job['save']}-rank{rank}.txt").write_text(outcome)


def _uneven_bn_job(rank, ws, job, out_dir):
    """Rank 0 holds 3 rows, rank 1 one row; both take the guard's decision from the
    smallest slice (1), so neither enters SyncBatchNorm's collective and nothing hangs
    (a hang fails at the group's collective timeout)."""
    from elastic_ddp.parallel.batchnorm import batchnorm_guard as _batchnorm_guard

    cfg = _cfg(model="cnn")
    torch.manual_seed(0)
    strategy = build_strategy(cfg, build_model(cfg), torch.device("cpu"), ws)
    n = 3 if rank == 0 else 1
    x, y = torch.rand(n, 64), torch.arange(n)
    with _batchnorm_guard(strategy.model, smallest_rows=1):
        loss, _ = per_sample_loss(strategy.model, cfg, x, y)
        loss.sum().backward()
    strategy.optimizer.step()
    w = torch.cat([p.detach().flatten() for p in strategy.module.parameters()])
    gathered = [torch.empty_like(w) for _ in range(ws)]
    dist.all_gather(gathered, w)
    if rank == 0:
        torch.save({"equal": all(torch.equal(gathered[0], g) for g in gathered)},
                   Path(out_dir) / job["save"])


_KINDS = {"train": _train_job, "probe_reshard": _probe_fsdp_reshard, "checksum": _checksum_job,
          "uneven_bn": _uneven_bn_job}


@_exits_cleanly
def _worker(rank, ws, init_file, jobs, out_dir):
    torch.set_num_threads(1)
    # A file rendezvous: no port chosen in the parent that another process (a second
    # xdist worker, gloo's own connections) could take before rank 0 binds it.
    # 120 s per collective: a rank that hangs fails the group instead of the session.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws,
                            timeout=timedelta(seconds=120))
    try:
        for job in jobs:
            _KINDS[job.get("kind", "train")](rank, ws, job, out_dir)
    finally:
        dist.destroy_process_group()


def _run_jobs(ws: int, jobs: list[dict], out_dir: Path) -> None:
    """``jobs`` one after another in one fresh process group of ``ws`` spawned ranks;
    each writes its result under ``out_dir`` (its ``save`` name)."""
    init = out_dir / f"pg-{uuid.uuid4().hex}"
    start_ranks(_worker, (ws, str(init), jobs, str(out_dir)), ws)


def _load(out_dir: Path, name: str) -> dict:
    return torch.load(out_dir / name, weights_only=True)


STRATEGIES = [
    ("zero1", "none", 1e-5),    # same maths, sharded optimizer state
    ("fsdp", "none", 1e-4),     # same maths, reduce-scatter instead of all-reduce
    ("ddp", "bf16", 2e-2),      # gradients summed in bf16
    ("ddp", "fp16", 2e-2),
    ("ddp", "powersgd", 5e-2),  # rank-2 approximation from step 3 on
]
SHARDED = ["zero1", "fsdp"]
LARGE_BATCH = [("lars", "LARS"), ("lamb", "Lamb")]
_BN = {"steps": 3, "micro": 1}


@pytest.fixture(scope="module")
def ws2(tmp_path_factory) -> Path:
    """Every world-size-2 job: plain DDP for 6 steps (the curve every strategy must
    match), each strategy and hook, fsdp keep-params and its probe, the first 3 steps of
    each sharded strategy (resumed by ``ws1_ws3``), LARS/LAMB, BatchNorm with and
    without sync, the parameter checksum and the uneven 1-row BatchNorm step."""
    out = tmp_path_factory.mktemp("ws2")
    jobs = [{"cfg": {"strategy": "ddp"}, "steps": 6, "save": "ref.pt"}]
    jobs += [{"cfg": {"strategy": st, "hook": hook}, "steps": 6, "save": f"s-{st}-{hook}.pt"}
             for st, hook, _ in STRATEGIES]
    jobs += [{"kind": "probe_reshard", "save": "probe.pt"},
             {"cfg": {"strategy": "fsdp", "keep_params": True}, "steps": 6, "save": "keep.pt"}]
    jobs += [{"cfg": {"strategy": st}, "steps": 3, "save": f"half-{st}.pt"} for st in SHARDED]
    jobs += [{"cfg": {"optim": o}, "steps": 5, "expect_optimizer": cls, "save": f"{o}-2.pt"}
             for o, cls in LARGE_BATCH]
    jobs += [{**_BN, "cfg": {"model": "cnn"}, "expect_syncbn": True, "save": "bn-sync.pt"},
             {**_BN, "cfg": {"model": "cnn", "sync_bn": False}, "expect_syncbn": False,
              "save": "bn-local.pt"},
             {"steps": 1, "micro": 1, "cfg": {"model": "cnn"}, "save": "bn-sync1.pt"},
             {"kind": "checksum", "save": "checksum"},
             {"kind": "uneven_bn", "save": "uneven.pt"}]
    _run_jobs(2, jobs, out)
    return out


@pytest.fixture(scope="module")
def ws1_ws3(ws2) -> Path:
    """The jobs at world sizes 1 and 3: steps 3..5 of each sharded strategy resumed
    from its world-size-2 state; at 1 also LARS/LAMB and the BatchNorm references."""
    for ws in (1, 3):
        jobs = [{"cfg": {"strategy": st}, "steps": 3, "start_step": 3, "load": f"half-{st}.pt",
                 "save": f"resume-{st}-{ws}.pt"} for st in SHARDED]
        if ws == 1:
            jobs += [{"cfg": {"optim": o}, "steps": 5, "expect_optimizer": cls, "save": f"{o}-1.pt"}
                     for o, cls in LARGE_BATCH]
            jobs += [{**_BN, "cfg": {"model": "cnn", "sync_bn": False}, "save": "bn-one.pt"},
                     {"steps": 1, "micro": 1, "cfg": {"model": "cnn", "sync_bn": False},
                      "save": "bn-one1.pt"}]
        _run_jobs(ws, jobs, ws2)
    return ws2


@pytest.mark.parametrize("strategy,hook,tol", STRATEGIES)
def test_strategy_matches_ddp(ws2, strategy, hook, tol):
    got = _load(ws2, f"s-{strategy}-{hook}.pt")
    ref = _load(ws2, "ref.pt")["losses"]
    assert got["losses"][-1] < got["losses"][0], "loss did not fall"
    rel = ((got["losses"] - ref).abs() / ref).max().item()
    assert rel <= tol, f"{strategy}/{hook}: loss curve differs from ddp by {rel:.2e} > {tol}"
    # The checkpoint state is full (unsharded) and plain-PyTorch loadable.
    plain = build_model(_cfg("ddp"))
    plain.load_state_dict(got["model"])
    if hook == "powersgd":
        assert len(got["comm_hook"]["error_dicts"]) == 2  # one residual per rank


def test_fsdp_keep_params_between_fwd_bwd_is_zero2_like(ws2):
    """reshard_after_forward=False: between forward and backward the blocks hold their
    full (unsharded) parameters, as ZeRO-2 does; by default they are sharded again right
    after forward (ZeRO-3). Both train exactly as ddp does."""
    seen = _load(ws2, "probe.pt")
    assert seen == {False: "DTensor", True: "Parameter"}, seen
    got, ref = _load(ws2, "keep.pt")["losses"], _load(ws2, "ref.pt")["losses"]
    rel = ((got - ref).abs() / ref).max().item()
    assert rel <= 1e-4, f"fsdp keep-params drifts from ddp by {rel:.2e}"


@pytest.mark.parametrize("strategy", SHARDED)
def test_checkpoint_written_at_2_resumes_at_1_and_3(ws1_ws3, strategy):
    """Write the full state after 3 steps at world size 2; resume steps 3..5 at world sizes
    1 and 3. Each global batch is the same whatever the world size, so both must land on
    the uninterrupted 6-step curve of plain DDP at world size 2."""
    first = _load(ws1_ws3, f"half-{strategy}.pt")
    assert first["optimizer"]["state"], "optimizer state missing from the checkpoint"
    for ws in (1, 3):
        done = _load(ws1_ws3, f"resume-{strategy}-{ws}.pt")
        ref = _load(ws1_ws3, "ref.pt")["losses"][3:]
        rel = ((done["losses"] - ref).abs() / ref).max().item()
        assert rel <= 1e-4, f"{strategy} resumed at world size {ws} drifts by {rel:.2e}"
        steps_seen = {float(v["step"]) for v in done["optimizer"]["state"].values() if "step" in v}
        assert steps_seen == {6.0}, f"optimizer step counter did not continue: {steps_seen}"


def test_powersgd_start_step_follows_pytorch_tuning_advice():
    """Unset: max(warm-up, 20% of the run's steps); an explicit value wins."""
    def cfg(**parallel):
        return Config.from_dict({"data": {"train_path": "unused"}, "model": {"name": "cnn"},
                                 "optim": {"warmup_steps": 10}, "parallel": parallel})

    assert powersgd_start_step(cfg(), total_steps=345) == 69   # the digits preset
    assert powersgd_start_step(cfg(), total_steps=40) == 10    # the warm-up is longer
    assert powersgd_start_step(cfg(), total_steps=None) == 10
    assert powersgd_start_step(cfg(powersgd_start_iter=3), total_steps=345) == 3
    assert powersgd_start_step(cfg(powersgd_start_iter=1), total_steps=345) == 2


def test_zero_memory_formula():
    """ZeRO paper (Rajbhandari et al. 2020, fig. 1) with fp32 Adam: 4 B params + 4 B grads
    + 8 B optimizer state per parameter; stage 1 shards the 8 B, stage 3 shards all 16 B."""
    psi = 1_000_000
    assert zero_memory_bytes(psi, 1, stage=0) == 16 * psi
    assert zero_memory_bytes(psi, 4, stage=1) == 4 * psi + 4 * psi + 8 * psi / 4
    assert zero_memory_bytes(psi, 4, stage=3) == 16 * psi / 4


def test_parameter_checksum_catches_a_diverged_rank(ws2):
    """train.checksum_every_steps: equal parameters pass; one rank's drift stops every
    rank with an error that names the step."""
    for rank in (0, 1):
        msg = (ws2 / f"checksum-rank{rank}.txt").read_text()
        assert "differs across ranks at step 2" in msg, msg


# ------------------------------------------------------------------ large-batch optimizers
@pytest.mark.parametrize("optim,cls", LARGE_BATCH)
def test_lars_lamb_from_pytorch_optimizer_are_world_size_invariant(ws1_ws3, optim, cls):
    """LARS/LAMB (You et al. 2017/2019) scale each layer's update by ||w|| / ||update||.
    On averaged gradients that ratio is the same whatever the world size, so the same
    global batches give the same curve at world sizes 1 and 2; and the optimizer is the
    maintained library's (pytorch-optimizer), not ours (each job asserts its class)."""
    one, two = _load(ws1_ws3, f"{optim}-1.pt"), _load(ws1_ws3, f"{optim}-2.pt")
    torch.manual_seed(0)
    init = build_model(_cfg(optim=optim)).state_dict()
    moved = max((two["model"][k] - v).abs().max().item() for k, v in init.items())
    assert moved > 1e-5, f"{optim}: 5 steps did not change the weights (max change {moved:.1e})"
    rel = ((two["losses"] - one["losses"]).abs() / one["losses"]).max().item()
    assert rel <= 1e-4, f"{optim}: world size 2 drifts from world size 1 by {rel:.2e}"
    assert two["optimizer"]["state"], "optimizer state missing from the checkpoint"


# ----------------------------------------------------------------------------- BatchNorm
def test_sync_batchnorm_gives_global_batch_statistics(ws1_ws3):
    """One micro-step per rank: with ``parallel.sync_batchnorm`` the statistics are over
    the global batch, so world size 2 reproduces world size 1 (loss and running
    statistics); plain BatchNorm at world size 2 normalises each rank's half separately
    and must not."""
    one, sync, local = (_load(ws1_ws3, f"bn-{k}.pt") for k in ("one", "sync", "local"))
    rel = ((sync["losses"] - one["losses"]).abs() / one["losses"]).max().item()
    assert rel <= 1e-4, f"SyncBatchNorm at world size 2 drifts from world size 1 by {rel:.2e}"
    rel_local = ((local["losses"] - one["losses"]).abs() / one["losses"]).max().item()
    assert rel_local > 1e-3, "per-rank BatchNorm matched global statistics: the check is blind"
    # Running statistics after one step (computed from the identical initial weights;
    # later steps see weights that Adam's normalised updates let drift by ~1e-3).
    one1, sync1 = _load(ws1_ws3, "bn-one1.pt"), _load(ws1_ws3, "bn-sync1.pt")
    stats = [k for k in one1["model"] if "running_" in k]
    assert stats, "no BatchNorm running statistics in the state: the check is blind"
    for k in stats:
        assert torch.allclose(sync1["model"][k], one1["model"][k], rtol=1e-4, atol=1e-6), k
    # The checkpoint holds plain BatchNorm keys: loads into the unconverted model.
    build_model(_cfg(model="cnn")).load_state_dict(sync["model"])


def test_batchnorm_guard_batch_of_one():
    """A per-rank micro-batch of 1 row: BatchNorm1d in training mode raises; under the
    worker's guard the layers use their running statistics (left unchanged) and return
    to training mode afterwards."""
    from elastic_ddp.parallel.batchnorm import batchnorm_guard as _batchnorm_guard

    cfg = Config.from_dict({"data": {"train_path": "unused"},
                            "model": {"name": "mlp", "kwargs": {"hidden": 16, "batch_norm": True}}})
    torch.manual_seed(0)
    model = build_model(cfg).train()
    x, y = torch.rand(1, 64), torch.tensor([3])
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        per_sample_loss(model, cfg, x, y)
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm1d)]
    assert len(bns) == 2, "the mlp has no BatchNorm: the test would be blind"
    before = [m.running_mean.clone() for m in bns]
    with _batchnorm_guard(model, smallest_rows=1):
        loss, _ = per_sample_loss(model, cfg, x, y)
        loss.sum().backward()
    assert torch.isfinite(loss).all()
    assert all(m.training for m in bns)
    assert all(torch.equal(b, m.running_mean) for b, m in zip(before, bns))
    with _batchnorm_guard(model, smallest_rows=2):  # 2 rows: batch statistics as usual
        per_sample_loss(model, cfg, torch.rand(2, 64), torch.tensor([1, 2]))
    assert not all(torch.equal(b, m.running_mean) for b, m in zip(before, bns))


def test_sync_batchnorm_uneven_ranks_one_row_no_hang(ws2):
    assert torch.load(ws2 / "uneven.pt")["equal"], "ranks diverged after the guarded step"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
