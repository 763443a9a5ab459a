"""Observers of the step that a job in production does not need, hung at the step's two
fixed hook points (``Trainer.before_step``: called with the progress and the step's
``rank_loader.StepBatch`` after the data read; ``Trainer.after_step``: also with whether
the update was applied, once the step is committed, before the progress moves on)."""

from __future__ import annotations

from typing import Callable


class LedgerObserver:
    """The sample ledger (``Diagnostics.ledger_dir``: tests and experiments): the ids of
    each step, and its commit (``ledger.LedgerWriter``). ``extra``: the mode's fields of a
    line (``ft.ledger_extra``: the quorum in per-step mode)."""

    def __init__(self, ledger, extra: Callable[[], dict]):
        self.ledger, self.extra = ledger, extra

    def before(self, p, batch) -> None:
        self.ledger.record(p.epoch, p.step + 1, batch.ids, **self.extra())

    def after(self, p, batch, applied: bool) -> None:
        self.ledger.commit(p.epoch, p.step + 1, skipped=not applied, **self.extra())


def fault_observer(fault) -> Callable:
    """Fault injection (``Diagnostics.fault``, ``worker.faults.Fault``) before the step's
    compute: a rank kills itself or raises there."""

    def before(p, batch) -> None:
        fault.at_step(p.step + 1)

    return before
