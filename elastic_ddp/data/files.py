"""Parquet files on any storage: a local disk, a shared one, or an object store.

    src = ParquetSource("s3://bucket/data/train/part-0.parquet", 1_048_576, fingerprint)
    table = read_row_group(src, 3, ["sample_id", "x"])

A file's identity is a string every node reads the same: an absolute local path (a disk
every node mounts) or a URI (``s3://bucket/key``, ``gs://bucket/key``), opened through
:func:`elastic_ddp.paths.uri_to_filesystem`. A row group is read by ranged reads of its
column chunks (``pre_buffer``: the chunks of the columns asked for, coalesced into few
requests); nothing else of the file is fetched once its footer is known.

Footers are kept per process (:data:`FOOTER_CACHE_FILES`, least recently used dropped),
keyed by the file, its size and the data set's fingerprint, with an object's open input
file: on an object store each re-read would be a HEAD request and a GET of up to 64 KiB
(Arrow's speculative footer read) per row group, which for small row groups would double
the bytes a rank reads. A file rewritten under the same name has another fingerprint (a job scans
its data set at its start), so a long-lived process never reads it with a stale footer.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import NamedTuple, Optional, Union

import pyarrow as pa
import pyarrow.parquet as pq

from elastic_ddp.paths import is_uri, uri_to_filesystem

#: Footers kept per process.
FOOTER_CACHE_FILES = 512


class ParquetSource(NamedTuple):
    """One file of a scanned data set: ``path`` (absolute local path or URI), ``size``
    (bytes, from the listing; -1 unknown) and ``tag`` (the data set's fingerprint: what
    the cached footer belongs to)."""

    path: str
    size: int = -1
    tag: str = ""


Source = Union[str, ParquetSource]

# (footer, the object store's open input file or None for a local file) by source.
_FOOTERS: "collections.OrderedDict[ParquetSource, tuple]" = collections.OrderedDict()
_FOOTERS_LOCK = threading.Lock()


def _remote(path: str) -> bool:
    return is_uri(path) and not path.lower().startswith("file:")


def open_input(src: ParquetSource):
    """What ``pq.ParquetFile`` opens: a local path as it is (Arrow's own local reader,
    closed with the ``ParquetFile``), else the object store's input file (one HEAD request
    for its size; then ranged GETs, safe from several threads at once)."""
    fs, path = uri_to_filesystem(src.path)
    return fs.open_input_file(path) if _remote(src.path) else path


def open_parquet(src: Source, metadata: Optional[pq.FileMetaData] = None) -> pq.ParquetFile:
    """``pq.ParquetFile`` of ``src`` (a path, URI or :class:`ParquetSource`); its footer
    from ``metadata``, else this process's cache (a :class:`ParquetSource` with a
    ``tag``: the footer, and for an object store the open input file, whose size request
    is then not repeated), else read from the file. Close it (``with``) when done: a local
    file holds a descriptor.

    Raises:
        OSError, pyarrow.ArrowException: the file cannot be opened or is not Parquet.
    """
    if not isinstance(src, ParquetSource):
        src = ParquetSource(os.fspath(src))
    cached = None
    if src.tag:
        with _FOOTERS_LOCK:
            cached = _FOOTERS.get(src)
            if cached is not None:
                _FOOTERS.move_to_end(src)
    handle = cached[1] if cached is not None and cached[1] is not None else open_input(src)
    pf = pq.ParquetFile(handle, metadata=metadata or (cached[0] if cached else None))
    if src.tag and cached is None:
        with _FOOTERS_LOCK:
            _FOOTERS[src] = (pf.metadata, handle if _remote(src.path) else None)
            while len(_FOOTERS) > FOOTER_CACHE_FILES:
                _FOOTERS.popitem(last=False)
    return pf


def read_row_group(src: Source, index: int, columns: list[str]) -> pa.Table:
    """Row group ``index`` of ``src``, only ``columns`` (ranged reads of their chunks)."""
    with open_parquet(src) as pf:
        return pf.read_row_group(index, columns=columns)


def read_columns(src: Source, columns: list[str], metadata: Optional[pq.FileMetaData] = None,
                 handle=None) -> pa.Table:
    """Every row of ``src``, only ``columns``; ``handle``: its input file already open
    (:func:`open_input`), with ``metadata`` its footer: no request but the reads."""
    if handle is not None:
        with pq.ParquetFile(handle, metadata=metadata) as pf:
            return pf.read(columns=columns)
    with open_parquet(src, metadata) as pf:
        return pf.read(columns=columns)
