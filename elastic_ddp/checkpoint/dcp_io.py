"""Reading a DCP checkpoint directory: a local view of one on any file system, and the
entries under one key prefix alone (the model without the optimizer state)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
from typing import Any, Iterator

import torch

# What DCP's load and save warn on every call made without a process group, even when
# the caller asked for one process (no_dist=True).
_SINGLE_PROCESS_WARNING = (r"torch\.distributed is disabled, unavailable or uninitialized, "
                           r"assuming the intent is to (load|save) in a single process")


@contextlib.contextmanager
def single_process(no_dist: bool = True) -> Iterator[None]:
    """Around a DCP load or save that is meant to run in one process (``no_dist``): that
    warning alone is silenced, within the block; any other warning shows. ``no_dist``
    False: nothing is changed (a collective call without a process group still warns)."""
    if not no_dist:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
        yield


class local_copy:
    """A local directory holding the checkpoint at ``path``: itself on a local file
    system, else a downloaded copy (removed on exit)."""

    def __init__(self, fs, path: str):
        self.fs, self.path, self.tmp = fs, path, None

    def __enter__(self) -> str:
        import pyarrow.fs as pafs

        if isinstance(self.fs, pafs.LocalFileSystem):
            return self.path
        self.tmp = tempfile.mkdtemp(prefix="elastic-ddp-restore-")
        pafs.copy_files(self.path, self.tmp, source_filesystem=self.fs)
        return self.tmp

    def __exit__(self, *exc) -> None:
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


def load_prefix(directory, prefix: str, no_dist: bool = True) -> dict[str, Any]:
    """The entries of a DCP checkpoint whose key starts with ``prefix`` (the prefix
    stripped), as full CPU tensors, read from the shards that hold them and nothing
    else (``model.``: the model alone, no optimizer state). ``directory``: a local
    checkpoint directory, or a DCP storage reader. Costs one copy of those entries in
    memory."""
    from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata
    from torch.distributed.checkpoint import load as dcp_load

    reader = FileSystemReader(directory) if isinstance(directory, (str, os.PathLike)) else directory
    meta = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    if not state:
        return {}
    with single_process(no_dist):
        dcp_load(state, storage_reader=reader, no_dist=no_dist)
    return {k[len(prefix):]: v for k, v in state.items()}


def powersgd_keys(h, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """PowerSGD's state (``PowerSGDState`` ``h``) as DCP keys: iteration, warm-start P/Q
    (replicated) and this rank's error feedback (``err<rank>.<bucket>``)."""
    out = {"iter": torch.tensor(int(h.iter)), "world_size": torch.tensor(world_size)}
    out.update({f"p.{k}": v.detach().cpu() for k, v in h.p_memory_dict.items()})
    out.update({f"q.{k}": v.detach().cpu() for k, v in h.q_memory_dict.items()})
    out.update({f"err{rank}.{k}": v.detach().cpu() for k, v in h.error_dict.items()})
    return out


def load_powersgd_keys(strategy, d, rank: int, world_size: int) -> None:
    """Restore ``powersgd_keys`` from checkpoint directory (or storage reader) ``d`` into the strategy's hook
    state; a rank's error feedback only at the world size it was written at (elsewhere
    it no longer matches the rank's share of the gradient and restarts from zero)."""
    saved = load_prefix(d, "comm_hook.", no_dist=True)
    if not saved:
        return
    h = strategy.hook_state
    dev = next(strategy.module.parameters()).device
    h.iter = int(saved["iter"])
    h.p_memory_dict = {int(k[2:]): v.to(dev) for k, v in saved.items() if k.startswith("p.")}
    h.q_memory_dict = {int(k[2:]): v.to(dev) for k, v in saved.items() if k.startswith("q.")}
    if int(saved["world_size"]) == world_size:
        p = f"err{rank}."
        h.error_dict = {int(k[len(p):]): v.to(dev) for k, v in saved.items() if k.startswith(p)}
