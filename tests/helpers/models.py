"""A trained model checked outside the product: its accuracy on a split's Parquet rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch


def val_accuracy_of(model: torch.nn.Module, val_dir: Path) -> tuple[float, int]:
    """Accuracy of ``model`` (called on [B, 64] float rows) on every val row."""
    files = sorted(val_dir.glob("*.parquet"))
    x = np.concatenate([np.stack(pq.read_table(f, columns=["x"])["x"].to_numpy(zero_copy_only=False))
                        for f in files]).astype(np.float32)
    y = np.concatenate([pq.read_table(f, columns=["y"])["y"].to_numpy() for f in files])
    model.eval()
    with torch.no_grad():
        pred = model(torch.from_numpy(x)).argmax(-1).numpy()
    return float((pred == y).mean()), len(y)
