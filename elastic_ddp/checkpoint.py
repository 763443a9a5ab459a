"""Checkpoint files: the trainer's full state in one ``state.pt``, written atomically,
read back with ``torch.load(weights_only=True)`` and a format check.

Layout of a checkpoint directory (what ``ray.train.report`` persists and
``ray.train.get_checkpoint()`` hands back)::

    state.pt      {"format", "model" (no DDP "module." prefix), "optimizer", "progress",
                   "counters", "data", ...}: the schema is ``Trainer.state_dict()``'s
                   (``elastic_ddp.worker.trainer``), its only writer and reader
    config.json   the job's config, so the checkpoint is self-describing

Load the model in plain PyTorch::

    sd = torch.load("state.pt", weights_only=True)["model"]
    model.load_state_dict(sd)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Optional

# torch is imported where a state is written or read, not here: the Ray Train controller
# imports this module for the storage helpers (events.ElasticEvents, after a failure),
# and a torch import there would sit between the failure and the restart.

FORMAT = "elastic-ddp/2"
STATE_FILE = "state.pt"
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, or not written by elastic-ddp."""


def save_state(directory: str | os.PathLike, state: dict[str, Any],
               config: dict | None = None,
               before_replace: Optional[Callable[[Path], None]] = None) -> Path:
    """Write ``state`` to ``directory/state.pt`` atomically: to a temporary name, fsync,
    then ``os.replace``, so a crash mid-write never leaves a truncated ``state.pt``.

    ``before_replace(tmp_path)`` is a test hook (fault injection): it runs after the
    temporary file is written and before the rename, i.e. inside the window a crash
    must not corrupt.

    Costs one full serialisation of model + optimizer (a copy to CPU memory for CUDA
    tensors) and one fsync.
    """
    import torch

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / (STATE_FILE + ".tmp")
    with open(tmp, "wb") as f:
        torch.save({"format": FORMAT, **state}, f)
        f.flush()
        os.fsync(f.fileno())
    if before_replace is not None:
        before_replace(tmp)
    os.replace(tmp, d / STATE_FILE)
    if config is not None:
        (d / "config.json").write_text(json.dumps(config, indent=2))
    # Written last: a copy of this directory (Ray Train persisting it to storage) that
    # was cut short has no manifest, or a state.pt of another size.
    (d / MANIFEST).write_text(json.dumps({"state_bytes": (d / STATE_FILE).stat().st_size,
                                          "format": FORMAT}))
    return d / STATE_FILE


def load_state(directory: str | os.PathLike) -> dict[str, Any]:
    """Read ``directory/state.pt`` with ``weights_only=True`` (no arbitrary pickles).

    Raises:
        CheckpointError: file missing, unreadable, or not an elastic-ddp checkpoint.
    """
    import torch

    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: no {STATE_FILE}; not an elastic-ddp checkpoint "
                              "directory (expected one written by ray.train.report)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means "not ours"
        raise CheckpointError(f"{path}: cannot be loaded safely ({type(e).__name__}: {e}); "
                              "refusing it. Only checkpoints written by elastic-ddp load.") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {state.get('format') if isinstance(state, dict) else type(state).__name__!r}"
                              f" is not {FORMAT!r}; refusing a checkpoint that is not ours")
    return state


def unwrap_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict without DDP's ``module.`` prefix (loadable in plain
    PyTorch and at any world size)."""
    inner = getattr(model, "module", model)
    return {k: v.detach().cpu() for k, v in inner.state_dict().items()}


def checkpoint_step(path: str) -> int:
    """The step in a ``checkpoint_step<k>`` directory name (-1 for another name)."""
    import re

    m = re.search(r"checkpoint_step(\d+)/?$", str(path))
    return int(m.group(1)) if m else -1


def newest_complete(storage_path: str, run_name: str, newer_than: int = -1):
    """The newest checkpoint under ``storage_path/run_name`` whose copy is complete (its
    manifest names the size its ``state.pt`` has), as a ``ray.train.Checkpoint``, if its
    step is above ``newer_than``; else None.

    Why: ``ray.train.report`` persists a checkpoint before the controller registers it
    (at its next poll), so a worker that dies right after a report restarts from the
    previous one in ``ray.train.get_checkpoint()``. Storage knows better."""
    import re

    import pyarrow.fs as pafs

    from elastic_ddp.paths import uri_to_filesystem

    fs, base = uri_to_filesystem(storage_path)
    base = f"{base.rstrip('/')}/{run_name}"
    try:
        infos = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    except OSError:
        return None
    steps = sorted(((int(m.group(1)), i.path) for i in infos
                    if i.type == pafs.FileType.Directory
                    and (m := re.fullmatch(r"checkpoint_step(\d+)", i.base_name))), reverse=True)
    for step, path in steps:
        if step <= newer_than:
            break
        try:
            with fs.open_input_stream(f"{path}/{MANIFEST}") as f:
                manifest = json.loads(f.read())
            if fs.get_file_info(f"{path}/{STATE_FILE}").size == manifest["state_bytes"]:
                from ray.train import Checkpoint

                return Checkpoint(path, filesystem=fs)
        except (OSError, ValueError, KeyError):
            continue
    return None


def report(state: Optional[dict[str, Any]], metrics: dict[str, float], step: int,
           config: dict | None = None,
           before_replace: Optional[Callable[[Path], None]] = None) -> None:
    """Commit a checkpoint through Ray Train: every rank calls it (``ray.train.report`` is
    a barrier); the rank holding ``state`` (rank 0; None elsewhere) writes it to a
    temporary directory that Ray Train copies into ``storage_path/name/checkpoint_step<k>``.
    The steps before it count as committed once it returns.
    """
    import tempfile

    import ray.train
    from ray.train import Checkpoint

    metrics = {k: float(v) for k, v in metrics.items()}
    if state is None:
        ray.train.report(metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory(prefix="elastic-ddp-ckpt-") as d:
        save_state(d, state, config=config, before_replace=before_replace)
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d),
                         checkpoint_dir_name=f"checkpoint_step{step:08d}")
