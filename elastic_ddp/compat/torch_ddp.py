"""torch's DDP communication-hook internals the parallel layer uses.

- :func:`compress_hook`: ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.
  _compress_hook(dtype, process_group, bucket)``, the body of torch's public
  ``bf16_compress_hook`` and ``fp16_compress_hook`` with the dtype as an argument. It
  buys bf16 compression of the gradient all-reduce on gloo and CPUs, which DDP refuses
  for the public ``bf16_compress_hook`` by its name unless CUDA and NCCL >= 2.10, with
  torch's own code (its path under ``torch.compile`` included). Version guard: on a torch
  release of :data:`~elastic_ddp.compat.versions.TESTED_TORCH` that still has the
  function; elsewhere :func:`public_compress_hook`, the same cast, division by the
  group's size, all-reduce and copy back into the bucket through public calls only
  (no functional-collective path: a hook compiled by ``torch.compile`` graph-breaks there).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from elastic_ddp.compat.versions import TESTED_TORCH, tested_release


def public_compress_hook(dtype: torch.dtype, process_group, bucket) -> torch.futures.Future:
    """The bucket's gradients all-reduced in ``dtype`` and averaged over
    ``process_group`` (None: the default group), written back into the bucket's buffer
    in its own dtype; a future of that buffer."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(group.size())

    def decompress(fut):
        buffer.copy_(fut.value()[0])  # in place: no second full-size buffer
        return buffer

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def _torch_compress_hook():
    """torch's ``_compress_hook``, or None where the guard says not to use it."""
    if not tested_release("torch", TESTED_TORCH):
        return None
    try:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    except ImportError:  # pragma: no cover - a torch without DDP comm hooks
        return None
    return getattr(default_hooks, "_compress_hook", None)


_PRIVATE = _torch_compress_hook()


def compress_hook(dtype: torch.dtype, process_group, bucket) -> torch.futures.Future:
    """DDP's compression hook for ``dtype`` (see the module's note): torch's on a tested
    release, :func:`public_compress_hook` elsewhere."""
    if _PRIVATE is not None:
        return _PRIVATE(dtype, process_group, bucket)
    return public_compress_hook(dtype, process_group, bucket)
