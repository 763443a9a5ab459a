"""Per-rank ingest: Ray Data reads this rank's rows of the epoch order and runs the task's
transform (the readers built on it: :mod:`elastic_ddp.data.readers`); the validation split's
batches.

Each rank builds its own pipeline per epoch, ``read_datasource(WindowSource) ->
map_batches(task.transform)``, executed by Ray Data's streaming executor (read and
transform tasks with prefetch and back-pressure, ``preserve_order`` on so windows arrive
in the order the rank needs them). A read task reads one window: the row groups of its
pieces (only the task's columns), cast to the scanned schema, rows permuted.

The same read function serves ``data.reader: dataloader``, whose DataLoader worker
processes (:mod:`elastic_ddp.data.workers`) read and transform a rank's windows on its own
node. The readers (:mod:`elastic_ddp.data.readers`) decide which windows a rank reads.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
from typing import Any, Iterator, NamedTuple, Optional

import numpy as np
import pyarrow as pa

from elastic_ddp.data.files import ParquetSource, read_row_group
from elastic_ddp.data.order import EpochOrder, Piece, Window
from elastic_ddp.data.scan import DatasetInfo
from elastic_ddp.tasks.protocol import Task
from elastic_ddp.tasks.transform import SEQ, TaskTransform, TransformError  # noqa: F401 - TransformError re-exported

# Read/transform tasks in flight per rank (data.read_tasks' default): two keep one window
# decoding while the trainer consumes the other (a window is thousands of rows, many
# steps' worth).
READ_TASKS = 2
# Parquet bytes per read task: a round is cut into tasks of about this size (at least
# READ_TASKS of them, at most one per window), READ_TASKS in flight. A round cut into only
# READ_TASKS long tasks with large outputs (decoded images) decodes at less than one core's
# rate: Ray Data hands the output over in task order (preserve_order) and a later task's
# output stalls on its back-pressure until the earlier task ends. Short tasks keep every
# slot busy to the round's last task; what it costs: Ray Data's per-task overhead (a few
# ms) per task, and a row group cut between two windows of different tasks read twice.
READ_TASK_BYTES = 8 * 2**20
# Object-store bytes a rank's pipeline may read ahead (data.read_ahead_mib's default).
READ_AHEAD_BYTES = 256 * 2**20
# A first round (read before the first step, at a start, restart or epoch start that was
# not prefetched) of at most this many Parquet bytes is read and transformed in the
# trainer's process: in a fresh worker process Ray Data's first execution must first start
# its read-task workers, which costs more than reading a small round here. Larger rounds
# (many rows, or a transform that decodes big images) keep Ray Data's parallel tasks.
LOCAL_FIRST_ROUND_BYTES = 64 * 2**20


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
def _read_window(files: list[ParquetSource], schema: pa.Schema, seq: int, window: Window,
                 cache: Optional[dict] = None) -> list[pa.Table]:
    """One window's rows (its pieces concatenated, then permuted), tagged with ``seq``.
    ``files``: the data set's files (``DatasetInfo.sources()``: on any storage, each row
    group read by ranged reads of only ``schema``'s columns). ``cache``: row groups
    already read by this read task, by (file, index)."""
    tables, cache = [], {} if cache is None else cache
    for pc in window.pieces:
        key = (pc.file, pc.index)
        if key not in cache:
            t = read_row_group(files[pc.file], pc.index, schema.names)
            cache[key] = t.select(schema.names).cast(schema)
        tables.append(cache[key].slice(pc.start, pc.num_rows))
    t = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    if window.key:
        t = t.take(pa.array(window.permutation()))
    return [t.append_column(SEQ, pa.array(np.full(t.num_rows, seq, dtype=np.int64)))]


def _read_windows(files: list[ParquetSource], schema: pa.Schema, first_seq: int,
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
    of them, as even as possible (:func:`read_task_count` says how many)."""
    bounds = np.linspace(0, n_windows, min(tasks, n_windows) + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds, bounds[1:]) if b > a]


class ReadSlots(NamedTuple):
    """A rank's data-path parallelism: ``tasks`` read and transform tasks (Ray Data) or
    DataLoader workers at a time (``data.read_tasks``), each Ray Data task reserving
    ``cpus`` logical CPUs (``data.task_cpus``; 0: none); ``training_cpus``: the logical
    CPUs the training workers hold (``world_size x scaling.cpus_per_worker``)."""

    tasks: int = READ_TASKS
    cpus: float = 0.0
    training_cpus: float = 0.0


def read_task_count(info: DatasetInfo, windows: list[Window], slots: int = READ_TASKS) -> int:
    """Read tasks for ``windows``: ``ceil(window_bytes / READ_TASK_BYTES)``, at least
    ``slots`` (the tasks in flight at a time) and at most one per window (0 for none)."""
    want = math.ceil(window_bytes(info, windows) / READ_TASK_BYTES)
    return min(len(windows), max(slots, want))


def window_source(files: list[ParquetSource], schema: pa.Schema, windows: list[Window],
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


def pipeline(info: DatasetInfo, task: Task, windows: list[Window], seed: int, epoch: int,
             split: str, local: bool = False, read_ahead_bytes: float = READ_AHEAD_BYTES,
             slots: ReadSlots = ReadSlots()) -> Iterator[dict[str, np.ndarray]]:
    """Numpy batches of ``windows`` (in that order) after the task's transform, read and
    transformed by Ray Data, at most ``read_ahead_bytes`` of object-store memory ahead of
    the consumer (``data.read_ahead_mib``), ``slots.tasks`` tasks at a time
    (:func:`task_resources` says where they may run). ``local=True`` runs the same read
    and transform functions in this process instead, one window at a time (the reader
    logic tested without Ray). The DataLoader path: :mod:`elastic_ddp.data.workers`."""
    transform = TaskTransform(task, seed, epoch, split, info.id_column)
    if local:
        from ray.data.block import BlockAccessor

        return (transform(BlockAccessor.for_block(t).to_batch_format("numpy"))
                for a, b in read_chunks(len(windows), READ_TASKS)
                for t in _read_windows(info.sources(), info.schema, a, windows[a:b]))
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
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
    remote = {"num_cpus": task_resources(slots), "concurrency": slots.tasks}
    tasks = read_task_count(info, windows, slots.tasks)
    src = window_source(info.sources(), info.schema, windows, tasks)
    ds = ray.data.read_datasource(src, override_num_blocks=len(read_chunks(len(windows), tasks)),
                                  **remote)
    ds = ds.map_batches(transform, batch_size=None, batch_format="numpy", zero_copy_batch=False,
                        **remote)
    return ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=1)


_TASK_CPUS_WARNED = False


def task_resources(slots: ReadSlots) -> float:
    """The logical CPUs each Ray Data read and transform task of a round reserves.

    ``slots.cpus == 0`` (``data.task_cpus``' default): none. The tasks then never wait
    for a CPU: the training workers may hold every CPU of their nodes (a cluster sized
    by workers x cpus_per_worker), and a task waiting for one would stall the job
    forever. Ray Data's default ``SPREAD`` scheduling places them on any node, but they
    share the cores with whatever runs there.

    ``slots.cpus > 0``: each task reserves that many, so Ray runs them where CPUs are
    free (a CPU-only node, the CPUs training leaves) and as many at a time as fit, up to
    ``slots.tasks``; a node added to the cluster adds data-path throughput. When the
    cluster's CPUs (``ray.cluster_resources()``, the nodes alive now) less those training
    holds (``slots.training_cpus``) are fewer than ``slots.cpus`` (no such node, or it
    left), the round's tasks reserve none, as with 0, and a warning says so once per
    process: the job goes on instead of waiting for CPUs that may never come. CPUs other
    jobs hold are not counted: the tasks wait for those like any Ray task. What it costs:
    one GCS request per round.
    """
    global _TASK_CPUS_WARNED
    if slots.cpus <= 0:
        return 0.0
    import ray

    spare = float(ray.cluster_resources().get("CPU", 0.0)) - slots.training_cpus
    if spare >= slots.cpus:
        return float(slots.cpus)
    if not _TASK_CPUS_WARNED:
        _TASK_CPUS_WARNED = True
        logging.getLogger(__name__).warning(
            "data.task_cpus is %s but the cluster has %.1f CPUs besides the training workers': "
            "the read and transform tasks reserve none and share the training nodes' cores. "
            "Add a CPU-only node (or lower scaling.max_workers) for the data path to have "
            "CPUs of its own.", slots.cpus, max(0.0, spare))
    return 0.0


def concat_rows(parts: list[dict[str, np.ndarray]], template: Optional[dict] = None) -> dict[str, np.ndarray]:
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


def take_rows(arrays: dict[str, np.ndarray], idx) -> dict[str, np.ndarray]:
    return {k: v[idx] for k, v in arrays.items()}


# ------------------------------------------------------------------------- readers
def val_share(num_rows: int, batch_size: int, rank: int, world_size: int,
              max_batches: Optional[int] = None) -> tuple[int, int, int]:
    """Rank ``rank``'s share of validation: ``(first row, end row, batches per rank)``.

    The evaluated rows (the first ``max_batches x batch_size`` of the split in file
    order, all without ``max_batches``) are cut into batches of ``batch_size`` rows at
    fixed offsets, and rank r takes the contiguous run of batches ``[r B / ws, (r + 1) B
    / ws)`` (B batches in all). A batch holds the same rows at every world size, so the
    per-batch sums, and the metrics, do not depend on it. Every rank runs the same
    number of batches, ``ceil(B / ws)``, padded with empty ones."""
    n = num_rows if not max_batches else min(num_rows, max_batches * batch_size)
    total = math.ceil(n / batch_size)
    first, last = rank * total // world_size, (rank + 1) * total // world_size
    return min(n, first * batch_size), min(n, last * batch_size), math.ceil(total / world_size)


def val_batches(info: DatasetInfo, task: Task, seed: int, epoch: int, rank: int,
                world_size: int, batch_size: int, max_batches: Optional[int],
                template: dict[str, Any], local: bool = False) -> Iterator[dict[str, np.ndarray]]:
    """This rank's batches of the validation split (:func:`val_share`: its run of the
    split's batches of ``batch_size`` rows, of at most ``max_batches`` batches in all),
    transformed with ``split="val"``; empty batches (shaped like ``template``) once the
    share is used up, so every rank runs the same number of forward passes.

    A share of at most ``LOCAL_FIRST_ROUND_BYTES`` of Parquet is read and transformed in
    this process (``local``), a larger one by Ray Data's tasks: the rows and values are
    the same either way (the same read and transform functions)."""
    lo, hi, n_batches = val_share(info.num_rows, batch_size, rank, world_size, max_batches)
    windows, start = [], 0
    for g in info.row_groups:
        a, b = max(lo, start), min(hi, start + g.num_rows)
        if b > a:
            windows.append(Window(0, 0, (Piece(g.file, g.index, a - start, b - start),), b - a, ()))
        start += g.num_rows
    # A Ray Data execution per evaluation starts its read-task workers and plans the
    # pipeline: seconds on 2 cores (6.7 s for digits' 360 val rows at 2 ranks), where a
    # small share reads in milliseconds here. What it costs: a large share's transform on
    # one core of this process instead of read_tasks tasks, hence the bound.
    local = local or window_bytes(info, windows) <= LOCAL_FIRST_ROUND_BYTES
    buf: list[dict[str, np.ndarray]] = []
    have = sent = 0
    for batch in pipeline(info, task, windows, seed, epoch, "val", local):
        batch.pop(SEQ)
        buf.append(batch)
        have += len(batch[info.id_column])
        while have >= batch_size and sent < n_batches:
            merged = concat_rows(buf, template)
            yield take_rows(merged, slice(0, batch_size))
            buf = [take_rows(merged, slice(batch_size, None))]
            have -= batch_size
            sent += 1
    if have and sent < n_batches:
        yield concat_rows(buf, template)
        sent += 1
    empty = {k: v[:0] for k, v in template.items()}
    for _ in range(n_batches - sent):
        yield empty


def window_bytes(info: DatasetInfo, windows: list[Window]) -> int:
    """Compressed bytes the read tasks of ``windows`` read: each window reads each of its
    row groups once (only the task's columns)."""
    size = {(g.file, g.index): g.nbytes for g in info.row_groups}
    return sum(size[k] for w in windows for k in {(pc.file, pc.index) for pc in w.pieces})
