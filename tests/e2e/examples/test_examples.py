"""The worked examples under experiments/examples/ must not rot.

Fast, no Ray: each ``prepare.py`` writes Parquet that the library's scan accepts for the
task's declared columns, and the task passes the library's dry run (``preflight``) with
the example's own ``config.yaml``; the PNG task's augmentation is a function of
(seed, epoch, sample_id) alone (what makes a restart or resize reproduce it); the LM's
per-document loss does not depend on padding.

Ray: each example trains a few steps end to end on 2 gloo workers (``elastic_ddp.train``
on the example's config with smaller settings) and its loss falls.
"""

from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import mlflow_runs
from elastic_ddp import TransformContext, train
from elastic_ddp.config import Config
from elastic_ddp.data.scan import scan_parquet
from elastic_ddp.tasks.dry_run import preflight, sample_rows
from elastic_ddp.tasks.loading import build_model, load_task

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "experiments" / "examples"


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _config(example: str, data: Path, tmp: Path, *overrides: str) -> Config:
    """The example's config.yaml on ``data``, with the task file given absolutely (tests
    do not run from the repo root) and MLflow/Ray storage under ``tmp``."""
    return Config.load(EXAMPLES / example / "config.yaml", [
        f"task.path={EXAMPLES / example / 'task.py'}:{'DigitsPNG' if example == 'digits_png' else 'StdlibLM'}",
        f"data.train_path={data / 'train'}", f"data.val_path={data / 'val'}",
        f"run.tracking_uri=sqlite:///{tmp / 'mlflow.db'}", f"run.storage_path={tmp / 'ray_results'}",
        "run.experiment_name=tests", *overrides])


@pytest.fixture(scope="module")
def png_data(tmp_path_factory) -> Path:
    """The whole PNG digits set (1,438 train / 359 val), ~1 s."""
    out = tmp_path_factory.mktemp("digits_png")
    _module(EXAMPLES / "digits_png" / "prepare.py", "digits_png_prepare").prepare(out)
    return out


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory) -> Path:
    """A 100 kB slice of the stdlib documents (~480 train / ~25 val)."""
    out = tmp_path_factory.mktemp("stdlib_lm")
    _module(EXAMPLES / "stdlib_lm" / "prepare.py", "stdlib_lm_prepare").prepare(out, max_bytes=100_000)
    return out


def _loss_history(tmp: Path, run_id: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss"))


# ------------------------------------------------------------------ PNG digits, no Ray
def test_png_prepare_scan_and_preflight(png_data, tmp_path):
    cfg = _config("digits_png", png_data, tmp_path)
    task = load_task(cfg)
    train_info = scan_parquet(png_data / "train", task.input_columns(), "sample_id")
    val_info = scan_parquet(png_data / "val", task.input_columns(), "sample_id")
    assert (train_info.num_rows, val_info.num_rows) == (1438, 359)
    assert len(train_info.files) == 4 and max(g.num_rows for g in train_info.row_groups) == 128
    # The library's digits split: the same 359 val images.
    perm = np.random.default_rng(0).permutation(1797)
    from elastic_ddp.data.scan import read_sample_ids
    assert np.array_equal(read_sample_ids(png_data / "val"), np.sort(perm[:359]))
    rows = preflight(cfg, task, train_info, val_info).sample
    assert rows["train"]["image"].shape == (1, 1, 16, 16) and rows["train"]["image"].dtype == np.float32
    assert rows["train"]["label"].dtype == np.int64


def _png_batch(task, png_data: Path, n: int = 40) -> dict:
    """The first ``n`` rows of the train split as Ray Data hands them to transform."""
    return sample_rows(scan_parquet(png_data / "train", task.input_columns(), "sample_id"), n)


def test_png_augmentation_is_a_function_of_seed_epoch_and_sample_id(png_data, tmp_path):
    """A restart re-reads a sample in another block; a resize moves it to another rank's
    batch, in another order. Its pixels must not change; only the epoch changes them."""
    task = load_task(_config("digits_png", png_data, tmp_path))
    batch = _png_batch(task, png_data)
    ids = batch["sample_id"]
    n = len(ids)

    def run(b, epoch=3, split="train"):
        return task.transform(dict(b), TransformContext(0, epoch, split, b["sample_id"]))["image"]

    ref = run(batch)
    assert ref.shape == (n, 1, 16, 16) and ref.dtype == np.float32
    assert np.array_equal(run(batch), ref)                     # same batch, same ctx
    perm = np.random.default_rng(1).permutation(n)             # other order (a resize)
    shuffled = run({k: v[perm] for k, v in batch.items()})
    assert np.array_equal(shuffled[np.argsort(perm)], ref)
    cut = 17                                                   # other batch boundaries
    halves = [run({k: v[a:b] for k, v in batch.items()}) for a, b in ((0, cut), (cut, n))]
    assert np.array_equal(np.concatenate(halves), ref)
    # Another epoch: every sample gets other pixels (the jitter is continuous).
    other = run(batch, epoch=4)
    assert all(not np.array_equal(other[i], ref[i]) for i in range(n))
    # Validation: no augmentation, the same decoded pixels in every epoch.
    val0, val5 = run(batch, 0, "val"), run(batch, 5, "val")
    assert np.array_equal(val0, val5) and not np.array_equal(val0, ref)
    assert np.abs(ref - val0).max() > 0.05                     # the augmentation does something


# -------------------------------------------------------------- stdlib LM, no Ray
def test_lm_prepare_scan_and_preflight(lm_data, tmp_path):
    cfg = _config("stdlib_lm", lm_data, tmp_path)
    task = load_task(cfg)
    train_info = scan_parquet(lm_data / "train", task.input_columns(), "sample_id")
    val_info = scan_parquet(lm_data / "val", task.input_columns(), "sample_id")
    assert train_info.num_rows > 300 and val_info.num_rows > 10
    rows = preflight(cfg, task, train_info, val_info).sample
    tok = rows["train"]["tokens"][0]
    assert tok.dtype == np.int16 and tok[0] == 256 and tok[-1] == 257

    import pyarrow.parquet as pq

    tables = {s: pq.read_table(lm_data / s) for s in ("train", "val")}
    lengths = np.array([len(t.encode()) for t in tables["train"]["text"].to_pylist()])
    assert lengths.min() >= 64 and lengths.max() <= 256 and len(np.unique(lengths)) > 50
    # Split by file: no source file has documents in both splits.
    srcs = {s: set(t["source"].to_pylist()) for s, t in tables.items()}
    assert srcs["train"] and srcs["val"] and not srcs["train"] & srcs["val"]
    # Deterministic: a second prepare writes the same documents.
    again = tmp_path / "again"
    _module(EXAMPLES / "stdlib_lm" / "prepare.py", "stdlib_lm_prepare").prepare(again, max_bytes=100_000)
    assert pq.read_table(again / "train").equals(tables["train"])


def test_lm_loss_ignores_padding(lm_data, tmp_path):
    """The same document padded to two lengths (and next to a longer document) has the
    same per-sample loss: causal attention never sees the trailing padding and the loss
    masks the padded targets."""
    from elastic_ddp import pad_sequences

    cfg = _config("stdlib_lm", lm_data, tmp_path, "model.kwargs.dim=64", "model.kwargs.layers=1")
    task = load_task(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, task).eval()
    info = scan_parquet(lm_data / "train", task.input_columns(), "sample_id")
    b = sample_rows(info, 8)
    toks = list(task.transform(b, TransformContext(0, 0, "train", b["sample_id"]))["tokens"])
    short = min(toks, key=len)
    longest = max(toks, key=len)
    assert len(longest) > len(short) + 20

    def doc_loss(seqs, max_len=None):
        x, m = pad_sequences(seqs, pad_value=258, max_len=max_len, dtype=np.int64)
        with torch.no_grad():
            return task.loss(model, {"tokens": torch.from_numpy(x), "mask": torch.from_numpy(m)})[0]

    alone = doc_loss([short])[0]
    assert torch.allclose(doc_loss([short], len(short) + 37)[0], alone, rtol=1e-5, atol=1e-6)
    assert torch.allclose(doc_loss([short, longest])[0], alone, rtol=1e-5, atol=1e-6)
    # and through the task's own collate (pads to the longest row of the micro-batch)
    with torch.no_grad():
        coll = task.loss(model, task.collate({"tokens": np.array([longest, short], dtype=object)}))[0]
    assert torch.allclose(coll[1], alone, rtol=1e-5, atol=1e-6)
    # Padding does change the loss if it is not masked: the check above is not vacuous.
    x, m = pad_sequences([short], pad_value=258, max_len=len(short) + 37, dtype=np.int64)
    with torch.no_grad():
        unmasked = task.loss(model, {"tokens": torch.from_numpy(x), "mask": torch.ones_like(torch.from_numpy(m))})[0]
    assert not torch.allclose(unmasked[0], alone, rtol=1e-3)
    # Bits per byte from evaluate: nats over the document's bytes (not its EOS) / ln 2.
    with torch.no_grad():
        ev = task.evaluate(model, task.collate({"tokens": np.array([short], dtype=object)}))
    n_bytes = len(short) - 2
    assert float(ev["bytes"][0]) == n_bytes
    assert float(ev["bpb"][0]) == pytest.approx(float(alone) * (n_bytes + 1) / n_bytes / math.log(2), rel=1e-5)


# --------------------------------------------------------------------- Ray, end to end
@pytest.mark.slow
def test_png_digits_trains_end_to_end(ray_cluster, png_data, tmp_path):
    cfg = _config("digits_png", png_data, tmp_path, "train.epochs=2", "train.log_every_steps=5")
    t0 = time.perf_counter()
    summary = train(cfg, progress=False)
    print(f"\n[examples digits_png] wall {time.perf_counter() - t0:.1f}s {summary.metrics}")
    assert summary.steps == 2 * math.ceil(1438 / 64) and summary.restarts == 0
    runs = mlflow_runs(tmp_path)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    loss = _loss_history(tmp_path, summary.run_id)
    assert loss[0][0] == 1 and loss[-1][1] < 0.5 * loss[0][1], loss
    assert summary.metrics["val_acc"] >= 0.8, summary.metrics


def test_stdlib_lm_trains_end_to_end(ray_cluster, lm_data, tmp_path):
    cfg = _config("stdlib_lm", lm_data, tmp_path, "model.kwargs.dim=64", "model.kwargs.layers=1",
                  "batch.global_batch_size=16", "batch.micro_batch_size=8", "train.max_steps=20",
                  "train.log_every_steps=5", "optim.lr=0.003", "optim.warmup_steps=5")
    t0 = time.perf_counter()
    summary = train(cfg, progress=False)
    print(f"\n[examples stdlib_lm] wall {time.perf_counter() - t0:.1f}s {summary.metrics}")
    assert summary.steps == 20 and summary.restarts == 0
    loss = _loss_history(tmp_path, summary.run_id)
    assert loss[0][0] == 1 and loss[0][1] > math.log(259) - 0.5  # starts near uniform
    assert loss[-1][1] < loss[0][1] - 1.0, loss
    m = summary.metrics
    assert m["val_bpb"] < 7.0, m                                # a uniform guess is 8 bits
    assert m["val_nats"] / (m["val_bytes"] * math.log(2)) < 7.0, m
