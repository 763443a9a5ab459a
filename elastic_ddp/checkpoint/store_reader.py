"""A ``torch.distributed.checkpoint`` storage reader over any pyarrow file system (a
local directory, ``s3://``, ``gs://``) that fetches each requested item by one ranged
read of its file, so a rank that loads only its share of a checkpoint (or only the
model's keys) downloads only those bytes, not the files that hold them.

    reader = StoreReader("s3://bucket/runs/job/checkpoint_step00000120")
    dcp.load(state, storage_reader=reader, no_dist=True)
    reader.bytes_read                  # bytes fetched, the .metadata included

DCP's ``.metadata`` names for every stored item its file, offset and length (the
``storage_data`` index that ``FileSystemWriter`` writes); ``FileSystemReader`` opens each
whole file as a local stream, which on object storage is a download of the file. Here
the items of one file are sorted by offset, runs of adjacent items become one read of at
most :data:`MAX_RANGE` bytes (no byte outside the items is read), and up to
``max_parallel`` reads are in flight at once (object stores answer each request after a
round trip: in series, a model of many small tensors would wait on latency alone).

Only public DCP API is used (``StorageReader``, ``Metadata``, the planner's
``load_bytes``/``resolve_tensor``/``commit_tensor``). Items written with a stream
transform (DCP's experimental extensions: compression) are refused by name: elastic-ddp
writes none.

Each read's time bound and retries are those of the file system handed in (pyarrow's S3
client: its connect and request timeouts and its retry strategy, as
``paths.uri_to_filesystem`` configures them); this reader adds none of its own.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
import uuid
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any, Iterator, Optional

import torch
from torch.distributed.checkpoint import Metadata, StorageReader
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

#: DCP's index of a checkpoint's items (``torch.distributed.checkpoint.filesystem``
#: writes it under this name).
METADATA = ".metadata"
#: The largest single read when adjacent items are joined (bytes): a read's buffer is
#: held in memory until its items are loaded.
MAX_RANGE = 64 << 20
#: Reads in flight at once, per reader.
MAX_PARALLEL = 8


class StoreReader(StorageReader):
    """Reads a DCP checkpoint directory on a pyarrow file system by ranged reads.

    Args:
        path: the checkpoint directory: a local path or a URI (``s3://...``,
            ``file://...``), resolved by ``elastic_ddp.paths.uri_to_filesystem``.
        filesystem: a pyarrow file system; then ``path`` is a path on it (no URI parsing).
        max_parallel: reads in flight at once (threads).

    Attributes:
        bytes_read: bytes fetched from storage by this reader, the ``.metadata`` included.
        requests: reads issued (one per run of adjacent items, plus one for the metadata).
        files: the files (names in the directory) this reader read from.

    Errors: what the file system raises (``OSError``/``FileNotFoundError``: a file
    missing; ``EOFError``: a file shorter than an item's range), wrapped by DCP's load in
    a ``CheckpointException``.
    """

    def __init__(self, path: str | os.PathLike, filesystem=None, max_parallel: int = MAX_PARALLEL):
        super().__init__()
        if filesystem is None:
            from elastic_ddp.paths import uri_to_filesystem

            filesystem, path = uri_to_filesystem(path)
        self.fs = filesystem
        self.path = str(os.fspath(path)).rstrip("/") or "/"
        self.max_parallel = max(1, int(max_parallel))
        self.storage_data: dict[Any, Any] = {}
        self.load_id = uuid.uuid4().hex
        self.bytes_read = 0
        self.requests = 0
        self.files: set[str] = set()
        self._lock = threading.Lock()
        self._metadata: dict[str, bytes] = {}  # read once per reader (DCP asks again)

    # ---------------------------------------------------------------- StorageReader
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = str(os.fspath(checkpoint_id)).rstrip("/") or "/"
            self._metadata = {}
        self.load_id = uuid.uuid4().hex

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return bool(os.fspath(checkpoint_id))

    def metadata_bytes(self, name: str = METADATA) -> bytes:
        """The raw bytes of DCP's index file ``name``, read once per reader (a caller can
        check them before they are unpickled: ``read_metadata`` then uses these)."""
        data = self._metadata.get(name)
        if data is None:
            with self.fs.open_input_stream(f"{self.path}/{name}") as f:
                data = self._metadata[name] = f.read()
            self._count(name, len(data))
        return data

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's index (``.metadata``, a pickle that ``FileSystemWriter`` wrote), read whole."""
        rank = kwargs.get("rank")
        metadata = pickle.loads(self.metadata_bytes(METADATA if rank is None else f"__{rank}{METADATA}"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise ValueError(f"{self.path}/{METADATA}: no storage index (storage_data); "
                             "not a checkpoint written by torch.distributed.checkpoint")
        self.storage_data = metadata.storage_data
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Fetch every item of ``plan`` (runs of adjacent items of a file as one read, up
        to ``max_parallel`` reads at once) and hand each to the planner in this thread."""
        ranges = self._ranges(plan)
        with ThreadPoolExecutor(self.max_parallel, thread_name_prefix="store-reader") as pool:
            handles: dict[str, Any] = {}
            handle_lock = threading.Lock()

            def fetch(rng):
                name, start, end, _ = rng
                with handle_lock:
                    f = handles.get(name)
                    if f is None:
                        f = handles[name] = self.fs.open_input_file(f"{self.path}/{name}")
                return self._read(f, name, start, end)

            try:
                todo = iter(ranges)
                running = {}
                for rng in _take(todo, self.max_parallel):
                    running[pool.submit(fetch, rng)] = rng
                while running:
                    done, _ = wait(running, return_when=FIRST_COMPLETED)
                    for fut in done:
                        rng = running.pop(fut)
                        self._load(fut.result(), rng, planner)
                    for rng in _take(todo, len(done)):
                        running[pool.submit(fetch, rng)] = rng
            finally:
                for f in handles.values():
                    f.close()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    # ------------------------------------------------------------------- internals
    def _read(self, f, name: str, start: int, end: int):
        """Bytes ``start``-``end`` of file ``name`` (open as ``f``), counted."""
        data = f.read_at(end - start, start)
        if len(data) != end - start:
            raise EOFError(f"{self.path}/{name}: {len(data)} bytes at offset {start}, "
                           f"{end - start} expected (the file is shorter than its index says)")
        self._count(name, len(data))
        return data

    def _joins(self, start: int, end: int, off: int, off_end: int) -> bool:
        """Whether an item at ``off``-``off_end`` joins the read ``start``-``end``: adjacent,
        within :data:`MAX_RANGE` (no byte outside the items is read)."""
        return off == end and off_end - start <= MAX_RANGE

    def _item_keys(self, req, info) -> tuple:
        """``(file, offset, length, kind)`` of what ``req`` reads of its stored item
        ``info``: the whole item (``kind`` None: a ``torch.save`` blob or raw bytes)."""
        return info.relative_path, info.offset, info.length, None

    def _count(self, name: str, n: int) -> None:
        with self._lock:
            self.bytes_read += n
            self.requests += 1
            self.files.add(name)

    def _ranges(self, plan: LoadPlan) -> list[tuple[str, int, int, list]]:
        """``(file, start, end, [(offset, length, kind, [read items])])`` reads: each file's
        distinct items sorted by offset, adjacent ones joined up to :data:`MAX_RANGE`."""
        per_file: dict[str, dict[tuple[int, int], list]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if getattr(info, "transform_descriptors", None):
                raise ValueError(f"{self.path}: item {req.storage_index.fqn} was written with "
                                 f"stream transforms {list(info.transform_descriptors)}, which "
                                 "this reader does not apply")
            name, off, length, kind = self._item_keys(req, info)
            per_file.setdefault(name, {}).setdefault((off, length, kind), []).append(req)
        out = []
        for name, items in per_file.items():
            cur = None
            for (off, length, kind), reqs in sorted(items.items(), key=lambda kv: kv[0][:2]):
                if cur is not None and self._joins(cur[1], cur[2], off, off + length):
                    cur[2] = max(cur[2], off + length)
                    cur[3].append((off, length, kind, reqs))
                else:
                    cur = [name, off, off + length, [(off, length, kind, reqs)]]
                    out.append(cur)
        return [tuple(r) for r in out]

    @staticmethod
    def _load(data, rng, planner: LoadPlanner) -> None:
        _, start, _, items = rng
        view = memoryview(data)
        for off, length, kind, reqs in items:
            raw = view[off - start: off - start + length]
            for req in reqs:
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(raw))
                    continue
                if kind is not None:  # ("rows", dtype, shape): the asked part's raw bytes
                    tensor = torch.frombuffer(bytearray(raw), dtype=kind[1]).view(kind[2])
                else:
                    tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
                    for dim, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                        tensor = tensor.narrow(dim, o, n)  # the part of the stored chunk asked for
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise ValueError(f"item {req.storage_index.fqn}: stored part "
                                     f"{tuple(tensor.size())} does not fit the target "
                                     f"{tuple(target.size())}")
                target.copy_(tensor)
                planner.commit_tensor(req, target)


def _take(it: Iterator, n: int) -> list:
    out = []
    for _ in range(n):
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out


def load_keys(path: str | os.PathLike, prefix: str, filesystem=None,
              reader: Optional[StoreReader] = None, no_dist: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint at ``path`` whose key starts with ``prefix`` (the
    prefix stripped), as full CPU tensors, fetched by ranged reads of only their bytes
    (``prefix="model."``: the model, no optimizer state). ``reader``: one to use (its
    ``bytes_read`` then counts this load)."""
    from torch.distributed.checkpoint import TensorStorageMetadata
    from torch.distributed.checkpoint import load as dcp_load

    from elastic_ddp.checkpoint.dcp_io import single_process

    reader = reader or StoreReader(path, filesystem)
    meta = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    if not state:
        return {}
    with single_process(no_dist):
        dcp_load(state, storage_reader=reader, no_dist=no_dist)
    return {k[len(prefix):]: v for k, v in state.items()}


def files_of(metadata: Metadata, prefix: str) -> list[str]:
    """The files (names in the checkpoint directory) that hold the items of the keys
    starting with ``prefix``, sorted."""
    return sorted({info.relative_path for idx, info in (metadata.storage_data or {}).items()
                   if idx.fqn.startswith(prefix)})
