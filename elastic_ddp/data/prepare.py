"""Write the project's two real data sets as Parquet, with stable per-row sample ids.

Both writers produce ``out_dir/train/part-00000.parquet ...`` and
``out_dir/val/part-00000.parquet ...`` with an int64 ``sample_id`` column (the unit the
elastic trainer accounts for: each id is consumed exactly once per epoch) and a list
column ``x``. Nothing is downloaded.

A data set is published atomically per split: files are written into a hidden staging
directory inside ``out_dir`` and renamed into place only once complete, so a crash
never leaves a half-written ``train/`` or ``val/`` behind. Do not run two prepares into
the same ``out_dir`` at once.

``out_dir`` may also be an object-store URI (``s3://bucket/prefix``, ``gs://...``): the
splits are written to a local temporary directory, then each split's old objects are
deleted and the new files uploaded (:func:`elastic_ddp.paths.uri_to_filesystem`: the
store's endpoint, time bounds and retries). An object store has no rename, so a split is
not swapped in atomically there: an upload that fails deletes what it wrote of that split
and raises, naming the split's URI (run the prepare again).
"""

from __future__ import annotations

import os
import shutil
import sysconfig
import tempfile
import zlib
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from elastic_ddp.paths import is_uri

SPLITS = ("train", "val")
_STAGING_PREFIX = ".staging-"
_TRASH_PREFIX = ".trash-"
# Between files of the code corpus, so one file's tail does not run straight into the
# next file's first line.
PYCODE_SEPARATOR = b"\n"


def prepare_digits(
    out_dir: str | os.PathLike, num_files: int = 4, val_fraction: float = 0.2, seed: int = 0
) -> dict[str, Any]:
    """Write scikit-learn's bundled digits (1,797 real 8x8 images) as Parquet.

    Columns:
        ``sample_id`` int64: the image's index in ``load_digits()`` order, so an image
        keeps its id whatever the split or file layout.
        ``x`` list<float32>, 64 values: pixels in row-major 8x8 order, scaled to [0, 1]
        (raw intensities 0..16 divided by 16).
        ``y`` int64: the digit, 0..9.

    The val split is ``round(1797 * val_fraction)`` images drawn by
    ``np.random.default_rng(seed)``; the same seed gives the same split and files.
    Rows are in sample-id order within a split; shuffling is the loader's job. Train
    goes to ``num_files`` files and val to ``max(1, num_files // 4)`` files.

    Args:
        out_dir: Directory to write; created if missing. Existing ``train/`` and
            ``val/`` in it are replaced (``val/`` is removed when ``val_fraction`` is 0).
        num_files: Training files (>= 1), for sharding across readers.
        val_fraction: Share of images held out, in [0, 1).
        seed: Seed of the split.

    Returns:
        Summary dict: ``out_dir``, ``dataset``, ``feature_len`` (64), ``num_classes``
        (10), and per split (``train``, ``val``; val is None when not written) a dict
        with ``path``, ``files``, ``num_rows``.

    Raises:
        ValueError: ``num_files < 1`` or ``val_fraction`` outside [0, 1).
    """
    from sklearn.datasets import load_digits

    _check_common(num_files, val_fraction)
    digits = load_digits()
    pixels = (np.asarray(digits.data, dtype=np.float32) / np.float32(16.0)).astype(np.float32)
    labels = np.asarray(digits.target, dtype=np.int64)
    n = len(labels)

    perm = np.random.default_rng(seed).permutation(n)
    n_val = int(round(n * val_fraction))
    split_ids = {"train": np.sort(perm[n_val:]), "val": np.sort(perm[:n_val])}

    tables: dict[str, pa.Table] = {}
    for split, ids in split_ids.items():
        if len(ids) == 0:
            continue
        tables[split] = pa.table(
            {
                "sample_id": pa.array(ids.astype(np.int64), type=pa.int64()),
                "x": _list_array(pixels[ids], pa.float32()),
                "y": pa.array(labels[ids], type=pa.int64()),
            }
        )
    splits = _publish_to(out_dir, tables, _files_per_split(num_files), row_group_size=256)
    return {
        "dataset": "digits",
        "out_dir": _shown(out_dir),
        "feature_len": int(pixels.shape[1]),
        "num_classes": int(labels.max()) + 1,
        **splits,
    }


def prepare_pycode(
    out_dir: str | os.PathLike,
    block_size: int = 128,
    num_files: int = 8,
    val_fraction: float = 0.05,
    max_bytes: Optional[int] = None,
) -> dict[str, Any]:
    """Write a byte-level language-modelling corpus of this Python's standard library.

    Source: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` except
    ``site-packages``/``dist-packages`` (tests included; about 30 MB on CPython 3.11),
    in sorted relative-path order. The corpus therefore depends on the Python install:
    deterministic on one machine, not across Python versions.

    A file goes to val when ``crc32(relative posix path) / 2**32 < val_fraction``, so
    the split is by file (no val text leaks into train) and stable as files come and
    go. Each split's files are concatenated, separated by ``PYCODE_SEPARATOR``, and cut
    into non-overlapping windows of ``block_size + 1`` bytes; the short tail is dropped.
    A model reads ``x[:-1]`` as input and ``x[1:]`` as target.

    Columns:
        ``sample_id`` int64: 0..n-1 within each split, in corpus order (val ids overlap
        train ids; they are separate data sets).
        ``x`` list<uint8>, ``block_size + 1`` raw bytes (token ids 0..255).

    Args:
        out_dir: Directory to write; created if missing; ``train/`` and ``val/`` in it
            are replaced.
        block_size: Context length in bytes (>= 1).
        num_files: Training files (>= 1); val gets ``max(1, num_files // 4)``.
        val_fraction: Approximate share of files (not bytes) held out, in [0, 1).
        max_bytes: Cap on corpus bytes for tests. Val keeps up to
            ``max_bytes * val_fraction`` bytes and train up to the rest, each at least
            one window and each the prefix of that split's byte stream, so a small cap
            still gives a non-empty val split. None reads everything.

    Returns:
        Summary dict: ``dataset``, ``out_dir``, ``stdlib``, ``block_size``,
        ``feature_len`` (``block_size + 1``), and per split a dict with ``path``,
        ``files``, ``num_rows``, ``source_files`` (count read), ``bytes`` (bytes of the
        stream before windowing).

    Raises:
        ValueError: bad arguments, or a split that ends up with no full window
            (``max_bytes`` too small for ``block_size``).
    """
    _check_common(num_files, val_fraction)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    by_split = _split_by_file(_stdlib_sources(stdlib), val_fraction)
    window = block_size + 1

    budgets: dict[str, Optional[int]] = {"train": None, "val": None}
    if max_bytes is not None:
        val_budget = max(window, int(round(max_bytes * val_fraction))) if val_fraction else 0
        budgets = {"train": max(window, max_bytes - val_budget), "val": val_budget}

    tables: dict[str, pa.Table] = {}
    stream_info: dict[str, dict[str, int]] = {}
    for split in SPLITS:
        if not by_split[split]:
            continue
        stream, n_sources = _read_stream(stdlib, by_split[split], budgets[split])
        n_rows = len(stream) // window
        if n_rows == 0:
            raise ValueError(
                f"pycode {split} split has {len(stream)} bytes, less than one window of "
                f"block_size + 1 = {window}; raise max_bytes or lower block_size"
            )
        windows = np.frombuffer(stream, dtype=np.uint8)[: n_rows * window].reshape(n_rows, window)
        tables[split] = pa.table(
            {
                "sample_id": pa.array(np.arange(n_rows, dtype=np.int64)),
                "x": _list_array(windows, pa.uint8()),
            }
        )
        stream_info[split] = {"source_files": n_sources, "bytes": len(stream)}

    splits = _publish_to(out_dir, tables, _files_per_split(num_files), row_group_size=4096)
    for split, info in stream_info.items():
        splits[split].update(info)
    return {
        "dataset": "pycode",
        "out_dir": _shown(out_dir),
        "stdlib": str(stdlib),
        "block_size": block_size,
        "feature_len": window,
        **splits,
    }


def _check_common(num_files: int, val_fraction: float) -> None:
    if num_files < 1:
        raise ValueError(f"num_files must be >= 1, got {num_files}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")


def _files_per_split(num_files: int) -> dict[str, int]:
    return {"train": num_files, "val": max(1, num_files // 4)}


def _list_array(matrix: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    """Rows of a 2-D array as one list array, built from offsets without a Python loop."""
    n_rows, width = matrix.shape
    values = pa.array(np.ascontiguousarray(matrix).reshape(-1), type=value_type)
    offsets = pa.array(np.arange(0, (n_rows + 1) * width, width, dtype=np.int32), type=pa.int32())
    return pa.ListArray.from_arrays(offsets, values)


def _stdlib_sources(stdlib: Path) -> list[str]:
    """Relative posix paths of the stdlib's ``*.py`` files, sorted.

    ``os.walk`` does not follow symlinked directories, so a link back into the tree
    cannot duplicate files.
    """
    skip = {"site-packages", "dist-packages", "__pycache__"}
    found = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = [d for d in dirs if d not in skip]
        rel_root = Path(root).relative_to(stdlib)
        found.extend((rel_root / f).as_posix() for f in files if f.endswith(".py"))
    return sorted(found)


def _split_by_file(rel_paths: list[str], val_fraction: float) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"train": [], "val": []}
    for rel in rel_paths:
        bucket = zlib.crc32(rel.encode("utf-8")) / 2**32
        out["val" if bucket < val_fraction else "train"].append(rel)
    return out


def _read_stream(root: Path, rel_paths: list[str], budget: Optional[int]) -> tuple[bytes, int]:
    """Concatenate files (separator between them), stopping once ``budget`` bytes are had."""
    parts: list[bytes] = []
    total = 0
    n_read = 0
    for rel in rel_paths:
        if budget is not None and total >= budget:
            break
        data = (root / rel).read_bytes() + PYCODE_SEPARATOR
        parts.append(data)
        total += len(data)
        n_read += 1
    stream = b"".join(parts)
    return (stream[:budget] if budget is not None else stream), n_read


def _shown(out_dir: str | os.PathLike) -> str:
    """``out_dir`` as the summary names it: a URI as given, a path normalised."""
    return str(out_dir) if _remote(out_dir) else str(Path(out_dir))


def _remote(out_dir: str | os.PathLike) -> bool:
    return is_uri(out_dir) and not os.fspath(out_dir).lower().startswith("file:")


def _publish_to(out_dir: str | os.PathLike, tables: dict[str, pa.Table],
                files_per_split: dict[str, int], row_group_size: int):
    """:func:`_publish` into a local directory, or through a local one to an object store."""
    if not is_uri(out_dir):
        return _publish(Path(out_dir), tables, files_per_split, row_group_size)
    if not _remote(out_dir):  # file://: its decoded path
        from elastic_ddp.paths import uri_to_filesystem
        return _publish(Path(uri_to_filesystem(out_dir)[1]), tables, files_per_split, row_group_size)
    return _publish_remote(os.fspath(out_dir).rstrip("/"), tables, files_per_split, row_group_size)


def _publish_remote(uri: str, tables: dict[str, pa.Table], files_per_split: dict[str, int],
                    row_group_size: int) -> dict[str, Optional[dict[str, Any]]]:
    """Write the splits locally, then replace each split's objects under ``uri`` by them.

    Raises:
        OSError: an upload or delete failed (the store's error in the message, after the
            file system's own retries); the split's objects are deleted (best effort), so
            no split is left with a mix of old and new files.
    """
    import pyarrow.fs

    from elastic_ddp.paths import uri_to_filesystem

    fs, root = uri_to_filesystem(uri)
    summary: dict[str, Optional[dict[str, Any]]] = {split: None for split in SPLITS}
    with tempfile.TemporaryDirectory(prefix="elastic-ddp-prepare-") as tmp:
        local = _publish(Path(tmp), tables, files_per_split, row_group_size)
        for split in SPLITS:
            dest = f"{root}/{split}"
            try:
                fs.delete_dir_contents(dest, missing_dir_ok=True)
                if local[split] is None:
                    continue
                pyarrow.fs.copy_files(f"{tmp}/{split}", dest,
                                      source_filesystem=pyarrow.fs.LocalFileSystem(),
                                      destination_filesystem=fs, use_threads=True)
            except OSError as e:
                try:
                    fs.delete_dir_contents(dest, missing_dir_ok=True)
                except OSError:
                    pass
                raise OSError(f"{uri}/{split}: the upload failed ({e}); its objects were "
                              "deleted, run the prepare again") from None
            names = [Path(f).name for f in local[split]["files"]]
            summary[split] = {"path": f"{uri}/{split}",
                              "files": [f"{uri}/{split}/{n}" for n in names],
                              "num_rows": local[split]["num_rows"]}
    return summary


def _publish(
    out_dir: Path, tables: dict[str, pa.Table], files_per_split: dict[str, int], row_group_size: int
) -> dict[str, Optional[dict[str, Any]]]:
    """Write each split into staging, then swap it in for ``out_dir/<split>``.

    A split absent from ``tables`` has its old directory removed, so a re-prepare with
    ``val_fraction=0`` does not leave a stale val set that a config might still point at.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(out_dir)
    staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=out_dir))
    summary: dict[str, Optional[dict[str, Any]]] = {split: None for split in SPLITS}
    try:
        for split, table in tables.items():
            files = _write_parts(staging / split, table, files_per_split[split], row_group_size)
            summary[split] = {
                "path": str(out_dir / split),
                "files": [str(out_dir / split / f.name) for f in files],
                "num_rows": table.num_rows,
            }
        trash = Path(tempfile.mkdtemp(prefix=_TRASH_PREFIX, dir=out_dir))
        for split in SPLITS:
            dest = out_dir / split
            if dest.exists():
                os.rename(dest, trash / split)
            if split in tables:
                os.rename(staging / split, dest)
        shutil.rmtree(trash, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return summary


def _remove_leftovers(out_dir: Path) -> None:
    """Remove staging/trash directories that an earlier, crashed prepare left behind."""
    for entry in out_dir.iterdir():
        if entry.is_dir() and entry.name.startswith((_STAGING_PREFIX, _TRASH_PREFIX)):
            shutil.rmtree(entry, ignore_errors=True)


def _write_parts(split_dir: Path, table: pa.Table, num_files: int, row_group_size: int) -> list[Path]:
    split_dir.mkdir(parents=True)
    # Never write empty files: a reader would get a file with no row groups for nothing.
    bounds = np.linspace(0, table.num_rows, min(num_files, table.num_rows) + 1).astype(np.int64)
    paths = []
    for i, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        path = split_dir / f"part-{i:05d}.parquet"
        pq.write_table(table.slice(start, stop - start), path, row_group_size=row_group_size)
        paths.append(path)
    return paths
