"""Write scikit-learn's real handwritten digits as PNG-encoded images in Parquet.

    python experiments/examples/digits_png/prepare.py data/digits_png [--size 16] [--max-rows N]

Output: ``OUT/train/part-0000{0..3}.parquet`` and ``OUT/val/part-00000.parquet``, each
with small row groups (``--row-group-rows``, default 128) so the windowed reader can
shuffle at a fine grain. Columns (one row per image):

    sample_id  int64   the image's index in ``load_digits()`` order (stable whatever the
                       split or file layout; the unit the trainer accounts for)
    png        binary  a grayscale (mode "L") PNG, SIZE x SIZE pixels, 8-bit: the 8x8
                       source (intensities 0..16 scaled to 0..255) resized bilinearly
    label      int64   the digit, 0..9

The split is the library's (``elastic_ddp.data.prepare.prepare_digits``):
``round(1797 * 0.2) = 359`` val images drawn by ``np.random.default_rng(0)``, so the
val images here are the same 359 as in ``data/digits``. Deterministic: the same
arguments write the same bytes. Nothing is downloaded (the digits ship with
scikit-learn) and nothing is written outside ``OUT``.
"""

from __future__ import annotations

import argparse
import io
import shutil
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

VAL_FRACTION = 0.2
SPLIT_SEED = 0


def encode_png(pixels8x8: np.ndarray, size: int) -> bytes:
    """One 8x8 digit (float, 0..16) -> PNG bytes of a ``size`` x ``size`` 8-bit grayscale
    image. ``size == 8`` keeps the source pixels."""
    img = Image.fromarray(np.round(pixels8x8 * (255.0 / 16.0)).astype(np.uint8), mode="L")
    if size != 8:
        img = img.resize((size, size), Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def split_ids(n: int) -> dict[str, np.ndarray]:
    """{split: sorted sample ids}, the library's digits split rule."""
    perm = np.random.default_rng(SPLIT_SEED).permutation(n)
    n_val = int(round(n * VAL_FRACTION))
    return {"train": np.sort(perm[n_val:]), "val": np.sort(perm[:n_val])}


def prepare(out_dir: str | Path, size: int = 16, train_files: int = 4, val_files: int = 1,
            row_group_rows: int = 128, max_rows: Optional[int] = None) -> dict[str, int]:
    """Write the data set; ``max_rows`` keeps only the first rows of each split (tests).
    Replaces ``OUT/train`` and ``OUT/val``. Returns {split: rows written}."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.asarray(digits.images, dtype=np.float64)        # [1797, 8, 8], 0..16
    labels = np.asarray(digits.target, dtype=np.int64)          # [1797]
    out = Path(out_dir)
    written = {}
    for split, ids in split_ids(len(labels)).items():
        ids = ids[:max_rows] if max_rows else ids
        table = pa.table({
            "sample_id": pa.array(ids.astype(np.int64), pa.int64()),
            "png": pa.array([encode_png(images[i], size) for i in ids], pa.binary()),
            "label": pa.array(labels[ids], pa.int64()),
        })
        n_files = min(train_files if split == "train" else val_files, len(ids))
        split_dir = out / split
        shutil.rmtree(split_dir, ignore_errors=True)
        split_dir.mkdir(parents=True)
        bounds = np.linspace(0, len(ids), n_files + 1).astype(int)
        for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            pq.write_table(table.slice(a, b - a), split_dir / f"part-{k:05d}.parquet",
                           row_group_size=row_group_rows)
        written[split] = len(ids)
    return written


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="output directory, e.g. data/digits_png (git-ignored)")
    p.add_argument("--size", type=int, default=16, help="image side in pixels (8: no resize)")
    p.add_argument("--train-files", type=int, default=4)
    p.add_argument("--row-group-rows", type=int, default=128)
    p.add_argument("--max-rows", type=int, default=None, help="first N rows per split (tests)")
    a = p.parse_args(argv)
    n = prepare(a.out_dir, a.size, a.train_files, 1, a.row_group_rows, a.max_rows)
    print(f"wrote {n['train']} train / {n['val']} val PNG digits ({a.size}x{a.size}) to {a.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
