"""The ledger's writer, on every rank: one JSON line of sample ids per step."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Optional

import numpy as np


class LedgerWriter:
    """Record of the sample ids each rank trained on, one JSON line per step, one file
    per (attempt, rank); audited by :func:`audit`. Off unless ``train(..., diagnostics=Diagnostics(ledger_dir=...))``
    is set (costs a JSON line of ids per step).

    The header's ``attempt`` id is drawn by rank 0 and broadcast (one small gloo/NCCL
    collective per attempt, only when the ledger is on), so the audit can group the
    ranks of one worker group without trusting clocks.
    """

    def __init__(self, directory: Optional[str], rank: int, resumed_from: Optional[int], ws: int,
                 mode: str = "restart"):
        self._f = None
        self._pending: Optional[dict] = None
        if directory:
            import torch.distributed as dist

            attempt = [uuid.uuid4().hex[:12]]
            if dist.is_available() and dist.is_initialized() and ws > 1:
                dist.broadcast_object_list(attempt, src=0)
            Path(directory).mkdir(parents=True, exist_ok=True)
            name = f"attempt-{time.time_ns()}-{attempt[0]}-rank{rank}.jsonl"
            self._f = open(Path(directory) / name, "w")
            self._f.write(json.dumps({"header": True, "attempt": attempt[0], "rank": rank,
                                      "world_size": ws, "resumed_from": resumed_from or 0,
                                      "mode": mode,
                                      "t": time.time()}) + "\n")
            self._f.flush()

    @property
    def enabled(self) -> bool:
        """Whether this job writes a ledger (``Diagnostics.ledger_dir``)."""
        return self._f is not None

    def record(self, epoch: int, step: int, ids: np.ndarray, **extra) -> None:
        """The ids this rank computed for ``step``. With ``extra`` (per-step fault
        tolerance: ``quorum``, ``n``) the line is written at once, before the step's
        all-reduce, and ``commit`` adds a commit line; otherwise it is written by
        ``commit``, with the skip flag."""
        if not self._f:
            return
        rec = {"epoch": epoch, "step": step, "ids": ids.tolist(), **extra}
        if extra:
            self._write(rec)
        else:
            self._pending = rec

    def commit(self, epoch: int, step: int, skipped: bool = False, **extra) -> None:
        """``step`` was applied (``skipped``: its update was dropped for a non-finite
        gradient; its samples were consumed, not learned from)."""
        if not self._f:
            return
        if extra:
            self._write({"commit": step, "epoch": epoch, "t": time.time(), **extra,
                         **({"skipped": True} if skipped else {})})
            return
        rec = self._pending or {"epoch": epoch, "step": step, "ids": []}
        rec["t"] = round(time.time(), 3)  # when the step ended: gaps and recovery times
        if skipped:
            rec["skipped"] = True
        self._write(rec)
        self._pending = None

    def _write(self, rec: dict) -> None:
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f:
            self._f.close()
