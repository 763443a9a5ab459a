"""Per-rank ingest: Ray Data reads this rank's rows of the epoch order and runs the task's
transform; a reader hands the trainer the rows of each step.

    reader = open_train_reader(info, task, cfg, rank, world_size, epoch, cursor)
    rows = reader.take(cursor, n_rows)         # {column: [rows of this rank, ...]}

Each rank builds its own pipeline per epoch, ``read_datasource(WindowSource) ->
map_batches(task.transform)``, executed by Ray Data's streaming executor (read and
transform tasks with prefetch and back-pressure, ``preserve_order`` on so windows arrive
in the order the rank needs them). A read task reads one window: the row groups of its
pieces (only the task's columns), cast to the scanned schema, rows permuted.

- windowed order: a rank reads only its own partitions' windows, starting at the window
  that holds the cursor (a restart re-reads at most one window per partition), and
  keeps about two windows per owned partition.
- permutation order (small data sets): a rank streams every row group and keeps the rows
  of its share of the rest of the epoch.
"""

from __future__ import annotations

import collections
import functools
import logging
from typing import Any, Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from elastic_ddp.background import Background
from elastic_ddp.data.order import EpochOrder, Piece, Window, owner
from elastic_ddp.data.scan import DataError, DatasetInfo
from elastic_ddp.tasks.protocol import Task, TransformContext

SEQ = "_edp_seq"  # bookkeeping column: which read item a row came from
# Read/transform tasks in flight per rank: two keep one window decoding while the trainer
# consumes the other (a window is thousands of rows, many steps' worth).
READ_TASKS = 2
# Object-store bytes a rank's pipeline may read ahead (data.read_ahead_mib's default).
READ_AHEAD_BYTES = 256 * 2**20
# A first round (read before the first step, at a start, restart or epoch start that was
# not prefetched) of at most this many Parquet bytes is read and transformed in the
# trainer's process: in a fresh worker process Ray Data's first execution must first start
# its read-task workers, which costs more than reading a small round here. Larger rounds
# (many rows, or a transform that decodes big images) keep Ray Data's parallel tasks.
LOCAL_FIRST_ROUND_BYTES = 64 * 2**20


class TransformError(DataError):
    """``Task.transform`` broke the contract (not a dict, or not one row per input row)."""


def epoch_partitions(info: DatasetInfo, cfg) -> int:
    """The canonical partitions of the epoch order: ``data.partitions`` when set (a count
    larger than the rows is refused by ``EpochOrder``), else the default fitted to the
    data set (``batching.fit_partitions``: fewer partitions when there are few row groups,
    so that cut row groups add at most ~10% to each rank's reads, or when a window of
    ``shuffle_window_rows / P`` rows would be smaller than a row group (or block), so that
    a round, and a restart's first read, stays near ``shuffle_window_rows / N`` rows)."""
    from elastic_ddp.batching import fit_partitions

    if cfg.data.order == "permutation" or cfg.data.partitions:
        return cfg.partitions
    block = cfg.data.block_rows
    units = sum(-(-g.num_rows // block) if block else 1 for g in info.row_groups)
    return fit_partitions(cfg.partitions, cfg.scaling.max_workers, len(info.row_groups),
                          info.num_rows, cfg.data.shuffle_window_rows,
                          info.num_rows / max(1, units))


def epoch_order(info: DatasetInfo, cfg, epoch: int) -> EpochOrder:
    """The order of ``epoch`` for a config (``elastic_ddp.config.Config``), with
    :func:`epoch_partitions`."""
    return EpochOrder(info.row_groups, cfg.seed, epoch, epoch_partitions(info, cfg),
                      cfg.data.shuffle_window_rows, cfg.data.block_rows, cfg.data.order)


# ------------------------------------------------------------------ Ray Data pieces
def _read_window(files: list[str], schema: pa.Schema, seq: int, window: Window,
                 cache: Optional[dict] = None) -> list[pa.Table]:
    """One window's rows (its pieces concatenated, then permuted), tagged with ``seq``.
    ``cache``: row groups already read by this read task, by (file, index)."""
    tables, cache = [], {} if cache is None else cache
    for pc in window.pieces:
        key = (pc.file, pc.index)
        if key not in cache:
            t = pq.ParquetFile(files[pc.file]).read_row_group(pc.index, columns=schema.names)
            cache[key] = t.select(schema.names).cast(schema)
        tables.append(cache[key].slice(pc.start, pc.num_rows))
    t = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    if window.key:
        t = t.take(pa.array(window.permutation()))
    return [t.append_column(SEQ, pa.array(np.full(t.num_rows, seq, dtype=np.int64)))]


def _read_windows(files: list[str], schema: pa.Schema, first_seq: int,
                  windows: list[Window]) -> Iterator[pa.Table]:
    """One read task: its windows in order, one block each. A row group shared by several
    of them (small partitions slice one row group many times) is read once; costs the
    task's row groups in memory until it ends."""
    cache: dict = {}
    needed = collections.Counter((pc.file, pc.index) for w in windows for pc in w.pieces)
    for i, w in enumerate(windows):
        yield from _read_window(files, schema, first_seq + i, w, cache)
        for pc in w.pieces:  # drop a row group once its last window here is read
            k = (pc.file, pc.index)
            needed[k] -= 1
            if needed[k] == 0:
                cache.pop(k, None)


def read_chunks(n_windows: int, tasks: int) -> list[tuple[int, int]]:
    """Contiguous ``[a, b)`` runs of window indices, one per read task: at most ``tasks``
    of them, as even as possible. Fewer, larger read tasks: Ray Data's per-task cost
    (scheduling, a worker, a block) is paid per task, and a reader waits for a whole round
    anyway."""
    bounds = np.linspace(0, n_windows, min(tasks, n_windows) + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds, bounds[1:]) if b > a]


def window_source(files: list[str], schema: pa.Schema, windows: list[Window],
                  tasks: Optional[int] = None):
    """A Ray Data ``Datasource`` over ``windows`` in order: ``tasks`` read tasks (default
    one per window), each reading a contiguous run of windows, one block per window."""
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    chunks = read_chunks(len(windows), tasks or len(windows))

    class WindowSource(Datasource):
        def estimate_inmemory_data_size(self) -> Optional[int]:
            return None

        def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
            return [ReadTask(functools.partial(_read_windows, files, schema, a, windows[a:b]),
                             BlockMetadata(num_rows=sum(w.num_rows for w in windows[a:b]),
                                           size_bytes=None, input_files=None, exec_stats=None))
                    for a, b in chunks]

        def get_name(self) -> str:
            return "ElasticDDPWindows"

    return WindowSource()


class _Transform:
    """The task's transform as a Ray Data batch function: checks the one-row-per-row
    contract and carries the id and bookkeeping columns through."""

    def __init__(self, task: Task, seed: int, epoch: int, split: str, id_column: str):
        self.task, self.seed, self.epoch, self.split, self.id_column = task, seed, epoch, split, id_column

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = np.asarray(batch[self.id_column])
        seq = batch.pop(SEQ)
        out = self.task.transform(batch, TransformContext(self.seed, self.epoch, self.split, ids))
        if not isinstance(out, dict):
            raise TransformError(f"{type(self.task).__name__}.transform returned a "
                                 f"{type(out).__name__}, not a dict of column arrays")
        for k, v in out.items():
            if len(v) != len(ids):
                raise TransformError(
                    f"{type(self.task).__name__}.transform returned {len(v)} rows in column "
                    f"{k!r} for {len(ids)} input rows; it must return one row per input row, "
                    "in order (filter bad samples out of the Parquet files instead)")
        out = dict(out)
        out[self.id_column] = ids
        out[SEQ] = seq
        return out


def pipeline(info: DatasetInfo, task: Task, windows: list[Window], seed: int, epoch: int,
             split: str, local: bool = False,
             read_ahead_bytes: float = READ_AHEAD_BYTES) -> Iterator[dict[str, np.ndarray]]:
    """Numpy batches of ``windows`` (in that order) after the task's transform, read and
    transformed by Ray Data, at most ``read_ahead_bytes`` of object-store memory ahead of
    the consumer (``data.read_ahead_mib``). ``local=True`` runs the same read and transform
    functions in this process instead, one window at a time (the reader logic tested
    without Ray)."""
    transform = _Transform(task, seed, epoch, split, info.id_column)
    if local:
        from ray.data.block import BlockAccessor

        return (transform(BlockAccessor.for_block(t).to_batch_format("numpy"))
                for a, b in read_chunks(len(windows), READ_TASKS)
                for t in _read_windows(info.files, info.schema, a, windows[a:b]))
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    # Read tasks on this rank's node: a window travels through the local object store.
    ctx.execution_options.locality_with_output = True
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    # Ray Data's own budget is a share of the whole object store: on a large data set it
    # reads the rank's epoch ahead for as long as that lasts (spilling to disk), on the
    # cores training runs on. The cap stops reading a few windows ahead; Ray Data still
    # runs one task per operator when a single window is larger than the cap.
    ctx.execution_options.resource_limits = ctx.execution_options.resource_limits.copy(
        object_store_memory=float(read_ahead_bytes))
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    if not windows:
        return iter(())
    # No CPU reserved for the read and transform tasks, at most READ_TASKS of them at
    # a time per rank: the training workers may hold every CPU of their nodes (a cluster
    # sized by workers x cpus_per_worker), and a task waiting for a free CPU would stall
    # the job forever. What it costs: the tasks share the cores with training.
    remote = {"num_cpus": 0, "concurrency": READ_TASKS}
    src = window_source(info.files, info.schema, windows, READ_TASKS)
    ds = ray.data.read_datasource(src, override_num_blocks=len(read_chunks(len(windows), READ_TASKS)),
                                  **remote)
    ds = ds.map_batches(transform, batch_size=None, batch_format="numpy", zero_copy_batch=False,
                        **remote)
    return ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=1)


def _concat(parts: list[dict[str, np.ndarray]], template: Optional[dict] = None) -> dict[str, np.ndarray]:
    parts = [p for p in parts if len(next(iter(p.values()), ()))]
    if not parts:
        return {k: v[:0] for k, v in (template or {}).items()}
    if len(parts) == 1:
        return parts[0]
    out = {}
    for k in parts[0]:
        arrs = [p[k] for p in parts]
        if any(a.dtype == object for a in arrs) or len({a.shape[1:] for a in arrs}) > 1:
            merged = np.empty(sum(len(a) for a in arrs), dtype=object)
            i = 0
            for a in arrs:
                for v in a:
                    merged[i] = v
                    i += 1
            out[k] = merged
        else:
            out[k] = np.concatenate(arrs)
    return out


def _take(arrays: dict[str, np.ndarray], idx) -> dict[str, np.ndarray]:
    return {k: v[idx] for k, v in arrays.items()}


# ------------------------------------------------------------------------- readers
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
    trainer; 0: never), unless ``prefetch`` starts it in the background."""

    def __init__(self, info: DatasetInfo, task: Task, order: EpochOrder, rank: int,
                 world_size: int, cursor: int, local: bool = False,
                 read_ahead_bytes: float = READ_AHEAD_BYTES,
                 held: Optional[dict[tuple[int, int], dict[str, np.ndarray]]] = None,
                 local_first_bytes: float = 0.0):
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
        self.bytes_read = _bytes(info, self._todo)
        self._source = (info, task, order.seed, order.epoch, local, read_ahead_bytes)
        self._local_first = held is not None or (
            bool(todo) and _bytes(info, self._todo[:self._rounds[0]]) <= local_first_bytes)
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

        def read() -> list[dict[str, np.ndarray]]:
            out = []
            for batch in pipeline(info, task, self._todo[a:b], seed, epoch, "train", local, ahead):
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
        return _concat(parts, self.template)

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
        return _concat(parts, self.template)

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
                self._buf.setdefault(w.partition, []).append((w, _concat(self._partial)))
                self._partial, self._have = [], 0
                self._next += 1


class PermutationReader:
    """This rank's rows of one epoch, permutation order: every row group is streamed and
    the rows of this rank's positional share of ``[cursor, N)`` are kept (memory: N /
    world_size rows; reads: the whole data set per rank)."""

    def __init__(self, info: DatasetInfo, task: Task, order: EpochOrder, rank: int,
                 world_size: int, cursor: int, global_batch_size: int,
                 rows_per_rank: Optional[list[int]] = None, local: bool = False):
        self.order, self.rank, self.world_size = order, rank, world_size
        self.g, self.rows_per_rank = global_batch_size, rows_per_rank
        mine = [self._positions(c) for c in range(cursor, order.num_rows, global_batch_size)]
        pos = np.concatenate(mine) if mine else np.zeros(0, np.int64)
        self._wanted = np.sort(order.permutation[pos])
        windows = [Window(0, 0, (Piece(g.file, g.index, 0, g.num_rows),), g.num_rows, ())
                   for g in info.row_groups]
        self.bytes_read = _bytes(info, windows)
        self._starts = np.cumsum([0] + [g.num_rows for g in info.row_groups])
        self._windows = windows
        self._source = (info, task, local)
        self._rows: Optional[np.ndarray] = None
        self._data: dict[str, np.ndarray] = {}
        self.template: Optional[dict] = None

    def _positions(self, cursor: int) -> np.ndarray:
        n = min(self.g, self.order.num_rows - cursor)
        rows = self.order.rank_rows(cursor, n, self.world_size, self.rows_per_rank)
        start = cursor + sum(rows[:self.rank])
        return np.arange(start, start + rows[self.rank], dtype=np.int64)

    def _load(self) -> None:
        info, task, local = self._source
        kept_rows, kept = [], []
        seen: dict[int, int] = {}
        for batch in pipeline(info, task, self._windows, self.order.seed, self.order.epoch, "train", local):
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
                kept.append(_take(batch, hit))
        self._rows = np.concatenate(kept_rows) if kept_rows else np.zeros(0, np.int64)
        order = np.argsort(self._rows)
        self._rows = self._rows[order]
        self._data = _take(_concat(kept, self.template), order) if kept else dict(self.template or {})

    def take(self, cursor: int, n_rows: int) -> dict[str, np.ndarray]:
        if self._rows is None:
            self._load()
        rows = self.order.permutation[self._positions(cursor)]
        return _take(self._data, np.searchsorted(self._rows, rows))


def open_train_reader(info: DatasetInfo, task: Task, cfg, rank: int, world_size: int,
                      epoch: int, cursor: int, global_batch_size: int,
                      rows_per_rank: Optional[list[int]] = None, local: bool = False,
                      template: Optional[dict] = None, held: Optional[dict] = None,
                      local_first_bytes: float = 0.0):
    """The order of ``epoch`` and this rank's reader from ``cursor`` (see the module
    docstring). ``template``: a transformed row (shapes of an empty share); ``local``:
    read in this process, without Ray (tests); ``held``: windows of another view's
    reader of this epoch (``WindowedReader.held_windows``, windowed order only);
    ``local_first_bytes``: see ``WindowedReader``."""
    order = epoch_order(info, cfg, epoch)
    if order.mode == "permutation":
        reader = PermutationReader(info, task, order, rank, world_size, cursor,
                                   global_batch_size, rows_per_rank, local)
    else:
        reader = WindowedReader(info, task, order, rank, world_size, cursor, local,
                                cfg.data.read_ahead_mib * 2**20, held, local_first_bytes)
    if template is not None:
        reader.template = {k: v[:0] for k, v in template.items()}
    return order, reader


def val_batches(info: DatasetInfo, task: Task, seed: int, epoch: int, rank: int,
                world_size: int, batch_size: int, n_batches: int,
                template: dict[str, Any], local: bool = False) -> Iterator[dict[str, np.ndarray]]:
    """Exactly ``n_batches`` batches of at most ``batch_size`` rows of this rank's
    contiguous share of the validation split (rows ``[r N / ws, (r + 1) N / ws)`` in file
    order), transformed with ``split="val"``; empty batches (shaped like ``template``)
    once the share is used up, so every rank runs the same number of forward passes."""
    n = info.num_rows
    lo, hi = rank * n // world_size, (rank + 1) * n // world_size
    hi = min(hi, lo + batch_size * n_batches)
    windows, start = [], 0
    for g in info.row_groups:
        a, b = max(lo, start), min(hi, start + g.num_rows)
        if b > a:
            windows.append(Window(0, 0, (Piece(g.file, g.index, a - start, b - start),), b - a, ()))
        start += g.num_rows
    buf: list[dict[str, np.ndarray]] = []
    have = sent = 0
    for batch in pipeline(info, task, windows, seed, epoch, "val", local):
        batch.pop(SEQ)
        buf.append(batch)
        have += len(batch[info.id_column])
        while have >= batch_size and sent < n_batches:
            merged = _concat(buf, template)
            yield _take(merged, slice(0, batch_size))
            buf = [_take(merged, slice(batch_size, None))]
            have -= batch_size
            sent += 1
    if have and sent < n_batches:
        yield _concat(buf, template)
        sent += 1
    empty = {k: v[:0] for k, v in template.items()}
    for _ in range(n_batches - sent):
        yield empty


def _bytes(info: DatasetInfo, windows: list[Window]) -> int:
    """Compressed bytes the read tasks of ``windows`` read: each window reads each of its
    row groups once (only the task's columns)."""
    size = {(g.file, g.index): g.nbytes for g in info.row_groups}
    return sum(size[k] for w in windows for k in {(pc.file, pc.index) for pc in w.pieces})
