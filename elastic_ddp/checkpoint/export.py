"""A checkpoint's model alone, for use outside training: one plain PyTorch state dict
(``torch.save``; loads with ``torch.load(weights_only=True)`` into the task's model), or
a safetensors file when ``out`` ends in ``.safetensors``. Only the model's entries are
read (``manager.load_prefix``): the optimizer state is never loaded."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from elastic_ddp.checkpoint.layout import LEGACY_STATE_FILE, MANIFEST, CheckpointError


def model_state(checkpoint_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model's state dict (parameter names without DDP's ``module.`` prefix, full
    CPU tensors) of a local checkpoint directory, either format.

    Raises:
        CheckpointError: not a checkpoint directory of elastic-ddp.
    """
    d = Path(checkpoint_dir)
    if (d / LEGACY_STATE_FILE).is_file():
        from elastic_ddp.checkpoint.legacy import load_state

        return load_state(d)["model"]
    if not (d / MANIFEST).is_file() or not (d / ".metadata").is_file():
        raise CheckpointError(f"{d}: not an elastic-ddp checkpoint directory (no {MANIFEST} and "
                              ".metadata); give a checkpoint_step<k> directory of the run's "
                              "storage path")
    from elastic_ddp.checkpoint.dcp_io import load_prefix

    return load_prefix(str(d), "model.")


def export(checkpoint_dir: str | os.PathLike, out: str | os.PathLike) -> dict[str, Any]:
    """Write the checkpoint's model to ``out`` (``.safetensors``: safetensors, which must
    be installed; anything else: ``torch.save`` of the plain state dict). Returns
    ``{"out", "tensors", "bytes"}``.

    Raises:
        CheckpointError: not a checkpoint. ModuleNotFoundError: safetensors missing.
    """
    return save_model(model_state(checkpoint_dir), out)


def save_model(sd: dict[str, torch.Tensor], out: str | os.PathLike) -> dict[str, Any]:
    """``export``'s write: ``sd`` to ``out`` under a temporary name, then renamed."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp))
    else:
        torch.save(sd, tmp)
    os.replace(tmp, out)  # never a half-written file under the name asked for
    return {"out": str(out), "tensors": len(sd), "bytes": out.stat().st_size}


def read_run_state(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """The run state (``progress``, ``counters``, ``data``) of a local checkpoint
    directory, either format (a legacy ``state.pt`` is loaded whole for it)."""
    import json

    from elastic_ddp.checkpoint.layout import RUN_STATE
    from elastic_ddp.checkpoint.manager import RUN_KEYS

    d = Path(checkpoint_dir)
    if (d / LEGACY_STATE_FILE).is_file():
        from elastic_ddp.checkpoint.legacy import load_state

        state = load_state(d)
    else:
        state = json.loads((d / RUN_STATE).read_text())
    return {k: state[k] for k in RUN_KEYS if k in state}
