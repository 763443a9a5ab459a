"""The Hugging Face worked example (experiments/examples/hf_lm/) must not rot.

Fast, no Ray: ``prepare.py`` writes Parquet the scan accepts and a BPE tokenizer whose
special ids are the task's; the task passes the library's dry run with the example's
own ``config.yaml``; its transform gives the ids the exported ``transformers``
tokenizer gives; the per-document loss does not depend on padding; autocast is off on
CPU; a too-small vocabulary is refused before anything is written.

Ray: one job of the example (smaller settings) on 2 gloo workers, rank 1 SIGKILLed
mid-epoch: it resumes from its checkpoint, the ledger shows every train document used
exactly once, the loss falls; the final checkpoint exported with ``save_pretrained`` and
reloaded with ``from_pretrained`` scores the run's own ``val_loss``.
"""

from __future__ import annotations

import importlib.util
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from elastic_ddp import Diagnostics, TransformContext, pad_sequences, train
from elastic_ddp.config import Config
from elastic_ddp.data.scan import read_sample_ids, scan_parquet
from elastic_ddp.ledger import audit, format_audit
from elastic_ddp.tasks.dry_run import preflight, sample_rows
from elastic_ddp.tasks.loading import build_model, load_task

EXAMPLE = Path(__file__).resolve().parents[3] / "experiments" / "examples" / "hf_lm"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"hf_lm_{name}", EXAMPLE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _config(data: Path, tmp: Path, *overrides: str) -> Config:
    """The example's config.yaml on ``data`` (task file and tokenizer given absolutely:
    tests do not run from the repo root), MLflow/Ray storage under ``tmp``."""
    return Config.load(EXAMPLE / "config.yaml", [
        f"task.path={EXAMPLE / 'task.py'}:HFCausalLM", f"task.kwargs.tokenizer={data / 'tokenizer.json'}",
        f"data.train_path={data / 'train'}", f"data.val_path={data / 'val'}",
        f"run.tracking_uri=sqlite:///{tmp / 'mlflow.db'}", f"run.storage_path={tmp / 'ray_results'}",
        "run.experiment_name=tests", *overrides])


@pytest.fixture(scope="module")
def hf_data(tmp_path_factory) -> Path:
    """A 100 kB slice of the stdlib documents (~490 train / ~26 val) and a 2,048-id BPE."""
    out = tmp_path_factory.mktemp("hf_lm")
    _module("prepare").prepare(out, max_bytes=100_000)
    return out


def test_prepare_tokenizer_and_preflight(hf_data, tmp_path):
    cfg = _config(hf_data, tmp_path)
    task = load_task(cfg)
    assert task.vocab_size == 2048
    train_info = scan_parquet(hf_data / "train", task.input_columns(), "sample_id")
    val_info = scan_parquet(hf_data / "val", task.input_columns(), "sample_id")
    assert train_info.num_rows > 300 and val_info.num_rows > 10
    rows = preflight(cfg, task, train_info, val_info).sample
    ids = rows["train"]["ids"][0]
    assert ids.dtype == np.int32 and ids[0] == 0 and ids[-1] == 1 and 2 not in ids

    # The transform's ids are the exported tokenizer's: BOS ... EOS, the same BPE merges.
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(hf_data / "tokenizer.json")))
    b = sample_rows(train_info, 16)
    out = task.transform(b, TransformContext(0, 0, "train", b["sample_id"]))
    texts = list(b["text"])
    assert [list(x) for x in out["ids"]] == hf_tok(texts)["input_ids"]
    assert list(out["n_bytes"]) == [len(t.encode()) for t in texts]
    # BPE compresses source code: well under one id per byte.
    assert sum(len(x) - 2 for x in out["ids"]) < 0.6 * sum(out["n_bytes"])
    # The tokenizer travels in the task's pickle (no path read on a worker), as JSON.
    clone = pickle.loads(pickle.dumps(task))
    assert clone._tok is None
    again = clone.transform(b, TransformContext(0, 0, "train", b["sample_id"]))
    assert all(np.array_equal(x, y) for x, y in zip(again["ids"], out["ids"]))


def test_prepare_refuses_a_vocabulary_too_small_before_writing(tmp_path):
    out = tmp_path / "hf"
    with pytest.raises(ValueError, match="--vocab-size 200: need at least 259"):
        _module("prepare").prepare(out, vocab_size=200, max_bytes=10_000)
    assert not out.exists()
    assert _module("prepare").main([str(out), "--vocab-size", "200"]) == 2


def test_missing_tokenizer_names_the_fix(hf_data, tmp_path):
    from elastic_ddp.tasks.loading import TaskError

    with pytest.raises((TaskError, ValueError), match="hf_lm/prepare.py"):
        load_task(_config(hf_data, tmp_path, f"task.kwargs.tokenizer={tmp_path / 'none.json'}"))


def test_loss_ignores_padding_and_autocast_is_off_on_cpu(hf_data, tmp_path):
    """A document's loss is the same alone, padded further, and next to a longer one;
    unmasked padding would change it (the check is not vacuous)."""
    cfg = _config(hf_data, tmp_path, "model.kwargs.dim=64", "model.kwargs.layers=1")
    task = load_task(cfg)
    assert not task.autocast_enabled(torch.device("cpu"))
    torch.manual_seed(0)
    model = build_model(cfg, task).eval()
    b = sample_rows(scan_parquet(hf_data / "train", task.input_columns(), "sample_id"), 8)
    out = task.transform(b, TransformContext(0, 0, "train", b["sample_id"]))
    order = np.argsort([len(x) for x in out["ids"]])
    short, longest = order[0], order[-1]
    assert len(out["ids"][longest]) > len(out["ids"][short]) + 10

    def doc_loss(rows, max_len=None, masked=True):
        ids, mask = pad_sequences([out["ids"][i] for i in rows], pad_value=2, max_len=max_len,
                                  dtype=np.int64)
        m = torch.from_numpy(mask)
        batch = {"ids": torch.from_numpy(ids), "mask": m if masked else torch.ones_like(m),
                 "n_bytes": torch.as_tensor(out["n_bytes"][rows])}
        with torch.no_grad():
            return task.loss(model, batch)[0]

    alone = doc_loss([short])[0]
    assert torch.allclose(doc_loss([short], len(out["ids"][short]) + 29)[0], alone, rtol=1e-5, atol=1e-6)
    assert torch.allclose(doc_loss([short, longest])[0], alone, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(doc_loss([short], len(out["ids"][short]) + 29, masked=False)[0],
                              alone, rtol=1e-3)
    with torch.no_grad():
        ev = task.evaluate(model, task.collate({k: v[[short]] for k, v in out.items()}))
    n_pred = len(out["ids"][short]) - 1
    assert float(ev["bpb"][0]) == pytest.approx(
        float(alone) * n_pred / int(out["n_bytes"][short]) / math.log(2), rel=1e-5)


# --------------------------------------------------------------------- Ray, end to end
@pytest.mark.slow
def test_hf_lm_survives_a_sigkill_and_round_trips_through_save_pretrained(ray_cluster, hf_data, tmp_path):
    # ~490 documents / 16 per step: ~31 steps in the one epoch; rank 1 dies at step 9,
    # after the checkpoint at step 8.
    cfg = _config(hf_data, tmp_path, "model.kwargs.dim=64", "model.kwargs.layers=1",
                  "batch.global_batch_size=16", "batch.micro_batch_size=8",
                  "train.checkpoint_every_steps=4", "train.log_every_steps=4",
                  "optim.lr=0.005", "optim.warmup_steps=4")
    ledger, marker = tmp_path / "ledger", tmp_path / "fired"
    summary = train(cfg, progress=False, diagnostics=Diagnostics(
        ledger_dir=str(ledger), fault={"rank": 1, "at_step": 9, "where": "step", "marker": str(marker)}))
    n_train = len(read_sample_ids(hf_data / "train"))
    steps = math.ceil(n_train / 16)
    print(f"\n[examples hf_lm] {summary.metrics} steps {summary.steps}")
    assert marker.exists() and summary.restarts == 1 and summary.steps == steps
    report = audit(ledger, read_sample_ids(hf_data / "train"), 1)
    assert report["ok"], format_audit(report)
    assert [a["resumed_from"] for a in report["attempts"]] == [0, 8]

    from mlflow.tracking import MlflowClient

    hist = sorted((m.step, m.value) for m in MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
                  .get_metric_history(summary.run_id, "train/loss"))
    print("[examples hf_lm] train/loss", hist)
    # Starts near uniform over the 2,048 ids (7.62 nats) and learns: 31 steps of a
    # 1-layer model on 100 kB reach ~6.6 (a margin of ~0.4 nats below each bound).
    assert hist[0][1] > math.log(2048) - 0.5 and hist[-1][1] < hist[0][1] - 0.6, hist
    val_loss = summary.metrics["val_loss"]
    assert val_loss < math.log(2048) - 0.6, summary.metrics

    export = _module("export")
    out = tmp_path / "hf_model"
    ckpt = export.export(tmp_path / "ray_results" / cfg.run.name, out)
    assert ckpt == Path(summary.checkpoint_path) and (out / "model.safetensors").is_file()
    scored = export.hf_val_loss(out, hf_data / "val")
    assert scored["documents"] == len(read_sample_ids(hf_data / "val"))
    assert scored["loss"] == pytest.approx(val_loss, rel=1e-4), (scored, val_loss)
