"""The epoch's sample order, computed from Parquet footers and ``(seed, epoch)`` alone: which
rows make up global step k, and which rank reads which of them. Pure functions, no Ray.

    order = EpochOrder(info.row_groups, seed=0, epoch=3, partitions=12, window_rows=65536)
    order.rank_segments(cursor, n_rows, rank=1, world_size=4)   # what rank 1 computes

**windowed** (``data.order: windowed``; the design of MosaicML Streaming's "canonical
nodes", arXiv 2306.08255 sec. 3): each epoch

1. shuffles the units (row groups, or blocks of ``block_rows`` rows of them) with
   ``rng(seed, epoch)``, which gives one stream of all N rows;
2. cuts that stream into P contiguous *canonical partitions* of ``split_evenly(N, P)``
   rows (the longer ones first);
3. cuts each partition into *windows* of whole pieces of at least ``ceil(W / P)`` rows
   and permutes the rows inside each window with ``rng(seed, epoch, p, window)``;
4. interleaves the partitions round-robin: global position i is row ``i // P`` of
   partition ``i % P``. Step k takes positions ``[k G, (k + 1) G)``.

Nothing here depends on the world size: the global batch at step k is the same set of
samples at any world size. A rank owns the partitions ``p`` with ``p % world_size ==
rank`` (balanced when the world size divides P), reads only their row groups, and holds
about two windows per owned partition.

**permutation** (``data.order: permutation``, P = 1): global position i is file-order row
``perm[i]`` of a uniform random permutation of the N rows; a step's rows are split over
the ranks by position (every rank streams every row and keeps its share).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence

import numpy as np

from elastic_ddp.batching import split_evenly


@dataclass(frozen=True)
class RowGroup:
    """One Parquet row group, from the footers: ``file`` (index into the data set's file
    list), ``index`` (row group number in that file), ``num_rows``, ``nbytes`` (compressed
    bytes of the columns the task reads)."""

    file: int
    index: int
    num_rows: int
    nbytes: int = 0


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of row group ``index`` of file ``file``."""

    file: int
    index: int
    start: int
    stop: int

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Window:
    """Rows of one partition read and shuffled together.

    Attributes:
        partition: canonical partition p.
        first: offset of the window's first row in the partition's stream.
        pieces: the row-group slices it holds, concatenated in this order.
        num_rows: sum of the pieces' rows.
        key: seed of its row permutation ([seed, epoch, p, window index]).
    """

    partition: int
    first: int
    pieces: tuple[Piece, ...]
    num_rows: int
    key: tuple[int, ...]

    def permutation(self) -> np.ndarray:
        """int64 [num_rows]: stream offset ``first + t`` is row ``perm[t]`` of the
        concatenated pieces (identity for an unshuffled window)."""
        if not self.key:
            return np.arange(self.num_rows)
        return np.random.default_rng(list(self.key)).permutation(self.num_rows)


def owner(partition: int, partitions: int, world_size: int) -> int:
    """The rank that reads partition ``p``: ``p mod world_size``. Interleaved, so the
    consecutive global positions of a step (consecutive partitions) spread over the ranks:
    a step's shares differ by at most one row when the world size divides P, whatever the
    global batch; ranks own ``P // world_size`` or one more partition otherwise."""
    return partition % world_size


def offset_in_partition(partition: int, partitions: int, position: int) -> int:
    """How many of the first ``position`` global positions belong to ``partition`` under
    the round-robin interleave: ``position // P + (partition < position % P)``."""
    return position // partitions + (1 if partition < position % partitions else 0)


class EpochOrder:
    """The order of one epoch (see the module docstring).

    Args:
        row_groups: every row group of the split, in file order.
        seed, epoch: the job's seed and the epoch (0-based).
        partitions: P; 1 with ``mode="permutation"``.
        window_rows: W, rows shuffled together over all partitions (windowed).
        block_rows: split row groups into blocks of at most this many rows (windowed).
        mode: ``"windowed"`` or ``"permutation"``.

    Raises:
        ValueError: no rows, or partitions > rows.
    """

    def __init__(self, row_groups: Sequence[RowGroup], seed: int, epoch: int,
                 partitions: int = 1, window_rows: int = 65536,
                 block_rows: Optional[int] = None, mode: str = "windowed"):
        self.row_groups = list(row_groups)
        self.num_rows = sum(g.num_rows for g in self.row_groups)
        self.seed, self.epoch, self.mode = int(seed), int(epoch), mode
        self.partitions = 1 if mode == "permutation" else int(partitions)
        if self.num_rows == 0:
            raise ValueError("the data set has no rows")
        if self.partitions > self.num_rows:
            raise ValueError(f"data.partitions={self.partitions} exceeds the {self.num_rows} rows "
                             "of the data set; lower data.partitions")
        self.window_rows = max(1, math.ceil(window_rows / self.partitions))
        self.block_rows = block_rows
        self.sizes = split_evenly(self.num_rows, self.partitions)

    # -- windowed: partitions and windows ------------------------------------------------
    def units(self) -> list[Piece]:
        """Row groups (or blocks of them) in file order: what the epoch shuffles."""
        out = []
        for g in self.row_groups:
            step = self.block_rows or g.num_rows or 1
            for a in range(0, g.num_rows, step):
                out.append(Piece(g.file, g.index, a, min(g.num_rows, a + step)))
        return out

    @cached_property
    def _windows(self) -> list[list[Window]]:
        units = self.units()
        perm = np.random.default_rng([self.seed, self.epoch, 0xB10C]).permutation(len(units))
        stream = [units[i] for i in perm]
        parts: list[list[Piece]] = [[] for _ in range(self.partitions)]
        p, room = 0, self.sizes[0]
        for u in stream:  # cut the shuffled stream at the partition boundaries
            start = u.start
            while start < u.stop:
                take = min(room, u.stop - start)
                parts[p].append(Piece(u.file, u.index, start, start + take))
                start += take
                room -= take
                if room == 0 and p + 1 < self.partitions:
                    p += 1
                    room = self.sizes[p]
        out = []
        for p, pieces in enumerate(parts):
            windows, cur, n, first = [], [], 0, 0
            for piece in pieces:
                cur.append(piece)
                n += piece.num_rows
                if n >= self.window_rows:
                    windows.append(Window(p, first, tuple(cur), n,
                                          (self.seed, self.epoch, p, len(windows), 0x3A1D)))
                    first, cur, n = first + n, [], 0
            if cur:
                windows.append(Window(p, first, tuple(cur), n,
                                      (self.seed, self.epoch, p, len(windows), 0x3A1D)))
            out.append(windows)
        return out

    def windows(self, partition: int) -> list[Window]:
        """Partition ``p``'s windows, in stream order."""
        return self._windows[partition]

    def window_at(self, partition: int, offset: int) -> int:
        """Index of the window of ``partition`` holding stream offset ``offset``."""
        firsts = [w.first for w in self.windows(partition)]
        return max(0, bisect_right(firsts, offset) - 1)

    def owned(self, rank: int, world_size: int) -> list[int]:
        """Partitions rank ``rank`` reads (windowed)."""
        return [p for p in range(self.partitions) if owner(p, self.partitions, world_size) == rank]

    def rank_windows(self, rank: int, world_size: int, cursor: int) -> list[Window]:
        """The windows rank ``rank`` needs from global position ``cursor`` to the end of
        the epoch, in the order it first needs them (window (p, j) is first needed at
        position ``first * P + p``): the order its reader must deliver them in."""
        out = []
        for p in self.owned(rank, world_size):
            offset = offset_in_partition(p, self.partitions, cursor)
            if offset < self.sizes[p]:  # else the partition is used up: nothing to read
                out.extend(self.windows(p)[self.window_at(p, offset):])
        out.sort(key=lambda w: w.first * self.partitions + w.partition)
        return out

    # -- steps ---------------------------------------------------------------------------
    def segments(self, cursor: int, n_rows: int) -> list[tuple[int, int, int]]:
        """The rows of the step covering global positions ``[cursor, cursor + n_rows)`` as
        ``(partition, start, stop)`` stream offsets (windowed), one per partition that
        contributes, in partition order."""
        out = []
        for p in range(self.partitions):
            a = offset_in_partition(p, self.partitions, cursor)
            b = offset_in_partition(p, self.partitions, cursor + n_rows)
            if b > a:
                out.append((p, a, b))
        return out

    def rank_rows(self, cursor: int, n_rows: int, world_size: int,
                  rows_per_rank: Optional[Sequence[int]] = None) -> list[int]:
        """Rows each rank computes in the step ``[cursor, cursor + n_rows)``: by partition
        ownership (windowed), or by position (permutation: ``rows_per_rank`` for a full
        step, else an even split)."""
        if self.mode == "permutation":
            if rows_per_rank is not None and sum(rows_per_rank) == n_rows:
                return list(rows_per_rank)
            return split_evenly(n_rows, world_size)
        out = [0] * world_size
        for p, a, b in self.segments(cursor, n_rows):
            out[owner(p, self.partitions, world_size)] += b - a
        return out

    def shard_index(self, cursor: int, n_rows: int, shards: int) -> list[np.ndarray]:
        """Where each shard's rows lie in world size 1's batch of the step ``[cursor,
        cursor + n_rows)`` (``batching.shard_count``): shard s holds the rows rank s of
        world size ``shards`` computes, in the order that rank's reader delivers them.
        Returns ``shards`` int64 arrays of positions in the batch as ``take`` lays it out
        (windowed: partition by partition, so shard s is the segments of the partitions
        ``p % shards == s``; permutation: by position, so shard s is the s-th block of
        ``rank_rows(cursor, n_rows, shards)``)."""
        out: list[list[np.ndarray]] = [[] for _ in range(shards)]
        if self.mode == "permutation":
            start = 0
            for s, k in enumerate(self.rank_rows(cursor, n_rows, shards)):
                out[s].append(np.arange(start, start + k, dtype=np.int64))
                start += k
        else:
            start = 0
            for p, a, b in self.segments(cursor, n_rows):
                out[owner(p, self.partitions, shards)].append(np.arange(start, start + b - a, dtype=np.int64))
                start += b - a
        return [np.concatenate(parts) if parts else np.zeros(0, np.int64) for parts in out]

    # -- permutation -----------------------------------------------------------------------
    @cached_property
    def permutation(self) -> np.ndarray:
        """permutation mode: int64 [N], global position i -> file-order row index."""
        return np.random.default_rng([self.seed, self.epoch, 0x5EED]).permutation(self.num_rows)

    # -- reference (small data sets, tests) --------------------------------------------------
    def global_rows(self) -> list[tuple[int, int]]:
        """Every global position's row as (row group position in ``row_groups``, row in
        it), in global order. O(N): for tests and the plain-PyTorch replay only."""
        starts = np.cumsum([0] + [g.num_rows for g in self.row_groups])
        where = {(g.file, g.index): i for i, g in enumerate(self.row_groups)}
        if self.mode == "permutation":
            out = []
            for r in self.permutation:
                i = int(np.searchsorted(starts, r, side="right") - 1)
                out.append((i, int(r - starts[i])))
            return out
        streams = []
        for p in range(self.partitions):
            rows = []
            for w in self.windows(p):
                flat = [(where[(pc.file, pc.index)], r) for pc in w.pieces for r in range(pc.start, pc.stop)]
                rows.extend(flat[t] for t in w.permutation())
            streams.append(rows)
        return [streams[i % self.partitions][i // self.partitions] for i in range(self.num_rows)]
