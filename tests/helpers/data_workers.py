"""The DataLoader worker pool's test pieces, shared by the data-worker tests and the
processes they start (a trainer in a fresh interpreter imports them from here): a task
that tags each row with the process that transformed it, one epoch's windows and rounds
over a small data set, and the processes of this machine (Linux ``/proc``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from elastic_ddp.config import Config
from elastic_ddp.data.ingest import epoch_order
from elastic_ddp.data.scan import scan_parquet
from elastic_ddp.tasks.protocol import Column, Task


class Pids(Task):
    """``pid``: the process that transformed the row; rows with ``x == bad`` raise a
    ``KeyError`` (a type the run must see again)."""

    columns = {"x": Column.integer()}

    def __init__(self, bad: int = -1):
        self.bad = bad

    def transform(self, batch, ctx):
        if (batch["x"] == self.bad).any():
            raise KeyError(f"row {self.bad} is bad")
        return {"x": batch["x"], "pid": np.full(len(batch["x"]), os.getpid(), np.int64)}

    def loss(self, model, batch):  # pragma: no cover - never trained here
        raise NotImplementedError


class ListRows(Task):
    """Two object columns of per-row arrays: ``fixed``, every row ``[x, x + 1, x + 2]``
    (int16: a fixed-length list column); ``ragged``, row ``x`` of ``x % 3`` elements."""

    columns = {"x": Column.integer()}

    def transform(self, batch, ctx):
        fixed, ragged = np.empty(len(batch["x"]), object), np.empty(len(batch["x"]), object)
        for i, x in enumerate(batch["x"]):
            fixed[i] = np.arange(x, x + 3, dtype=np.int16)
            ragged[i] = np.arange(x % 3, dtype=np.int64)
        return {"x": batch["x"], "fixed": fixed, "ragged": ragged}

    def loss(self, model, batch):  # pragma: no cover - never trained here
        raise NotImplementedError


def windows(tmp: Path, epoch: int):
    cfg = Config.from_dict({"data": {"train_path": str(tmp), "shuffle_window_rows": 40, "partitions": 4},
                            "task": {"path": "tests:Echo"}, "batch": {"global_batch_size": 16},
                            "scaling": {"min_workers": 1, "max_workers": 1}})
    info = scan_parquet(tmp, Pids.columns)
    return info, epoch_order(info, cfg, epoch).rank_windows(0, 1, 0)


def rounds(n: int, k: int) -> list[int]:
    return [round(n * (i + 1) / k) for i in range(k)]


def processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, command line) of every process (Linux /proc)."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            out[int(d.name)] = (int(ppid), state, cmd)
    return out


def forkserver_of(pid: int) -> tuple[int, list[int]]:
    """The forkserver ``pid`` started and the processes it forked (its DataLoader workers)."""
    procs = processes()
    (server,) = [p for p, (pp, _, cmd) in procs.items() if pp == pid and "forkserver import main" in cmd]
    return server, [p for p, (pp, _, _) in procs.items() if pp == server]


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """The processes of ``pids`` still running (zombies count as ended) after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        procs = processes()
        alive = [p for p in pids if p in procs and procs[p][1] != "Z"]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)
