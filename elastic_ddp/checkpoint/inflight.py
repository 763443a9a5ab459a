"""An asynchronous checkpoint in flight (``CheckpointManager.save(asynchronous=True)``).

The step loop is blocked only while DCP's ``async_save`` stages the state into host
memory (a copy of this rank's share); the write to storage (on object storage: into a
local staging directory, then uploaded in parallel), this rank's checksums, the gather
of the file records and rank 0's manifest run in a background thread over a gloo
process group of their own (background collectives on the training group could
interleave with the step's). The checkpoint counts (Ray Train report: goodput, the
restart point, the ledger's committed steps) only once every rank's write is done and
the manifest is written: a kill before that leaves the previous checkpoint the newest
complete one. A write that fails (a store error past the file system's retries) fails
the checkpoint on every rank with one line naming the rank, the key and the store's
error (``CheckpointManager.poll`` says it and goes on training; nothing is reported).

Staging goes through one ``DefaultStager`` kept for the process (``_stager``): its staging
buffers, one per tensor storage of the state, are allocated at the first asynchronous
save and copied into at every later one (torchtitan keeps its stager the same way).
Costs: one host copy of this rank's share of the state, held from the first asynchronous
save on (a buffer is freed when the tensor it copies is). Why not the storage writer's
own staging (``FileSystemWriter.stage``, what ``async_save`` uses when given a writer
and no stager): for a DTensor (FSDP's parameters and optimizer state) it deep-copies the
whole tensor before swapping in an empty local tensor to copy into, so every FSDP tensor
is copied twice and its buffers allocated afresh at each save.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from elastic_ddp.background import start_deferring_signals

_GROUP = None
_STAGER = None
#: The write in flight (``Pending``) whose staged copy lives in ``_STAGER``'s buffers.
_IN_FLIGHT = None


def _gloo_group():
    """The background thread's process group (created once, collectively, at the first
    asynchronous save: every rank reaches that save at the same step)."""
    global _GROUP
    if _GROUP is None:
        _GROUP = dist.new_group(backend="gloo")
    return _GROUP


def _stager(device: torch.device):
    """The process's stager (``torch.distributed.checkpoint.staging.DefaultStager``),
    made at the first asynchronous save. Synchronous staging (the step loop must not
    change the state before it is copied); on CUDA into pinned memory with non-blocking
    copies (one synchronize at the end), on the CPU into plain host memory. None on a
    torch without ``DefaultStager`` (``async_save`` then stages with the writer)."""
    global _STAGER
    if _STAGER is None:
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError:  # a torch older than the stager API: the writer's own staging
            return None

        class KeptStager(DefaultStager):
            """The process's stager, never closed: some torch releases' ``async_save``
            close the stager they are given after its save, which drops its buffers and
            clears its copy table (the next save then fails with ``KeyError: <class
            'type'>``). Its buffers are freed with the process."""

            def close(self) -> None:
                pass

        cuda = device.type == "cuda"
        _STAGER = KeptStager(StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
            use_non_blocking_copy=cuda))
    return _STAGER


class Pending:
    """One checkpoint being written. ``all_done()`` is collective (every rank at the same
    step boundary); ``join()`` waits for this rank's part."""

    def __init__(self, fs, dest: str, name: str, step: int, metrics: Optional[dict], device):
        self.fs, self.dest, self.name, self.step, self.metrics = fs, dest, name, step, metrics
        self.device = device
        self.error: Optional[BaseException] = None
        self.thread: Optional[threading.Thread] = None

    def all_done(self) -> bool:
        mine = torch.tensor([0 if self.thread.is_alive() else 1], device=self.device)
        dist.all_reduce(mine, op=dist.ReduceOp.MIN)
        if bool(mine.item()):
            self.thread.join()
            return True
        return False

    def join(self) -> None:
        self.thread.join()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


def save_async(manager, state: dict[str, Any], fs, dest: str, name: str, step: int,
               run_state: dict, metrics: Optional[dict],
               fault_hook: Optional[Callable[[str], None]] = None, report: bool = True,
               local: bool = True) -> Pending:
    """Stage ``state`` and start its write into ``dest``; returns the :class:`Pending`
    checkpoint once the state is staged. ``local``: ``dest`` is a local directory, DCP
    writes into it; else DCP writes into a local staging directory whose files are
    uploaded into ``dest`` (``checkpoint.upload``) and which is removed afterwards,
    also when the write fails.

    Whatever fails in this rank's write (DCP's, a checksum, an upload) becomes this
    rank's error line, and every rank still meets the others at the gather of the file
    records: no rank waits on one that gave up. Every rank's ``Pending.error`` is then
    the same ``CheckpointWriteError`` (no manifest written)."""
    from torch.distributed.checkpoint import FileSystemWriter, async_save

    from elastic_ddp.checkpoint.upload import (CheckpointWriteError, remove_staging,
                                               staging_dir, write_failure)

    group = _gloo_group()
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    global _IN_FLIGHT
    if _IN_FLIGHT is not None:
        # The staging buffers are shared: a write still reading them (another manager's
        # in this process) must end before they are overwritten.
        _IN_FLIGHT.join()
    p = Pending(fs, dest, name, step, metrics, device)
    p.report = report
    stager = _stager(device)
    extra = {"async_stager": stager} if stager is not None else {}
    target = dest if local else staging_dir()
    files = getattr(manager, "files_per_rank", 1)
    if getattr(manager, "writer", "thread") == "process":
        from elastic_ddp.checkpoint.writer_process import process_writer

        writer = process_writer(target, files)  # serialisation and checksums in a process
    else:
        writer = FileSystemWriter(target, thread_count=files)
    try:
        future = async_save(state, storage_writer=writer, process_group=group, **extra)
    except BaseException:
        if not local:
            remove_staging(target)
        raise
    lead = manager.rank == 0

    def finish() -> None:
        records, error = {}, None
        try:
            try:
                future.result()
                records = manager.records(fs, target, dest, lead, local, fault_hook,
                                          known=getattr(writer, "records", None))
            except CheckpointWriteError as e:
                error = str(e)
            except Exception as e:  # noqa: BLE001 - DCP's write, a checksum: one line too
                error = write_failure(manager.rank, target if local else dest, e)
            finally:
                if not local:
                    remove_staging(target)
            manager.finish_write(fs, dest, step, run_state, records, lead, group=group,
                                 reported=report, error=error)
        except BaseException as e:  # noqa: BLE001 - handled in the step loop at the commit
            p.error = e

    p.thread = threading.Thread(target=finish, name=f"checkpoint-{step}", daemon=True)
    start_deferring_signals(p.thread)
    _IN_FLIGHT = p
    return p
