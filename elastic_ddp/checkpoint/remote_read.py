"""A checkpoint on object storage read for a restore without a full download: this
rank's share of the files (the ones it verifies, ``checksum.share_of``) downloaded into
a local directory in parallel and checked there, every other byte DCP's load needs read
by ranged reads from the store.

At the world size the checkpoint was written at, a rank's share is the file it wrote,
which holds every tensor it loads (ddp's replicated share, fsdp's shard), so the bytes a
rank reads from the store are its share and the small files (``.metadata``, and the
few non-tensor entries DCP kept in another rank's file). At another world size the
tensors a rank loads lie in other ranks' files too: those are read by ranged reads, so
a rank reads its share of the files (to verify them) and the ranges it loads.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

#: The smallest ranged read (a request per miss): DCP reads a non-tensor entry in one
#: read of its length, and a tensor as its zip's small headers, then its bytes; 4 KiB
#: covers the headers of one in a request or two and adds at most that per miss.
MIN_READ = 4 << 10
DOWNLOAD_THREADS = 4


class RangedFile(io.RawIOBase):
    """A file on a pyarrow file system read by ranged reads (``read_at``): the bytes
    asked for, at least :data:`MIN_READ` per request, the last request's bytes kept to
    serve the next reads inside them. ``requested``: bytes fetched from the store."""

    def __init__(self, f):
        super().__init__()
        self.f, self.size, self.pos = f, f.size(), 0
        self.start, self.buf, self.requested = 0, b"", 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self.size - self.pos
        n = min(n, self.size - self.pos)
        if n <= 0:
            return b""
        end = self.pos + n
        if not (self.start <= self.pos and end <= self.start + len(self.buf)):
            want = min(max(n, MIN_READ), self.size - self.pos)
            self.buf, self.start = self.f.read_at(want, self.pos), self.pos
            self.requested += len(self.buf)
        out = self.buf[self.pos - self.start:end - self.start]
        self.pos = end
        return out

    def readinto(self, b) -> int:
        data = self.read(len(b))
        memoryview(b)[:len(data)] = data
        return len(data)

    def close(self) -> None:
        self.f.close()
        super().close()


def download(fs, path: str, names: list[str], into: str) -> None:
    """Copy ``path/<name>`` for each of ``names`` from ``fs`` into local ``into``, in
    parallel (a streamed GET each)."""
    def one(n: str) -> None:
        with fs.open_input_stream(f"{path}/{n}") as src, open(os.path.join(into, n), "wb") as out:
            while b := src.read(8 << 20):
                out.write(b)

    if not names:
        return
    with ThreadPoolExecutor(max_workers=min(DOWNLOAD_THREADS, len(names)),
                            thread_name_prefix="checkpoint-download") as pool:
        for f in [pool.submit(one, n) for n in names]:
            f.result()


def storage_reader(fs, path: str, local_dir: str):
    """A DCP ``FileSystemReader`` of the checkpoint at ``path`` on ``fs`` that opens the
    files present in ``local_dir`` there and every other file by ranged reads
    (:class:`RangedFile`). Its ``ranged`` list holds the ranged files it opened."""
    from contextlib import contextmanager
    from pathlib import Path

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem

    class Mixed(FileSystem):
        """DCP's local file system, with the files not in ``local_dir`` on ``fs``."""

        def __init__(self, ranged: list):
            self.ranged = ranged

        @contextmanager
        def create_stream(self, p, mode: str):
            p = Path(p)
            if p.exists():
                with p.open(mode) as stream:
                    yield stream
                return
            f = RangedFile(fs.open_input_file(f"{path}/{p.name}"))
            self.ranged.append(f)
            try:
                yield f
            finally:
                f.close()

    reader = FileSystemReader(local_dir)
    reader.ranged = []
    reader.fs = Mixed(reader.ranged)
    return reader


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
