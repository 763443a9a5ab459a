"""A user task on PNG-encoded images: decode and augment in Ray Data, a user-defined CNN.

    task.path: experiments/examples/digits_png/task.py:DigitsPNG

Data flow of one micro-batch (B rows, S = image side, 16 by default):

    Parquet           sample_id int64, png binary (8-bit grayscale PNG), label int64
    Ray Data batch    {"sample_id": int64 [B], "png": object [B] of bytes, "label": int64 [B]}
    transform ->      {"image": float32 [B, 1, S, S] in [0, 1], "label": int64 [B]}
    collate   ->      {"image": torch.float32 [B, 1, S, S], "label": torch.int64 [B]}
    loss      ->      (cross-entropy float32 [B], {"acc": float32 [B] of 0/1})

Augmentation (train split only): shift by up to ``max_shift`` pixels in x and y (zero
fill, no wrap-around), then ``clip(x * contrast + brightness, 0, 1)`` with contrast in
``1 +- contrast`` and brightness in ``+- brightness``. Every random number comes from
``ctx.rngs()``, one generator per row seeded by (seed, epoch, sample_id): after a
restart or a resize, a sample lands in another block, rank or Ray Data task and still
gets the same pixels in the same epoch (``tests/e2e/examples/test_examples.py`` checks it).

This file is the whole task: the library ships it to the Ray workers by value
(cloudpickle), so it imports only installed packages, never a sibling file.
"""

from __future__ import annotations

import io

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

from elastic_ddp import Column, Task, TransformContext


def decode_png(blobs) -> np.ndarray:
    """Object array [B] of PNG bytes -> uint8 [B, S, S] (every image the same size)."""
    return np.stack([np.asarray(Image.open(io.BytesIO(b)).convert("L")) for b in blobs])


def augment(images: np.ndarray, rngs: list[np.random.Generator], max_shift: int,
            contrast: float, brightness: float) -> np.ndarray:
    """float32 [B, S, S] in [0, 1] -> augmented float32 [B, S, S], row i drawn from
    ``rngs[i]`` only (4 draws, always in the same order, so a row's result does not
    depend on the other rows of its batch)."""
    b, s, _ = images.shape
    m = max_shift
    padded = np.pad(images, ((0, 0), (m, m), (m, m)))          # zero fill for the shift
    out = np.empty_like(images)
    for i, g in enumerate(rngs):
        dy, dx = g.integers(-m, m + 1, size=2)
        c = 1.0 + g.uniform(-contrast, contrast)
        br = g.uniform(-brightness, brightness)
        crop = padded[i, m - dy:m - dy + s, m - dx:m - dx + s]   # content moves by (dy, dx)
        out[i] = np.clip(crop * np.float32(c) + np.float32(br), 0.0, 1.0)
    return out


class SmallCNN(nn.Module):
    """Two conv blocks and a linear head: [B, 1, S, S] -> logits [B, classes] (S divisible
    by 4). No BatchNorm: a rank may hold 1 row of a step under uneven batches, and the
    model then behaves the same whatever the world size."""

    def __init__(self, size: int = 16, width: int = 32, classes: int = 10, dropout: float = 0.1):
        super().__init__()
        w = width
        self.features = nn.Sequential(
            nn.Conv2d(1, w, 3, padding=1), nn.ReLU(),
            nn.Conv2d(w, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(),
            nn.Conv2d(2 * w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout),
            nn.Linear(2 * w * (size // 4) ** 2, 128), nn.ReLU(), nn.Linear(128, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class DigitsPNG(Task):
    """Digits stored as PNG bytes. ``task.kwargs``: max_shift (pixels), contrast and
    brightness (jitter half-widths), size (the PNGs' side, checked when decoding).
    ``model.kwargs``: width, dropout (see :class:`SmallCNN`)."""

    columns = {
        "png": Column.binary(hint="run experiments/examples/digits_png/prepare.py"),
        "label": Column.integer(min=0, max=9, hint="labels must be the digits 0..9"),
    }

    def __init__(self, size: int = 16, max_shift: int = 1, contrast: float = 0.2,
                 brightness: float = 0.1):
        if size % 4:
            raise ValueError(f"task.kwargs.size must be a multiple of 4, got {size}")
        self.size, self.max_shift = int(size), int(max_shift)
        self.contrast, self.brightness = float(contrast), float(brightness)

    def transform(self, batch: dict[str, np.ndarray], ctx: TransformContext) -> dict[str, np.ndarray]:
        images = decode_png(batch["png"])
        if images.shape[1:] != (self.size, self.size):
            raise ValueError(f"PNGs are {images.shape[1]}x{images.shape[2]}, task.kwargs.size "
                             f"is {self.size}; set task.kwargs.size or re-run prepare.py --size")
        x = images.astype(np.float32) / np.float32(255.0)
        if ctx.split == "train":
            x = augment(x, ctx.rngs(), self.max_shift, self.contrast, self.brightness)
        return {"image": x[:, None], "label": np.asarray(batch["label"], dtype=np.int64)}

    def collate(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        # np.array copies: Ray Data hands out read-only views, which torch will not wrap.
        return {"image": torch.from_numpy(np.array(batch["image"], dtype=np.float32)),
                "label": torch.from_numpy(np.array(batch["label"], dtype=np.int64))}

    def build_model(self, width: int = 32, dropout: float = 0.1) -> nn.Module:
        return SmallCNN(self.size, width, 10, dropout)

    def loss(self, model, batch):
        logits = model(batch["image"])
        per_sample = F.cross_entropy(logits, batch["label"], reduction="none")
        return per_sample, {"acc": (logits.argmax(-1) == batch["label"]).float()}
