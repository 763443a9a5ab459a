"""This rank's readers of the training split, per data view: ``(epoch, index, n)``, this
rank's ``index`` among the ``n`` ranks sharing a step (the world size in ``restart`` mode;
the step's quorum in ``per_step`` mode, where the view changes with the quorum).

    loader = RankLoader(job, cfg, plan, world_size, device, mark)   # by the Trainer
    batch = loader.next_batch(progress, index, n, window)           # one step's StepBatch
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from elastic_ddp.batching import step_rows
from elastic_ddp.data.ingest import LOCAL_FIRST_ROUND_BYTES
from elastic_ddp.data.readers import open_train_reader
from elastic_ddp.run_state import Progress


@dataclass(frozen=True)
class StepBatch:
    """One optimizer step's data on this rank.

    Attributes:
        n: the step's global rows (``G``, fewer at an epoch's end).
        rows: every sharing rank's row count in the step (``rows[r]``: rank ``r``'s).
        rank: this rank's index among them.
        columns: this rank's rows, column name -> array (``[rows[rank]]`` each; a
            healing replica's: empty).
        ids: the id column of ``columns`` (``[rows[rank]]``).
        shard_rows: world size 1 with shards: each shard's positions in ``columns``
            (``EpochOrder.shard_index``); None otherwise.
    """

    n: int
    rows: list[int]
    rank: int
    columns: dict
    ids: np.ndarray
    shard_rows: Optional[list[np.ndarray]] = None

# Readers of other data views of the epoch a rank keeps (RankLoader.ensure): its
# full-quorum view and the view of a quorum one replica short.
KEPT_VIEWS = 2


class RankLoader:
    """See the module docstring. ``order``/``reader``: the current view's epoch order and
    reader (None before the first ``ensure``); ``next_row``: the position its next read
    starts at."""

    def __init__(self, job, cfg, plan, world_size: int, device=None,
                 mark: Optional[Callable[[str, int], None]] = None):
        self.job, self.task, self.cfg, self.plan, self.world_size = job, job.task, cfg, plan, world_size
        self.n_train = job.train.num_rows
        self.device = device
        # Where this rank is (Trainer.at: the position record): "data read", "training step".
        self.mark = mark or (lambda phase, step: None)
        self.order = self.reader = None
        self._key: Optional[tuple] = None
        self.next_row = -1
        self._views: dict[tuple, tuple] = {}  # other views' readers (ensure)

    def next_batch(self, p: Progress, rank: Optional[int], ws: int, window) -> StepBatch:
        """The step at ``p`` (its cursor, step and epoch): this rank's rows as rank
        ``rank`` of ``ws`` (None: a replica healing this step computes nothing, its
        share is empty), the position marks around the read, and the next epoch's
        reader started where its time has come (:meth:`prefetch_next`). ``window``:
        the ``metrics.StepWindow`` the read's time goes to (``data``)."""
        n = step_rows(self.n_train, p.cursor, self.plan.global_batch_size)
        clock = window.clock(self.device)
        t = clock.start()
        if rank is not None:
            window.data_s += self.ensure(p, rank, ws)
            rows = self.rank_rows(p.cursor, n, ws)
            self.mark("data read", p.step + 1)
            columns = self.take(p.cursor, n)
            self.mark("training step", p.step + 1)
            self.prefetch_next(p, rank, ws)
        else:
            rows, rank = [0] + [n], 0
            columns = {k: v[:0] for k, v in self.job.sample["train"].items()}
        clock.stop("data", t)
        shards = self.plan.shards
        shard_rows = (self.order.shard_index(p.cursor, n, shards)
                      if len(rows) == 1 and shards > 1 and n > 0 else None)
        return StepBatch(n, rows, rank, columns, np.asarray(columns[self.job.train.id_column]),
                         shard_rows)

    def warm(self, p: Progress, rank: int, ws: int) -> float:
        """Open this rank's reader of view ``(rank, ws)`` at ``p`` and read its first round
        now (``Reader.warm``). Returns the seconds spent opening it."""
        s = self.ensure(p, rank, ws)
        self.reader.warm()
        return s

    def rank_rows(self, cursor: int, n: int, ws: int) -> list[int]:
        """Rows of each of the ``ws`` ranks in the step of ``n`` rows at ``cursor``."""
        return self.order.rank_rows(cursor, n, ws, list(self.plan.rows_per_rank)
                                    if ws == self.world_size else None)

    def take(self, cursor: int, n: int) -> dict:
        """This rank's rows of the step of ``n`` rows at ``cursor`` (the current view)."""
        batch = self.reader.take(cursor, n)
        self.next_row = cursor + n
        return batch

    def ensure(self, p: Progress, rank: int, ws: int) -> float:
        """This rank's reader for the epoch, (re)opened when the epoch, the data view or
        the expected position changed. Readers of other views of the epoch are kept (at
        most ``KEPT_VIEWS``): per-step fault tolerance switches views when the quorum
        shrinks and back when the replacement joins, and a kept windowed reader serves
        any later cursor of its view. A new view's reader takes the windows the kept
        ones hold and reads only the rest (a survivor taking over a dead replica's
        partitions reads those alone). Costs the kept views' windows in memory while the
        quorum is short. ``p``: the trainer's progress. Returns the seconds spent opening a
        reader (0.0 when one was kept)."""
        key = (p.epoch, rank, ws)
        windowed = self.cfg.data.order == "windowed"

        def usable(at: int) -> bool:
            return at == p.cursor or (windowed and 0 <= at <= p.cursor)

        if self.reader is not None and self._key == key and usable(self.next_row):
            self.next_row = p.cursor
            return 0.0
        if self.reader is not None and self._key != key and self._key[0] == p.epoch:
            self._views.pop(self._key, None)  # re-inserted last: the newest
            self._views[self._key] = (self.order, self.reader, self.next_row)
        # This epoch's views, and the next epoch's reader already reading (prefetch_next).
        self._views = {k: v for k, v in self._views.items() if k[0] >= p.epoch}
        kept = self._views.pop(key, None)
        now = [k for k in self._views if k[0] == p.epoch]  # oldest first
        while len(now) > KEPT_VIEWS:
            self._views.pop(now.pop(0))
        if kept is not None and usable(kept[2]):
            self.order, self.reader, _ = kept
            self._key, self.next_row = key, p.cursor
            return 0.0
        # A view change within the epoch: the windows the other views' readers hold.
        others = [r for k, (_, r, _) in self._views.items() if k[0] == p.epoch]
        held = {w: a for r in others for w, a in r.held_windows().items()} if windowed and others else None
        t = time.perf_counter()
        self.order, self.reader = self._open(rank, ws, p.epoch, p.cursor, held)
        self._key, self.next_row = key, p.cursor
        return time.perf_counter() - t

    def prefetch_next(self, p: Progress, rank: int, ws: int) -> None:
        """Once this epoch's reader has started its last round, open this view's reader of
        the next epoch and start reading its first round in the background: the next
        epoch's first step then finds its windows (the first round otherwise stalls
        every rank at each epoch start). Windowed order, and only when the run goes on
        into that epoch. Costs one more window per owned partition in memory over the
        epoch's last round."""
        c = self.cfg.train
        key = (p.epoch + 1, rank, ws)
        if (self.cfg.data.order != "windowed" or key in self._views or p.epoch + 1 >= c.epochs
                or not getattr(self.reader, "last_round_started", False)):
            return
        left = -(-(self.n_train - p.cursor) // self.plan.global_batch_size)
        if c.max_steps is not None and p.step + left >= c.max_steps:
            return
        order, reader = self._open(rank, ws, p.epoch + 1, 0)
        reader.prefetch()
        self._views[key] = (order, reader, 0)

    def _open(self, rank: int, ws: int, epoch: int, cursor: int, held: Optional[dict] = None):
        """(order, reader) of view (rank, ws) of ``epoch`` from ``cursor``."""
        return open_train_reader(
            self.job.train, self.task, self.cfg, rank, ws, epoch, cursor,
            self.plan.global_batch_size,
            list(self.plan.rows_per_rank) if ws == self.world_size else None,
            template=self.job.sample["train"], held=held, local_first_bytes=LOCAL_FIRST_ROUND_BYTES)
