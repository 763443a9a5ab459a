"""What a DataLoader worker of ``data.reader: dataloader`` does (``data.workers``): a read
chunk (:class:`ChunkKey`: the windows of one read item, the epoch's transform seed and
split) read and transformed into one batch per window, and handed to the trainer's
process, numeric columns as tensors in shared memory (an object column of equal arrays,
a fixed-length list column, stacked into one). A chunk whose read or transform
raises is handed over as its error (:class:`ChunkFailed`), re-raised by the run that
takes it.

This module is what the workers import (``data.lifetime.WORKER_PRELOAD``): they are
forked from a server that imported it once.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple, Optional

import numpy as np
import pyarrow as pa

from elastic_ddp.data.ingest import _read_windows
from elastic_ddp.data.order import Window
from elastic_ddp.tasks.protocol import Task
from elastic_ddp.tasks.transform import TaskTransform


class ChunkKey(NamedTuple):
    """One read item: ``windows`` read in order (a row group shared by several read once),
    each transformed with ``TransformContext(seed, epoch, split, ids)``; the batch of
    ``windows[i]`` carries ``SEQ = first_seq + i``."""

    seed: int
    epoch: int
    split: str
    first_seq: int
    windows: tuple[Window, ...]


class StackedRows(NamedTuple):
    """An object column whose rows are arrays of one shape and dtype (a fixed-length list
    column), stacked into one tensor ``[B, ...]`` for the handover (:func:`_to_shared`)."""

    tensor: Any


def _stacked(v: np.ndarray) -> Optional[np.ndarray]:
    """The rows of object column ``v`` stacked (``[B, ...]``), or None where they are not
    all arrays of one shape and numeric dtype."""
    if not len(v) or not all(isinstance(r, np.ndarray) for r in v):
        return None
    first = v[0]
    if first.dtype == object or any(r.shape != first.shape or r.dtype != first.dtype for r in v):
        return None
    return np.stack(list(v))


def _to_shared(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """Numeric columns as tensors (a DataLoader worker hands a tensor over in shared
    memory; a numpy array would be pickled through a pipe); an object column of equal
    arrays (a fixed-length list column) as one such tensor (:class:`StackedRows`); other
    object columns as they are.

    A fixed-length list column pickled row by row would arrive as one small array per
    row, allocated by the trainer's receiving thread: a window's rows scattered through
    malloc's arenas, freed after their steps into fragments the later windows' rows do
    not fill (the trainer's RSS grows by megabytes per step). Stacked, a window's rows
    arrive in one shared-memory mapping, unmapped when the last row is dropped. What it
    costs: one copy of the column in the worker (the stack), and the window's mapping
    lives as long as any of its rows (a step's rows span at most two windows per
    partition)."""
    import torch

    out = {}
    for k, v in batch.items():
        if isinstance(v, np.ndarray) and v.dtype == object:
            rows = _stacked(v)
            if rows is not None:
                try:
                    v = StackedRows(torch.from_numpy(rows))
                except TypeError:  # a dtype torch has no tensor of: pickled row by row
                    pass
        elif isinstance(v, np.ndarray):
            try:
                with warnings.catch_warnings():
                    # Arrow's arrays are read-only; the tensor is only copied into shared
                    # memory by the handover, never written.
                    warnings.simplefilter("ignore", UserWarning)
                    v = torch.from_numpy(np.ascontiguousarray(v))
            except TypeError:  # a dtype torch has no tensor of: pickled as it is
                pass
        out[k] = v
    return out


def _unstacked(rows: np.ndarray) -> np.ndarray:
    """``[B, ...]`` as an object column of its ``B`` rows (views)."""
    out = np.empty(len(rows), dtype=object)
    for i, r in enumerate(rows):
        out[i] = r
    return out


def own_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``batch`` with each object column whose rows are views of one buffer (a stacked
    column, :func:`from_shared`) copied into a buffer of its own rows: a reader that keeps
    a subset of a batch's rows for long then holds those rows, not the whole buffer of
    the batch they came in. Other columns as they are."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, np.ndarray) and v.dtype == object and len(v):
            base = getattr(v[0], "base", None)
            if isinstance(base, np.ndarray) and base.ndim == v[0].ndim + 1 and all(
                    getattr(r, "base", None) is base for r in v):
                v = _unstacked(np.stack(list(v)))
        out[k] = v
    return out


def from_shared(batch: dict[str, Any]) -> dict[str, np.ndarray]:
    """A batch handed over by a worker, its tensors back as numpy arrays and its stacked
    columns back as object columns of row arrays (the trainer's process side of
    :func:`_to_shared`)."""
    import torch

    return {k: _unstacked(v.tensor.numpy()) if isinstance(v, StackedRows)
            else v.numpy() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def as_is(item):
    """The DataLoader's ``collate_fn``: a chunk is handed over as the worker made it."""
    return item


def _chunk_jobs(data: bytes) -> "ChunkJobs":
    import pickle

    return ChunkJobs(*pickle.loads(data))


class ChunkJobs:
    """Map-style dataset keyed by :class:`ChunkKey`: item ``key`` is its windows read
    (:func:`elastic_ddp.data.ingest._read_windows`) and transformed, one batch per
    window, numeric columns as tensors."""

    def __init__(self, files: list, schema: pa.Schema, task: Task, id_column: str):
        self.files, self.schema, self.task, self.id_column = files, schema, task, id_column

    def __reduce__(self):
        # cloudpickle: a task class defined in a file the workers cannot import by name
        # (task.path 'file.py:Name') travels by value, as to Ray's tasks.
        import ray.cloudpickle

        return (_chunk_jobs, (ray.cloudpickle.dumps((self.files, self.schema, self.task, self.id_column)),))

    def read(self, key: ChunkKey) -> list[dict[str, Any]]:
        from ray.data.block import BlockAccessor

        transform = TaskTransform(self.task, key.seed, key.epoch, key.split, self.id_column)
        return [_to_shared(transform(BlockAccessor.for_block(t).to_batch_format("numpy")))
                for t in _read_windows(self.files, self.schema, key.first_seq, list(key.windows))]

    def __getitem__(self, key: ChunkKey):
        try:
            return self.read(key)
        except Exception as e:  # noqa: BLE001 - handed to the run that takes the chunk
            return ChunkFailed(e)


class ChunkFailed:
    """A chunk whose read or transform raised in a worker: the exception, re-raised by the
    run that takes the chunk (its type kept, the worker's traceback added as a note)."""

    def __init__(self, error: BaseException):
        import pickle
        import traceback

        error.add_note("in a DataLoader worker:\n" + "".join(traceback.format_exception(error)))
        try:
            pickle.dumps(error)
        except Exception:  # noqa: BLE001 - an exception that cannot travel: its text does
            error = RuntimeError(f"{type(error).__name__}: {error}\n" + "\n".join(getattr(error, "__notes__", [])))
        self.error = error
