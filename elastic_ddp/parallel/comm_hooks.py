"""DDP communication hooks and their state, and the ZeRO memory formula.

- the plain SUM all-reduce (DDP's default averages);
- bf16 / fp16 compression of the gradient all-reduce (PyTorch "DDP Communication Hooks");
- PowerSGD (Vogels et al. 2019): when it starts, and its state in the checkpoint;
- ``zero_memory_bytes``: model-state memory per rank under ZeRO stages 0-3.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from elastic_ddp.config import Config


def allreduce_sum(state, bucket):
    """DDP's all-reduce without its division by the world size: the bucket's SUM over
    the ranks (``state``: the process group, None for the default one). The loss
    weights carry the mean instead (``Strategy.grad_divisor``), so a micro-batch's
    gradient does not depend on the world size. Costs one Python call per bucket over
    DDP's built-in hook."""
    return (dist.all_reduce(bucket.buffer(), group=state, async_op=True).get_future()
            .then(lambda fut: fut.value()[0]))


def bf16_compress(state, bucket):
    """``default_hooks.bf16_compress_hook`` under another name: DDP refuses that function
    by name unless CUDA + NCCL >= 2.10, while gloo all-reduces bf16 on CPUs too. Halves
    the all-reduce bytes; the sum is taken in bf16 (8-bit mantissa) then cast back
    (``elastic_ddp.compat.torch_ddp``: torch's own hook body, version-guarded)."""
    from elastic_ddp.compat.torch_ddp import compress_hook

    return compress_hook(torch.bfloat16, state, bucket)


def powersgd_state(state) -> dict[str, Any]:
    """PowerSGD's persistent state as tensors only (loadable with weights_only=True): the
    iteration count, the warm-start P/Q buffers (identical on every rank after their
    all-reduce) and every rank's error-feedback residual, gathered to all ranks with one
    ``all_gather_object`` (a collective costing about one gradient per rank, paid only at
    checkpoints)."""
    ws = dist.get_world_size() if dist.is_initialized() else 1
    local = {str(k): v.detach().cpu() for k, v in state.error_dict.items()}
    gathered: list[Any] = [None] * ws
    if ws > 1:
        dist.all_gather_object(gathered, local)
    else:
        gathered = [local]
    return {
        "iter": torch.tensor(int(state.iter)),
        "p_memory_dict": {str(k): v.detach().cpu() for k, v in state.p_memory_dict.items()},
        "q_memory_dict": {str(k): v.detach().cpu() for k, v in state.q_memory_dict.items()},
        "error_dicts": gathered,
        "world_size": torch.tensor(ws),
    }


def load_powersgd_state(state, saved: dict[str, Any], world_size: int) -> None:
    """Restore PowerSGD's iteration count and warm-start buffers always; restore each
    rank's error feedback only at the same world size (elsewhere a rank's residual no
    longer matches its share of the gradient, so it restarts from zero, as at step 0)."""
    state.iter = int(saved["iter"])
    dev = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    state.p_memory_dict = {int(k): v.to(dev) for k, v in saved["p_memory_dict"].items()}
    state.q_memory_dict = {int(k): v.to(dev) for k, v in saved["q_memory_dict"].items()}
    if int(saved["world_size"]) == world_size:
        mine = saved["error_dicts"][dist.get_rank()]
        state.error_dict = {int(k): v.to(dev) for k, v in mine.items()}


def zero_memory_bytes(num_params: int, world_size: int, stage: int,
                      param_bytes: int = 4, grad_bytes: int = 4,
                      optimizer_bytes: int = 8) -> float:
    """Model-state memory per rank in bytes under ZeRO stage 0 (plain DDP), 1, 2 or 3
    (Rajbhandari et al. 2020, "ZeRO", sec. 5 and fig. 1): parameters, gradients and
    optimizer state per parameter (defaults: fp32 AdamW, 4 + 4 + 8 bytes); stage 1
    shards the optimizer state, stage 2 also the gradients, stage 3 also the parameters.
    Activations and buffers are not included."""
    n = max(1, world_size)
    p, g, o = param_bytes * num_params, grad_bytes * num_params, optimizer_bytes * num_params
    if stage <= 0:
        return p + g + o
    if stage == 1:
        return p + g + o / n
    if stage == 2:
        return p + (g + o) / n
    return (p + g + o) / n


def powersgd_start_step(cfg: Config, total_steps: Optional[int] = None) -> int:
    """The optimizer step from which PowerSGD compresses (plain all-reduce before it).

    ``parallel.powersgd_start_iter`` when set; otherwise max(``optim.warmup_steps``,
    ceil(0.2 * ``total_steps``)), and at least 2 (PowerSGDState needs
    ``start_powerSGD_iter`` > 1 with warm start). Without ``total_steps``, the warm-up
    (or 10 steps).

    Why 20%: PyTorch's ``PowerSGDState`` documentation advises starting the search at
    10% of the training steps and raising it until the accuracy is satisfactory (early
    training is the most sensitive to inexact gradients). On the digits preset (rank 8,
    5 seeds, docs/benchmarks.md) 10% cost +4.2% +- 2.1% val loss against ddp, 20% +2.0% +- 1.1%.
    """
    p = cfg.parallel
    if p.powersgd_start_iter is not None:
        return max(2, p.powersgd_start_iter)
    fifth = math.ceil(0.2 * total_steps) if total_steps else 10
    return max(2, cfg.optim.warmup_steps, fifth)
