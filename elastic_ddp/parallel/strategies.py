"""Data-parallel strategies behind one interface: ``ddp`` (default), ``zero1`` and ``fsdp``.

    strategy = build_strategy(cfg, model, device, world_size)
    ctx, kind = strategy.micro_step(last_micro_step, probe=False)
    with ctx:
        loss.backward()
    strategy.clip_grad_norm(max_norm); strategy.optimizer.step()
    full = strategy.full_state()           # collective: every rank calls it; rank 0 gets the dicts
    strategy.load_full_state(full)         # any world size: the state is gathered, not sharded

- ``ddp``: ``DistributedDataParallel`` with its knobs (``bucket_cap_mb``,
  ``gradient_as_bucket_view``, ``static_graph``, ``find_unused_parameters``) and an
  optional comm hook (bf16/fp16 compression, PowerSGD; PyTorch "DDP Communication Hooks").
  Without one, gradients are SUM-all-reduced (``comm_hooks.allreduce_sum``), not averaged:
  the loss weights are then the same at every world size (``grad_divisor``).
- ``zero1``: DDP + ``ZeroRedundancyOptimizer``: optimizer state sharded across ranks
  (ZeRO stage 1, Rajbhandari et al. 2020, "ZeRO: Memory Optimizations ...", sec. 5.1).
  Checkpoints consolidate the optimizer on rank 0, so they load at any world size.
- ``fsdp``: FSDP2 ``fully_shard`` on every block and the root: parameters, gradients and
  optimizer state sharded (ZeRO-3); ``reshard_after_forward=False`` keeps parameters
  gathered between forward and backward (ZeRO-2-like: more memory, one all-gather fewer).
  Checkpoints gather the full state with ``torch.distributed.checkpoint.state_dict``.

The single-process case (world_size 1 or no process group) runs the plain module.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from elastic_ddp.parallel.comm_hooks import (allreduce_sum, bf16_compress, load_powersgd_state,  # noqa: F401
                                    powersgd_state, powersgd_start_step, zero_memory_bytes)
from elastic_ddp.config import Config


def unwrap_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict without DDP's ``module.`` prefix (loadable in plain
    PyTorch and at any world size), on the CPU."""
    inner = getattr(model, "module", model)
    return {k: v.detach().cpu() for k, v in inner.state_dict().items()}


def build_optimizer(cfg: Config, params, zero: bool = False) -> torch.optim.Optimizer:
    """The configured optimizer over ``params``; wrapped in ZeroRedundancyOptimizer when
    ``zero``. LARS (You et al. 2017) and LAMB (You et al. 2019) come from the maintained
    ``pytorch-optimizer`` library."""
    o = cfg.optim
    params = list(params)
    if o.name == "sgd":
        cls, kw = torch.optim.SGD, {"momentum": o.momentum, "weight_decay": o.weight_decay}
    elif o.name == "adamw":
        cls, kw = torch.optim.AdamW, {"betas": tuple(o.betas), "weight_decay": o.weight_decay}
    elif o.name == "lars":
        from pytorch_optimizer import LARS

        cls, kw = LARS, {"momentum": o.momentum, "weight_decay": o.weight_decay}
    elif o.name == "lamb":
        from pytorch_optimizer import Lamb

        cls, kw = Lamb, {"betas": tuple(o.betas), "weight_decay": o.weight_decay}
    else:  # the config's Literal refuses other names first
        raise ValueError(f"optim.name={o.name!r} unknown")
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, lr=o.lr, **kw)
    return cls(params, lr=o.lr, **kw)


class Strategy:
    """A wrapped model + optimizer for one world size. ``model`` is what the loop calls;
    ``module`` is the unwrapped network (same object for fsdp, whose sharded parameters
    live in place)."""

    name = "ddp"

    def __init__(self, cfg: Config, module: nn.Module, device: torch.device, world_size: int):
        self.cfg = cfg
        self.module = module
        self.device = device
        self.world_size = world_size
        self.distributed = dist.is_available() and dist.is_initialized() and world_size > 1
        self.model: nn.Module = module
        self.optimizer: torch.optim.Optimizer
        self.hook_state: Any = None

    # -- the loop's hooks --------------------------------------------------------------
    #: Whether evaluation must run the same number of forward passes on every rank, empty
    #: batches included (a forward with collectives inside: FSDP's all-gathers).
    collective_forward = False

    def maybe_no_sync(self, last_micro_step: bool) -> contextlib.AbstractContextManager:
        """DDP's ``no_sync`` on every micro-step but the last: gradients accumulate locally
        and one all-reduce runs at the end (saves grad_accum_steps-1 all-reduces)."""
        return contextlib.nullcontext()

    def micro_step(self, last: bool, probe: bool) -> tuple[contextlib.AbstractContextManager, str]:
        """The context of one micro-step's forward+backward and its timing kind: ``fb_sync``
        (DDP's overlapped all-reduce inside), ``fb_nosync`` (no all-reduce: accumulation,
        or a probe step whose all-reduce runs afterwards), or ``fb`` (no DDP)."""
        return self.maybe_no_sync(last), "fb"

    @property
    def can_probe(self) -> bool:
        """Whether a probe step may replace DDP's overlapped all-reduce by an explicit
        one (plain DDP, several ranks, no compression hook: the same maths)."""
        return False

    @property
    def grad_divisor(self) -> int:
        """What the gradient reduction divides the ranks' sum by: 1 where it sums (one
        process; DDP without a comm hook), the world size where it averages (a
        compression comm hook, FSDP's reduce-scatter). A micro-batch's loss is weighted
        ``grad_divisor / G`` so that the reduced gradient is the mean over the G rows."""
        return 1

    def allreduce_gradients(self) -> None:
        """The probe's explicit gradient all-reduce (see ``can_probe``), the same sum as
        the comm hook's."""
        allreduce_gradients(self.model, self.grad_divisor)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip to ``max_norm`` (0: no clipping) and return the global gradient norm
        before clipping (nan/inf when a gradient is not finite). After the all-reduce
        every rank holds the same gradient (or the norm is all-reduced), so every rank
        gets the same norm and takes the same skip decision without a collective."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        if max_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        return float(torch.nn.utils.get_total_norm([p.grad for p in params])) if params else 0.0

    def check_params_equal(self, step: int) -> None:
        """Compare a parameter checksum across ranks (two tiny all-reduces).

        Raises:
            RuntimeError: ranks hold different parameters (a bug or silent corruption).
        """
        check_params_equal(self.module, step)

    # -- checkpoint state ----------------------------------------------------------------
    def full_state(self, rank: int) -> dict[str, Any]:
        """Model (no ``module.`` prefix) and optimizer state as full, unsharded dicts.
        Collective for zero1/fsdp: every rank must call it. Only rank 0's return is used."""
        return {"model": unwrap_state_dict(self.module),
                "optimizer": self.optimizer.state_dict()}

    def load_full_state(self, state: dict[str, Any]) -> None:
        """Load a full state written at any world size. Called on every rank."""
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(self, cfg, module, device, world_size, zero: bool = False,
                 total_steps: Optional[int] = None):
        super().__init__(cfg, module, device, world_size)
        self.total_steps = total_steps
        p = cfg.parallel
        if p.sync_batchnorm and self.distributed:
            # Batch statistics over the global batch, not the per-rank slice (one
            # all-reduce of mean/var per BN layer per forward, one more in backward).
            # PyTorch's SyncBatchNorm is GPU-only (DDP refuses it on CPU modules), so
            # gloo/CPU runs get GlobalBatchNorm, the same statistics by a plain all-reduce.
            from elastic_ddp.parallel.batchnorm import convert_global_batchnorm

            self.module = module = (nn.SyncBatchNorm.convert_sync_batchnorm(module)
                                    if device.type == "cuda" else convert_global_batchnorm(module))
        if self.distributed:
            self.model = nn.parallel.DistributedDataParallel(
                module,
                device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=p.bucket_cap_mb,
                gradient_as_bucket_view=p.gradient_as_bucket_view,
                static_graph=p.static_graph,
                find_unused_parameters=p.find_unused_parameters,
            )
            self._register_comm_hook(p.comm_hook)
        self.optimizer = build_optimizer(cfg, module.parameters(), zero=zero and self.distributed)

    def maybe_no_sync(self, last_micro_step: bool):
        if last_micro_step or not self.distributed:
            return contextlib.nullcontext()
        return self.model.no_sync()

    def micro_step(self, last: bool, probe: bool):
        if not self.distributed:
            return contextlib.nullcontext(), "fb"
        syncing = last and not (probe and self.can_probe)
        return (contextlib.nullcontext(), "fb_sync") if syncing else (self.model.no_sync(), "fb_nosync")

    @property
    def can_probe(self) -> bool:
        return self.distributed and self.cfg.parallel.comm_hook == "none"

    @property
    def grad_divisor(self) -> int:
        return self.world_size if self.distributed and self.cfg.parallel.comm_hook != "none" else 1

    def _register_comm_hook(self, hook: str) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if hook == "none":
            # SUM, not DDP's average: a micro-batch's gradient is then the same bits at
            # every world size (weight 1 / G), and the all-reduce of two ranks is the
            # sum world size 1 makes of its two shards (batching, "Shards").
            self.model.register_comm_hook(None, allreduce_sum)
            return
        if hook == "bf16":
            self.model.register_comm_hook(None, bf16_compress)
        elif hook == "fp16":
            self.model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif hook == "powersgd":
            p = self.cfg.parallel
            # Vogels et al. 2019, "PowerSGD": rank-r low-rank gradient compression with
            # error feedback; plain all-reduce for the first start_iter steps.
            self.hook_state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=p.powersgd_rank,
                start_powerSGD_iter=powersgd_start_step(self.cfg, self.total_steps),
                min_compression_rate=0.5,
                use_error_feedback=True, warm_start=True)
            self.model.register_comm_hook(self.hook_state, powerSGD_hook.powerSGD_hook)

    def full_state(self, rank: int) -> dict[str, Any]:
        out = {"model": unwrap_state_dict(self.module)}
        opt = self.optimizer
        if hasattr(opt, "consolidate_state_dict"):
            # ZeRO-1: gather every rank's optimizer shard on rank 0 (a collective; costs
            # one copy of the full optimizer state on rank 0).
            opt.consolidate_state_dict(to=0)
            out["optimizer"] = opt.state_dict() if rank == 0 else {}
        else:
            out["optimizer"] = opt.state_dict()
        if self.hook_state is not None:
            out["comm_hook"] = powersgd_state(self.hook_state)
        return out

    def load_full_state(self, state: dict[str, Any]) -> None:
        # SyncBatchNorm / GlobalBatchNorm keep BatchNorm's state-dict keys.
        self.module.load_state_dict(state["model"])
        # ZeroRedundancyOptimizer.load_state_dict takes the consolidated (full) state and
        # keeps this rank's partition, so the world size may differ from the writer's.
        self.optimizer.load_state_dict(state["optimizer"])
        if self.hook_state is not None and state.get("comm_hook"):
            load_powersgd_state(self.hook_state, state["comm_hook"], self.world_size)


class FSDPStrategy(Strategy):
    name = "fsdp"

    def __init__(self, cfg, module, device, world_size):
        super().__init__(cfg, module, device, world_size)
        if self.distributed:
            from torch.distributed.fsdp import fully_shard

            reshard = not cfg.parallel.fsdp_keep_params_between_fwd_bwd
            for sub in _fsdp_units(module):
                fully_shard(sub, reshard_after_forward=reshard)
            fully_shard(module, reshard_after_forward=reshard)
        self.model = module
        self.optimizer = build_optimizer(cfg, module.parameters())

    def maybe_no_sync(self, last_micro_step: bool):
        if not self.distributed:
            return contextlib.nullcontext()
        # FSDP2: skip the reduce-scatter on accumulation micro-steps (set per micro-step).
        self.model.set_requires_gradient_sync(last_micro_step)
        return contextlib.nullcontext()

    @property
    def collective_forward(self) -> bool:
        return self.distributed

    def clip_grad_norm(self, max_norm: float) -> float:
        if not self.distributed:
            return super().clip_grad_norm(max_norm)
        # DTensor-aware: the norm is computed over the sharded gradients (an all-reduce).
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def check_params_equal(self, step: int) -> None:
        return  # fsdp ranks hold different shards by design

    @property
    def grad_divisor(self) -> int:
        return self.world_size if self.distributed else 1  # the reduce-scatter averages

    def full_state(self, rank: int) -> dict[str, Any]:
        if not self.distributed:
            return super().full_state(rank)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

        # All-gathers every shard to rank 0 on the CPU (full_state_dict + cpu_offload):
        # the checkpoint is unsharded, so it loads at any world size and in plain PyTorch.
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {"model": get_model_state_dict(self.module, options=opts),
                "optimizer": get_optimizer_state_dict(self.module, self.optimizer, options=opts)}

    def load_full_state(self, state: dict[str, Any]) -> None:
        if not self.distributed:
            return super().load_full_state(state)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        set_model_state_dict(self.module, state["model"], options=opts)
        set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"], options=opts)


def allreduce_gradients(model: nn.Module, divisor: int = 1) -> None:
    """All-reduce gradients over ranks by hand (divide by ``divisor``, then all-reduce
    SUM, as a DDP comm hook does), in one flat buffer per dtype -- one collective, like
    one big DDP bucket, so its time is the whole all-reduce. Costs a gradient-sized copy."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for dtype in sorted({g.dtype for g in grads}, key=str):
        group = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in group])
        if divisor != 1:
            flat.div_(divisor)
        dist.all_reduce(flat)
        offset = 0
        for g in group:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def check_params_equal(model: nn.Module, step: int) -> None:
    """All-reduce MIN and MAX of a float64 parameter checksum; unequal means ranks
    diverged (a bug or a silent corruption). Costs two tiny all-reduces.

    Raises:
        RuntimeError: the checksums differ across ranks.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    s = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
    lo, hi = s.clone().reshape(1), s.clone().reshape(1)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    if lo.item() != hi.item():
        raise RuntimeError(f"parameter checksum differs across ranks at step {step}: "
                           f"min {lo.item()!r} max {hi.item()!r}")


def _fsdp_units(module: nn.Module) -> Iterator[nn.Module]:
    """Sub-modules sharded as their own FSDP unit: transformer blocks, else the top-level
    children that hold parameters (one all-gather per unit)."""
    blocks = getattr(module, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        yield from blocks
        return
    for child in module.children():
        if any(True for _ in child.parameters()):
            yield child


def build_strategy(cfg: Config, module: nn.Module, device: torch.device,
                   world_size: int, total_steps: Optional[int] = None) -> Strategy:
    """Wrap ``module`` (already on ``device``) per ``cfg.parallel.strategy``.
    ``total_steps``: the run's optimizer steps (for ``powersgd_start_step``).

    Raises:
        ValueError: an unknown strategy (the config refuses it first).
    """
    name = cfg.parallel.strategy
    if name == "ddp":
        return DDPStrategy(cfg, module, device, world_size, total_steps=total_steps)
    if name == "zero1":
        s = DDPStrategy(cfg, module, device, world_size, zero=True, total_steps=total_steps)
        s.name = "zero1"
        return s
    if name == "fsdp":
        return FSDPStrategy(cfg, module, device, world_size)
    raise ValueError(f"parallel.strategy={name!r} unknown; choose ddp, zero1 or fsdp")
