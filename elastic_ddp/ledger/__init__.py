"""Audit of the sample ledger: which sample ids each committed step trained on, per epoch.

    from elastic_ddp.ledger import audit, format_audit
    report = audit("runs/ledger", all_ids=train_info.sample_ids, epochs=15)
    print(format_audit(report))

:class:`LedgerWriter` (``train(cfg, diagnostics=Diagnostics(ledger_dir=...))``) writes one file per
(attempt, rank), ``attempt-<t_ns>-<hex>-rank<r>.jsonl``: a header line
``{"header": true, "attempt", "rank", "world_size", "resumed_from", "t"}`` (``attempt`` is
an id shared by the ranks of one worker group, ``t`` the wall-clock start in seconds),
then one line per optimizer step ``{"epoch", "step", "ids"}`` with the ids this rank
computed in that step (``step`` counts from 1 over the whole run), plus ``"skipped":
true`` when the step's update was dropped on every rank (a non-finite gradient).

Commit rule (the checkpoint is the only committed progress): a step of an attempt is
COMMITTED iff ``step <= resumed_from`` of the NEXT attempt (attempts ordered by start
time); every step of the last attempt is committed, because a job that finishes ends with
a checkpoint. Steps past the next attempt's resume point were recomputed after the
restart; counting them would double-count.

What "loses nothing" means here, per epoch: every id of the data set appears in exactly
one committed step (``lost == 0`` and ``repeated == 0``), and inside every attempt all
ranks ran the same number of steps (else a collective would have hung). A skipped step's
samples were consumed (they are not lost, the epoch moved past them) but not learned from:
the audit counts them apart, as ``skipped``, and checks that every rank skipped the same
steps (the decision must be one for all ranks).
"""

from elastic_ddp.ledger.audit import audit, audit_per_step, format_audit
from elastic_ddp.ledger.files import Attempt, LedgerError, read_attempts, recomputed_after
from elastic_ddp.ledger.writer import LedgerWriter

__all__ = ["Attempt", "LedgerError", "LedgerWriter", "audit", "audit_per_step", "format_audit",
           "read_attempts", "recomputed_after"]
