"""Check a Parquet data set on the driver before training, from its footers.

    info = scan_parquet("data/digits/train", task.input_columns(), id_column="sample_id")

:func:`scan_parquet` lists the files (following symlinked directories, with a loop
guard), reads every footer, checks the columns the task declares (``Column``: kind,
length, value range and nulls from the footer statistics, list lengths from the first and
last row group), unifies the files' schemas (nullability, list child names, numbers of
different widths widened: ``columns.unify_field``; the reader casts every file to it, so
the scan and the reader see the same data), and returns the row groups the epoch order is
built from. It is what turns a bad path or a broken file into one clear message before
Ray, MLflow or any worker starts.

``path`` is a local path or a URI (``s3://``, ``gs://``, ``file://``): files are listed
and opened through the storage's pyarrow file system (:mod:`elastic_ddp.data.files`), and
the footers are read :data:`FOOTER_THREADS` at a time (on an object store each is a
request: 1,000 files one after another would take 1,000 round trips), the results used in
file order, so messages and the order are those of a one-by-one scan.

Cost: footers, plus the columns' first and last row group of each file for list lengths.
The id column is read in full only for data sets of at most ``ID_CHECK_MAX_ROWS`` rows
(to prove ids unique); larger ones are proven unique from per-row-group min/max
statistics when the ranges are disjoint and dense, else a warning says they were not
checked. Nothing proportional to the number of rows leaves this function.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from elastic_ddp.data.columns import check_column, unify_field
from elastic_ddp.data.files import ParquetSource, open_input, read_columns, read_row_group
from elastic_ddp.data.listing import (DATA_PATH_FIELDS, DataError, is_remote, listing, one_line,
                                      relative_name, shown)
from elastic_ddp.data.order import RowGroup
from elastic_ddp.paths import is_uri, uri_to_filesystem
from elastic_ddp.tasks.protocol import Column

# Data sets up to this many rows have their ids read in full to prove them unique.
ID_CHECK_MAX_ROWS = 5_000_000
# Footers (and id columns) read at a time: each is one or two requests to an object store,
# mostly waiting on the network, so threads overlap them; a local disk gains little and
# loses nothing. Bounded so that a scan does not open more connections than a store's
# client pool serves well.
FOOTER_THREADS = 16
# An object of at most this many bytes is read whole by the scan, in one request: Arrow's
# footer read fetches the last 64 KiB anyway, so its id column then costs no request and
# no byte more (1,000 small files: 2 requests each instead of 3).
SMALL_FILE_BYTES = 64 * 2**10


@dataclass
class DatasetInfo:
    """What :func:`scan_parquet` found.

    Attributes:
        path: the path as given (directory or file; a local path or a URI).
        files: Parquet files in read order (sorted relative paths): absolute local paths,
            or URIs (``s3://bucket/key``) for an object store, valid on every node.
        num_rows: rows over all files.
        rows_per_file: row count per entry of ``files``.
        row_groups: every row group in file order (``RowGroup``: file index, row group,
            rows, compressed bytes of the columns read).
        columns: the columns read: the task's plus the id column.
        schema: the unified Arrow schema of ``columns`` (nullable where any file is),
            which the reader casts every file to.
        id_column: the sample id column.
        fingerprint: sha256 of the file names (relative to ``path``), their sizes in
            bytes (the storage's metadata: ``os.stat``, or the object's size from the
            listing), row groups' row counts and id statistics: changes when rows are
            added, removed or renumbered, or a file is rewritten with another size; a copy
            of the same files elsewhere (another directory, bucket or store) keeps it. The
            modification time is not used: a copy or re-upload of the same bytes changes it.
        skipped: files or directories under ``path`` that were not read, and why.
        id_ranges: per entry of ``row_groups``, the id column's ``(min, max)`` from the
            footer statistics (``(None, None)`` where the file has none): where
            :func:`locate_ids` looks for a row.
    """

    path: str
    files: list[str]
    num_rows: int
    rows_per_file: list[int]
    row_groups: list[RowGroup]
    columns: list[str]
    schema: pa.Schema
    id_column: str
    fingerprint: str
    skipped: list[str] = field(default_factory=list)
    id_ranges: list[tuple] = field(default_factory=list)
    file_sizes: list[int] = field(default_factory=list)

    def sources(self) -> list[ParquetSource]:
        """``files`` as the readers open them: with their sizes (no size request on an
        object store) and the fingerprint (what their cached footers belong to)."""
        sizes = self.file_sizes or [-1] * len(self.files)
        return [ParquetSource(f, n, self.fingerprint) for f, n in zip(self.files, sizes)]


def scan_parquet(path: str | os.PathLike, columns: Mapping[str, Column],
                 id_column: str = "sample_id", field: str = DATA_PATH_FIELDS) -> DatasetInfo:
    """Validate a Parquet data set against the task's declared ``columns``. ``field``:
    the config field that names ``path`` (``data.train_path``), for the messages.

    ``path`` is one Parquet file or a directory (a local path, or a ``s3://``, ``gs://``,
    ``file://`` URI): every ``*.parquet`` file under it, recursively (local symlinked
    directories followed once each), in sorted relative-path order. Entries whose name
    starts with ``.`` or ``_`` are skipped (staging directories, ``_SUCCESS`` markers), as
    Spark and Arrow do; ``DatasetInfo.skipped`` lists them.

    Raises:
        DataError: missing path, no Parquet files, an unreadable file, an empty data
            set, a missing column, a type that does not fit the declared ``Column`` or
            differs between files, nulls where none are allowed, values out of the
            declared range, list lengths that do not fit, a non-integer or duplicated id;
            a storage that cannot be listed or read (the store's answer in the message).
    """
    root, files, sizes, skipped = listing(path, field)
    wanted = {id_column: Column.integer(hint="store one unique int64 id per row, or set "
                                             "data.id_column"), **dict(columns)}

    def inspect(i: int):
        """One file's footer and the checks that need only this file; a DataError is
        returned, not raised, so that the first file in order reports first."""
        f = files[i]
        try:
            handle = open_input(ParquetSource(f, sizes[i]))
            small = isinstance(handle, pa.NativeFile) and 0 <= sizes[i] <= SMALL_FILE_BYTES
            if small:  # one GET for the whole object, footer and id column from memory
                handle = pa.BufferReader(handle.read_at(sizes[i], 0))
            with pq.ParquetFile(handle) as pf:
                schema, md = pf.schema_arrow, pf.metadata
                checked = {}
                for name, spec in wanted.items():
                    if schema.get_field_index(name) >= 0:
                        try:
                            check_column(pf, f, name, spec, DataError)
                        except DataError as e:
                            checked[name] = e
                ids = None
                if small and schema.get_field_index(id_column) >= 0:
                    ids = pf.read(columns=[id_column])[id_column]
                # An object store's open file is kept for the id read (no second HEAD
                # and footer request); a local one is closed (a descriptor each), and a
                # small object's bytes are dropped once its ids are read.
                keep = isinstance(handle, pa.NativeFile) and not small
                return schema, md, checked, (handle if keep else None), ids
        except (pa.ArrowException, OSError) as exc:
            return DataError(f"{f}: not a valid Parquet file ({one_line(exc)}); delete or "
                             "re-write it, or move it out of the data directory")

    fields: dict[str, tuple[pa.Field, str]] = {}
    row_groups: list[RowGroup] = []
    rows_per_file: list[int] = []
    digest = hashlib.sha256()
    id_ranges: list[tuple[int, int, int]] = []
    footers: list[tuple] = []  # (footer, open input file or None, ids read or None) per file
    for fi, got in enumerate(_in_order(inspect, len(files))):
        if isinstance(got, DataError):
            raise got
        schema, md, checked, handle, ids = got
        f = files[fi]
        for name, spec in wanted.items():
            idx = schema.get_field_index(name)
            if idx < 0:
                have = ", ".join(repr(n) for n in schema.names) or "none"
                # Not the column's hint: that is about its values (a label range, a
                # list length), which a missing column has none of.
                fix = (f"set data.id_column to the column that holds each row's unique id, or "
                       f"write one (int64) named {name!r}" if name == id_column else
                       "point the task at existing columns (Task.columns) or rewrite the file")
                raise DataError(f"{f}: missing column {name!r}; the file has columns: {have}. "
                                f"{fix[0].upper()}{fix[1:]}")
            fld = schema.field(idx)
            if name in fields:
                try:
                    fields[name] = (unify_field(fields[name][0], fld), fields[name][1])
                except TypeError:
                    raise DataError(
                        f"{f}: column {name!r} has type {fld.type}, but {fields[name][1]} has "
                        f"type {fields[name][0].type}; the files of a data set must share one "
                        "type (numbers of different widths are widened, e.g. int32 and int64 "
                        "to int64, but integers and floats, or these two, have no common type "
                        "without loss): re-write one of them with the other's type") from None
            else:
                fields[name] = (fld, f)
            if checked.get(name) is not None:
                raise checked[name]
        footers.append((md, handle, ids))
        rows_per_file.append(md.num_rows)
        digest.update(f"{relative_name(root, f)}|{sizes[fi]}|{md.num_rows}|{md.num_row_groups}".encode())
        col_idx = [i for i in range(md.num_columns)
                   if md.schema.column(i).path.split(".")[0] in wanted]
        id_leaf = next(i for i in range(md.num_columns) if md.schema.column(i).path == id_column)
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            if rg.num_rows == 0:
                continue
            nbytes = sum(rg.column(i).total_compressed_size for i in col_idx)
            row_groups.append(RowGroup(fi, g, rg.num_rows, nbytes))
            st = rg.column(id_leaf).statistics
            lo, hi = (st.min, st.max) if st is not None and st.has_min_max else (None, None)
            digest.update(f"{g}|{rg.num_rows}|{lo}|{hi}".encode())
            id_ranges.append((lo, hi, rg.num_rows) if lo is not None else (None, None, rg.num_rows))
    num_rows = sum(rows_per_file)
    if num_rows == 0:
        raise DataError(f"{shown(path)}: the data set is empty (0 rows in {len(files)} file(s)); "
                        "write data into it, e.g. `elastic-ddp prepare`")
    sources = [ParquetSource(f, n) for f, n in zip(files, sizes)]
    _check_unique_ids(sources, rows_per_file, id_column, id_ranges, footers)
    names = list(wanted)
    return DatasetInfo(
        path=str(path), files=files, num_rows=num_rows,
        rows_per_file=rows_per_file, row_groups=row_groups, columns=names,
        schema=pa.schema([fields[n][0] for n in names]), id_column=id_column,
        fingerprint=digest.hexdigest(), skipped=skipped,
        id_ranges=[(lo, hi) for lo, hi, _ in id_ranges], file_sizes=sizes)


def locate_ids(info: DatasetInfo, ids, limit: int = 8) -> dict:
    """Where the rows with sample ids ``ids`` (the first ``limit`` of them) are:
    ``{id: (file relative to the data set's path, row in that file, 0-based)}``. Reads
    the id column of only the row groups whose id range (``DatasetInfo.id_ranges``)
    holds one of them; an id in no known range, or a file that cannot be read, is left
    out (this serves messages, never the training)."""
    want = {int(i) for i in list(ids)[:limit]}
    found: dict = {}
    root = _root_of(info)
    sources = info.sources()
    first_row, last_file = 0, None
    for k, g in enumerate(info.row_groups):
        if g.file != last_file:
            first_row, last_file = 0, g.file
        lo, hi = info.id_ranges[k] if k < len(info.id_ranges) else (None, None)
        hits = want.difference(found)
        if lo is not None and any(lo <= i <= hi for i in hits):
            try:
                col = read_row_group(sources[g.file], g.index, [info.id_column])
                got = col.column(0).to_numpy(zero_copy_only=False)
            except (pa.ArrowException, OSError):
                got = ()
            for r, i in enumerate(got):
                if int(i) in hits:
                    found[int(i)] = (relative_name(root, info.files[g.file]), first_row + r)
            if len(found) == len(want):
                break
        first_row += g.num_rows
    return found


def list_files(root: str | os.PathLike, field: str = DATA_PATH_FIELDS) -> tuple[list[str], list[str]]:
    """``*.parquet`` files under ``root`` (a local path or a URI; sorted by relative path:
    absolute local paths or URIs) and what was skipped. Local symlinked directories are
    followed; a directory reached twice (a link loop, or two links to one place) is read
    once and reported.

    Raises:
        DataError: ``root`` does not exist or holds no Parquet file; the storage cannot
            be listed.
    """
    return listing(root, field)[1::2]


def read_sample_ids(path: str | os.PathLike, id_column: str = "sample_id") -> np.ndarray:
    """Every sample id of a data set, sorted (int64 [N]): for audits and tests, O(N)."""
    _, files, sizes, _ = listing(path, DATA_PATH_FIELDS)
    read = lambda i: read_columns(ParquetSource(files[i], sizes[i]), [id_column])[id_column].to_numpy()  # noqa: E731
    ids = np.concatenate(list(_in_order(read, len(files))))
    return np.sort(ids.astype(np.int64))


def _in_order(fn: Callable[[int], object], n: int):
    """``fn(0), ..., fn(n - 1)`` computed :data:`FOOTER_THREADS` at a time, yielded in
    order (all of them are computed even when the caller stops at an error)."""
    if n <= 1:
        return (fn(i) for i in range(n))
    pool = ThreadPoolExecutor(max_workers=min(FOOTER_THREADS, n), thread_name_prefix="elastic-ddp-scan")
    try:
        return iter(list(pool.map(fn, range(n))))
    finally:
        pool.shutdown(wait=True)


def _root_of(info: DatasetInfo) -> str:
    """The directory ``info.files`` are named relative to."""
    text = info.path
    if is_remote(text):
        return text.rstrip("/") if not (len(info.files) == 1 and info.files[0] == text) \
            else text.rsplit("/", 1)[0]
    if is_uri(text):
        text = uri_to_filesystem(text)[1]
    p = os.path.abspath(text)
    return p if os.path.isdir(p) else os.path.dirname(p)


def _check_unique_ids(files: list[ParquetSource], rows_per_file: list[int], col: str,
                      ranges: list[tuple], footers: Optional[list] = None) -> None:
    """Prove the ids unique: read them when the data set is small (the files' id columns,
    :data:`FOOTER_THREADS` at a time); else from per-row-group statistics (disjoint
    ranges, each holding exactly max - min + 1 rows)."""
    n = sum(rows_per_file)
    if n <= ID_CHECK_MAX_ROWS:
        def read(i: int):
            try:
                md, handle, ids = footers[i] if footers else (None, None, None)
                return ids if ids is not None else read_columns(files[i], [col], md, handle)[col]
            except (pa.ArrowException, OSError) as exc:
                return DataError(f"{files[i].path}: the id column {col!r} cannot be read "
                                 f"({one_line(exc)}); re-write the file or check the storage")

        chunks = []
        for i, column in enumerate(_in_order(read, len(files))):
            f = files[i].path
            if isinstance(column, DataError):
                raise column
            if column.null_count:
                raise DataError(f"{f}: id column {col!r} has {column.null_count} null(s); every row "
                                "needs an integer sample id (re-prepare the data or fill the ids)")
            try:
                chunks.append(column.cast(pa.int64()).to_numpy())
            except pa.ArrowInvalid as exc:
                raise DataError(f"{f}: id column {col!r} has values that do not fit int64 ({exc}); "
                                "renumber the ids within 0..2**63-1") from exc
        ids = np.concatenate(chunks)
        order = np.argsort(ids, kind="stable")
        dup = np.flatnonzero(ids[order][1:] == ids[order][:-1])
        if dup.size:
            k = int(dup[0])
            file_of_row = np.repeat(np.arange(len(files)), rows_per_file)
            fa, fb = files[file_of_row[order[k]]].path, files[file_of_row[order[k + 1]]].path
            where = f"{fa}" if fa == fb else f"{fa} and {fb}"
            raise DataError(f"{where}: column {col!r} has duplicate sample id {int(ids[order][k])} "
                            f"({dup.size} duplicate(s) in all); sample ids must be unique across the "
                            "whole data set (renumber the ids, or remove a file that was copied twice)")
        return
    spans = sorted(r for r in ranges if r[0] is not None)
    dense = len(spans) == len(ranges) and all(hi - lo + 1 == rows for lo, hi, rows in spans)
    disjoint = all(a[1] < b[0] for a, b in zip(spans, spans[1:]))
    if not (dense and disjoint):
        warnings.warn(f"{n} rows: sample ids were not checked for duplicates (only data sets of up "
                      f"to {ID_CHECK_MAX_ROWS} rows are read in full); the ledger assumes unique ids",
                      stacklevel=3)
