"""BatchNorm across ranks and on tiny batches.

- ``GlobalBatchNorm``: BatchNorm statistics over every rank's rows on CPU process groups
  (gloo), where PyTorch's ``nn.SyncBatchNorm`` refuses to run; ``parallel.py`` converts a
  model's BatchNorm layers to it when ``parallel.sync_batchnorm`` is on without CUDA.
- ``batchnorm_guard``: run BatchNorm on its running statistics for a micro-step in which
  some rank holds fewer than 2 rows, the same decision on every rank.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from elastic_ddp.compat.torch_nn import BatchNormBase


class _AllReduceSum(torch.autograd.Function):
    """y = sum over ranks of x; dL/dx = sum over ranks of dL/dy (each rank's loss uses
    y). What the deprecated ``torch.distributed.nn.functional.all_reduce`` did. One
    all-reduce each way, a copy of x in forward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        g = grad.contiguous().clone()
        dist.all_reduce(g)
        return g


class GlobalBatchNorm(BatchNormBase):
    """BatchNorm over every rank's rows, for CPU process groups (gloo), where PyTorch's
    ``nn.SyncBatchNorm`` refuses to run. Input: [B, C] or [B, C, *spatial], any B >= 0
    per rank (the worker's guard keeps the global count >= 2).

    Training statistics from one all-reduce of [sum_c, sum_c x^2, count] per forward
    (2C+1 floats) whose backward all-reduces the gradient (``_AllReduceSum``), so d loss / d x includes every rank's rows as in
    single-process BatchNorm over the global batch; Ioffe & Szegedy 2015, eq. in Alg. 1).
    var = E[x^2] - E[x]^2 (biased for normalising, unbiased n/(n-1) for the running
    estimate, as ``nn.BatchNorm``). Evaluation, or no process group: plain BatchNorm.
    The state dict is BatchNorm's (same keys), so checkpoints load into the plain model.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"GlobalBatchNorm expects [B, C, ...], got shape {tuple(input.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or not dist.is_initialized() or dist.get_world_size() == 1:
            return super().forward(x)
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        xf = x.float()
        local = torch.cat([xf.sum(dims), (xf * xf).sum(dims),
                           xf.new_tensor([float(x.numel() // max(1, c))])])
        total = _AllReduceSum.apply(local)  # a sync point: every rank, every BN forward
        n = total[-1]
        mean = total[:c] / n
        var = (total[c:2 * c] / n - mean * mean).clamp_min(0.0)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = (self.momentum if self.momentum is not None
                     else 1.0 / float(self.num_batches_tracked))
                self.running_mean.mul_(1 - m).add_(mean.detach() * m)
                self.running_var.mul_(1 - m).add_(var.detach() * (n / (n - 1)) * m)
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


def convert_global_batchnorm(module: nn.Module) -> nn.Module:
    """Every BatchNorm layer of ``module`` replaced by a ``GlobalBatchNorm`` with the same
    parameters and running statistics (``nn.SyncBatchNorm.convert_sync_batchnorm``'s
    pattern); returns the (possibly new) root module."""
    out = module
    if isinstance(module, BatchNormBase) and not isinstance(module, GlobalBatchNorm):
        out = GlobalBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                              module.track_running_stats)
        if module.affine:
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias
        if module.track_running_stats:
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, convert_global_batchnorm(child))
    return out


@contextlib.contextmanager
def batchnorm_guard(model: torch.nn.Module, smallest_rows: int):
    """Run BatchNorm layers on their running statistics for a micro-step in which some
    rank holds fewer than 2 rows (batch statistics of 0 or 1 sample are undefined or
    raise). The decision uses the smallest slice over all ranks, so SyncBatchNorm's
    collective is skipped on every rank or on none."""
    if smallest_rows >= 2:
        yield
        return
    bns = [m for m in model.modules() if isinstance(m, BatchNormBase) and m.training]
    for m in bns:
        m.eval()
    try:
        yield
    finally:
        for m in bns:
            m.train()
