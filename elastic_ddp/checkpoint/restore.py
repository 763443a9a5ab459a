"""Restoring a checkpoint (``CheckpointManager.restore``): the newest complete checkpoint
of the run whose files verify, loaded into the strategy on every rank; a checkpoint with a
bad file is named, marked rejected on storage and skipped for the next older one.

Each function takes the rank's :class:`~elastic_ddp.checkpoint.manager.CheckpointManager`
(``mgr``: the storage, the run, this rank in the job, its collectives, log, tracker and
fence).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

from elastic_ddp.fencing import check as check_fence
from elastic_ddp.checkpoint.checksum import share_of, size_mismatches, start_verify
from elastic_ddp.checkpoint.dcp_io import load_powersgd_keys, local_copy, single_process
from elastic_ddp.checkpoint.layout import (
    FORMAT, LEGACY_FORMAT, RUN_STATE, CheckpointCorruptError, CheckpointError,
    complete_checkpoints, describe, incomplete_checkpoints, is_complete, mark_rejected,
    none_verifies, read_manifest, rejected_paths, run_dir)
from elastic_ddp.checkpoint.shares import REPLICATED_PARTS, broadcast_shares, replicated_share
from elastic_ddp.checkpoint.state import (model_optimizer_state, run_state_of,
                                          set_model_optimizer_state)


def restore(mgr, strategy, ray_checkpoint=None) -> Optional[tuple[dict, str]]:
    """Load the newest checkpoint that verifies into ``strategy``; every rank calls it.
    Candidates: the run's complete checkpoints in storage, newest first (a report the
    controller had not registered yet included), else Ray Train's. Each rank checks
    the size and checksum of its share of the files (:func:`load_verified`); a checkpoint
    with a bad file is named in a warning and a ``checkpoint_rejected`` event, and the
    next older one is tried (its load overwrites all of the rejected one's state).

    Returns:
        (the run state, the checkpoint's path), or None: no checkpoint (a fresh start).
    Raises:
        CheckpointCorruptError: checkpoints exist and none verifies.
        CheckpointError: the newest that verifies does not fit this config's model.
    """
    fs = None
    cands: list[str] = []
    if mgr.storage:
        fs, _ = run_dir(mgr.storage, mgr.run_name)
        cands = [p for _, p in complete_checkpoints(mgr.storage, mgr.run_name, sizes=False)]
    if not cands and ray_checkpoint is not None and not rejected_paths(
            ray_checkpoint.filesystem, [ray_checkpoint.path]):
        fs, cands = ray_checkpoint.filesystem, [ray_checkpoint.path]
    cands = mgr.broadcast(cands)
    rejected: list[tuple[str, list[str]]] = []
    for path in cands:
        manifest = read_manifest(fs, path)
        if manifest.get("format") == LEGACY_FORMAT or "state_bytes" in manifest:
            if not is_complete(fs, path, manifest):
                rejected.append((path, ["state.pt (not the size its manifest names)"]))
                reject(mgr, path, rejected[-1][1], fs)
                continue
            return load_legacy(mgr, strategy, fs, path), path
        names = sorted(manifest["files"])
        share = share_of(names, mgr.rank, mgr.world_size) if mgr.collective else names
        bad = mgr.all_ranks(size_mismatches(fs, path, manifest, share))
        if not bad:
            bad, run_state = load_verified(mgr, strategy, fs, path, manifest, share)
        if bad:
            rejected.append((path, bad))
            reject(mgr, path, bad, fs)
            continue
        # Restart mode only: every rank is restoring, so no write is under way (in
        # per-step mode a replacement restores while the quorum may be writing).
        if mgr.rank == 0 and mgr.storage and (mgr.collective or mgr.world_size == 1):
            check_fence(mgr.fence, "the removal of incomplete checkpoints")
            for p in incomplete_checkpoints(mgr.storage, mgr.run_name, manifest["step"]):
                if p not in {r[0] for r in rejected}:
                    fs.delete_dir(p)
        mgr.log(f"restored {path} ({describe(manifest)}) at world size {mgr.world_size}")
        return run_state, path
    if rejected:
        raise CheckpointCorruptError(none_verifies(mgr.run_name, rejected))
    return None


def reject(mgr, path: str, bad: list[str], fs=None) -> None:
    """Reject the checkpoint at ``path`` (``bad``: its bad files). Rank 0 says so (this
    process's stderr; the driver's console through the tracker's notices, as it
    happens), records a ``checkpoint_rejected`` event, and marks the checkpoint rejected
    on storage, so that no later restore tries it (or warns about it) again."""
    text = (f"checkpoint {path} fails its checksums: {', '.join(bad)}; "
            "trying the previous checkpoint")
    if mgr.rank == 0:
        msg = f"elastic-ddp: warning: {text}"
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()
        mgr.log(msg)
        if fs is not None:
            mark_rejected(fs, path, bad, by=f"a restore at world size {mgr.world_size}")
        if mgr.tracker is not None:
            mgr.tracker.event({"type": "checkpoint_rejected", "t": time.time(),
                               "checkpoint": path, "bad_files": bad, "cause": msg,
                               "warning": text})


def load_verified(mgr, strategy, fs, path: str, manifest: dict,
                  share: list[str]) -> tuple[list[str], Optional[dict]]:
    """Load the checkpoint at ``path`` while a thread hashes this rank's ``share`` of its
    files (the bytes the load reads, from the page cache: the check costs its hashing,
    on a core of its own where one is free). Only DCP's read touches unverified bytes:
    the state reaches the optimizer, the hook and the run state once every rank's files
    verify, and no step runs before. Returns (every rank's bad files, the run state:
    None when a file is bad). Raises CheckpointError: the files verify and do not fit
    this config's model."""
    import contextlib

    import pyarrow.fs as pafs
    from torch.distributed.checkpoint import CheckpointException, FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    from elastic_ddp.checkpoint.remote_read import overlay, share_view
    from elastic_ddp.checkpoint.store_reader import StoreReader
    from elastic_ddp.checkpoint.verified_read import VerifiedReader, verifiable

    local = isinstance(fs, pafs.LocalFileSystem)
    blocks = verifiable(manifest)
    # Shards with block checksums: every byte DCP loads is read by a ranged read and
    # verified (``VerifiedReader``), on local disk and object storage alike, so a rank
    # reads about its share at any world size; the small files of its share (.metadata,
    # run_state.json, config.json) are hashed whole. Else (older manifests) the share of
    # the files is hashed whole: on object storage downloaded (and verified there), the
    # rest of what a rank loads by ranged reads; never the whole checkpoint.
    if blocks:
        share = [n for n in share if not n.endswith(".distcp")]
    view = (contextlib.nullcontext(path) if local or blocks
            else share_view(fs, path, sorted(set(share) | {".metadata"})))
    views: list = []

    def reader():
        if blocks:
            views.append(VerifiedReader(path, fs, manifest))
            return views[-1]
        if local:
            return FileSystemReader(d)
        view, remote_bytes = overlay(fs, path, d)
        views.append(remote_bytes)
        return StoreReader(path, filesystem=view)

    with view as d:
        check = start_verify(pafs.LocalFileSystem() if not blocks else fs, d, manifest, share)
        state, error = model_optimizer_state(strategy), None
        # Replicated tensors (ddp, zero1's model): each rank reads its share, then the
        # shares are broadcast; a world_size-fold read becomes one read and a broadcast.
        parts = (REPLICATED_PARTS.get(strategy.name, ())
                 if mgr.collective and mgr.world_size > 1 else ())
        mine = replicated_share(state, parts, mgr.rank, mgr.world_size)
        try:
            with single_process(not mgr.collective):
                dcp_load(mine, storage_reader=reader(), no_dist=not mgr.collective)
            for part in parts:  # DCP sets non-tensor values in the dicts it was given
                state[part].update(mine[part])
        # DCP wraps every rank's error in a CheckpointException (a BaseException).
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            error = e
        bad = mgr.all_ranks(check.result() + sorted(
            {b for v in views if isinstance(v, VerifiedReader) for b in v.bad}))
        if bad:
            return bad, None
        if parts and not mgr.all_ranks([mgr.rank] if error is not None else []):
            broadcast_shares(state, parts, mgr.world_size)
        try:
            if error is None:
                set_model_optimizer_state(strategy, state)
        except Exception as e:  # noqa: BLE001 - as DCP's: the state does not fit
            error = e
        if error is not None:
            raise misfit(path, describe(manifest), error) from error
        if strategy.hook_state is not None:
            load_powersgd_keys(strategy, reader(), mgr.rank, mgr.world_size)
        with fs.open_input_stream(f"{path}/{RUN_STATE}") as f:
            run_state = json.loads(f.read())
        if blocks:  # the shards' verified reads, the small files hashed, run_state.json
            mgr.read_bytes = (sum(v.bytes_read for v in views)
                              + sum(manifest["files"][n]["bytes"] for n in share)
                              + len(json.dumps(run_state)))
        elif not local:
            mgr.read_bytes = (sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))
                              + sum(n() for n in views))
    return [], run_state_of(run_state)


def load_legacy(mgr, strategy, fs, path: str) -> dict:
    """Load a checkpoint of format ``elastic-ddp/2`` (one ``state.pt``, the full state)
    into ``strategy``; returns its run state. Raises CheckpointError: it does not fit."""
    from elastic_ddp.checkpoint.legacy import load_state

    with local_copy(fs, path) as d:
        state = load_state(d)
    try:
        strategy.load_full_state(state)
    except (RuntimeError, ValueError, KeyError) as e:
        raise misfit(path, f"format {LEGACY_FORMAT}", e) from e
    mgr.log(f"restored {path} (format {LEGACY_FORMAT}: one state.pt); the next checkpoint "
            f"is written in format {FORMAT}")
    return run_state_of(state)


def misfit(path: str, what: str, e: BaseException) -> CheckpointError:
    """The error for a checkpoint at ``path`` (``what``: its description) whose state
    does not fit this config's model or optimizer (``e``: torch's error)."""
    return CheckpointError(
        f"checkpoint {path} ({what}) does not fit this config's model/optimizer "
        f"({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}); resume it "
        "with its own config (config.json beside it) or set a new run.name")
