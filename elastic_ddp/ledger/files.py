"""Reading a ledger directory: its attempts (one per worker group) and the steps each rank
recorded (the file format is in :mod:`elastic_ddp.ledger`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np

from elastic_ddp.errors import ElasticDDPError


class LedgerError(ElasticDDPError, RuntimeError):
    """A ledger directory that cannot be audited: missing, empty, or a malformed file."""


@dataclass
class Attempt:
    """One worker group's run: its ranks' step lines.

    Attributes:
        key: the shared attempt id (or a file-derived key for ledgers without one).
        t: start time, seconds since the epoch (min over ranks' headers).
        world_size: ranks in this attempt.
        resumed_from: the checkpoint step it resumed from (0: a fresh start).
        steps: rank -> list of (epoch, step, ids as an int64 array [k]).
        skipped: rank -> the steps that rank recorded as skipped.
    """

    key: str
    t: float
    world_size: int
    resumed_from: int
    steps: dict[int, list[tuple[int, int, np.ndarray]]] = field(default_factory=dict)
    skipped: dict[int, set[int]] = field(default_factory=dict)


def read_attempts(ledger_dir: str | Path) -> list[Attempt]:
    """Every attempt in ``ledger_dir``, ordered by start time.

    A torn last line (a rank SIGKILLed mid-write) is skipped: the step it belonged to
    never reached a checkpoint either.

    Raises:
        LedgerError: the directory is missing or has no ledger files, or a header is
            missing or inconsistent across the ranks of one attempt.
    """
    d = Path(ledger_dir)
    files = sorted(d.glob("attempt-*-rank*.jsonl")) if d.is_dir() else []
    if not files:
        raise LedgerError(f"{d}: no attempt-*-rank*.jsonl ledger files; run train(cfg, "
                          "diagnostics=Diagnostics(ledger_dir=...)) to write them")
    attempts: dict[str, Attempt] = {}
    for f in files:
        lines = f.read_text().splitlines()
        try:
            head = json.loads(lines[0]) if lines else {}
        except json.JSONDecodeError:
            head = {}
        if not head.get("header"):
            raise LedgerError(f"{f}: first line is not a ledger header")
        # Ledgers written before the shared attempt id existed: one attempt per file
        # stem minus the rank (only correct for world_size 1).
        key = str(head.get("attempt") or f.name.rsplit("-rank", 1)[0])
        a = attempts.get(key)
        if a is None:
            a = attempts[key] = Attempt(key, float(head["t"]), int(head["world_size"]),
                                        int(head["resumed_from"]))
        elif (a.world_size, a.resumed_from) != (int(head["world_size"]), int(head["resumed_from"])):
            raise LedgerError(f"{f}: header disagrees with another rank of attempt {key}: "
                              f"world_size/resumed_from {head['world_size']}/{head['resumed_from']} "
                              f"vs {a.world_size}/{a.resumed_from}")
        a.t = min(a.t, float(head["t"]))
        rows: list[tuple[int, int, np.ndarray]] = []
        skipped: set[int] = set()
        for rec in _records(lines[1:]):
            if "commit" in rec:
                continue  # per-step ledgers: audit_per_step reads these
            rows.append((int(rec["epoch"]), int(rec["step"]), np.asarray(rec["ids"], np.int64)))
            if rec.get("skipped"):
                skipped.add(int(rec["step"]))
        a.steps[int(head["rank"])] = rows
        a.skipped[int(head["rank"])] = skipped
    return sorted(attempts.values(), key=lambda a: a.t)


def _records(lines: Iterable[str]) -> Iterator[dict]:
    """The JSON records of a ledger file's lines after the header; a torn line (the last
    write of a killed rank) is skipped."""
    for ln in lines:
        try:
            yield json.loads(ln)
        except json.JSONDecodeError:
            continue


def _mode(ledger_dir: str | Path) -> str:
    for f in sorted(Path(ledger_dir).glob("attempt-*-rank*.jsonl"))[:1]:
        with open(f) as fh:
            try:
                return json.loads(fh.readline()).get("mode", "restart")
            except json.JSONDecodeError:
                return "restart"
    return "restart"


def recomputed_after(attempts: list[Attempt], t: float) -> Optional[dict]:
    """For an event at time ``t`` (seconds since the epoch): the attempt that was running
    then, the last step it reached, the step the next attempt resumed from, and the
    steps recomputed (reached - resumed). None when no attempt started before ``t`` or
    none followed it. ``attempt`` is that attempt's index: two events that find the same
    one (a restart whose new group failed to start) must count its steps once.

    Exact, unlike the driver's MLflow-based estimate, which only sees steps flushed at
    ``train.log_every_steps``.
    """
    before = [i for i, a in enumerate(attempts) if a.t <= t]
    if not before or before[-1] + 1 >= len(attempts):
        return None
    a, nxt = attempts[before[-1]], attempts[before[-1] + 1]
    reached = max((s for rows in a.steps.values() for _, s, _ in rows), default=a.resumed_from)
    return {"attempt": before[-1], "reached_step": reached, "resumed_from": nxt.resumed_from,
            "steps_recomputed": max(0, reached - nxt.resumed_from)}
