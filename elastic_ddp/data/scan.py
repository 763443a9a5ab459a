"""Check a Parquet data set on the driver before training, and list its sample ids.

:func:`scan_parquet` reads footers and schemas of every file, reads only the id (and
label) column in full, and samples the feature column in the first and last row group
of each file. It is what turns a bad path or a broken file into one clear message
before Ray, MLflow or any worker starts, and its sorted id array is the ledger the
elastic trainer accounts against.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq


class DataError(ValueError):
    """A data set that cannot be trained on. The message names the file, the column and the fix."""


@dataclass
class DatasetInfo:
    """What :func:`scan_parquet` found.

    Attributes:
        path: The path as given (directory or file).
        files: Parquet files in read order (sorted relative paths), absolute.
        num_rows: Total rows over all files.
        rows_per_file: Row count per entry of ``files``, from the footers.
        sample_ids: Every sample id, sorted ascending, unique; int64, shape (num_rows,).
        feature_column: Name of the list-typed feature column.
        feature_len: Length of every feature list (e.g. 64 for digits, block_size + 1
            for pycode); None only when no file has a row to sample.
        label_column: Name of the integer label column, or None.
        num_classes_seen: ``max(label) + 1`` when there is a label column, else None.
            A lower bound on the model's class count (a class absent here is not seen).
    """

    path: str
    files: list[str]
    num_rows: int
    rows_per_file: list[int]
    sample_ids: np.ndarray
    feature_column: str
    feature_len: Optional[int]
    label_column: Optional[str]
    num_classes_seen: Optional[int]


def scan_parquet(
    path: str | os.PathLike,
    feature_column: str,
    id_column: str = "sample_id",
    label_column: Optional[str] = None,
) -> DatasetInfo:
    """Validate a Parquet data set and return its row counts and sorted sample ids.

    ``path`` is one Parquet file or a directory; a directory means every ``*.parquet``
    file under it, recursively, in sorted relative-path order. Paths with a component
    starting with ``.`` or ``_`` are skipped (staging directories, ``_SUCCESS``-style
    markers), as Spark and Arrow do.

    Cost: footers for every file, the id and label columns in full (8 bytes a row
    each), and the feature column of the first and last row group of each file. About
    100k rows scan in well under a second.

    Checks, each raising :class:`DataError` naming the file(s) and column:
        * the path exists; a directory holds at least one Parquet file; each file is
          valid Parquet; the data set has at least one row;
        * every file has ``id_column``, ``feature_column`` and ``label_column`` (if
          given), with the same Arrow type in every file;
        * ``id_column`` is an integer type, without nulls, unique over all files
          (values must fit int64);
        * ``feature_column`` is a (fixed-size or variable) list of numbers, and every
          sampled list has the same length, across files too;
        * ``label_column`` is an integer type, without nulls or negative values.

    Args:
        path: File or directory.
        feature_column: The list column a model reads (``x``).
        id_column: The unique integer id column.
        label_column: The class label column, or None for language modelling.

    Returns:
        A :class:`DatasetInfo`.

    Raises:
        DataError: on any of the problems above.
    """
    root = Path(path)
    files = _list_files(root)
    columns = [id_column, feature_column] + ([label_column] if label_column else [])
    if len(set(columns)) != len(columns):
        raise DataError(
            f"{root}: columns must be distinct, got id_column={id_column!r}, "
            f"feature_column={feature_column!r}, label_column={label_column!r}; "
            "set data.id_column / data.feature_column / data.label_column to different columns"
        )

    first_types: dict[str, tuple[pa.DataType, Path]] = {}
    rows_per_file: list[int] = []
    id_chunks: list[np.ndarray] = []
    label_max: Optional[int] = None
    feature_len: Optional[int] = None
    feature_len_file: Optional[Path] = None

    for f in files:
        pf = _open(f)
        schema = pf.schema_arrow
        for col in columns:
            if schema.get_field_index(col) < 0:
                have = ", ".join(repr(n) for n in schema.names) or "none"
                raise DataError(
                    f"{f}: missing column {col!r}; the file has columns: {have}. Point the "
                    f"config's data column names at existing columns or rewrite the file"
                )
            _check_same_type(f, col, schema.field(col).type, first_types)

        id_type = schema.field(id_column).type
        if not pa.types.is_integer(id_type):
            raise DataError(
                f"{f}: id column {id_column!r} has type {id_type}, not an integer type; "
                "store sample ids as int64 (or set data.id_column to the integer id column)"
            )
        feature_type = schema.field(feature_column).type
        _check_feature_type(f, feature_column, feature_type)
        if label_column:
            label_type = schema.field(label_column).type
            if not pa.types.is_integer(label_type):
                raise DataError(
                    f"{f}: label column {label_column!r} has type {label_type}, not an "
                    "integer type; store class labels as int64 0..C-1 (or set "
                    "data.label_column: null for language modelling)"
                )

        n_rows = pf.metadata.num_rows
        rows_per_file.append(n_rows)
        if n_rows == 0:
            id_chunks.append(np.empty(0, dtype=np.int64))
            continue

        read_cols = [id_column] + ([label_column] if label_column else [])
        table = pf.read(columns=read_cols)
        id_chunks.append(_ids(f, id_column, table.column(id_column)))
        if label_column:
            file_max = _label_max(f, label_column, table.column(label_column))
            label_max = file_max if label_max is None else max(label_max, file_max)

        file_len = _feature_len(pf, f, feature_column, feature_type)
        if feature_len is None:
            feature_len, feature_len_file = file_len, f
        elif file_len != feature_len:
            raise DataError(
                f"{f}: feature column {feature_column!r} has lists of length {file_len}, but "
                f"{feature_len_file} has length {feature_len}; every sample's features must "
                "have the same length (re-prepare the data with one block size / image size)"
            )

    num_rows = sum(rows_per_file)
    if num_rows == 0:
        raise DataError(
            f"{root}: the data set is empty (0 rows in {len(files)} file(s), column "
            f"{id_column!r} has no ids); write data into it, e.g. `elastic-ddp prepare`"
        )
    sample_ids = _sorted_unique_ids(files, rows_per_file, id_chunks, id_column)
    return DatasetInfo(
        path=str(path),
        files=[str(f) for f in files],
        num_rows=num_rows,
        rows_per_file=rows_per_file,
        sample_ids=sample_ids,
        feature_column=feature_column,
        feature_len=feature_len,
        label_column=label_column,
        num_classes_seen=None if label_max is None else label_max + 1,
    )


def _list_files(root: Path) -> list[Path]:
    if not root.exists():
        raise DataError(
            f"{root}: path does not exist; check data.train_path / data.val_path, or "
            "create the data set first (e.g. `elastic-ddp prepare digits data/digits`)"
        )
    if root.is_file():
        return [Path(os.path.abspath(root))]
    found = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.parquet")
        if p.is_file()
        and not any(part.startswith((".", "_")) for part in p.relative_to(root).parts)
    )
    if not found:
        raise DataError(
            f"{root}: directory has no Parquet files (*.parquet, searched recursively); "
            "point the config at the directory that holds them or prepare the data first"
        )
    base = Path(os.path.abspath(root))
    return [base / rel for rel in found]


def _open(f: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(
            f"{f}: not a valid Parquet file ({exc}); delete or re-write it, or move it out "
            "of the data directory"
        ) from exc


def _type_key(t: pa.DataType) -> tuple:
    """A type's identity for cross-file comparison, ignoring list child field names.

    Writers disagree on the child name (``item`` vs ``element``) without changing what
    the column holds.
    """
    if pa.types.is_fixed_size_list(t):
        return ("fixed_size_list", t.list_size, _type_key(t.value_type))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return (str(t).split("<", 1)[0], _type_key(t.value_type))
    return (str(t),)


def _check_same_type(
    f: Path, col: str, t: pa.DataType, first_types: dict[str, tuple[pa.DataType, Path]]
) -> None:
    if col not in first_types:
        first_types[col] = (t, f)
        return
    first_t, first_f = first_types[col]
    if _type_key(t) != _type_key(first_t):
        raise DataError(
            f"{f}: column {col!r} has type {t}, but {first_f} has type {first_t}; all files "
            "of a data set must share one schema (re-write one of them with the other's type)"
        )


def _check_feature_type(f: Path, col: str, t: pa.DataType) -> None:
    is_list = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    if not is_list:
        raise DataError(
            f"{f}: feature column {col!r} has type {t}, not a list type; store each sample's "
            "features as one list<float32> (pixels) or list<uint8> (byte tokens) per row, "
            "or set data.feature_column to such a column"
        )
    value_type = t.value_type
    if not (pa.types.is_integer(value_type) or pa.types.is_floating(value_type)):
        raise DataError(
            f"{f}: feature column {col!r} is a list of {value_type}, not of numbers; "
            "store features as integers or floats"
        )


def _ids(f: Path, col: str, column: pa.ChunkedArray) -> np.ndarray:
    if column.null_count:
        raise DataError(
            f"{f}: id column {col!r} has {column.null_count} null(s); every row needs an "
            "integer sample id (re-prepare the data or fill the ids)"
        )
    try:
        column = column.cast(pa.int64())
    except pa.ArrowInvalid as exc:
        raise DataError(
            f"{f}: id column {col!r} has values that do not fit int64 ({exc}); renumber "
            "the ids within 0..2**63-1"
        ) from exc
    return column.to_numpy()


def _label_max(f: Path, col: str, column: pa.ChunkedArray) -> int:
    if column.null_count:
        raise DataError(
            f"{f}: label column {col!r} has {column.null_count} null(s); every row needs "
            "a class label (drop unlabelled rows)"
        )
    bounds = pc.min_max(column)
    lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
    if lo < 0:
        raise DataError(
            f"{f}: label column {col!r} has negative label {lo}; labels must be class "
            "indices 0..C-1 (remap them)"
        )
    return int(hi)


def _feature_len(pf: pq.ParquetFile, f: Path, col: str, t: pa.DataType) -> Optional[int]:
    """Length of the feature lists, sampled from the first and last row group."""
    if pa.types.is_fixed_size_list(t):
        return t.list_size
    groups = sorted({0, pf.metadata.num_row_groups - 1})
    lengths: set[int] = set()
    for g in groups:
        column = pf.read_row_group(g, columns=[col]).column(col)
        if column.null_count:
            raise DataError(
                f"{f}: feature column {col!r} has null lists (row group {g}); every row "
                "needs features (drop those rows)"
            )
        if len(column) == 0:
            continue
        bounds = pc.min_max(pc.list_value_length(column))
        lengths.update({bounds["min"].as_py(), bounds["max"].as_py()})
    if len(lengths) > 1:
        raise DataError(
            f"{f}: feature column {col!r} has lists of different lengths "
            f"({', '.join(str(n) for n in sorted(lengths))}); every sample's features must "
            "have one length (pad or re-prepare the data)"
        )
    return lengths.pop() if lengths else None


def _sorted_unique_ids(
    files: list[Path], rows_per_file: list[int], id_chunks: list[np.ndarray], col: str
) -> np.ndarray:
    ids = np.concatenate(id_chunks)
    # Stable sort keeps equal ids in file order, so a duplicate's two files come out
    # in read order in the message.
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    dup = np.flatnonzero(sorted_ids[1:] == sorted_ids[:-1])
    if dup.size:
        k = int(dup[0])
        file_of_row = np.repeat(np.arange(len(files)), rows_per_file)
        fa, fb = files[file_of_row[order[k]]], files[file_of_row[order[k + 1]]]
        where = f"{fa}" if fa == fb else f"{fa} and {fb}"
        raise DataError(
            f"{where}: column {col!r} has duplicate sample id {int(sorted_ids[k])} "
            f"({dup.size} duplicate(s) in all); sample ids must be unique across the whole "
            "data set (renumber the ids, or remove a file that was copied twice)"
        )
    return sorted_ids
