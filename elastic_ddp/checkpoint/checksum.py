"""The checksums of a checkpoint's files (no torch here: see ``checkpoint.layout``).

A manifest names its algorithm in ``"checksum"`` and gives each file a record
``{"bytes": n, <algorithm>: digest}``:

    xxh3_64   XXH3, 64 bits (the ``xxhash`` package), as 16 hex digits; written today
    crc32     ``zlib.crc32`` as an int; manifests without a ``"checksum"`` field (checkpoints
              written before XXH3) still verify with it

XXH3 hashes several times faster than ``zlib.crc32`` (figures: docs/benchmarks.md,
"Checkpoint verification"), and both release the GIL on large buffers (xxhash >= 3.0), so
a restore hashes its share of the files in a thread while ``torch.distributed.checkpoint``
loads them (``start_verify``).
"""

from __future__ import annotations

import re
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable

ALGO = "xxh3_64"
LEGACY_ALGO = "crc32"
ALGOS = (ALGO, LEGACY_ALGO)
#: One read's size: large enough that the hash runs without the GIL (xxhash: above
#: 64 KiB, zlib: above 5 KiB) and syscalls are few; small enough to stay in the CPU's cache.
_CHUNK = 4 << 20
#: The bytes of one block of a shard's block checksums (``BLOCKS``: the XXH3 of every
#: block, so that a restore that reads part of a shard verifies what it reads; a read is
#: widened to whole blocks: at most two blocks more per run of bytes read).
BLOCK = 16 << 10
#: The record field of a shard's block checksums: 16 hex digits per block of ``BLOCK``
#: bytes (the last one shorter), concatenated.
BLOCKS = "xxh3_64_blocks"
_local = threading.local()


class _Crc32:
    """``zlib.crc32`` behind ``update``/``value`` (the record's value: an int)."""

    def __init__(self) -> None:
        self.crc = 0

    def update(self, b) -> None:
        self.crc = zlib.crc32(b, self.crc)

    def value(self) -> int:
        return self.crc


class _Xxh3:
    """XXH3-64 behind ``update``/``value`` (the record's value: 16 hex digits)."""

    def __init__(self) -> None:
        import xxhash

        self.h = xxhash.xxh3_64()

    def update(self, b) -> None:
        self.h.update(b)

    def value(self) -> str:
        return self.h.hexdigest()


def _hasher(algo: str):
    """A fresh hasher of ``algo``.

    Raises:
        ValueError: an algorithm this version does not know.
    """
    if algo == ALGO:
        return _Xxh3()
    if algo == LEGACY_ALGO:
        return _Crc32()
    raise ValueError(f"checksum algorithm {algo!r} is not one of {', '.join(ALGOS)}")


def manifest_algo(manifest: dict) -> str:
    """The algorithm of a manifest's checksums (``crc32`` where it names none)."""
    return manifest.get("checksum", LEGACY_ALGO)


def digest_bytes(data: bytes, algo: str = ALGO):
    """The checksum of ``data`` in ``algo`` (a manifest record's value)."""
    h = _hasher(algo)
    h.update(data)
    return h.value()


class _Blocks:
    """The XXH3 of every ``BLOCK`` bytes of a stream fed in pieces of any size."""

    def __init__(self) -> None:
        import xxhash

        self.new = xxhash.xxh3_64
        self.h, self.fill, self.out = self.new(), 0, []

    def update(self, b) -> None:
        b = memoryview(b)
        while len(b):
            k = min(BLOCK - self.fill, len(b))
            self.h.update(b[:k])
            self.fill += k
            b = b[k:]
            if self.fill == BLOCK:
                self.out.append(self.h.hexdigest())
                self.h, self.fill = self.new(), 0

    def value(self) -> str:
        if self.fill:
            self.out.append(self.h.hexdigest())
            self.h, self.fill = self.new(), 0
        return "".join(self.out)


def digest_stream(f, algo: str = ALGO, blocks: bool = False) -> tuple[object, int]:
    """(checksum, bytes) of a binary stream read to its end, 4 MiB at a time into one
    buffer of this thread's (``readinto`` where the stream has it: no allocation per read).
    ``blocks``: (checksum, bytes, the block checksums: ``BLOCKS``'s value)."""
    h = _hasher(algo)
    hb = _Blocks() if blocks else None
    n = 0
    if hasattr(f, "readinto"):
        buf = getattr(_local, "buf", None) or bytearray(_CHUNK)
        _local.buf = buf  # one per thread, reused file after file
        view = memoryview(buf)
        while k := f.readinto(buf):
            h.update(view[:k])
            if hb is not None:
                hb.update(view[:k])
            n += k
    else:
        while b := f.read(_CHUNK):
            h.update(b)
            if hb is not None:
                hb.update(b)
            n += len(b)
    return (h.value(), n, hb.value()) if hb is not None else (h.value(), n)


def block_mismatch(record: dict, data, start: int) -> str:
    """Where ``data`` (the bytes of a file from offset ``start``, a multiple of ``BLOCK``,
    to a block's end or the file's) differs from the block checksums of ``record`` (its
    manifest record): ``"xxh3_64 <got> of bytes a-b, the manifest says <want>"``, or ""."""
    import xxhash

    want = record[BLOCKS]
    view = memoryview(data)
    for i in range(0, len(view), BLOCK):
        k = (start + i) // BLOCK
        got = xxhash.xxh3_64_hexdigest(view[i:i + BLOCK])
        if got != want[16 * k:16 * k + 16]:
            end = start + min(i + BLOCK, len(view))
            return (f"{ALGO} {got} of bytes {start + i}-{end}, the manifest says "
                    f"{want[16 * k:16 * k + 16] or 'no such block'}")
    return ""


def file_record(fs, path: str, algo: str = ALGO, blocks: bool = False) -> dict:
    """``{"bytes": n, algo: checksum}`` of one file (read once); ``blocks``: with its block
    checksums (``BLOCKS``) too. A local file is read with ``open`` (unbuffered): pyarrow's
    local stream copies each read once more."""
    import pyarrow.fs as pafs

    if isinstance(fs, pafs.LocalFileSystem):
        with open(path, "rb", buffering=0) as f:
            got = digest_stream(f, algo, blocks)
    else:
        with fs.open_input_stream(path) as f:
            got = digest_stream(f, algo, blocks)
    out = {"bytes": got[1], algo: got[0]}
    if blocks:
        out[BLOCKS] = got[2]
    return out


def _show(value) -> str:
    return f"{value:08x}" if isinstance(value, int) else str(value)


def size_mismatches(fs, path: str, manifest: dict, names: Iterable[str]) -> list[str]:
    """The files among ``names`` that are missing or not the size the manifest names (a
    stat each, no read), as ``"name (why)"`` lines."""
    import pyarrow.fs as pafs

    names = list(names)
    try:
        infos = fs.get_file_info([f"{path}/{n}" for n in names])
    except OSError as e:
        return [f"{n} (unreadable: {e})" for n in names]
    out = []
    for name, info in zip(names, infos):
        want = manifest["files"][name]["bytes"]
        if info.type != pafs.FileType.File:
            out.append(f"{name} (missing)")
        elif info.size != want:
            out.append(f"{name} ({info.size} bytes, the manifest says {want})")
    return out


def bad_files(fs, path: str, manifest: dict, names: Iterable[str]) -> list[str]:
    """The files among ``names`` whose size or checksum differs from the manifest's (each
    read once in full, hashed with the manifest's algorithm), as ``"name (why)"`` lines.
    A manifest whose algorithm this version does not know (a later version's) fails
    every file, unread: nothing unverified is used."""
    algo = manifest_algo(manifest)
    names = list(names)
    if algo not in ALGOS:
        return [f"{n} (checksum algorithm {algo!r} unknown to this elastic-ddp: "
                f"restore it with the version that wrote it)" for n in names]
    out = []
    for name in names:
        want = manifest["files"][name]
        try:
            got = file_record(fs, f"{path}/{name}", algo)
        except OSError as e:
            out.append(f"{name} (unreadable: {e})")
            continue
        if got["bytes"] != want["bytes"]:
            out.append(f"{name} ({got['bytes']} bytes, the manifest says {want['bytes']})")
        elif got[algo] != want.get(algo):
            out.append(f"{name} ({algo} {_show(got[algo])}, the manifest says "
                       f"{_show(want.get(algo))})")
    return out


def start_verify(fs, path: str, manifest: dict, names: Iterable[str]) -> Future:
    """``bad_files`` of ``names`` computed in a thread of its own; the future's result is
    the list (the thread ends with it). A restore starts it, loads the same files
    meanwhile, and waits for it before the loaded state is used."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-verify")
    try:
        return pool.submit(bad_files, fs, path, manifest, list(names))
    finally:
        pool.shutdown(wait=False)


def share_of(names: list[str], rank: int, world_size: int) -> list[str]:
    """The files ``rank`` verifies at a restore: the shards rank r wrote (``__r_*``) go
    to rank r mod world_size, so at the world size they were written at each rank checks
    the file it loads anyway (read once more, from the page cache); the others round-robin."""
    out = []
    for i, n in enumerate(names):
        m = re.match(r"__(\d+)_", n)
        if (int(m.group(1)) if m else i) % world_size == rank:
            out.append(n)
    return out
