"""The Trainer's fault-tolerance component, one per ``scaling.fault_tolerance`` mode.

The ``Trainer`` holds one fault-tolerance component and calls it at fixed points of the
run (``build``): ``RestartFaultTolerance`` in ``restart`` mode (the plain DDP step; Ray
Train restarts the group on a failure), ``PerStepFaultTolerance`` in ``per_step`` mode
(``worker.per_step``: torchft, imported only there: ``pip install 'elastic-ddp[ft]'``). Both have the same
interface: ``begin_step``, ``loss_weight``, ``sync_gradients``, ``stop_due``,
``leaving_alone``, ``ledger_extra``, ``may_report``, ``state_dict``/``load_state_dict``,
``fit`` and ``roles`` (``elastic_ddp.worker.roles``). Each gets what it uses at
construction (``build``), not the trainer.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from elastic_ddp.worker.roles import RestartRoles


def comm_size(cfg, world_size: int) -> int:
    """Ranks of the torch.distributed group the strategy and the metric reductions use:
    every worker (``restart`` mode), or this replica alone (``per_step``). Known before
    the strategy is built, which it sizes."""
    return 1 if cfg.scaling.fault_tolerance == "per_step" else world_size


def build(job, rank: int, world_size: int, device, strategy, window: Callable[[], Any],
          state_dict: Callable[[], dict], load_state_dict: Callable[[dict], None],
          log: Callable[[str], None]):
    """The fault-tolerance component of the job's mode (``scaling.fault_tolerance``).

    Args:
        job: the ``JobSpec`` (its config, storage and notice support).
        rank, world_size: this worker among the job's; ``device``: its device.
        strategy: the rank's ``parallel.strategies`` strategy (gradients, reductions).
        window: the trainer's current ``metrics.StepWindow`` (the probe's time).
        state_dict, load_state_dict: the live state a healing replica receives from a
            peer and takes (per-step mode; ``Trainer.state_dict``/``adopt_live_state``).
        log: a line in the lead's log.
    """
    if job.config.scaling.fault_tolerance == "per_step":
        from elastic_ddp.worker.per_step import PerStepFaultTolerance

        return PerStepFaultTolerance(job, rank, world_size, device, strategy, state_dict,
                                     load_state_dict, log)
    return RestartFaultTolerance(rank, world_size, device, strategy, window)


class RestartFaultTolerance:
    """``restart`` mode: every worker in one torch.distributed group (DDP); a failure
    restarts the group from the last checkpoint (Ray Train). The step is plain DDP."""

    ledger_mode = "restart"
    #: Whether ``sync_gradients`` also sums the metric window's row sums: no, the window
    #: reduces itself over the group on log steps (StepWindow.reduce).
    sums_in_step = False
    #: The driver's stop is agreed by the notice listener (``worker.notice``), not here.
    stop_agreed = False
    #: Never a last step alone (per-step mode's leave).
    leaving_alone = False

    def __init__(self, rank: int, world_size: int, device, strategy, window: Callable[[], Any]):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.strategy, self.window = strategy, window
        self.comm_size = world_size  # ranks of the strategy's process group
        self.roles = RestartRoles(rank, world_size)

    def begin_step(self, step: int = 0) -> tuple[Optional[int], int]:
        """This step's data view: (this rank's index, ranks sharing the step)."""
        return self.rank, self.world_size

    def loss_weight(self, n: int) -> float:
        """Per-sample loss weight of a step of ``n`` rows: ``1 / n`` with DDP's SUM
        all-reduce (the same weight at every world size), ``world_size / n`` where the
        strategy's reduction averages (``Strategy.grad_divisor``): the mean over the
        step's rows either way."""
        return self.strategy.grad_divisor / n

    def sync_gradients(self, probe: bool, sums: Optional[dict] = None) -> tuple[bool, Optional[dict]]:
        """After the backward passes: the probe step's explicit all-reduce (DDP did the
        others inside backward). Returns (whether the step may be applied, None)."""
        if probe:
            w = self.window()
            clock = w.clock(self.device)
            t = clock.start()
            self.strategy.allreduce_gradients()
            clock.stop("allreduce_probe", t)
            w.probes += 1
        return True, None

    def stop_due(self, step: int) -> None:
        """Never: the driver's stop comes as a notice (``worker.notice``)."""
        return None

    def ledger_extra(self) -> dict:
        return {}

    def may_report(self) -> bool:
        """Whether ``ray.train.report`` (a barrier over every world rank) may be called."""
        return True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def fit(self, loop: Callable[[], None], fresh: bool = True, done=None, warm=None) -> None:
        loop()
