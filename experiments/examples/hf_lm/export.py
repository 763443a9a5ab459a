"""The trained model in the Hugging Face format, from an elastic-ddp checkpoint, and its
validation loss measured with ``transformers`` alone.

    python experiments/examples/hf_lm/export.py ray_results/hf-lm outputs/hf-lm --val data/hf_lm/val

``CHECKPOINT``: a ``checkpoint_step<k>`` directory, or the run's directory above them
(the newest complete one is taken). ``OUT`` receives ``save_pretrained``'s files: the
model (``config.json``, ``model.safetensors``) and the tokenizer (``tokenizer.json`` and
its config), loadable with ``AutoModelForCausalLM.from_pretrained(OUT)`` and
``AutoTokenizer.from_pretrained(OUT)``. With ``--val``, the exported model is reloaded
from OUT and scored on that Parquet split: the mean over documents of each document's
mean nats per predicted token, the figure the run logs as ``val_loss``.

The model is rebuilt from the checkpoint's own ``config.json`` (the job's config: task
path and kwargs, model kwargs), so run it from the directory the job ran in (relative
paths in that config resolve there).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import numpy as np


def final_checkpoint(path: str | Path) -> Path:
    """``path`` itself when it holds a checkpoint, else its newest complete
    ``checkpoint_step<k>`` (one whose ``manifest.json`` is written: the last file of a
    checkpoint).

    Raises:
        FileNotFoundError: no checkpoint there.
    """
    from elastic_ddp.checkpoint import MANIFEST, checkpoint_step

    p = Path(path)
    if (p / MANIFEST).is_file():
        return p
    found = sorted((d for d in p.glob("checkpoint_step*") if (d / MANIFEST).is_file()),
                   key=lambda d: checkpoint_step(str(d)))
    if not found:
        raise FileNotFoundError(f"{p}: no complete checkpoint_step<k> directory; give a run's "
                                "checkpoint directory (run.storage_path/run.name)")
    return found[-1]


def checkpoint_weights(ckpt_dir: str | Path) -> dict:
    """The model's state dict (no DDP ``module.`` prefix) from an elastic-ddp checkpoint:
    the one call that knows the checkpoint's layout."""
    from elastic_ddp.checkpoint.export import model_state

    return model_state(ckpt_dir)


def export(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write the checkpoint's model and the task's tokenizer to ``out_dir`` with
    ``save_pretrained``. Returns the checkpoint directory used.

    Raises:
        FileNotFoundError: no checkpoint (see :func:`final_checkpoint`).
        elastic_ddp.checkpoint.CheckpointError: the checkpoint is not elastic-ddp's.
        elastic_ddp.tasks.loading.TaskError: its task cannot be loaded from here.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from elastic_ddp.config import Config
    from elastic_ddp.tasks.loading import build_model, load_task

    ckpt = final_checkpoint(checkpoint)
    cfg = Config.from_dict(json.loads((ckpt / "config.json").read_text()))
    task = load_task(cfg)
    model = build_model(cfg, task)
    model.load_state_dict(checkpoint_weights(ckpt))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(task.tokenizer_json),
                                  bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
                                  model_max_length=model.config.n_positions)
    tok.save_pretrained(out)
    return ckpt


def hf_val_loss(model_dir: str | Path, val_path: str | Path, column: str = "text",
                batch_size: int = 32) -> dict[str, float]:
    """Score a ``save_pretrained`` directory on a Parquet split with ``transformers``
    only: ``{"loss": mean over documents of mean nats per predicted token, "documents": n}``.
    Documents are tokenized by the exported tokenizer (BOS ... EOS, cut to the model's
    context) and right-padded per batch; the padded targets are masked out."""
    import pyarrow.parquet as pq
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = pq.read_table(val_path, columns=[column])[column].to_pylist()
    losses = []
    with torch.no_grad():
        for a in range(0, len(texts), batch_size):
            enc = tok(texts[a:a + batch_size], truncation=True, max_length=model.config.n_positions,
                      padding=True, return_tensors="pt")
            ids, mask = enc["input_ids"], enc["attention_mask"]
            logits = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1]).logits.float()
            nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            m = mask[:, 1:].float()
            losses.append(((nll * m).sum(1) / m.sum(1).clamp_min(1.0)).numpy())
    per_doc = np.concatenate(losses)
    return {"loss": float(per_doc.mean()), "documents": int(len(per_doc))}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="checkpoint_step<k> directory or the run directory above it")
    p.add_argument("out_dir", help="where save_pretrained writes the model and tokenizer")
    p.add_argument("--val", default=None, help="Parquet split to score the reloaded model on")
    a = p.parse_args(argv)
    try:
        ckpt = export(a.checkpoint, a.out_dir)
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        print(f"export.py: error: {e}", file=sys.stderr)
        return 2
    print(f"exported {ckpt} -> {a.out_dir}")
    if a.val:
        r = hf_val_loss(a.out_dir, a.val)
        print(f"from_pretrained({a.out_dir}): val_loss {r['loss']:.4f} over {r['documents']} documents")
    return 0


if __name__ == "__main__":
    sys.exit(main())
