"""This rank's readers of the training split, per data view: ``(epoch, index, n)``, this
rank's ``index`` among the ``n`` ranks sharing a step (the world size in ``restart`` mode;
the step's quorum in ``per_step`` mode, where the view changes with the quorum).

    loader = RankLoader(job, cfg, plan, world_size)       # by the Trainer
    loader.ensure(progress, index, n)                     # before each step's read
    rows = loader.rank_rows(cursor, g, n)                 # every rank's share of the step
    batch = loader.take(cursor, g)                        # this rank's rows of it
"""

from __future__ import annotations

import time
from typing import Optional

from elastic_ddp.data.ingest import LOCAL_FIRST_ROUND_BYTES
from elastic_ddp.data.readers import open_train_reader
from elastic_ddp.run_state import Progress

# Readers of other data views of the epoch a rank keeps (RankLoader.ensure): its
# full-quorum view and the view of a quorum one replica short.
KEPT_VIEWS = 2


class RankLoader:
    """See the module docstring. ``order``/``reader``: the current view's epoch order and
    reader (None before the first ``ensure``); ``next_row``: the position its next read
    starts at."""

    def __init__(self, job, cfg, plan, world_size: int):
        self.job, self.task, self.cfg, self.plan, self.world_size = job, job.task, cfg, plan, world_size
        self.n_train = job.train.num_rows
        self.order = self.reader = None
        self._key: Optional[tuple] = None
        self.next_row = -1
        self._views: dict[tuple, tuple] = {}  # other views' readers (ensure)

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
