"""An asynchronous checkpoint in flight (``CheckpointManager.save(asynchronous=True)``).

The step loop is blocked only while DCP's ``async_save`` stages the state into host
memory (a copy of this rank's share); the write to storage, this rank's checksums, the
gather of the file records and rank 0's manifest run in a background thread over a gloo
process group of their own (background collectives on the training group could
interleave with the step's). The checkpoint counts (Ray Train report: goodput, the
restart point, the ledger's committed steps) only once every rank's write is done and
the manifest is written: a kill before that leaves the previous checkpoint the newest
complete one. Costs: one host copy of this rank's share of the state while in flight.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

_GROUP = None


def _gloo_group():
    """The background thread's process group (created once, collectively, at the first
    asynchronous save: every rank reaches that save at the same step)."""
    global _GROUP
    if _GROUP is None:
        _GROUP = dist.new_group(backend="gloo")
    return _GROUP


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
               fault_hook: Optional[Callable[[str], None]] = None, report: bool = True) -> Pending:
    """Stage ``state`` and start its write into ``dest`` (a local directory); returns
    the :class:`Pending` checkpoint once the state is staged."""
    from torch.distributed.checkpoint import FileSystemWriter, async_save

    group = _gloo_group()
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    p = Pending(fs, dest, name, step, metrics, device)
    p.report = report
    future = async_save(state, storage_writer=FileSystemWriter(dest), process_group=group)
    lead = manager.rank == 0

    def finish() -> None:
        try:
            future.result()
            records = manager.records(fs, dest, dest, lead, True, fault_hook)
            manager.finish_write(fs, dest, step, run_state, records, lead, group=group)
        except BaseException as e:  # noqa: BLE001 - raised in the step loop at the commit
            p.error = e

    p.thread = threading.Thread(target=finish, name=f"checkpoint-{step}", daemon=True)
    p.thread.start()
    return p
