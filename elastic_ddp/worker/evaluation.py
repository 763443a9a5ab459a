"""Validation: the task's per-sample metrics over the whole val split (or its first
``train.eval_max_batches`` batches), exact means however the rows are split over ranks.
Used by ``Trainer.evaluate``."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from elastic_ddp.data.ingest import val_batches


class Evaluator:
    """Validation of one rank (:meth:`run`).

    Args:
        job: the ``JobSpec`` (``val``: the split, None without one; ``sample["val"]``).
        strategy: the rank's strategy (``model``, ``distributed``, ``collective_forward``).
        device: this rank's device (the all-reduce's tensor).
        to_device: a collated batch onto the device (``tasks.protocol.model_inputs``).
    """

    def __init__(self, job, strategy, device, to_device: Callable[[dict], dict]):
        self.job, self.task, self.cfg = job, job.task, job.config
        self.strategy, self.device, self.to_device = strategy, device, to_device
        self.names: Optional[list[str]] = None  # the task's metric names (the first run)

    @torch.no_grad()
    def run(self, epoch: int, rank: int, world_size: int) -> dict[str, float]:
        """Validation metrics over the whole val split (``val_<name>``, exact means over
        its rows whatever the split across ranks; a batch holds the same rows at every
        world size, ``ingest.val_share``) in epoch ``epoch``'s order. Every rank of the
        ``world_size`` sharing it (``rank``: this one's index; ``0``/``1``: this process
        alone) runs the same number of batches and the same all-reduce, also a rank
        whose share is empty. {} without a val split."""
        val, task, cfg, s = self.job.val, self.task, self.cfg, self.strategy
        if val is None:
            return {}
        sample = self.job.sample["val"]
        bs = max(1, cfg.batch.micro_batch_size * 2)
        s.model.eval()
        if self.names is None:
            # Every rank, the same one-row forward (collective under FSDP): the metric
            # names, hence the reduction vector, are the same on every rank.
            self.names = sorted(task.evaluate(s.model, self.to_device(task.collate(sample))))
        names = self.names
        sums = torch.zeros(len(names) + 1, dtype=torch.float64)
        try:
            for batch in val_batches(val, task, cfg.seed, epoch, rank, world_size, bs,
                                     cfg.train.eval_max_batches, sample):
                k = len(batch[val.id_column])
                if k == 0:  # FSDP: the same forward count on every rank (the sample row)
                    if s.collective_forward:
                        task.evaluate(s.model, self.to_device(task.collate(sample)))
                    continue
                out = task.evaluate(s.model, self.to_device(task.collate(batch)))
                for i, name in enumerate(names):
                    sums[i] += float(out[name].float().sum())
                sums[-1] += k
        finally:
            s.model.train()
        sums = sums.to(self.device)
        if s.distributed and world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(sums)
        count = max(1.0, float(sums[-1]))
        return {f"val_{name}": float(sums[i]) / count for i, name in enumerate(names)}
