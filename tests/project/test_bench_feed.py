"""experiments/bench_feed.py stays runnable (no Ray): its image prepare step writes real
JPEG crops in Parquet, its transform's random crop and flip are a function of (seed, epoch,
sample_id) alone; its token prepare step writes stdlib documents and a BPE tokenizer, its
collate packs every token of the batch's documents once; its DataLoader side delivers
every batch of both workloads. The elastic and Ray Data sides run in the benchmark itself
(a Ray cluster each)."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from elastic_ddp import TransformContext

BENCH = Path(__file__).resolve().parents[2] / "experiments" / "bench_feed.py"


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
    r = bench.run_dataloader(out, task.Feed(), "images", procs=1, batch=16, epochs=2)
    assert r["batches"] == 6 and r["rows_per_s"] > 0 and r["first_s"] > 0


@pytest.fixture(scope="module")
def tokens(bench, tmp_path_factory):
    return bench.prepare_tokens(tmp_path_factory.mktemp("tokens"), mib=0.25, vocab_size=512)


def test_tokens_are_tokenized_and_packed(bench, tokens, tmp_path):
    t = pq.read_table(tokens / "train")
    lengths = [len(x.encode()) for x in t["text"].to_pylist()]
    assert t.num_rows > 50 and min(lengths) >= 64 and max(lengths) <= 2048
    mod, _ = bench._task_module(tmp_path)
    task = mod.Tokens(tokenizer=str(tokens / "tokenizer.json"))
    ids = t["sample_id"].to_numpy()[:40]
    texts = np.array(t["text"].to_pylist()[:40], dtype=object)
    out = task.transform({"text": texts}, TransformContext(0, 0, "train", ids))["ids"]
    assert len(out) == 40 and all(s[0] == 0 and s[-1] == 1 and len(s) <= mod.MAX_IDS for s in out)
    b = task.collate({"ids": out})
    assert b["ids"].shape[1] == mod.CTX and b["lens"].tolist() == [len(s) for s in out]
    doc, flat = b["doc"].reshape(-1), b["ids"].reshape(-1)
    for i in (0, 17, 39):                          # each document's tokens, in order, once
        assert flat[doc == i].tolist() == out[i].tolist()
    assert int((doc >= 0).sum()) == sum(len(s) for s in out)
    assert task.loss(task.build_model(), b).shape == (40,)


def test_the_dataloader_side_delivers_every_token_batch(bench, tokens, tmp_path):
    mod, _ = bench._task_module(tmp_path)
    task = mod.Tokens(tokenizer=str(tokens / "tokenizer.json"))
    n = pq.read_table(tokens / "train").num_rows
    r = bench.run_dataloader(tokens, task, "tokens", procs=1, batch=32, epochs=2)
    assert r["batches"] == 2 * -(-n // 32) and r["rows_per_s"] > 0
