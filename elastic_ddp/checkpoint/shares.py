"""Replicated state among the ranks of a checkpoint: which rank writes (and, at a
restore, reads) each tensor that every rank holds identically (ddp's model and optimizer,
zero1's model), so that the ranks share the bytes instead of each copying all of them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

#: The parts of ``model_optimizer_state`` that every rank holds identically, per strategy:
#: ddp replicates model and optimizer; zero1 the model (its optimizer is partitioned);
#: fsdp's parts are DTensors, each rank holding its shard.
REPLICATED_PARTS = {"ddp": ("model", "optim"), "zero1": ("model",)}


def share_owners(state: dict[str, Any], parts, world_size: int) -> dict[tuple[str, str], int]:
    """The rank that writes (and, at a restore, reads) each plain tensor of the replicated
    ``parts`` of ``state``: ``{(part, key): rank}``. Tensors by size, largest first (ties
    by key), each to the rank with the fewest bytes so far (ties to the lowest rank), the
    greedy "largest first" rule for balancing (Graham 1969, "Bounds on multiprocessing
    timing anomalies"); the same on every rank, since the replicated tensors' shapes are.
    DTensors (a rank's shard) and non-tensor values are not in it."""
    from torch.distributed.tensor import DTensor

    sizes = []
    for part in parts:
        for key, value in state.get(part, {}).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                sizes.append((-value.numel() * value.element_size(), part, key))
    loads = [0] * world_size
    owners = {}
    for neg, part, key in sorted(sizes):
        owner = min(range(world_size), key=lambda r: (loads[r], r))
        loads[owner] -= neg
        owners[(part, key)] = owner
    return owners


def replicated_share(state: dict[str, Any], parts, rank: int, world_size: int) -> dict[str, Any]:
    """``state`` with the plain tensors of its replicated ``parts`` cut to ``rank``'s share
    (``share_owners``), so that each rank stages (copies to host memory) and writes only
    what it writes anyway, and at a restore reads only its share (the rest arrives by
    broadcast from the rank that read it).

    DCP's planner would dedup the replicated tensors at the plan, after ``async_save``
    has staged the whole state on every rank: a world_size-fold copy for a 1/world_size
    write. Non-tensor values (step counts, learning rates) stay on every rank; DCP dedups
    them. The checkpoint's metadata is the union of the ranks' plans, so a restore at any
    world size finds every key."""
    owners = share_owners(state, parts, world_size)
    out = dict(state)
    for part in parts:
        if part in out:
            out[part] = {k: v for k, v in out[part].items() if owners.get((part, k), rank) == rank}
    return out


def broadcast_shares(state: dict[str, Any], parts, world_size: int) -> None:
    """After each rank loaded its ``replicated_share`` of ``state`` in place: every other
    tensor of the replicated ``parts`` from the rank that read it (one broadcast per
    tensor, in ``share_owners``' order, on the job's process group). Collective."""
    for (part, key), owner in share_owners(state, parts, world_size).items():
        dist.broadcast(state[part][key], src=owner)
