"""What a rank tells the tracker about its attempt and its steps: the attempt's start
marks and tags, its first step, and the step window's metrics on step 1 and every
``train.log_every_steps`` (``Trainer.fit``, ``Trainer.maybe_log``)."""

from __future__ import annotations

import time
from typing import Callable


class StepReporter:
    """See the module docstring.

    Args:
        cfg: the job's config (``train.log_every_steps``).
        total_steps: the run's steps (``batching.RunLength.total_steps``, the log line's).
        tracker: the rank's tracker client.
        roles: the mode's roles (``lead``, ``records_start``, ``records_attempt``).
        rank, world_size: this worker among the job's; ``device``: its device.
        comm_size: ranks of the group the window reduces over (``fault_tolerance.comm_size``).
        per_step: ``per_step`` mode (every replica's start is an attempt of its own).
        log: a line in the lead's log.
    """

    def __init__(self, cfg, total_steps: int, tracker, roles, rank: int, world_size: int, device,
                 comm_size: int, per_step: bool, log: Callable[[str], None]):
        self.every, self.total_steps = cfg.train.log_every_steps, total_steps
        self.tracker, self.roles, self.log = tracker, roles, log
        self.rank, self.world_size, self.device, self.comm_size = rank, world_size, device, comm_size
        # Per-step mode: every replica's start is an attempt of its own, named by its rank
        # (a replacement joins the live quorum, or restarts the run from storage).
        self.mine = {"rank": rank} if per_step else {}
        self._first = False

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.every == 0

    def started(self, enter: float, marks: dict, step: int, checkpoint, counters) -> None:
        """The attempt is ready to train at ``step`` (restored from ``checkpoint``, None:
        a fresh start): its marks (``enter``: the train function's entry, ``marks``: the
        finer ones, seconds since the epoch) and its tags."""
        self._first = self.roles.records_attempt
        if self.roles.records_attempt:
            self.tracker.attempt(enter=enter, ready=time.time(), world_size=self.world_size,
                                 resumed_from=step, checkpoint=checkpoint,
                                 committed_s=counters.committed_train_s, **self.mine, **marks)
        if self.roles.records_start:
            import torch.distributed as dist

            self.tracker.set_tags({"elastic_ddp.world_size": self.world_size,
                                   "elastic_ddp.restarts": counters.restarts,
                                   # gloo or nccl: what this attempt's collectives ran on.
                                   "elastic_ddp.backend": dist.get_backend() if dist.is_initialized() else "none",
                                   "elastic_ddp.device": str(self.device)})

    def stepped(self, step: int) -> None:
        """A committed step: the attempt's first one is marked."""
        if self._first:
            self.tracker.attempt(first_step=time.time(), step=step, **self.mine)
            self._first = False

    def log_window(self, window, step: int, epoch: int) -> None:
        """Reduce ``window`` across ranks (two small collectives; per-step mode: the row
        sums came summed over the step's quorum with its gradients, the timings are the
        lead's own) and the lead sends it to the tracker (``epoch``: 0-based)."""
        m = window.reduce(self.comm_size, self.device)
        if not self.roles.lead:
            return
        # epoch 1-based, as every line a person reads counts it (progress, logs, summary).
        m.update(step=step, epoch=epoch + 1, world_size=self.world_size)
        self.tracker.log_metrics(m, step)
        loss = f"{m['train_loss']:.4f}" if "train_loss" in m else "- (steps skipped)"
        self.log(f"epoch {epoch + 1} step {step}/{self.total_steps} loss {loss} "
                 f"lr {m['lr']:.2e} {m['samples_per_s']:.0f} samples/s")
