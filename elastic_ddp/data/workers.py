"""The DataLoader worker processes of ``data.reader: dataloader``: a rank's training
windows read and transformed by ``torch.utils.data.DataLoader`` workers on the trainer's
node, kept for the life of the trainer's process.

    pool = data_workers(info, task)     # one per (task, data set) in a process
    rid = pool.open(keys)               # a run: chunks read in order, in the workers
    pool.want(rid, len(keys))
    batches = pool.take(rid, 0)         # chunk 0's batches, one per window

A run is a list of read chunks (``data.chunks.ChunkKey``: the windows of one read item,
the epoch's transform seed and split; what a worker does with one: ``data.chunks``); the
workers read ahead within it, runs are served one at a time, in the order they ask. :class:`WindowStream` cuts an epoch's windows into rounds of
chunks (the Ray Data path's cut) and takes each round as one run.

The workers are started once, at the first run, and kept (``persistent_workers``): a new
epoch, round or data view sends only the chunks' keys. A DataLoader per epoch would start
its workers again each epoch, and a fresh worker's first reads and decodes (imports, Arrow
and decoder set-up) are slower than its later ones; the next epoch's prefetch would run two
sets of workers on the same cores. What it costs: the workers' memory (a Python process
with torch, the task and its transform state, each) for as long as the trainer runs.
"""

from __future__ import annotations

import collections
import functools
import itertools
import os
import threading
import weakref
from typing import Any, Iterator, Optional

import numpy as np

from elastic_ddp.data.chunks import ChunkFailed, ChunkJobs, ChunkKey, as_is, from_shared
from elastic_ddp.data.ingest import READ_TASKS, read_chunks, read_task_count
from elastic_ddp.data.lifetime import watch_trainer, worker_context
from elastic_ddp.data.order import Window
from elastic_ddp.data.scan import DatasetInfo
from elastic_ddp.tasks.protocol import Task

# Chunks in flight per worker (the DataLoader's prefetch_factor).
PREFETCH_PER_WORKER = 2
# Chunks a run may have read past the chunks it asked for (the start of its next round).
READ_AHEAD_CHUNKS = 2 * PREFETCH_PER_WORKER


class _Sampler:
    """The DataLoader's sampler: ``iter`` gives the pool's key feed, which hands the
    DataLoader the next chunk to read whenever a slot frees, and ends (for now) when no
    run wants one; the pool restarts the iteration when a run asks for more."""

    def __init__(self, pool: "DataWorkers"):
        self._pool = pool

    def __iter__(self):
        return self

    def __next__(self) -> ChunkKey:
        return self._pool._next_key()


class _Run:
    """The pool's side of one stream of chunks: ``keys`` in order, ``sent`` of them
    handed to the workers, ``wanted`` asked for by the stream's reader, the chunks
    received and not yet taken (``items``, by index)."""

    def __init__(self, keys: list[ChunkKey]):
        self.keys, self.sent, self.wanted = keys, 0, 0
        self.items: dict[int, Any] = {}


class DataWorkers:
    """``workers`` persistent DataLoader worker processes over one data set and task
    (:func:`data_workers` gives a process's), serving runs of chunks.

    A run (``open(keys)``, one per :class:`WindowStream`) is asked for up to a chunk
    (``want``) and its chunks taken in order (``take``). The workers read the chunks
    wanted, oldest run first (this epoch's last round before the next epoch's first), and
    after that up to ``READ_AHEAD_CHUNKS`` chunks past what a run wants (its next round
    starts while this one is handed over); a run's chunks read by another run's thread
    wait in its buffer. A run closed (its stream dropped) is sent no more chunks, and
    those in flight are dropped on arrival.

    Raises (from ``take``): the chunk's own error (its read or transform raised in a
    worker: that exception, with the worker's traceback as a note); ``RuntimeError`` when
    a worker died (the DataLoader's error, naming its pid, or the failed handover of a
    chunk it was sending, chained): the pool is broken then, every run fails, and
    :func:`data_workers` makes a new pool."""

    def __init__(self, info: DatasetInfo, task: Task, workers: int = READ_TASKS):
        self.task, self.info, self.workers = task, info, max(1, workers)
        self._jobs = ChunkJobs(info.sources(), info.schema, task, info.id_column)
        self._state = threading.Lock()  # runs, their counters and buffers, the in-flight log
        self._pull = threading.Lock()   # one thread at a time takes from the DataLoader
        self._runs: dict[int, _Run] = {}
        self._ids = itertools.count()
        self._in_flight: collections.deque = collections.deque()  # (run, index) in send order
        self._loader = None
        self._it = None
        self.broken: Optional[BaseException] = None
        self._ctx = worker_context()

    def serves(self, info: DatasetInfo, task: Task) -> bool:
        """Whether this pool reads ``info`` with ``task`` (the same task object)."""
        return (self.broken is None and task is self.task and info.files == self.info.files
                and info.schema == self.info.schema and info.id_column == self.info.id_column)

    @property
    def idle(self) -> bool:
        with self._state:
            return not self._runs

    def open(self, keys: list[ChunkKey]) -> int:
        """A new run over ``keys``; returns its id."""
        with self._state:
            rid = next(self._ids)
            self._runs[rid] = _Run(list(keys))
            return rid

    def close_run(self, rid: int) -> None:
        with self._state:
            self._runs.pop(rid, None)

    def want(self, rid: int, end: int) -> None:
        """Run ``rid``'s chunks up to ``end`` are to be read."""
        with self._state:
            r = self._runs[rid]
            r.wanted = max(r.wanted, min(end, len(r.keys)))

    def _next_key(self) -> ChunkKey:
        with self._state:
            runs = self._runs.items()
            rid, pick = next(((k, r) for k, r in runs if r.sent < r.wanted), None) or next(
                ((k, r) for k, r in runs if r.sent < min(len(r.keys), r.wanted + READ_AHEAD_CHUNKS)),
                (None, None))
            if pick is None:
                raise StopIteration
            self._in_flight.append((rid, pick.sent))
            pick.sent += 1
            return pick.keys[pick.sent - 1]

    def take(self, rid: int, i: int) -> list[dict[str, np.ndarray]]:
        """Chunk ``i`` of run ``rid`` (wanted first: ``want``), its batches in numpy;
        waits until it is read."""
        while True:
            with self._state:
                r = self._runs[rid]
                if i in r.items:
                    item = r.items.pop(i)
                    if isinstance(item, ChunkFailed):
                        raise item.error
                    return item
                if self.broken is not None:
                    raise RuntimeError(f"the data loader's workers failed: {self.broken}") from self.broken
                if i >= r.wanted:
                    raise RuntimeError(f"chunk {i} of a run taken before it was wanted (a bug)")
            with self._pull:
                with self._state:
                    if i in r.items or self.broken is not None:
                        continue
                    pending = any(x.sent < x.wanted for x in self._runs.values())
                try:
                    if self._it is None or (not self._in_flight and pending):
                        # Nothing in flight: a new iteration (the same persistent workers)
                        # primes the DataLoader's prefetch from the key feed.
                        self._it = iter(self._data_loader())
                    item = next(self._it)
                except StopIteration:
                    raise RuntimeError("the data loader ran out of chunks to read (a bug)") from None
                except Exception as e:  # a worker died (its items' handover fails too)
                    with self._state:
                        self.broken = e
                    self._shutdown()
                    raise RuntimeError(f"a DataLoader worker of this rank's data path died "
                                       f"({type(e).__name__}: {e}); killed by the OOM killer or "
                                       "a signal? The attempt restarts from its checkpoint") from e
                except BaseException as e:  # interrupted mid-handover: the iterator's state is lost
                    with self._state:
                        self.broken = e
                    self._shutdown()
                    raise
                with self._state:
                    owner, j = self._in_flight.popleft()
                    if owner in self._runs:
                        self._runs[owner].items[j] = item if isinstance(item, ChunkFailed) else \
                            [from_shared(x) for x in item]

    def _data_loader(self):
        from torch.utils.data import DataLoader

        if self._loader is None:
            # Each worker ends with this process, a SIGKILL included (data.lifetime).
            # A generator of its own: every iteration draws the workers' base seed from
            # it, by default from torch's global generator, which the trainer seeds before
            # each micro-step's dropout. An iteration started by the read-ahead thread
            # during a step would change that step's dropout masks. The workers' seeds
            # serve no transform (a task's randomness is keyed by sample id).
            import torch

            self._loader = DataLoader(
                self._jobs, batch_size=None, sampler=_Sampler(self), num_workers=self.workers,
                collate_fn=as_is, prefetch_factor=PREFETCH_PER_WORKER,
                persistent_workers=True, multiprocessing_context=self._ctx,
                generator=torch.Generator().manual_seed(0),
                worker_init_fn=functools.partial(watch_trainer, os.getpid()))
        return self._loader

    def _shutdown(self) -> None:
        """End the workers: the DataLoader's iterator shuts them down when it is freed
        (the loader holds it too)."""
        self._it = self._loader = None

    def close(self) -> None:
        with self._pull:
            self._shutdown()


_POOLS: list[DataWorkers] = []
_POOLS_LOCK = threading.Lock()


def data_workers(info: DatasetInfo, task: Task, workers: int = READ_TASKS) -> DataWorkers:
    """This process's pool for ``info`` and ``task``, made at the first call (or when the
    last one broke). A pool for another data set or task closes the idle pools (a
    trainer reads one training split with one task; a process that reads several, like
    the tests, starts workers per data set)."""
    with _POOLS_LOCK:
        for p in _POOLS:
            if p.serves(info, task) and p.workers == max(1, workers):
                return p
        for p in [p for p in _POOLS if p.idle or p.broken is not None]:
            p.close()
            _POOLS.remove(p)
        pool = DataWorkers(info, task, workers)
        _POOLS.append(pool)
        return pool


def has_workers(info: DatasetInfo, task: Task, workers: int = READ_TASKS) -> bool:
    """Whether this process has a pool for ``info`` and ``task`` that :func:`data_workers`
    would hand out (started by an earlier run, its workers up or starting)."""
    with _POOLS_LOCK:
        return any(p.serves(info, task) and p.workers == max(1, workers) for p in _POOLS)


class WindowStream:
    """``windows`` read and transformed by this process's :class:`DataWorkers` (one run),
    in order, cut at ``rounds`` (ascending window indices ending at ``len(windows)``) into
    the same read chunks as the Ray Data path (:func:`read_task_count`,
    :func:`read_chunks`, per round). ``round(a, b)``: the batches of windows ``[a, b)``,
    ``b`` the next round boundary, rounds taken in order from the first; each batch's
    ``SEQ`` is its window's index in ``windows``. ``batches()``: every window's batch in
    order, streamed (all rounds at once).

    The read and transform functions, the cut and the conversion to numpy are those of
    the Ray Data path, so the rows and their order are the same. What it costs: the
    workers run on this process's node only; up to ``PREFETCH_PER_WORKER x workers``
    chunks are in flight and ``READ_AHEAD_CHUNKS`` read past the round asked for, bounded
    in count, not in bytes like ``data.read_ahead_mib``. Dropping the stream ends its
    run (chunks in flight are dropped on arrival)."""

    def __init__(self, info: DatasetInfo, task: Task, windows: list[Window], rounds: list[int],
                 seed: int, epoch: int, split: str, workers: int = READ_TASKS):
        keys: list[ChunkKey] = []
        self._ends: list[int] = []  # chunks up to the end of each round
        a = 0
        for b in rounds:
            run = windows[a:b]
            keys += [ChunkKey(seed, epoch, split, a + x, tuple(windows[a + x:a + y]))
                     for x, y in read_chunks(len(run), read_task_count(info, run, workers))]
            self._ends.append(len(keys))
            a = b
        self.chunks = len(keys)
        self._rounds = list(rounds)
        self._pool = data_workers(info, task, workers)
        self._rid = self._pool.open(keys)
        weakref.finalize(self, self._pool.close_run, self._rid)
        self._k = self._at = 0  # rounds taken; their windows' end
        self._taken = 0         # chunks taken

    def round(self, a: int, b: int) -> list[dict[str, np.ndarray]]:
        if self._k >= len(self._rounds) or (a, b) != (self._at, self._rounds[self._k]):
            raise RuntimeError(f"rounds taken out of order: windows [{a}, {b}) after "
                               f"[0, {self._at}) of {self._rounds[-1]}")
        end = self._ends[self._k]
        self._k, self._at = self._k + 1, b
        return list(self._take(end))

    def batches(self) -> Iterator[dict[str, np.ndarray]]:
        self._k, self._at = len(self._rounds), self._rounds[-1] if self._rounds else 0
        return self._take(self.chunks)

    def _take(self, end: int) -> Iterator[dict[str, np.ndarray]]:
        self._pool.want(self._rid, end)
        while self._taken < end:
            item = self._pool.take(self._rid, self._taken)
            self._taken += 1
            yield from item


def dataloader_batches(info: DatasetInfo, task: Task, windows: list[Window], seed: int,
                       epoch: int, split: str, workers: int = READ_TASKS) -> Iterator[dict[str, np.ndarray]]:
    """Numpy batches of ``windows`` in order (one per window), read and transformed by
    this process's :class:`DataWorkers`, streamed (the permutation reader keeps only its
    rank's rows of each)."""
    if not windows:
        return iter(())
    stream = WindowStream(info, task, windows, [len(windows)], seed, epoch, split, workers)
    return stream.batches()
