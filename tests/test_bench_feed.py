"""experiments/bench_feed.py stays runnable (no Ray): its prepare step writes real JPEG
crops in Parquet, its transform's random crop and flip are a function of (seed, epoch,
sample_id) alone, and its DataLoader side delivers every batch. The elastic and Ray Data
sides run in the benchmark itself (a Ray cluster each)."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from elastic_ddp import TransformContext

BENCH = Path(__file__).resolve().parents[1] / "experiments" / "bench_feed.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_feed", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_prepare_and_the_transform(bench, tmp_path):
    from PIL import Image

    out = bench.prepare(tmp_path / "feed", rows=40)
    t = pq.read_table(out / "train")
    assert t.num_rows == 40 and t["sample_id"].to_pylist() == list(range(40))
    first = Image.open(io.BytesIO(t["jpeg"][0].as_py()))
    assert first.format == "JPEG" and first.size == (256, 256)
    assert len({t["jpeg"][i].as_py() for i in range(40)}) == 40          # 40 different crops

    task, _ = bench._task_module(tmp_path)
    ids, jpegs = t["sample_id"].to_numpy(), t["jpeg"].to_pylist()

    def run(order, epoch=1, split="train"):
        return task.decode_crop_flip([jpegs[i] for i in order], TransformContext(0, epoch, split, ids[order]))

    ref = run(np.arange(40))
    assert ref.shape == (40, 3, 224, 224) and ref.dtype == np.uint8
    perm = np.random.default_rng(3).permutation(40)                      # another batch order
    assert np.array_equal(run(perm)[np.argsort(perm)], ref)
    other = run(np.arange(40), epoch=2)
    assert sum(not np.array_equal(other[i], ref[i]) for i in range(40)) > 30


def test_the_dataloader_side_delivers_every_batch(bench, tmp_path):
    out = bench.prepare(tmp_path / "feed", rows=48)
    task, _ = bench._task_module(tmp_path)
    r = bench.run_dataloader(out, task, procs=1, batch=16, epochs=2, warmup=1)
    assert r["batches"] == 6 and r["rows_per_s"] > 0
