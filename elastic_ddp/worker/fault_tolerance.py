"""The Trainer's fault-tolerance component, one per ``scaling.fault_tolerance`` mode.

The ``Trainer`` holds one fault-tolerance component and calls it at fixed points of the
run (``build``): ``RestartFaultTolerance`` in ``restart`` mode (the plain DDP step; Ray
Train restarts the group on a failure), ``PerStepFaultTolerance`` in ``per_step`` mode
(``worker.per_step``: torchft, imported only there: ``pip install 'elastic-ddp[ft]'``). Both have the same
interface: ``begin_step``, ``loss_weight``, ``sync_gradients``, ``ledger_extra``,
``may_report``, ``write_unreported``, ``state_dict``/``load_state_dict``, ``fit`` and ``roles``
(``elastic_ddp.worker.roles``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from elastic_ddp.worker.roles import RestartRoles


def build(trainer):
    """The fault-tolerance component of ``trainer``'s mode (``scaling.fault_tolerance``).
    Built before the trainer's strategy (its ``comm_size`` sizes the strategy); it reads
    the trainer's model and state only when called."""
    if trainer.cfg.scaling.fault_tolerance == "per_step":
        from elastic_ddp.worker.per_step import PerStepFaultTolerance

        return PerStepFaultTolerance(trainer)
    return RestartFaultTolerance(trainer)


class RestartFaultTolerance:
    """``restart`` mode: every worker in one torch.distributed group (DDP); a failure
    restarts the group from the last checkpoint (Ray Train). The step is plain DDP."""

    ledger_mode = "restart"
    #: Whether ``sync_gradients`` also sums the metric window's row sums: no, the window
    #: reduces itself over the group on log steps (StepWindow.reduce).
    sums_in_step = False
    #: The driver's stop is agreed by the notice listener (``worker.notice``), not here.
    stop_agreed = False

    def __init__(self, trainer):
        self.t = trainer
        self.comm_size = trainer.world_size  # ranks of the strategy's process group
        self.roles = RestartRoles(trainer.rank, trainer.world_size)

    def begin_step(self) -> tuple[Optional[int], int]:
        """This step's data view: (this rank's index, ranks sharing the step)."""
        return self.t.rank, self.t.world_size

    def loss_weight(self, n: int) -> float:
        """Per-sample loss weight of a step of ``n`` rows: ``1 / n`` with DDP's SUM
        all-reduce (the same weight at every world size), ``world_size / n`` where the
        strategy's reduction averages (``Strategy.grad_divisor``): the mean over the
        step's rows either way."""
        return self.t.strategy.grad_divisor / n

    def sync_gradients(self, probe: bool, sums: Optional[dict] = None) -> tuple[bool, Optional[dict]]:
        """After the backward passes: the probe step's explicit all-reduce (DDP did the
        others inside backward). Returns (whether the step may be applied, None)."""
        if probe:
            w = self.t.window
            clock = w.clock(self.t.device)
            t = clock.start()
            self.t.strategy.allreduce_gradients()
            clock.stop("allreduce_probe", t)
            w.probes += 1
        return True, None

    def ledger_extra(self) -> dict:
        return {}

    def may_report(self) -> bool:
        """Whether ``ray.train.report`` (a barrier over every world rank) may be called."""
        return True

    def write_unreported(self) -> None:
        """Never called: every checkpoint is reported (``may_report``)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def fit(self, loop: Callable[[], None]) -> None:
        loop()
