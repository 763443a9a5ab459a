"""The micro-batches of one training step: forward and backward on this rank's share
(``Trainer.train_step`` calls ``forward_backward`` between the data read and the
gradient sync), and the BatchNorm buffers a dropped step restores."""

from __future__ import annotations

import torch

from elastic_ddp.compat.torch_nn import BatchNormBase
from elastic_ddp.batching import grad_accum_steps, micro_slices, split_evenly
from elastic_ddp.metrics import gradient_bytes
from elastic_ddp.parallel.batchnorm import batchnorm_guard
from elastic_ddp.tasks.protocol import split_loss


def forward_backward(t, batch: dict, rows: list[int], rank: int, n: int, probe: bool):
    """Every micro-batch's forward and backward of this rank's share of a step of ``n``
    rows (``rows[r]``: rank ``r``'s rows; ``rank``: this rank's index among them), each
    micro-batch's per-sample loss weighted by ``t.ft.loss_weight(n)``.

    ``t``: the rank's ``Trainer``. Returns ``(sums, bn_saved)``: per micro-batch (loss sum,
    {metric: sum}, rows), and the BatchNorm buffers to restore if the step is dropped
    (None without BatchNorm)."""
    s, task, w, clock = t.strategy, t.task, t.window, t.window.clock(t.device)
    accum = grad_accum_steps(rows, t.cfg.batch.micro_batch_size)
    slices = micro_slices(rows[rank], accum)
    smallest = [min(split_evenly(r, accum)[i] for r in rows) for i in range(accum)]
    weight = t.ft.loss_weight(n)
    bn_saved = save_bn(s.module) if t.has_batchnorm else None
    autocast = torch.autocast(t.device.type, dtype=torch.bfloat16, enabled=t.cfg.parallel.bf16)
    sums: list[tuple[float, dict, int]] = []
    for i, (a, b) in enumerate(slices):
        t0 = clock.start()
        # An empty share still runs forward and backward (every rank joins every
        # all-reduce): on the one-row sample, weighted 0, so tasks never see B = 0.
        part = {k: v[a:b] for k, v in batch.items()} if b > a else t.job.sample["train"]
        tensors = t.to_device(task.collate(part))
        clock.stop("data", t0)
        ctx, kind = s.micro_step(i == len(slices) - 1, probe)
        t0 = clock.start()
        with ctx, batchnorm_guard(s.model, smallest[i]), autocast:
            loss_vec, extra = split_loss(task.loss(s.model, tensors), max(1, b - a))
            (loss_vec.float().sum() * (weight if b > a else 0.0)).backward()
        clock.stop(kind, t0)
        w.micro[kind] = w.micro.get(kind, 0) + 1
        tokens = task.tokens(tensors) if b > a else None
        if tokens is not None:
            w.tokens += tokens
            w.token_task = True
        # .item() is a device sync; free on CPU, one per micro-step on GPU.
        if b > a:
            sums.append((float(loss_vec.detach().float().sum()),
                         {k: float(v.detach().float().sum()) for k, v in extra.items()}, b - a))
        else:
            # An empty share still names the task's metrics: every rank must send the
            # same keys to the window's all-reduce (metrics.StepWindow.reduce).
            sums.append((0.0, {k: 0.0 for k in extra}, 0))
    if w.grad_bytes is None:
        w.grad_bytes = gradient_bytes(s.model.parameters())
    return sums, bn_saved


def save_bn(module: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(buffer, copy) of every BatchNorm buffer of ``module`` (running stats, counts)."""
    return [(b, b.detach().clone()) for m in module.modules()
            if isinstance(m, BatchNormBase) for b in m.buffers()]


def restore_bn(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Put back the BatchNorm buffers ``save_bn`` copied."""
    for buf, copy in saved:
        buf.copy_(copy)
