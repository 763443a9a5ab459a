"""A checkpoint directory on storage, its manifest and its checksums (no torch here: the
Ray Train controller imports this module after a failure, and a torch import there would
sit between the failure and the restart).

A checkpoint of step k is the directory ``storage_path/run.name/checkpoint_step<k>``
(8 digits) holding::

    .metadata             torch.distributed.checkpoint's index of the shards
    __<rank>_<i>.distcp   each writing rank's part of the model and optimizer state
    run_state.json        progress, counters, the data fingerprint: small and exact
    config.json           the job's config, so the checkpoint is self-describing
    manifest.json         written last: format, step, world size, strategy, the checksum
                          algorithm, and every file's size and checksum of the bytes as
                          written (``checkpoint.checksum``: XXH3-64; crc32 in older ones)
    rejected.json         only in a checkpoint a restore rejected: its bad files

A directory without a manifest, or whose files do not have the sizes the manifest names,
is not complete (a write or a copy cut short) and is never restored from. A directory
with ``rejected.json`` failed its checks once: it is never tried again, and is kept (the
evidence) until the run's pruning removes it like any other.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from elastic_ddp.errors import EXIT_BAD_INPUT, ElasticDDPError

FORMAT = "elastic-ddp/3"
LEGACY_FORMAT = "elastic-ddp/2"
MANIFEST = "manifest.json"
RUN_STATE = "run_state.json"
CONFIG = "config.json"
REJECTED = "rejected.json"
LEGACY_STATE_FILE = "state.pt"


class CheckpointError(ElasticDDPError, RuntimeError):
    """A checkpoint that is missing, unreadable, or not written by elastic-ddp."""

    exit_code = EXIT_BAD_INPUT
    kind = "checkpoint error"


class CheckpointCorruptError(CheckpointError):
    """No checkpoint of the run passes its checksums (the CLI exits 2 on it)."""


#: ``checkpoint_step<k>``, or ``checkpoint_step<k>_r<n>``: step k written again after a
#: restore from an older checkpoint, beside the first one (which Ray Train may have
#: registered and will delete by its own bookkeeping: it is never rewritten in place).
_NAME = re.compile(r"checkpoint_step(\d+)(?:_r(\d+))?")


def checkpoint_name(step: int, rewrite: int = 0) -> str:
    return f"checkpoint_step{step:08d}" + (f"_r{rewrite}" if rewrite else "")


def _order(name: str) -> Optional[tuple[int, int]]:
    m = _NAME.fullmatch(name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def checkpoint_step(path: str) -> int:
    """The step in a ``checkpoint_step<k>`` directory name (-1 for another name)."""
    o = _order(str(path).rstrip("/").rsplit("/", 1)[-1])
    return o[0] if o else -1


#: The file systems made for storage URIs, by the URI and the environment that configures
#: them: making an S3 file system costs 50-300 ms (its client and credential chain), paid
#: inside the training-blocked part of every checkpoint otherwise.
_FILESYSTEMS: dict[tuple, tuple] = {}
_FS_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION",
           "AWS_PROFILE", "AWS_ACCESS_KEY_ID", "GOOGLE_APPLICATION_CREDENTIALS")


def run_dir(storage_path: str, run_name: str):
    """(pyarrow file system, the run's directory on it). The file system of a URI is made
    once per process and configuration (pyarrow's file systems are thread-safe; an S3
    client refreshes expiring credentials itself)."""
    import os

    from elastic_ddp.paths import is_uri, uri_to_filesystem

    if is_uri(storage_path):
        key = (str(storage_path), *(os.environ.get(k) for k in _FS_ENV))
        if key not in _FILESYSTEMS:
            _FILESYSTEMS[key] = uri_to_filesystem(storage_path)
        fs, base = _FILESYSTEMS[key]
    else:
        fs, base = uri_to_filesystem(storage_path)
    return fs, f"{base.rstrip('/')}/{run_name}"


def free_name(fs, base: str, step: int) -> str:
    """The directory name for step ``step`` under the run's directory ``base``:
    ``checkpoint_step<k>``, or the next ``_r<n>`` when a checkpoint of that step with a
    manifest is there (one a restore rejected or passed over: Ray Train may have registered
    it, so it is left alone). A directory without a manifest is a write cut short: removed
    and reused."""
    import pyarrow.fs as pafs

    n = 0
    while True:
        name = checkpoint_name(step, n)
        info = fs.get_file_info(f"{base}/{name}")
        if info.type == pafs.FileType.NotFound:
            return name
        if fs.get_file_info(f"{base}/{name}/{MANIFEST}").type == pafs.FileType.NotFound:
            fs.delete_dir(f"{base}/{name}")
            return name
        n += 1


def read_manifest(fs, path: str) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``.

    Raises:
        OSError: no manifest. ValueError: not JSON.
    """
    with fs.open_input_stream(f"{path}/{MANIFEST}") as f:
        return json.loads(f.read())


def is_complete(fs, path: str, manifest: dict) -> bool:
    """Every file the manifest names exists with its recorded size (a stat per file; no
    read). A legacy ``state.pt`` manifest names the one file's size as ``state_bytes``."""
    import pyarrow.fs as pafs

    if manifest.get("format") == LEGACY_FORMAT or "state_bytes" in manifest:
        sizes = {LEGACY_STATE_FILE: manifest["state_bytes"]}
    else:
        sizes = {n: r["bytes"] for n, r in manifest["files"].items()}
    infos = fs.get_file_info([f"{path}/{n}" for n in sizes])
    return all(i.type == pafs.FileType.File and i.size == want
               for i, want in zip(infos, sizes.values()))


def complete_checkpoints(storage_path: str, run_name: str, newer_than: int = -1,
                         sizes: bool = True, rejected: bool = False) -> list[tuple[int, str]]:
    """``(step, path)`` of the run's complete checkpoints above ``newer_than``, newest
    first (``is_complete``: sizes only, no read). ``sizes=False``: every one with a
    manifest (a restore then names the files whose size is wrong). Checkpoints marked
    rejected (:func:`mark_rejected`) are left out unless ``rejected``."""
    import pyarrow.fs as pafs

    fs, base = run_dir(storage_path, run_name)
    try:
        infos = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    except OSError:
        return []
    steps = sorted(((o, i.path) for i in infos
                    if i.type == pafs.FileType.Directory and (o := _order(i.base_name))), reverse=True)
    marked = set() if rejected else rejected_paths(fs, [p for _, p in steps])
    out = []
    for (step, _), path in steps:
        if step <= newer_than:
            break
        if path in marked:
            continue
        try:
            manifest = read_manifest(fs, path)
            if not sizes or is_complete(fs, path, manifest):
                out.append((step, path))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return out


def newest_complete(storage_path: str, run_name: str, newer_than: int = -1):
    """The newest complete checkpoint under ``storage_path/run_name`` as a
    ``ray.train.Checkpoint``, if its step is above ``newer_than``; else None.

    Why: ``ray.train.report`` persists a checkpoint before the controller registers it
    (at its next poll), so a worker that dies right after a report restarts from the
    previous one in ``ray.train.get_checkpoint()``. Storage knows better."""
    found = complete_checkpoints(storage_path, run_name, newer_than)
    if not found:
        return None
    from ray.train import Checkpoint

    fs, _ = run_dir(storage_path, run_name)
    return Checkpoint(found[0][1], filesystem=fs)


def incomplete_checkpoints(storage_path: str, run_name: str, newer_than: int) -> list[str]:
    """Paths of the run's checkpoint directories above step ``newer_than`` that are not
    complete (a write cut short): removed at a restore, so nothing half-written stays."""
    import pyarrow.fs as pafs

    fs, base = run_dir(storage_path, run_name)
    try:
        infos = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    except OSError:
        return []
    dirs = [i.path for i in infos if i.type == pafs.FileType.Directory
            and checkpoint_step(i.base_name) > newer_than]
    done = {p for _, p in complete_checkpoints(storage_path, run_name, newer_than)}
    kept = done | rejected_paths(fs, dirs)  # a rejected one is evidence, pruned as any other
    return [p for p in dirs if p not in kept]


def rejected_paths(fs, paths: list[str]) -> set[str]:
    """The checkpoint directories among ``paths`` marked rejected (one stat each, in one
    call)."""
    import pyarrow.fs as pafs

    if not paths:
        return set()
    try:
        infos = fs.get_file_info([f"{p}/{REJECTED}" for p in paths])
    except OSError:
        return set()
    return {p for p, i in zip(paths, infos) if i.type == pafs.FileType.File}


def mark_rejected(fs, path: str, bad: list[str], by: str) -> None:
    """Mark the checkpoint at ``path`` rejected (``rejected.json``: when, by whom, its bad
    files): no restore, final model or storage scan uses it again. Never raises (a
    read-only storage leaves it unmarked: it is then checked, and rejected, again)."""
    import time

    try:
        with fs.open_output_stream(f"{path}/{REJECTED}") as out:
            out.write(json.dumps({"t": time.time(), "by": by, "bad_files": list(bad)}, indent=1).encode())
    except OSError:
        pass


def rejected_reasons(fs, path: str) -> Optional[list[str]]:
    """The bad files recorded in the rejected checkpoint at ``path`` (None: not marked)."""
    try:
        with fs.open_input_stream(f"{path}/{REJECTED}") as f:
            return list(json.loads(f.read()).get("bad_files") or ["(marked rejected)"])
    except (OSError, ValueError, AttributeError):
        return None


def none_verifies(run_name: str, rejected: list[tuple[str, list[str]]]) -> str:
    """The error when checkpoints exist and none verifies: every bad file of each
    (``rejected``: path, bad files), then the fix."""
    return (f"no checkpoint of run {run_name!r} verifies: "
            + "; ".join(f"{p}: {', '.join(b)}" for p, b in rejected)
            + ". Restore the files from a copy, or start a new run (another run.name)")


def describe(manifest: Optional[dict]) -> str:
    """``"step k, world size N, fsdp"`` for log lines."""
    if not manifest:
        return "?"
    return (f"step {manifest.get('step')}, world size {manifest.get('world_size')}, "
            f"{manifest.get('strategy')}")
