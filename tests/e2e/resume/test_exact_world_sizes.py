"""Training is bitwise the same at world sizes 1 and 2 (docs/design.md, "Bitwise across
world sizes"): the product's ``Trainer`` steps a small byte-level GPT with dropout over
real Parquet windows, on real gloo process groups of 2 ranks (torch.multiprocessing, no
Ray) and in this process alone (world size 1), across an epoch end (the remainder step)
and in both epoch orders; then every parameter and every optimizer state tensor must be
``torch.equal`` to the other world size's, also after a resize 2 -> 1 -> 2 in the middle
(the live state handed over as a healing replica receives it).

Ray (slow): a real resize of a job. A ``per_step`` job's replica is SIGKILLed mid-epoch,
the survivor commits steps alone (a quorum of 1) and the replacement heals from it and
joins (a quorum of 2 again); the final checkpoint's model and optimizer state must be
``torch.equal`` to the same job trained uninterrupted, here by the product's ``Trainer``
at world size 1 in this process. The quorum-of-1 steps run the world-size-1 arithmetic
through torchft's all-reduce; the healing hands the live state over torchft's transport.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import digits_config, pycode_config
from elastic_ddp import train
from elastic_ddp.checkpoint.dcp_io import load_prefix
from elastic_ddp.config import Config
from elastic_ddp.data.scan import read_sample_ids
from elastic_ddp.driver.preflight import job_spec, prepare
from elastic_ddp.ledger import audit
from elastic_ddp.run_state import Diagnostics
from helpers import ledger_files, one_thread_steps, start_ranks, trainer_steps

STEPS = 24  # past the epoch end (step 12 of 13: a remainder of 9 rows)


@pytest.fixture(scope="module")
def small_lm(tmp_path_factory) -> Path:
    """About 400 windows of 17 bytes of the stdlib corpus: 13 steps of 32 per epoch."""
    from elastic_ddp.data.prepare import prepare_pycode

    out = tmp_path_factory.mktemp("lm")
    prepare_pycode(out, block_size=16, num_files=3, val_fraction=0.1, max_bytes=7_500)
    return out


def _job(data: Path, tmp: Path, order: str = "windowed", max_workers: int = 2):
    """The job's ``JobSpec`` as the driver builds it (no tracker: nothing is logged)."""
    from elastic_ddp.config import Config
    from elastic_ddp.driver.preflight import job_spec, prepare

    raw = pycode_config(data, tmp, {
        "task": {"kwargs": {"block_size": 16}},
        "model": {"kwargs": {"n_layer": 1, "n_head": 2, "n_embd": 32, "dropout": 0.1}},
        "batch": {"global_batch_size": 32, "micro_batch_size": 8, "policy": "uneven"},
        "train": {"epochs": 3, "max_steps": None, "eval_max_batches": None},
        "data": {"order": order},
        "scaling": {"min_workers": 1, "max_workers": max_workers, "torch_threads": 1},
    })
    cfg = Config.from_dict(raw)
    return job_spec(cfg, prepare(cfg), tracker=None, t0=time.time(), storage=str(tmp / "ray_results"))


def _exits_cleanly(fn):
    """A spawned rank leaves with ``os._exit(0)`` once done: gloo's C++ threads can still
    be joinable when the interpreter's static destructors run (std::terminate)."""
    @functools.wraps(fn)
    def run(*args):
        fn(*args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return run


@_exits_cleanly
def _ranks(rank: int, init_file: str, legs: list, out_dir: str) -> None:
    """Rank ``rank`` of 2: each leg ``(job, steps, load file or None, save file)``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        for job, steps, load, save in legs:
            state = trainer_steps(job, rank, 2, steps, torch.load(Path(out_dir) / load, weights_only=False)
                           if load else None)
            if rank == 0:
                torch.save(state, Path(out_dir) / save)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _at_two(tmp: Path, legs: list, tag: str) -> None:
    start_ranks(_ranks, (str(tmp / f"pg-{tag}"), legs, str(tmp)), nprocs=2)


def _assert_same(a: dict, b: dict, what: str) -> None:
    """Every model tensor and every optimizer state tensor equal, and the same progress."""
    assert a["progress"] == b["progress"], what
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), f"{what}: model {k} differs (max abs diff " \
            f"{(v.double() - b['model'][k].double()).abs().max().item():.2e})"
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sorted(sa) == sorted(sb), what
    for i in sa:
        for k, v in sa[i].items():
            assert torch.equal(v, sb[i][k]), f"{what}: optimizer state {i}.{k} differs"


ORDERS = ("windowed", "permutation")


@pytest.fixture(scope="module")
def trained(small_lm, tmp_path_factory) -> dict:
    """Per epoch order: the job, its uninterrupted run at world size 1 (``one``) and at 2
    (``two``), and the run resized 2 -> 1 -> 2 (``resized``): steps [0, a) at 2, [a, a + b)
    at 1, the rest at 2. Both orders' legs at world size 2 run in the same two process
    groups (a rank spends seconds importing torch and starting its data workers)."""
    tmp = tmp_path_factory.mktemp("exact")
    jobs = {}
    for order in ORDERS:
        (tmp / order).mkdir()
        jobs[order] = _job(small_lm, tmp / order, order)
    a, b = STEPS // 3, STEPS // 3
    _at_two(tmp, [leg for o in ORDERS for leg in ((jobs[o], STEPS, None, f"{o}-two.pt"),
                                                  (jobs[o], a, None, f"{o}-two-a.pt"))], "first")
    got = {o: {"job": jobs[o], "one": one_thread_steps(jobs[o], STEPS)} for o in ORDERS}
    for o in ORDERS:
        mid = one_thread_steps(jobs[o], b, load=torch.load(tmp / f"{o}-two-a.pt", weights_only=False))
        torch.save(mid, tmp / f"{o}-mid.pt")
    _at_two(tmp, [(jobs[o], STEPS - a - b, f"{o}-mid.pt", f"{o}-resized.pt") for o in ORDERS],
            "second")
    for o in ORDERS:
        for k in ("two", "resized"):
            got[o][k] = torch.load(tmp / f"{o}-{k}.pt", weights_only=False)
    return got


@pytest.mark.parametrize("order", ORDERS)
def test_world_sizes_1_and_2_train_bitwise_alike_also_across_a_resize(trained, order):
    got = trained[order]
    assert got["job"].train.num_rows % 32, "the data set must end an epoch with a remainder step"
    _assert_same(got["one"], got["two"], f"{order}: world size 1 vs 2, {STEPS} steps")
    _assert_same(got["resized"], got["two"], f"{order}: resized 2 -> 1 -> 2 vs uninterrupted")


# --------------------------------------------------------------------------- Ray
# As tests/e2e/per_step/test_fault_tolerance.py: every step takes at least STEP_S, so the survivor is
# still training when the replacement (a new Ray worker process: seconds) arrives.
STEP_S = 0.05
EPOCHS = 8
JOB = {"model": {"kwargs": {"hidden": 16, "dropout": 0.1}},
       "batch": {"global_batch_size": 32, "micro_batch_size": 8},
       "train": {"epochs": EPOCHS, "log_every_steps": 5, "checkpoint_every_steps": 20},
       "scaling": {"fault_tolerance": "per_step", "min_workers": 1, "max_workers": 2,
                   "max_failures": 3, "health_check_interval_s": 0.2, "torch_threads": 1}}


@pytest.mark.slow
def test_per_step_quorum_2_1_2_ends_bitwise_as_the_uninterrupted_run(ray_cluster, digits_data, tmp_path):
    cfg = Config.from_dict(digits_config(digits_data, tmp_path, JOB))
    ledger = tmp_path / "ledger"
    steps = math.ceil(len(read_sample_ids(digits_data / "train")) / 32) * EPOCHS
    s = train(cfg, progress=False, diagnostics=Diagnostics(ledger_dir=str(ledger), fault={
        "rank": 0, "at_step": 6, "where": "step", "marker": str(tmp_path / "fired"), "step_s": STEP_S}))
    assert (tmp_path / "fired").exists() and s.steps == steps
    assert audit(ledger, read_sample_ids(digits_data / "train"), EPOCHS)["ok"]
    # The quorum changed: steps committed by one replica alone, and by two after them.
    commits = [(r["commit"], r["n"]) for _, recs in ledger_files(ledger) for r in recs if "commit" in r]
    alone = [k for k, n in commits if n == 1]
    assert alone and any(n == 2 and k > max(alone) for k, n in commits), commits

    # The same job uninterrupted at world size 1 (restart mode's step: the arithmetic of
    # a quorum of one, without torchft), in this process.
    plain = Config.from_dict(digits_config(digits_data, tmp_path, {
        **JOB, "scaling": {**JOB["scaling"], "fault_tolerance": "restart"}}))
    ref = one_thread_steps(job_spec(plain, prepare(plain), tracker=None, t0=time.time(),
                                    storage=str(tmp_path / "ref")), steps)
    model = load_prefix(s.checkpoint_path, "model.")
    assert sorted(model) == sorted(ref["model"])
    for k, v in ref["model"].items():
        assert torch.equal(model[k], v), f"model {k}: max abs diff {(model[k] - v).abs().max().item():.2e}"
    optim = load_prefix(s.checkpoint_path, "optim.")
    names = [n for n, _ in torch.nn.Module.named_parameters(_module(cfg))]
    for i, state in ref["optimizer"]["state"].items():
        for k, v in state.items():
            assert torch.equal(optim[f"state.{names[i]}.{k}"], v), f"optimizer {names[i]}.{k}"


def _module(cfg):
    from elastic_ddp.tasks.loading import build_model, load_task

    return build_model(cfg, load_task(cfg))
