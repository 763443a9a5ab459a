"""A checkpoint on object storage read for a restore without a full download: this
rank's share of the files (the ones it verifies, ``checksum.share_of``) downloaded into
a local directory in parallel and checked there, every other byte DCP's load needs read
by ranged reads from the store (``checkpoint.store_reader.StoreReader`` over
:func:`overlay`, which serves the downloaded files locally).

At the world size the checkpoint was written at, a rank's share is the file it wrote,
which holds every tensor it loads (ddp's replicated share, fsdp's shard), so the bytes a
rank reads from the store are its share and the small files (``.metadata``, and the
few non-tensor entries DCP kept in another rank's file). At another world size the
tensors a rank loads lie in other ranks' files too: those are read by ranged reads, so
a rank reads its share of the files (to verify them) and the ranges it loads.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

DOWNLOAD_THREADS = 4


class _Counted:
    """A remote file (pyarrow ``RandomAccessFile``) behind a Python file object that counts
    the bytes read (``pyarrow.PythonFile`` turns it back into one for ``read_at``)."""

    def __init__(self, f, count):
        self.f, self.count = f, count
        self.closed = False

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n if n is not None and n >= 0 else None)
        self.count(len(data))
        return data

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.f.seek(pos, whence)

    def tell(self) -> int:
        return self.f.tell()

    def size(self) -> int:
        return self.f.size()

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True
        self.f.close()


def overlay(fs, path: str, local_dir: str):
    """A read-only pyarrow file system (``pyarrow.fs.PyFileSystem``) for the checkpoint
    at ``path`` on ``fs``, whose files present in ``local_dir`` are read there and every
    other from ``fs``; and a function that gives the bytes read from ``fs`` so far."""
    import pyarrow as pa
    import pyarrow.fs as pafs

    local = pafs.LocalFileSystem()
    got = [0]
    lock = __import__("threading").Lock()

    def count(n: int) -> None:
        with lock:
            got[0] += n

    def where(p: str):
        name = p.rstrip("/").rsplit("/", 1)[-1]
        lp = os.path.join(local_dir, name)
        return (local, lp) if os.path.exists(lp) else (fs, f"{path}/{name}")

    class Overlay(pafs.FileSystemHandler):
        def get_type_name(self):
            return "elastic-ddp-restore-overlay"

        def get_file_info(self, paths):
            return [where(p)[0].get_file_info(where(p)[1]) for p in paths]

        def open_input_file(self, p):
            f, q = where(p)
            if f is local:
                return local.open_input_file(q)
            return pa.PythonFile(_Counted(fs.open_input_file(q), count), mode="r")

        def open_input_stream(self, p):
            return self.open_input_file(p)

        def normalize_path(self, p):
            return p

        def _refused(self, *a, **k):
            raise NotImplementedError("a restore's view of a checkpoint is read-only")

        get_file_info_selector = create_dir = delete_dir = delete_dir_contents = _refused
        delete_root_dir_contents = delete_file = move = copy_file = _refused
        open_output_stream = open_append_stream = _refused

    return pafs.PyFileSystem(Overlay()), lambda: got[0]


#: Bytes per request of a download: each a ranged GET of its own, under the client's
#: time bound and retries (one GET streaming a whole shard of gigabytes is one request
#: that a stall anywhere fails, and that no retry resumes).
DOWNLOAD_CHUNK = 64 << 20


def download(fs, path: str, names: list[str], into: str) -> None:
    """Copy ``path/<name>`` for each of ``names`` from ``fs`` into local ``into``: the
    files in parallel, each by ranged reads of :data:`DOWNLOAD_CHUNK` bytes."""
    def one(n: str) -> None:
        with fs.open_input_file(f"{path}/{n}") as src, open(os.path.join(into, n), "wb") as out:
            size = src.size()
            for off in range(0, size, DOWNLOAD_CHUNK):
                out.write(src.read_at(min(DOWNLOAD_CHUNK, size - off), off))

    if not names:
        return
    with ThreadPoolExecutor(max_workers=min(DOWNLOAD_THREADS, len(names)),
                            thread_name_prefix="checkpoint-download") as pool:
        for f in [pool.submit(one, n) for n in names]:
            f.result()


@contextlib.contextmanager
def share_view(fs, path: str, names: list[str]) -> Iterator[str]:
    """A local directory holding ``names`` (this rank's share of the files and the
    small ones it reads whole) of the checkpoint at ``path`` on ``fs``; removed on exit."""
    import shutil

    d = tempfile.mkdtemp(prefix="elastic-ddp-restore-")
    try:
        download(fs, path, names, d)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
