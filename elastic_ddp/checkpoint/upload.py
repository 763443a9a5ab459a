"""This rank's files of a checkpoint, from the directory DCP wrote them into, onto
storage: their records (size, XXH3) from the local copy, then, on a remote file system
(``s3://``, ``gs://``), an upload of each in parallel (no torch here).

On object storage DCP writes into a local staging directory (``staging_dir``); the
checksums are read from those local files (the page cache), so the store is never read
back. The upload is one ``open_output_stream`` per file on a thread pool: pyarrow's S3
stream cuts a file into parts and sends them as a multipart upload, each request under
the file system's own time bound and retry budget (``elastic_ddp.paths``). A file the
store refuses past those retries fails the checkpoint with one line naming the rank, the
key and the store's error (:class:`CheckpointWriteError`); the manifest is then never
written, so the checkpoint is never used, listed or pruned as complete.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from elastic_ddp.checkpoint.layout import CheckpointError
from elastic_ddp.errors import EXIT_FAILED

#: Files uploaded at once per rank: enough to keep a store's bandwidth busy with the
#: few shard files a rank writes (one per rank with DCP's default, plus .metadata).
UPLOAD_THREADS = 4
#: Bytes per write into the store's stream (the stream buffers them into its parts).
_CHUNK = 8 << 20


class CheckpointWriteError(CheckpointError):
    """A checkpoint's write failed (a store error past the file system's retries): the
    checkpoint is not committed; the previous one stays the restart point."""

    exit_code = EXIT_FAILED  # a store's failure, not bad input


_STAGING = "elastic-ddp-ckpt-"


def staging_dir() -> str:
    """A fresh local directory for one rank's part of a checkpoint bound for object
    storage (removed by :func:`remove_staging`, also on failure), named by this process's
    id. The staging directories of processes that no longer run (a rank killed inside a
    write) are removed first: a node's temporary disk does not fill with them."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        pid = name[len(_STAGING):].split("-", 1)[0]
        if name.startswith(_STAGING) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{_STAGING}{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_staging(path: Optional[str]) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


def my_files(target: str, rank: int, lead: bool) -> list[str]:
    """The files of ``rank`` in DCP's output directory ``target`` (``__<rank>_*``; the
    lead's ``.metadata`` too)."""
    mine = sorted(f for f in os.listdir(target) if f.startswith(f"__{rank}_"))
    if lead and os.path.exists(os.path.join(target, ".metadata")):
        mine.append(".metadata")
    return mine


def local_records(target: str, names: list[str]) -> dict:
    """``{name: {"bytes", "xxh3_64"}}`` of the local files ``names`` in ``target``; the
    shards (``*.distcp``) with their block checksums too (``checksum.BLOCKS``)."""
    import pyarrow.fs as pafs

    from elastic_ddp.checkpoint.checksum import file_record

    local = pafs.LocalFileSystem()
    return {n: file_record(local, os.path.join(target, n), blocks=n.endswith(".distcp"))
            for n in names}


def upload_one(fs, src: str, key: str) -> None:
    """Copy the local file ``src`` to ``key`` on ``fs`` (one output stream: a multipart
    upload on S3, completed when the stream closes)."""
    with open(src, "rb", buffering=0) as f, fs.open_output_stream(key) as out:
        while b := f.read(_CHUNK):
            out.write(b)


def upload(fs, target: str, names: list[str], dest: str, rank: int,
           put: Callable[[object, str, str], None] = upload_one) -> None:
    """Upload ``names`` from local ``target`` into ``dest`` on ``fs``, in parallel.

    Raises:
        CheckpointWriteError: one line: the rank, the first key that failed and the
            store's error (the other uploads are waited for first, so nothing writes
            into ``dest`` after this returns).
    """
    if not names:
        return
    with ThreadPoolExecutor(max_workers=min(UPLOAD_THREADS, len(names)),
                            thread_name_prefix="checkpoint-upload") as pool:
        futures = [(n, pool.submit(put, fs, os.path.join(target, n), f"{dest}/{n}")) for n in names]
        errors = [(n, f.exception()) for n, f in futures]
    for n, e in errors:
        if e is not None:
            raise CheckpointWriteError(write_failure(rank, f"{dest}/{n}", e)) from e


def write_failure(rank: int, key: str, e: BaseException) -> str:
    """The one line a failed checkpoint write is reported with."""
    first = str(e).strip().splitlines()[0][:400] if str(e).strip() else type(e).__name__
    return f"checkpoint write failed: rank {rank} could not write {key}: {first}"
