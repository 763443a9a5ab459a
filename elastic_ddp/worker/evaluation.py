"""Validation: the task's per-sample metrics over the whole val split (or its first
``train.eval_max_batches`` batches), exact means however the rows are split over ranks.
Used by ``Trainer.evaluate``."""

from __future__ import annotations

from typing import Optional

import torch

from elastic_ddp.data.ingest import val_batches


@torch.no_grad()
def evaluate(t, rank: Optional[int] = None, world_size: Optional[int] = None) -> dict[str, float]:
    """Validation metrics over the whole val split (``val_<name>``, exact means over
    its rows whatever the split across ranks; a batch holds the same rows at every world
    size, ``ingest.val_share``). Every rank runs the same number of batches and the same
    all-reduce, also a rank whose share is empty.

    ``t``: the rank's ``elastic_ddp.worker.trainer.Trainer``; ``rank``/``world_size``: how the
    split is shared (default: the trainer's; ``0``/``1``: this process alone)."""
    val = t.job.val
    if val is None:
        return {}
    rank = t.rank if rank is None else rank
    world_size = t.world_size if world_size is None else world_size
    s = t.strategy
    bs = max(1, t.cfg.batch.micro_batch_size * 2)
    s.model.eval()
    if t._eval_names is None:
        # Every rank, the same one-row forward (collective under FSDP): the metric
        # names, hence the reduction vector, are the same on every rank.
        one = t.to_device(t.task.collate(t.job.sample["val"]))
        t._eval_names = sorted(t.task.evaluate(s.model, one))
    names = t._eval_names
    sums = torch.zeros(len(names) + 1, dtype=torch.float64)
    try:
        for batch in val_batches(val, t.task, t.cfg.seed, t.progress.epoch, rank,
                                 world_size, bs, t.cfg.train.eval_max_batches, t.job.sample["val"]):
            k = len(batch[val.id_column])
            if k == 0:  # FSDP: the same forward count on every rank (the sample row)
                if s.collective_forward:
                    t.task.evaluate(s.model, t.to_device(t.task.collate(t.job.sample["val"])))
                continue
            out = t.task.evaluate(s.model, t.to_device(t.task.collate(batch)))
            for i, name in enumerate(names):
                sums[i] += float(out[name].float().sum())
            sums[-1] += k
    finally:
        s.model.train()
    sums = sums.to(t.device)
    if s.distributed and world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(sums)
    count = max(1.0, float(sums[-1]))
    out = {f"val_{name}": float(sums[i]) / count for i, name in enumerate(names)}
    return out
