"""Write this Python's standard-library source as documents of different lengths in Parquet.

    python experiments/examples/stdlib_lm/prepare.py data/stdlib_lm [--max-bytes N] [--doc-bytes 256]

Each ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (not site-packages, tests
included; sorted relative paths) is cut into documents:

1. at top-level ``def`` / ``async def`` / ``class`` / decorator lines (a decorated
   definition stays one piece; the module header before the first one is a piece);
2. a piece longer than ``--doc-bytes`` UTF-8 bytes is packed greedily from its
   paragraphs (blank-line separated), a paragraph that is still too long from its lines,
   and a line that is still too long is cut (at a character boundary);
3. leading/trailing blank lines are stripped and pieces under ``--min-bytes`` dropped.

So document lengths run from ``--min-bytes`` to ``--doc-bytes``. Files that are not valid
UTF-8 (a few encoding tests) are skipped. A file goes to val when
``crc32(relative posix path) / 2**32 < --val-fraction`` (the rule of
``elastic_ddp.data.prepare.prepare_pycode``): the split is by file, no val text is in train.

Columns (one row per document), row groups of ``--row-group-rows`` (default 512):

    sample_id  int64   0..n-1 within each split, in (file, position) order
    text       string  the document (UTF-8)
    source     string  its file, relative to the stdlib (for inspection; the task does
                       not read it)

``--max-bytes`` caps the text: val keeps up to ``max_bytes * val_fraction`` bytes and train
the rest, each the first documents of its split in order. Deterministic on one Python
install (the corpus is that install's stdlib). Writes only under OUT.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import sysconfig
import zlib
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

# A line that starts a top-level definition (or its decorators).
TOP_LEVEL = re.compile(r"(def |async def |class |@)")


def stdlib_files(root: Path) -> list[str]:
    """Relative posix paths of the stdlib's ``*.py`` files, sorted (symlinked directories
    are not followed, so nothing is read twice)."""
    skip = {"site-packages", "dist-packages", "__pycache__"}
    found = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in skip]
        rel = Path(d).relative_to(root)
        found += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    return sorted(found)


def _nbytes(s: str) -> int:
    return len(s.encode("utf-8"))


def _top_level_pieces(text: str) -> list[str]:
    """The file cut before each top-level definition; a decorator keeps its definition."""
    pieces, cur, prev = [], [], ""
    for line in text.splitlines(keepends=True):
        if cur and TOP_LEVEL.match(line) and not prev.startswith("@"):
            pieces.append("".join(cur))
            cur = []
        cur.append(line)
        if line.strip():
            prev = line
    if cur:
        pieces.append("".join(cur))
    return pieces


def _pack(parts: list[str], cap: int) -> list[str]:
    """Concatenate consecutive parts greedily into chunks of at most ``cap`` bytes (a
    part larger than ``cap`` is a chunk of its own, for the caller to cut further)."""
    out, cur, size = [], [], 0
    for p in parts:
        n = _nbytes(p)
        if cur and size + n > cap:
            out.append("".join(cur))
            cur, size = [], 0
        cur.append(p)
        size += n
    if cur:
        out.append("".join(cur))
    return out


def _cut_line(line: str, cap: int) -> list[str]:
    """A line longer than ``cap`` bytes, cut at character boundaries."""
    out, cur, size = [], [], 0
    for ch in line:
        n = _nbytes(ch)
        if size + n > cap:
            out.append("".join(cur))
            cur, size = [], 0
        cur.append(ch)
        size += n
    out.append("".join(cur))
    return out


def split_document(text: str, cap: int) -> Iterator[str]:
    """One source file -> chunks of at most ``cap`` UTF-8 bytes (before stripping)."""
    for piece in _top_level_pieces(text):
        if _nbytes(piece) <= cap:
            yield piece
            continue
        paragraphs = re.split(r"(?<=\n)(?=[ \t]*\n)", piece)    # keep the blank lines
        for chunk in _pack(paragraphs, cap):
            if _nbytes(chunk) <= cap:
                yield chunk
                continue
            lines = [seg for ln in chunk.splitlines(keepends=True) for seg in _cut_line(ln, cap)]
            yield from _pack(lines, cap)


def documents(root: Path, rel_paths: list[str], doc_bytes: int, min_bytes: int,
              budget: Optional[int]) -> tuple[list[str], list[str], int]:
    """(texts, sources, files skipped as not UTF-8), stopping once ``budget`` bytes of
    text are had."""
    texts, sources, skipped, total = [], [], 0, 0
    for rel in rel_paths:
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        for chunk in split_document(text.replace("\r\n", "\n"), doc_bytes):
            chunk = chunk.strip("\n")
            n = _nbytes(chunk)
            if n < min_bytes:
                continue
            if budget is not None and total + n > budget:
                return texts, sources, skipped
            texts.append(chunk)
            sources.append(rel)
            total += n
    return texts, sources, skipped


def prepare(out_dir: str | Path, doc_bytes: int = 256, min_bytes: int = 64,
            val_fraction: float = 0.05, max_bytes: Optional[int] = None,
            train_files: int = 8, row_group_rows: int = 512) -> dict[str, dict]:
    """Write ``OUT/train`` and ``OUT/val`` (replacing them). Returns per split: rows,
    bytes of text, source files skipped."""
    if not 0 < min_bytes <= doc_bytes:
        raise ValueError(f"need 0 < min_bytes <= doc_bytes, got {min_bytes}, {doc_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    by_split: dict[str, list[str]] = {"train": [], "val": []}
    for rel in stdlib_files(root):
        by_split["val" if zlib.crc32(rel.encode()) / 2**32 < val_fraction else "train"].append(rel)
    budgets = {"train": None, "val": None}
    if max_bytes is not None:
        val_budget = max(doc_bytes, int(max_bytes * val_fraction))
        budgets = {"train": max(doc_bytes, max_bytes - val_budget), "val": val_budget}
    summary = {}
    for split, rels in by_split.items():
        texts, sources, skipped = documents(root, rels, doc_bytes, min_bytes, budgets[split])
        if not texts:
            raise ValueError(f"{split}: no documents (raise --max-bytes)")
        table = pa.table({"sample_id": pa.array(np.arange(len(texts), dtype=np.int64)),
                          "text": pa.array(texts, pa.string()),
                          "source": pa.array(sources, pa.string())})
        split_dir = Path(out_dir) / split
        shutil.rmtree(split_dir, ignore_errors=True)
        split_dir.mkdir(parents=True)
        n_files = min(train_files if split == "train" else max(1, train_files // 4), len(texts))
        bounds = np.linspace(0, len(texts), n_files + 1).astype(int)
        for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            pq.write_table(table.slice(a, b - a), split_dir / f"part-{k:05d}.parquet",
                           row_group_size=row_group_rows)
        lengths = np.array([_nbytes(t) for t in texts])
        summary[split] = {"rows": len(texts), "bytes": int(lengths.sum()),
                          "median_bytes": int(np.median(lengths)), "skipped_files": skipped}
    return summary


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="output directory, e.g. data/stdlib_lm (git-ignored)")
    p.add_argument("--max-bytes", type=int, default=None, help="cap on text bytes (quick runs)")
    p.add_argument("--doc-bytes", type=int, default=256, help="longest document, UTF-8 bytes")
    p.add_argument("--min-bytes", type=int, default=64, help="shorter documents are dropped")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--train-files", type=int, default=8)
    p.add_argument("--row-group-rows", type=int, default=512)
    a = p.parse_args(argv)
    s = prepare(a.out_dir, a.doc_bytes, a.min_bytes, a.val_fraction, a.max_bytes,
                a.train_files, a.row_group_rows)
    for split, v in s.items():
        print(f"{split}: {v['rows']} documents, {v['bytes']} bytes (median {v['median_bytes']}), "
              f"{v['skipped_files']} non-UTF-8 files skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
