"""Training is bitwise the same at world sizes 1 and 2 (docs/design.md, "Bitwise across
world sizes"): the product's ``Trainer`` steps a small byte-level GPT with dropout over
real Parquet windows, on real gloo process groups of 2 ranks (torch.multiprocessing, no
Ray) and in this process alone (world size 1), across an epoch end (the remainder step)
and in both epoch orders; then every parameter and every optimizer state tensor must be
``torch.equal`` to the other world size's, also after a resize 2 -> 1 -> 2 in the middle
(the live state handed over as a healing replica receives it).

The Ray runs (a real resize of a job, both fault-tolerance modes) are in
tests/e2e/resume/test_exact_world_sizes_ray.py.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import pycode_config
from helpers import one_thread_steps, start_ranks, trainer_steps

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


@pytest.mark.parametrize("order", ["windowed", "permutation"])
def test_world_sizes_1_and_2_train_bitwise_alike_also_across_a_resize(small_lm, tmp_path, order):
    job = _job(small_lm, tmp_path, order)
    assert job.train.num_rows % 32, "the data set must end an epoch with a remainder step"
    a, b = STEPS // 3, STEPS // 3
    # World size 2: the uninterrupted run, and the first and last legs of the resized one.
    _at_two(tmp_path, [(job, STEPS, None, "two.pt"), (job, a, None, "two-a.pt")], "first")
    one = one_thread_steps(job, STEPS)
    two = torch.load(tmp_path / "two.pt", weights_only=False)
    _assert_same(one, two, f"{order}: world size 1 vs 2, {STEPS} steps")
    # 2 -> 1 -> 2: steps [0, a) at 2, [a, a + b) at 1, the rest at 2.
    mid = one_thread_steps(job, b, load=torch.load(tmp_path / "two-a.pt", weights_only=False))
    torch.save(mid, tmp_path / "mid.pt")
    _at_two(tmp_path, [(job, STEPS - a - b, "mid.pt", "resized.pt")], "second")
    _assert_same(torch.load(tmp_path / "resized.pt", weights_only=False), two,
                 f"{order}: resized 2 -> 1 -> 2 vs uninterrupted")
