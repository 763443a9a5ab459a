"""A restore's reader of a checkpoint: DCP's load fetches by ranged reads only the bytes
this rank loads (``StoreReader``), each read widened to whole blocks of the shard's block
checksums (``checksum.BLOCK``) and verified against the manifest's (``checksum.BLOCKS``)
before its bytes are used, on local disk and on object storage alike.

So a rank reads about its share of a checkpoint at any world size, and verifies what it
reads: at the world size the checkpoint was written at, the file it wrote; at another,
the tensors (ddp: its share of the replicated ones) or the rows of the stored chunks
(fsdp, zero1: the part of each chunk its shard covers, located inside the chunk's
``torch.save`` blob from the blob's head) it loads from every file. A read costs at
most two blocks more than its bytes (a block at each end), a chunk read in part the
block of its head besides.

A block that fails its checksum stops the load (``BadBlock``) and names the file, the
bytes and both checksums in :attr:`VerifiedReader.bad`; the caller rejects the checkpoint.
"""

from __future__ import annotations

import io
import pickle
import threading
from typing import Any

from elastic_ddp.checkpoint.checksum import ALGO, BLOCK, BLOCKS, block_mismatch
from elastic_ddp.checkpoint.store_reader import StoreReader
from elastic_ddp.errors import ElasticDDPError

#: A stored chunk is read in part (its rows) only above this many bytes: a smaller one
#: is read whole (its zip index would cost about as much as the rest).
PART_MIN = 4 * BLOCK
#: The bytes of a stored chunk's head read to find its tensor bytes (``torch.save``
#: writes ``data.pkl``, three small records and the tensor's local header there).
HEAD = 2048


class BadBlock(ElasticDDPError, OSError):
    """A block of a shard whose checksum is not the manifest's. An ``OSError`` too: the
    restore treats it as a damaged file (the checkpoint is rejected, the previous one
    tried)."""


def verifiable(manifest: dict) -> bool:
    """Whether every shard (``*.distcp``) of ``manifest`` has block checksums, so that a
    restore can verify the parts it reads (else it hashes whole files)."""
    files = manifest.get("files", {})
    if manifest.get("checksum") != ALGO:  # crc32 records, or an algorithm of a later version
        return False
    return any(n.endswith(".distcp") for n in files) and all(
        BLOCKS in r for n, r in files.items() if n.endswith(".distcp"))


class _Rebuilt:
    """What ``data.pkl`` of a ``torch.save``d tensor says: storage offset, size, stride."""

    def __init__(self, storage, offset, size, stride, *rest):
        self.offset, self.size, self.stride = int(offset), tuple(size), tuple(stride)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _Rebuilt
        if module == "collections" and name == "OrderedDict":
            import collections

            return collections.OrderedDict
        if module == "torch":
            return lambda *a, **k: None  # storage types, dtypes: not needed here
        raise pickle.UnpicklingError(f"unexpected {module}.{name} in a stored tensor")

    def persistent_load(self, pid):
        return pid


class VerifiedReader(StoreReader):
    """``StoreReader`` whose every read of a shard is widened to whole blocks and verified
    (``manifest``: the checkpoint's, with block checksums: :func:`verifiable`).

    Attributes (beside ``StoreReader``'s; ``bytes_read`` counts the widened reads):
        bad: ``"name (why)"`` of the blocks that failed (the load then raised ``BadBlock``).
    """

    def __init__(self, path, filesystem, manifest: dict, **kwargs: Any):
        super().__init__(path, filesystem=filesystem, **kwargs)
        self.records = manifest["files"]
        self.bad: list[str] = []
        self._blocks: dict[tuple[str, int], bytes] = {}  # zip indexes' blocks, read once
        self._parts: dict[tuple, tuple] = {}
        self._vlock = threading.Lock()

    # ------------------------------------------------------------ verified reads
    def _read(self, f, name: str, start: int, end: int):
        rec = self.records.get(name)
        if rec is None or BLOCKS not in rec:
            raise BadBlock(f"{self.path}/{name}: not in the manifest with block checksums")
        a, b = start // BLOCK * BLOCK, min(rec["bytes"], -(-end // BLOCK) * BLOCK)
        # Blocks already read and verified (a chunk's head) are not read again.
        head = self._blocks.get((name, a // BLOCK)) if b - a > BLOCK else None
        if head is not None:
            a += BLOCK
        data = super()._read(f, name, a, b)
        why = block_mismatch(rec, data, a)
        if why:
            with self._vlock:
                self.bad.append(f"{name} ({why})")
            raise BadBlock(f"{self.path}/{name}: {why}")
        if head is not None:
            data, a = head + bytes(data), a - BLOCK
        return memoryview(data)[start - a:end - a]

    def _joins(self, start: int, end: int, off: int, off_end: int) -> bool:
        # Reads whose widened blocks meet are one read: the bytes between are read anyway.
        return off // BLOCK <= -(-end // BLOCK) and off_end - start <= 64 << 20

    def _cached(self, f, name: str, start: int, end: int) -> bytes:
        """Bytes ``start``-``end`` of ``name`` through a cache of verified blocks (the heads
        of the chunks read in part, each block fetched once)."""
        out = []
        for k in range(start // BLOCK, -(-end // BLOCK)):
            blk = self._blocks.get((name, k))
            if blk is None:
                blk = self._blocks[(name, k)] = bytes(self._read(
                    f, name, k * BLOCK, min((k + 1) * BLOCK, self.records[name]["bytes"])))
            lo, hi = max(start, k * BLOCK) - k * BLOCK, min(end, (k + 1) * BLOCK) - k * BLOCK
            out.append(blk[lo:hi])
        return b"".join(out)

    # ------------------------------------------------------------- parts of chunks
    def _item_keys(self, req, info) -> tuple:
        whole = (info.relative_path, info.offset, info.length, None)
        part = self._part(req, info)
        return whole if part is None else part

    def _part(self, req, info):
        """``(file, offset, length, ("rows", dtype, shape))`` of the rows of a stored chunk
        that ``req`` asks for, when it asks for rows (a dim-0 range, every other dim whole)
        of a chunk above :data:`PART_MIN` bytes stored contiguous; else None."""
        from torch.distributed.checkpoint.planner import LoadItemType

        if req.type != LoadItemType.TENSOR or info.length < PART_MIN:
            return None
        md = self.metadata.state_dict_metadata.get(req.storage_index.fqn)
        chunk = next((c for c in getattr(md, "chunks", ())
                      if tuple(c.offsets) == tuple(req.storage_index.offset)), None)
        if chunk is None or not chunk.sizes:
            return None
        sizes = tuple(chunk.sizes)
        if tuple(req.lengths) == sizes or any(
                o != 0 or n != s for o, n, s in zip(req.storage_offsets[1:], req.lengths[1:], sizes[1:])):
            return None
        located = self._locate(info, md.properties.dtype, sizes)
        if located is None:
            return None
        data_off, elsize = located
        row = elsize
        for s in sizes[1:]:
            row *= s
        shape = (int(req.lengths[0]),) + sizes[1:]
        return (info.relative_path, data_off + int(req.storage_offsets[0]) * row,
                int(req.lengths[0]) * row, ("rows", md.properties.dtype, shape))

    def _locate(self, info, dtype, sizes):
        """(offset in the file of the chunk's element 0, bytes per element), read from the
        head of the chunk's ``torch.save`` blob (a zip archive whose first record is
        ``<archive>/data.pkl`` and whose tensor bytes are record ``<archive>/data/0``;
        both within the blob's first :data:`HEAD` bytes: verified blocks), or None where
        the stored tensor is not the contiguous chunk itself (then it is read whole)."""
        import torch

        key = (info.relative_path, info.offset)
        if key not in self._parts:
            self._parts[key] = None  # read whole, as torch.load reads it
            f = self.fs.open_input_file(f"{self.path}/{info.relative_path}")
            try:
                head = self._cached(f, info.relative_path, info.offset,
                                    info.offset + min(info.length, HEAD))
            finally:
                f.close()
            rec = _zip_records(head)
            if "data.pkl" in rec and "data/0" in rec:
                try:
                    rebuilt = _Unpickler(io.BytesIO(head[rec["data.pkl"]:])).load()
                except (pickle.UnpicklingError, EOFError, ValueError, TypeError):
                    rebuilt = None
                elsize = torch.empty((), dtype=dtype).element_size()
                contiguous, acc = [], 1
                for s in reversed(sizes):
                    contiguous.insert(0, acc)
                    acc *= s
                if (isinstance(rebuilt, _Rebuilt) and rebuilt.size == sizes
                        and rebuilt.stride == tuple(contiguous)
                        and rec["data/0"] + (rebuilt.offset + acc) * elsize <= info.length):
                    self._parts[key] = (info.offset + rec["data/0"] + rebuilt.offset * elsize,
                                        elsize)
        return self._parts[key]


def _zip_records(head: bytes) -> dict[str, int]:
    """``{record name without the archive's folder: offset of its data}`` of the zip local
    file headers found in ``head`` (the start of a ``torch.save`` blob), from the first
    (``data.pkl``) on, each header checked to name a record of the first's folder."""
    import struct

    out: dict[str, int] = {}
    if head[:4] != _LOCAL:
        return out
    nl, xl = struct.unpack_from("<HH", head, 26)
    first = head[30:30 + nl]
    if not first.endswith(b"/data.pkl"):
        return out
    folder = first[:-len(b"data.pkl")]
    pos = 0
    while 0 <= pos and pos + 30 <= len(head):
        nl, xl = struct.unpack_from("<HH", head, pos + 26)
        name = head[pos + 30:pos + 30 + nl]
        if name.startswith(folder) and pos + 30 + nl + xl <= len(head):
            out[name[len(folder):].decode("utf-8", "replace")] = pos + 30 + nl + xl
        pos = head.find(_LOCAL, pos + 30 + nl + xl)
    return out


_LOCAL = b"PK\x03\x04"  # a zip local file header's signature
