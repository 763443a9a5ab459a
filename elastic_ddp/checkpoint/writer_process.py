"""The asynchronous checkpoint's serialisation in a process of its own (``writer:
process``): ``torch.save`` of every item into the shard files and their checksums run in
a child process at a lower CPU priority, not in a thread of the training process, where
they would hold its GIL against the step loop.

DCP's save still runs in the training process's background thread (``checkpoint.inflight``:
the plan, its collectives over the background gloo group, and ``.metadata`` written by
the coordinator); only the storage writer's ``write_data`` is handed over
(:class:`ProcessWriter`). The child gets this rank's write plan and its items: tensors in
shared memory (the stager's buffers, moved into shared memory once at the first such
save: no copy after), the few non-tensor items as bytes; it writes the files with DCP's
own ``FileSystemWriter.write_data`` (its files are identical to the thread's), computes
their records (size, XXH3, block checksums), and answers with DCP's write results and
the records. Upload, the gather of the records, fencing and the manifest stay where they
were: the manifest is still written last, after every rank's files are durable.

One child per training process, started (``spawn``: it imports torch, seconds) at the
first save that needs it and kept; it exits with the training process (a daemon, and it
ends when its pipe closes). Its nice value is :data:`NICE` above the parent's
(``os.nice`` in the child), so the step loop's threads win the cores it shares with it.
"""

from __future__ import annotations

import io
import os
import threading
from typing import Any, Optional

#: How much lower the writer's CPU priority is than the training process's (``os.nice``).
NICE = 10

_CHILD = None  # (process, connection)
_LOCK = threading.Lock()


def _serve(conn, nice: int) -> None:
    """The child's loop: one write per message, until the pipe closes."""
    import pyarrow.fs as pafs
    import torch
    from torch.distributed.checkpoint import FileSystemWriter

    from elastic_ddp.checkpoint.checksum import file_record

    try:
        os.nice(nice)
    except OSError:
        pass
    torch.set_num_threads(1)
    local = pafs.LocalFileSystem()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        path, plan, items, files = msg
        try:
            writer = FileSystemWriter(path, thread_count=files)
            results = writer.write_data(plan, _Items(items)).wait()
            names = sorted({r.storage_data.relative_path for r in results})
            records = {n: file_record(local, os.path.join(path, n), blocks=n.endswith(".distcp"))
                       for n in names}
            conn.send(("ok", results, records))
        except BaseException as e:  # noqa: BLE001 - the parent's write fails with the line
            conn.send(("error", f"{type(e).__name__}: {e}", None))
        del items, msg


class _Items:
    """The planner the child's ``write_data`` asks: each item's data by its key."""

    def __init__(self, items: dict):
        self.items = items

    def resolve_data(self, item):
        data = self.items[_key(item)]
        return io.BytesIO(data) if isinstance(data, bytes) else data


def _key(item) -> tuple:
    idx = item.index
    return (idx.fqn, tuple(idx.offset) if idx.offset is not None else None, idx.index)


def _child():
    """The connection to this process's writer, started at the first call."""
    global _CHILD
    with _LOCK:
        if _CHILD is None or not _CHILD[0].is_alive():
            import torch.multiprocessing as mp

            ctx = mp.get_context("spawn")
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, NICE), daemon=True,
                               name="elastic-ddp-checkpoint-writer")
            proc.start()
            child.close()
            _CHILD = (proc, parent)
        return _CHILD


def _writer_class():
    from torch.distributed.checkpoint import FileSystemWriter

    class ProcessWriter(FileSystemWriter):
        """``FileSystemWriter`` whose ``write_data`` runs in the writer process; the
        files' records it computed are in :attr:`records` after the write."""

        records: Optional[dict] = None

        def write_data(self, plan, planner):
            from torch.distributed.checkpoint.planner import WriteItemType
            from torch.futures import Future

            items: dict[tuple, Any] = {}
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    items[_key(item)] = bytes(data.getbuffer())
                else:
                    t = data.detach()
                    if t.device.type != "cpu":
                        t = t.cpu()
                    if t.untyped_storage().size() != t.nbytes or t.is_pinned():
                        # As DCP writes a view: its own bytes alone. Pinned memory (a GPU's
                        # staging) is not shared: a plain copy is (one per checkpoint).
                        t = t.clone() if not t.is_pinned() else t.to("cpu", copy=True)
                    items[_key(item)] = t
            proc, conn = _child()
            # One write at a time per process (at most one checkpoint is in flight).
            conn.send((str(self.path), plan, items, self.thread_count))
            try:
                status, results, records = conn.recv()
            except (EOFError, OSError) as e:
                raise OSError(f"the checkpoint writer process (pid {proc.pid}) ended: {e}") from e
            if status != "ok":
                raise OSError(results)
            self.records = records
            fut: Future = Future()
            fut.set_result(results)
            return fut

    return ProcessWriter


_CLASS = None


def process_writer(path: str, files_per_rank: int = 1):
    """A DCP storage writer into local directory ``path`` whose serialisation and
    checksums run in the writer process (``records`` holds the checksums after);
    ``files_per_rank``: DCP's ``thread_count`` (the files this rank writes)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _writer_class()
    return _CLASS(path, thread_count=files_per_rank)
