"""The optimizer's side of a step (``Trainer.train_step``): the learning rate, then the
clip and the optimizer step, or the skip of a step whose gradient is not finite on any
rank (every rank sees the same norm after the all-reduce, so every rank skips it), with
the rows that made it named (``tracking.nonfinite``)."""

from __future__ import annotations

import math
import sys
from typing import Callable

from elastic_ddp.batching import lr_at
from elastic_ddp.data.scan import locate_ids
from elastic_ddp.run_state import NonFiniteError
from elastic_ddp.tracking.nonfinite import row_report
from elastic_ddp.worker.micro_steps import MicroResult, restore_bn


class Update:
    """See the module docstring.

    Args:
        strategy: the rank's strategy (``optimizer``, ``clip_grad_norm``).
        cfg: the job's config (``optim``, ``train.max_nonfinite_steps``).
        run: the job's ``batching.RunLength`` (the LR schedule).
        counters: the trainer's ``run_state.Counters`` (skipped steps and samples).
        device: this rank's device (the optimizer's time).
        rank, world_size: this worker among the job's (the skip's lines).
        train: the training split (``JobSpec.train``: its id column, its files).
        roles: the mode's roles (``lead`` logs and sends the counts).
        log: a line in the lead's log.
        tracker: the lead's tracker client; ``row_reports``: every rank's (the rows).
    """

    def __init__(self, strategy, cfg, run, counters, device, rank: int, world_size: int, train,
                 roles, log: Callable[[str], None], tracker, row_reports):
        self.strategy, self.cfg, self.run, self.counters, self.device = strategy, cfg, run, counters, device
        self.rank, self.world_size, self.train, self.roles = rank, world_size, train, roles
        self.log, self.tracker, self.row_reports = log, tracker, row_reports
        self.nonfinite_run = 0  # consecutive skipped steps

    def set_lr(self, samples_seen: int) -> float:
        """The schedule's learning rate after ``samples_seen`` samples, set on the optimizer."""
        c, o = self.run, self.cfg.optim
        lr = lr_at(samples_seen, c.schedule_samples, c.peak_lr, c.warmup_samples, o.min_lr_ratio)
        for g in self.strategy.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def drop(self, micro: MicroResult) -> None:
        """A step its quorum did not commit: its gradient and BatchNorm statistics go."""
        self.strategy.optimizer.zero_grad(set_to_none=True)
        if micro.bn_saved is not None:
            restore_bn(micro.bn_saved)

    def apply(self, micro: MicroResult, n: int, step: int, epoch: int, w) -> bool:
        """Clip and step the optimizer, adding the micro-batches' sums to the window
        ``w``; or skip step ``step`` (1-based, of ``n`` rows, in 0-based ``epoch``) whose
        gradient is not finite. Returns whether it was applied.

        Raises:
            NonFiniteError: ``train.max_nonfinite_steps`` steps in a row were skipped."""
        s, clock = self.strategy, w.clock(self.device)
        t = clock.start()
        finite = math.isfinite(s.clip_grad_norm(self.cfg.optim.grad_clip))
        if finite:
            s.optimizer.step()
            for loss_sum, metric_sums, count in micro.sums:
                w.add_rows(loss_sum, metric_sums, count)
            self.nonfinite_run = 0
        else:
            self._skip(micro, n, step, epoch)
        s.optimizer.zero_grad(set_to_none=True)
        clock.stop("opt", t)
        return finite

    def _skip(self, micro: MicroResult, n: int, step: int, epoch: int) -> None:
        if micro.bn_saved is not None:  # the forward's batch statistics saw the non-finite rows
            restore_bn(micro.bn_saved)
        c = self.counters
        c.skipped_steps += 1
        c.skipped_samples += n
        self.nonfinite_run += 1
        rows = self.describe_rows(micro.nonfinite_ids)
        line = (f"step {step}: non-finite gradient, step skipped on every rank "
                f"({self.nonfinite_run} in a row); {rows}")
        if micro.nonfinite_ids and not self.roles.lead:  # the rank that holds the rows says so
            sys.stdout.write(f"[rank {self.rank}/{self.world_size}] {line}\n")
            sys.stdout.flush()
        self.log(line)
        if micro.nonfinite_ids:  # the console's warning and the run's record of the rows
            self.row_reports.nonfinite_rows(row_report(
                step, epoch + 1, self.rank, n, self.train.id_column, micro.nonfinite_ids,
                micro.nonfinite_losses, locate_ids(self.train, micro.nonfinite_ids)))
        if self.roles.lead:
            self.tracker.log_metrics({"skipped_steps": c.skipped_steps,
                                      "skipped_samples": c.skipped_samples}, step)
        if self.nonfinite_run >= self.cfg.train.max_nonfinite_steps:
            raise NonFiniteError(
                f"{self.nonfinite_run} consecutive steps had a non-finite loss or gradient (up to "
                f"step {step}; {rows}): look for NaN/inf in the data (nulls "
                "inside list columns read as NaN) or lower optim.lr; train.max_nonfinite_steps sets "
                "the limit")

    def describe_rows(self, ids: list) -> str:
        """Which of this rank's rows of the step had a non-finite per-sample loss (``ids``),
        by the id column (at most 8 named), or that none had: the gradient itself overflowed."""
        if not ids:
            return f"rank {self.rank}'s rows all had a finite loss"
        more = f" and {len(ids) - 8} more" if len(ids) > 8 else ""
        return (f"rank {self.rank}'s rows with a non-finite loss: {self.train.id_column} "
                f"{', '.join(map(str, ids[:8]))}{more}")
