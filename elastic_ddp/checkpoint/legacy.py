"""Checkpoints of format ``elastic-ddp/2``: the whole state in one ``state.pt`` (model,
optimizer, progress, counters, data). They still load, at any world size: a run resumes
across the change of format, and its next checkpoint is sharded."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from elastic_ddp.checkpoint.layout import LEGACY_FORMAT, LEGACY_STATE_FILE, CheckpointError


def is_legacy(directory: str | os.PathLike) -> bool:
    return (Path(directory) / LEGACY_STATE_FILE).is_file()


def load_state(directory: str | os.PathLike) -> dict[str, Any]:
    """Read ``directory/state.pt`` with ``weights_only=True`` (no arbitrary pickles).
    Costs the whole state in this process's memory.

    Raises:
        CheckpointError: file missing, unreadable, or not an elastic-ddp checkpoint.
    """
    import torch

    path = Path(directory) / LEGACY_STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: no {LEGACY_STATE_FILE}; not an elastic-ddp checkpoint "
                              "directory of format elastic-ddp/2")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means "not ours"
        raise CheckpointError(f"{path}: cannot be loaded safely ({type(e).__name__}: {e}); "
                              "refusing it. Only checkpoints written by elastic-ddp load.") from e
    fmt = state.get("format") if isinstance(state, dict) else type(state).__name__
    if fmt != LEGACY_FORMAT:
        raise CheckpointError(f"{path}: format {fmt!r} is not {LEGACY_FORMAT!r}; refusing a "
                              "checkpoint that is not ours")
    return state
