"""The micro-batches of one training step: forward and backward on this rank's share
(``Trainer.train_step`` calls ``MicroSteps.forward_backward`` between the data read and
the gradient sync), and the BatchNorm buffers a dropped step restores."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import numpy as np
import torch

from elastic_ddp.compat.torch_nn import BatchNormBase
from elastic_ddp.batching import grad_accum_steps, micro_slices, split_evenly
from elastic_ddp.metrics import gradient_bytes
from elastic_ddp.parallel.batchnorm import batchnorm_guard
from elastic_ddp.tasks.protocol import split_loss


@dataclass(frozen=True)
class Micro:
    """One micro-batch of this rank's share of a step.

    Attributes:
        rows: its rows of the rank's batch (a slice, or int64 positions).
        count: how many rows.
        unit: its place in the step, ``shard x grad_accum_steps + i`` (the i-th
            micro-batch of a shard; world sizes without shards: of a rank): the same
            micro-batch has the same unit at world size 1 and 2. Seeds its random numbers.
        smallest: the fewest rows any rank (or shard) holds in this micro-step: the
            BatchNorm guard's decision, the same on every rank.
        shard_end: the last micro-batch of a shard of several micro-batches that another
            shard of this rank follows: the shard's gradient is set aside until the
            step's last shard is done (``_ShardSum``).
    """

    rows: Union[slice, np.ndarray]
    count: int
    unit: int
    smallest: int
    shard_end: bool = False


def micro_batches(rows: list[int], rank: int, micro_batch_size: int,
                  shard_rows: Optional[list[np.ndarray]] = None) -> list[Micro]:
    """This rank's micro-batches of a step. ``rows[r]``: rank ``r``'s rows in the step,
    ``rank``: this rank's index among them. ``shard_rows`` (world size 1 with shards,
    ``EpochOrder.shard_index``): each shard's positions in the batch; every shard is cut
    as the rank of world size ``len(shard_rows)`` holding it cuts its rows, into
    ``grad_accum_steps(shard sizes)`` micro-batches. Without, the rank's rows are cut into
    ``grad_accum_steps(rows)`` contiguous micro-batches differing by at most one row."""
    if shard_rows is not None:
        sizes = [len(ix) for ix in shard_rows]
        accum = grad_accum_steps(sizes, micro_batch_size)
        smallest = [min(split_evenly(k, accum)[i] for k in sizes) for i in range(accum)]
        out = []
        for s, ix in enumerate(shard_rows):
            for i, (a, b) in enumerate(micro_slices(len(ix), accum)):
                # With one micro-batch per shard, shard 1's backward adds to g0 in place:
                # already the two-term sum, nothing to set aside.
                out.append(Micro(ix[a:b], b - a, s * accum + i, smallest[i],
                                 shard_end=accum > 1 and i == accum - 1 and s < len(shard_rows) - 1))
        return out
    accum = grad_accum_steps(rows, micro_batch_size)
    smallest = [min(split_evenly(r, accum)[i] for r in rows) for i in range(accum)]
    return [Micro(slice(a, b), b - a, rank * accum + i, smallest[i])
            for i, (a, b) in enumerate(micro_slices(rows[rank], accum))]


def micro_seed(seed: int, step: int, unit: int) -> int:
    """The torch seed of micro-batch ``unit`` of step ``step`` (0-based) of a job seeded
    ``seed``: dropout masks (any random number the forward draws) are a function of the
    micro-batch's place in the step, not of the rank that computes it, so a micro-batch
    draws the same numbers at world size 1 and 2, and across restarts."""
    return seed * 1_000_003 + step * 1009 + unit


@dataclass
class MicroResult:
    """What the micro-batches of a step leave for the rest of it.

    Attributes:
        sums: per micro-batch (loss sum, {metric: sum}, rows) over its rows.
        bn_saved: the BatchNorm buffers to put back if the step is dropped or skipped
            (``restore_bn``; None without BatchNorm).
        nonfinite_ids, nonfinite_losses: this rank's rows of the step whose per-sample
            loss was not finite (their ids, in row order) and those losses.
    """

    sums: list[tuple[float, dict, int]]
    bn_saved: Optional[list] = None
    nonfinite_ids: list = field(default_factory=list)
    nonfinite_losses: list[float] = field(default_factory=list)


class MicroSteps:
    """Forward and backward of this rank's share of every step (``forward_backward``).

    Args:
        strategy: the rank's ``parallel.strategies`` strategy (model, ``micro_step``).
        task: the job's task (``collate``, ``loss``, ``tokens``).
        cfg: the job's config (``batch.micro_batch_size``, ``parallel.bf16``, ``seed``).
        device: this rank's device.
        to_device: a collated batch onto the device (``tasks.protocol.model_inputs``).
        sample: the one-row sample an empty share computes on (``JobSpec.sample["train"]``).
        id_column: the training split's id column (names non-finite rows).
        loss_weight: the per-sample loss weight of a step of ``n`` rows (``ft.loss_weight``).
    """

    def __init__(self, strategy, task, cfg, device, to_device: Callable[[dict], dict], sample: dict,
                 id_column: str, loss_weight: Callable[[int], float]):
        self.strategy, self.task, self.cfg, self.device = strategy, task, cfg, device
        self.to_device, self.sample, self.id_column = to_device, sample, id_column
        self.loss_weight = loss_weight
        self.has_batchnorm = any(isinstance(m, BatchNormBase) for m in strategy.module.modules())

    def forward_backward(self, batch, step: int, probe: bool, w) -> MicroResult:
        """Every micro-batch's forward and backward of this rank's share of ``batch``
        (a ``rank_loader.StepBatch`` of ``n`` rows) at ``step`` (0-based: the step being
        computed is ``step + 1``), each micro-batch's per-sample loss weighted by
        ``loss_weight(n)`` and seeded by :func:`micro_seed`. At world size 1 with shards
        (``batching.shard_count``) the shards' gradients are added last
        (:func:`micro_batches`, ``_ShardSum``). ``probe``: the strategy's probe step (its
        explicit all-reduce). ``w``: the ``metrics.StepWindow`` the times and counts go to."""
        s, task, clock, n = self.strategy, self.task, w.clock(self.device), batch.n
        micros = micro_batches(batch.rows, batch.rank, self.cfg.batch.micro_batch_size, batch.shard_rows)
        weight = self.loss_weight(n)
        out = MicroResult([], save_bn(s.module) if self.has_batchnorm else None)
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.parallel.bf16)
        held = _ShardSum(s.module)
        for i, mb in enumerate(micros):
            t0 = clock.start()
            # An empty share still runs forward and backward (every rank joins every
            # all-reduce): on the one-row sample, weighted 0, so tasks never see B = 0.
            part = {k: v[mb.rows] for k, v in batch.columns.items()} if mb.count else self.sample
            tensors = self.to_device(task.collate(part))
            clock.stop("data", t0)
            ctx, kind = s.micro_step(i == len(micros) - 1, probe)
            torch.manual_seed(micro_seed(self.cfg.seed, step, mb.unit))
            t0 = clock.start()
            with ctx, batchnorm_guard(s.model, mb.smallest), autocast:
                loss_vec, extra = split_loss(task.loss(s.model, tensors), max(1, mb.count))
                (loss_vec.float().sum() * (weight if mb.count else 0.0)).backward()
            if mb.shard_end:
                held.set_aside()
            clock.stop(kind, t0)
            w.micro[kind] = w.micro.get(kind, 0) + 1
            tokens = task.tokens(tensors) if mb.count else None
            if tokens is not None:
                w.tokens += tokens
                w.token_task = True
            # .item() is a device sync; free on CPU, one per micro-step on GPU.
            if mb.count:
                loss_sum = float(loss_vec.detach().float().sum())
                if not math.isfinite(loss_sum):  # rare: the rows to name in the skip's message
                    ids, losses = nonfinite_rows(loss_vec, part[self.id_column])
                    out.nonfinite_ids.extend(ids)
                    out.nonfinite_losses.extend(losses)
                out.sums.append((loss_sum, {k: float(v.detach().float().sum()) for k, v in extra.items()},
                                 mb.count))
            else:
                # An empty share still names the task's metrics: every rank must send the
                # same keys to the window's all-reduce (metrics.StepWindow.reduce).
                out.sums.append((0.0, {k: 0.0 for k in extra}, 0))
        held.add_back()
        if w.grad_bytes is None:
            w.grad_bytes = gradient_bytes(s.model.parameters())
        return out


def nonfinite_rows(loss_vec: torch.Tensor, ids) -> tuple[list, list[float]]:
    """The ids (``ids``: the micro-batch's id column, [B]) of the rows whose per-sample
    loss (``loss_vec``, [B]) is NaN or infinite, in row order, and those losses."""
    loss = loss_vec.detach().float().cpu()
    bad = (~torch.isfinite(loss)).numpy()
    return ([i.item() if hasattr(i, "item") else i for i in np.asarray(ids)[bad]],
            [float(v) for v in loss.numpy()[bad]])


class _ShardSum:
    """The gradients of the shards a rank of world size 1 computes before its last, set
    aside while the next shard accumulates from zero, then added to it: the step's
    gradient is ``g1 + g0``, bit for bit the ``g0 + g1`` an all-reduce of two ranks makes
    (floating-point addition is commutative; accumulating ``g0`` then each micro-batch
    of shard 1 in place would round differently). Costs one gradient-sized buffer while
    a step runs, only when a shard takes more than one micro-batch (with one, shard 1's
    backward adds its micro-batch's gradient to ``g0`` directly: the same sum)."""

    def __init__(self, module: torch.nn.Module):
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.held: Optional[list[Optional[torch.Tensor]]] = None

    def set_aside(self) -> None:
        if self.held is not None:  # a third shard: never (shards are 1 or 2)
            self.add_back()
        self.held = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def add_back(self) -> None:
        if self.held is None:
            return
        for p, g in zip(self.params, self.held):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
        self.held = None


def save_bn(module: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(buffer, copy) of every BatchNorm buffer of ``module`` (running stats, counts)."""
    return [(b, b.detach().clone()) for m in module.modules()
            if isinstance(m, BatchNormBase) for b in m.buffers()]


def restore_bn(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Put back the BatchNorm buffers ``save_bn`` copied."""
    for buf, copy in saved:
        buf.copy_(copy)
