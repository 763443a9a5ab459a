"""This rank's train readers: a reader hands the trainer the rows of each step.

    order, reader = open_train_reader(info, task, cfg, rank, world_size, epoch, cursor, G)
    rows = reader.take(cursor, n_rows)         # {column: [rows of this rank, ...]}

- :class:`WindowedReader` (windowed order): reads only this rank's partitions' windows,
  starting at the window that holds the cursor (a restart re-reads at most one window per
  partition), and keeps about two windows per owned partition.
- :class:`PermutationReader` (permutation order, small data sets): streams every row group
  and keeps the rows of this rank's share of the rest of the epoch.

Both read through :func:`elastic_ddp.data.ingest.pipeline` (``data.reader: ray_data``)
or the process's DataLoader workers (``dataloader``: :mod:`elastic_ddp.data.workers`, the
same read and transform functions in worker processes on the trainer's node, kept across
rounds and epochs).
"""

from __future__ import annotations

import collections
from typing import Optional

import numpy as np

from elastic_ddp.background import Background
from elastic_ddp.data.ingest import (READ_AHEAD_BYTES, READ_TASK_BYTES, ReadSlots, concat_rows, epoch_order,
                                     pipeline, take_rows, window_bytes)
from elastic_ddp.data.chunks import own_rows
from elastic_ddp.data.order import EpochOrder, Piece, Window, owner
from elastic_ddp.data.scan import DatasetInfo
from elastic_ddp.data.workers import WindowStream, dataloader_batches, has_workers
from elastic_ddp.tasks.protocol import Task
from elastic_ddp.tasks.transform import SEQ


class WindowedReader:
    """This rank's rows of the steps of one epoch, windowed order.

    ``held``: windows another reader of this epoch already holds, by (partition, first),
    as ``held_windows()`` returns them. A view change (per-step fault tolerance: the
    quorum shrank, and the survivors take over a dead replica's partitions) then reads
    only the windows it lacks, first those the next step needs. That first round is read
    in this process with the same read and transform functions, not by Ray Data: the
    survivors wait for it, and Ray Data's read tasks would first need worker processes
    started (Ray stops idle ones within seconds), on cores the replacement is starting
    on. What it costs: one generation of the lost partitions' windows read and
    transformed by the trainer's process, without Ray Data's parallelism.

    ``local_first_bytes``: the first round is also read in this process when its row
    groups hold at most this many Parquet bytes (``LOCAL_FIRST_ROUND_BYTES`` from the
    trainer; 0: never), unless ``prefetch`` starts it in the background: always with
    ``reader="ray_data"``, and with ``"dataloader"`` while this process has no DataLoader
    workers for the data set and task (:func:`~elastic_ddp.data.workers.has_workers`:
    a fresh worker process after a start or restart) and the round holds at most
    ``READ_TASK_BYTES`` (one read chunk: larger rounds are split between the workers,
    which then outpace this one thread). Either pool's start (Ray Data's read-task
    workers; a forkserver importing torch, then the DataLoader workers) then runs after
    the first step instead of before it.

    ``reader``: ``"ray_data"`` (each round one Ray Data pipeline) or ``"dataloader"``
    (the rounds taken in turn from one :class:`WindowStream` over the windows from the
    first round not read in this process, each round one run of the process's DataLoader
    workers); the rows and their order are the same. ``slots``: the data path's
    parallelism (``data.read_tasks``, ``data.task_cpus``)."""

    def __init__(self, info: DatasetInfo, task: Task, order: EpochOrder, rank: int,
                 world_size: int, cursor: int, local: bool = False,
                 read_ahead_bytes: float = READ_AHEAD_BYTES,
                 held: Optional[dict[tuple[int, int], dict[str, np.ndarray]]] = None,
                 local_first_bytes: float = 0.0, reader: str = "ray_data",
                 slots: ReadSlots = ReadSlots()):
        self.order, self.rank, self.world_size = order, rank, world_size
        self.windows = order.rank_windows(rank, world_size, cursor)
        self._buf: dict[int, list[tuple[Window, dict[str, np.ndarray]]]] = {}
        # A window's generation: its index among its partition's windows from the cursor.
        # Rounds are generations: one window per owned partition, the partitions used in
        # lockstep. A held window is used only as a prefix of its partition's windows.
        gen: collections.Counter = collections.Counter()
        gaps: set[int] = set()
        todo: list[tuple[int, Window]] = []
        for w in self.windows:
            g, gen[w.partition] = gen[w.partition], gen[w.partition] + 1
            arrs = (held or {}).get((w.partition, w.first))
            if arrs is not None and w.partition not in gaps:
                self._buf.setdefault(w.partition, []).append((w, arrs))
            else:
                gaps.add(w.partition)
                todo.append((g, w))
        todo.sort(key=lambda gw: gw[0])  # stable: the need order within a generation
        self._todo = [w for _, w in todo]
        self._rounds = [i for i in range(1, len(todo)) if todo[i][0] != todo[i - 1][0]] + [len(todo)]
        self.bytes_read = window_bytes(info, self._todo)
        self._source = (info, task, order.seed, order.epoch, local, read_ahead_bytes)
        self._slots = slots
        # A small first round is read here when the data path's workers are not running
        # yet: Ray Data's first execution in a fresh process starts its workers, and the
        # DataLoader reader's first run starts a forkserver (which imports torch and the
        # task) and its workers, seconds of CPU on the cores the restart's first step
        # needs. Once this process's DataLoader workers exist they serve every round.
        cap = local_first_bytes if reader == "ray_data" else min(local_first_bytes, READ_TASK_BYTES)
        self._local_first = held is not None or (
            bool(todo) and (reader == "ray_data" or not has_workers(info, task, slots.tasks))
            and window_bytes(info, self._todo[:self._rounds[0]]) <= cap)
        self._reader = reader
        self._stream: Optional[tuple[int, WindowStream]] = None  # (first window, stream)
        # Windows are read a round at a time, the next round in a background thread while
        # this one is used. Ray Data's executor then runs only while a round is read: a
        # live executor polls in a loop (GIL and CPU taken from training) for as long as
        # any of its output is unconsumed, i.e. the whole epoch for one long pipeline.
        self._read_at = 0
        self._ready: collections.deque = collections.deque()
        self._pending: Optional[Background] = None
        self._next = 0                                  # next window (in _todo) to complete
        self._partial: list[dict[str, np.ndarray]] = []
        self._have = 0
        self._takes = 0
        self.template: Optional[dict] = None

    def held_windows(self) -> dict[tuple[int, int], dict[str, np.ndarray]]:
        """The windows this reader holds (read, transformed, not yet used up), by
        (partition, first): what a reader of another view of the epoch need not read."""
        return {(w.partition, w.first): arrs for ws in self._buf.values() for w, arrs in ws}

    def _read_round(self) -> Optional[Background]:
        if self._read_at >= len(self._todo):
            return None
        a = self._read_at
        b = self._read_at = next(r for r in self._rounds if r > a)
        info, task, seed, epoch, local, ahead = self._source
        local = local or (a == 0 and self._local_first)

        if self._reader == "dataloader" and not local:
            if self._stream is None:
                self._stream = (a, WindowStream(info, task, self._todo[a:],
                                                [r - a for r in self._rounds if r > a], seed, epoch, "train",
                                                self._slots.tasks))
            base, stream = self._stream

            def read() -> list[dict[str, np.ndarray]]:
                out = stream.round(a - base, b - base)
                for batch in out:
                    batch[SEQ] = batch[SEQ] + base
                return out

            return Background(read, name="elastic-ddp-read")

        def read() -> list[dict[str, np.ndarray]]:
            out = []
            for batch in pipeline(info, task, self._todo[a:b], seed, epoch, "train", local, ahead,
                                  self._slots):
                batch[SEQ] = batch[SEQ] + a
                out.append(batch)
            return out

        return Background(read, name="elastic-ddp-read")

    def warm(self) -> None:
        """Read the first round now (blocking), so that the first ``take`` finds it."""
        if not self._ready:
            self._fill()

    def prefetch(self) -> None:
        """Start reading the first round in the background (no-op once reading began)."""
        if not self._ready and self._pending is None and self._read_at == 0 and self._todo:
            self._local_first = False  # in the background: Ray Data, off the trainer's GIL
            self._pending = self._read_round()

    @property
    def last_round_started(self) -> bool:
        """Every round of the epoch is read or being read: the reader's epoch is in its
        last round (when the next epoch's reader may start reading)."""
        return self._read_at >= len(self._todo)

    def _fill(self) -> bool:
        """Wait for the round being read (starting it if none is) and start the next one;
        False when every round is used up."""
        if self._pending is None:
            self._pending = self._read_round()
        if self._pending is None:
            return False
        first_local = self._read_at == self._rounds[0] and self._local_first
        self._ready.extend(self._pending.result())
        # After a first round read here, the next round starts once the first step is
        # done: Ray Data's first execution starts worker processes on the cores that
        # step runs on. Costs nothing while a round holds more than one step's rows.
        self._pending = None if first_local and self._takes <= 1 else self._read_round()
        return True

    def _next_batch(self) -> dict[str, np.ndarray]:
        if not self._ready and not self._fill():
            raise StopIteration
        return self._ready.popleft()

    def take(self, cursor: int, n_rows: int) -> dict[str, np.ndarray]:
        """Rows of this rank in the step over global positions ``[cursor, cursor + n)``,
        partition by partition."""
        if self._takes and self._pending is None and self._read_at < len(self._todo):
            self._pending = self._read_round()  # deferred by _fill until this step
        self._takes += 1
        parts = []
        for p, a, b in self.order.segments(cursor, n_rows):
            if owner(p, self.order.partitions, self.world_size) == self.rank:
                parts.append(self._rows(p, a, b))
        return concat_rows(parts, self.template)

    def _rows(self, p: int, a: int, b: int) -> dict[str, np.ndarray]:
        while not any(w.first + w.num_rows >= b for w, _ in self._buf.get(p, [])):
            self._pull()
        parts = []
        for w, arrs in self._buf[p]:
            lo, hi = max(a, w.first), min(b, w.first + w.num_rows)
            if hi > lo:
                parts.append({k: v[lo - w.first:hi - w.first] for k, v in arrs.items()})
        # Later steps only ask for offsets >= b: drop what is used up.
        self._buf[p] = [(w, arrs) for w, arrs in self._buf[p] if w.first + w.num_rows > b]
        return concat_rows(parts, self.template)

    def _pull(self) -> None:
        """Take the next batch of the pipeline into the windows it belongs to (a batch is
        one window or part of one; split by window should Ray Data merge blocks)."""
        if self._next >= len(self._todo):
            raise RuntimeError("the epoch's pipeline ended before this rank's rows did (a bug)")
        try:
            batch = self._next_batch()
        except StopIteration:
            raise RuntimeError(f"the data pipeline ended after {self._next} of "
                               f"{len(self._todo)} windows") from None
        seq = batch.pop(SEQ)
        if self.template is None:
            self.template = {k: v[:0] for k, v in batch.items()}
        cuts = [0, *(np.flatnonzero(np.diff(seq)) + 1).tolist(), len(seq)]
        for lo, hi in zip(cuts, cuts[1:]):
            if hi == lo:
                continue
            if seq[lo] != self._next or self._next >= len(self._todo):
                raise RuntimeError(f"data pipeline out of order: got window {seq[lo]}, "
                                   f"expected {self._next}")
            self._partial.append({k: v[lo:hi] for k, v in batch.items()} if (lo, hi) != (0, len(seq))
                                 else batch)
            self._have += hi - lo
            w = self._todo[self._next]
            if self._have >= w.num_rows:
                self._buf.setdefault(w.partition, []).append((w, concat_rows(self._partial)))
                self._partial, self._have = [], 0
                self._next += 1


class PermutationReader:
    """This rank's rows of one epoch, permutation order: every row group is streamed and
    the rows of this rank's positional share of ``[cursor, N)`` are kept (memory: N /
    world_size rows; reads: the whole data set per rank)."""

    def __init__(self, info: DatasetInfo, task: Task, order: EpochOrder, rank: int,
                 world_size: int, cursor: int, global_batch_size: int,
                 rows_per_rank: Optional[list[int]] = None, local: bool = False,
                 reader: str = "ray_data", slots: ReadSlots = ReadSlots()):
        self.order, self.rank, self.world_size = order, rank, world_size
        self.g, self.rows_per_rank = global_batch_size, rows_per_rank
        mine = [self._positions(c) for c in range(cursor, order.num_rows, global_batch_size)]
        pos = np.concatenate(mine) if mine else np.zeros(0, np.int64)
        self._wanted = np.sort(order.permutation[pos])
        windows = [Window(0, 0, (Piece(g.file, g.index, 0, g.num_rows),), g.num_rows, ())
                   for g in info.row_groups]
        self.bytes_read = window_bytes(info, windows)
        self._starts = np.cumsum([0] + [g.num_rows for g in info.row_groups])
        self._windows = windows
        self._source = (info, task, local, reader, slots)
        self._rows: Optional[np.ndarray] = None
        self._data: dict[str, np.ndarray] = {}
        self.template: Optional[dict] = None

    def _positions(self, cursor: int) -> np.ndarray:
        n = min(self.g, self.order.num_rows - cursor)
        rows = self.order.rank_rows(cursor, n, self.world_size, self.rows_per_rank)
        start = cursor + sum(rows[:self.rank])
        return np.arange(start, start + rows[self.rank], dtype=np.int64)

    def _load(self) -> None:
        info, task, local, reader, slots = self._source
        kept_rows, kept = [], []
        seen: dict[int, int] = {}
        seed, epoch = self.order.seed, self.order.epoch
        batches = (dataloader_batches(info, task, self._windows, seed, epoch, "train", slots.tasks)
                   if reader == "dataloader" and not local and self._windows
                   else pipeline(info, task, self._windows, seed, epoch, "train", local, slots=slots))
        for batch in batches:
            seq = batch.pop(SEQ)
            if self.template is None:
                self.template = {k: v[:0] for k, v in batch.items()}
            if not len(seq):
                continue
            # Row groups stream in file order, each possibly split over several blocks:
            # a row's index in the data set is its row group's start + rows seen before.
            offsets = np.empty(len(seq), np.int64)
            for v in np.unique(seq):
                idx = np.flatnonzero(seq == v)
                base = int(self._starts[v]) + seen.get(int(v), 0)
                offsets[idx] = base + np.arange(len(idx))
                seen[int(v)] = seen.get(int(v), 0) + len(idx)
            hit = np.isin(offsets, self._wanted, assume_unique=True)
            if hit.any():
                kept_rows.append(offsets[hit])
                # Its own copy of a stacked column's rows kept: views would hold the
                # whole batch's buffer, every rank's rows of it, for the epoch.
                kept.append(own_rows(take_rows(batch, hit)))
        self._rows = np.concatenate(kept_rows) if kept_rows else np.zeros(0, np.int64)
        order = np.argsort(self._rows)
        self._rows = self._rows[order]
        self._data = take_rows(concat_rows(kept, self.template), order) if kept else dict(self.template or {})

    def take(self, cursor: int, n_rows: int) -> dict[str, np.ndarray]:
        if self._rows is None:
            self._load()
        rows = self.order.permutation[self._positions(cursor)]
        return take_rows(self._data, np.searchsorted(self._rows, rows))


def open_train_reader(info: DatasetInfo, task: Task, cfg, rank: int, world_size: int,
                      epoch: int, cursor: int, global_batch_size: int,
                      rows_per_rank: Optional[list[int]] = None, local: bool = False,
                      template: Optional[dict] = None, held: Optional[dict] = None,
                      local_first_bytes: float = 0.0, reader: Optional[str] = None):
    """The order of ``epoch`` and this rank's reader from ``cursor`` (see the module
    docstring). ``template``: a transformed row (shapes of an empty share); ``local``:
    read in this process, without Ray (tests); ``held``: windows of another view's
    reader of this epoch (``WindowedReader.held_windows``, windowed order only);
    ``local_first_bytes``: see ``WindowedReader``; ``reader``: ``"ray_data"`` or
    ``"dataloader"`` (default: :func:`reader_kind` of ``cfg``)."""
    order = epoch_order(info, cfg, epoch)
    reader = reader or reader_kind(cfg)
    slots = ReadSlots(cfg.data.read_tasks, cfg.data.task_cpus, world_size * cfg.scaling.cpus_per_worker)
    if order.mode == "permutation":
        rd = PermutationReader(info, task, order, rank, world_size, cursor,
                               global_batch_size, rows_per_rank, local, reader, slots)
    else:
        rd = WindowedReader(info, task, order, rank, world_size, cursor, local,
                            cfg.data.read_ahead_mib * 2**20, held, local_first_bytes, reader, slots)
    if template is not None:
        rd.template = {k: v[:0] for k, v in template.items()}
    return order, rd


def reader_kind(cfg) -> str:
    """``data.reader`` resolved: ``auto`` is ``dataloader``."""
    return "dataloader" if cfg.data.reader == "auto" else cfg.data.reader
