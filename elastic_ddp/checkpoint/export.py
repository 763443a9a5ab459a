"""A checkpoint's model alone, for use outside training: one plain PyTorch state dict
(``torch.save``; loads with ``torch.load(weights_only=True)`` into the task's model), or
a safetensors file when ``out`` ends in ``.safetensors``.

The checkpoint is a local directory or a URI (``s3://``, ``gs://``, ``file://``). Only
the model's entries are read, each by a ranged read of its shard
(``checkpoint.store_reader``): the optimizer state is never loaded nor copied to local
disk. Before anything is written, every file the export reads (``.metadata`` and the
shards that hold the model) is checked against the checkpoint's manifest: its size, and
its checksum (XXH3), hashed by streaming the whole file once in a thread while the model
loads; so a verified export reads those files once in full plus the model's bytes, and
``verify=False`` (``--no-verify``) the model's bytes and the index only.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from elastic_ddp.checkpoint.layout import LEGACY_STATE_FILE, MANIFEST, CheckpointError

#: What a rejected checkpoint's line ends with: the fix.
_FIX = "restore the file from a copy, or export another checkpoint of the run"


class CheckpointDamagedError(CheckpointError):
    """A checkpoint that is incomplete or whose files differ from its manifest."""


def _where(checkpoint) -> tuple[Any, str, str]:
    """(file system, path on it, the name to show: the URI or path as given)."""
    from elastic_ddp.paths import uri_to_filesystem

    shown = os.fspath(checkpoint)
    try:
        fs, path = uri_to_filesystem(shown)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{shown}: {e}") from e
    return fs, path.rstrip("/"), shown.rstrip("/")


def _kinds(fs, path: str, names: list[str]) -> dict[str, bool]:
    import pyarrow.fs as pafs

    infos = fs.get_file_info([f"{path}/{n}" for n in names])
    return {n: i.type == pafs.FileType.File for n, i in zip(names, infos)}


def _read_manifest(fs, path: str, shown: str, verify: bool):
    """The manifest (None: ``verify`` off). Raises CheckpointError: not a
    checkpoint directory; CheckpointDamagedError: no manifest (a write cut short) or one
    that does not parse."""
    import json

    import pyarrow.fs as pafs

    try:
        there = _kinds(fs, path, [MANIFEST, ".metadata"])
        is_dir = fs.get_file_info(path).type == pafs.FileType.Directory
    except OSError as e:
        raise CheckpointError(f"{shown}: cannot be read ({e})") from e
    if not there[MANIFEST]:
        if not (there[".metadata"] or (is_dir and _has_shards(fs, path))):
            raise CheckpointError(f"{shown}: not an elastic-ddp checkpoint directory (no "
                                  f"{MANIFEST} and .metadata); give a checkpoint_step<k> "
                                  "directory of the run's storage path")
        if verify:
            raise CheckpointDamagedError(
                f"checkpoint {shown}: incomplete: its write did not finish (no {MANIFEST}); "
                "export an older checkpoint of the run, or --no-verify to read it as it is")
    if not verify:
        return None
    try:
        with fs.open_input_stream(f"{path}/{MANIFEST}") as f:
            manifest = json.loads(f.read())
        manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointDamagedError(f"checkpoint {shown}: {MANIFEST} is damaged ({e}); "
                                     f"{_FIX}") from e
    return manifest


def _has_shards(fs, path: str) -> bool:
    import pyarrow.fs as pafs

    try:
        infos = fs.get_file_info(pafs.FileSelector(path))
    except OSError:
        return False
    return any(i.base_name.endswith(".distcp") for i in infos)


def model_state(checkpoint: str | os.PathLike, verify: bool = True) -> dict[str, torch.Tensor]:
    """The model's state dict (parameter names without DDP's ``module.`` prefix, full
    CPU tensors) of the checkpoint at ``checkpoint`` (a directory or a URI), either format.

    ``verify``: every file read is checked against the manifest (size, then XXH3) and
    nothing is returned unless all pass. Off: no manifest needed, nothing compared.

    Raises:
        CheckpointError: not a checkpoint directory of elastic-ddp, or unreadable.
        CheckpointDamagedError: incomplete (no manifest), or a file missing, of another
            size or checksum than its manifest names, or not loadable.
    """
    fs, path, shown = _where(checkpoint)
    try:
        legacy = _kinds(fs, path, [LEGACY_STATE_FILE])[LEGACY_STATE_FILE]
    except OSError as e:
        raise CheckpointError(f"{shown}: cannot be read ({e})") from e
    if legacy:
        return _legacy(fs, path)
    manifest = _read_manifest(fs, path, shown, verify)
    from elastic_ddp.checkpoint.checksum import (
        digest_bytes, manifest_algo, size_mismatches, start_verify)
    from elastic_ddp.checkpoint.store_reader import METADATA, StoreReader, files_of, load_keys

    def damaged(bad: list[str]) -> CheckpointDamagedError:
        return CheckpointDamagedError(f"checkpoint {shown}: {'; '.join(bad)}; {_FIX}")

    reader = StoreReader(path, fs)
    if manifest is not None:
        bad = _unlisted(manifest, [METADATA]) or size_mismatches(fs, path, manifest, [METADATA])
        if bad:
            raise damaged(bad)
    try:
        raw = reader.metadata_bytes()
    except OSError as e:
        raise damaged([f"{METADATA} (unreadable: {e})"]) from e
    if manifest is not None:  # the index is checked before it is unpickled
        algo = manifest_algo(manifest)
        got, want = digest_bytes(raw, algo), manifest["files"][METADATA].get(algo)
        if got != want:
            raise damaged([f"{METADATA} ({algo} {got}, the manifest says {want})"])
    try:
        files = files_of(reader.read_metadata(), "model.")
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise damaged([f"{METADATA} (not DCP's index: {type(e).__name__}: {e})"]) from e
    if not files:
        raise CheckpointError(f"checkpoint {shown}: no model entries (no key model.*) in "
                              f"{METADATA}; not a checkpoint of elastic-ddp's trainer")
    check = None
    if manifest is not None:
        bad = _unlisted(manifest, files) or size_mismatches(fs, path, manifest, files)
        if bad:
            raise damaged(bad)
        check = start_verify(fs, path, manifest, files)
    state, error = None, None
    try:
        state = load_keys(path, "model.", reader=reader)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if not isinstance(e, Exception) and type(e).__name__ != "CheckpointException":
            raise
        error = e
    if check is not None and (bad := check.result()):
        raise damaged(bad)
    if error is not None:
        text = str(error).strip().splitlines()
        raise damaged([f"cannot be loaded ({type(error).__name__}: "
                       f"{text[-1][:300] if text else ''})"]) from error
    return state


def _unlisted(manifest: dict, names: list[str]) -> list[str]:
    return [f"{n} (not in its {MANIFEST})" for n in names if n not in manifest["files"]]


def _legacy(fs, path: str) -> dict[str, torch.Tensor]:
    """A format elastic-ddp/2 checkpoint's model (one ``state.pt``, downloaded whole where
    it is not on local disk)."""
    from elastic_ddp.checkpoint.dcp_io import local_copy
    from elastic_ddp.checkpoint.legacy import load_state

    with local_copy(fs, path) as d:
        return load_state(d)["model"]


def export(checkpoint: str | os.PathLike, out: str | os.PathLike,
           verify: bool = True) -> dict[str, Any]:
    """Write the checkpoint's model to ``out`` (``.safetensors``: safetensors, which must
    be installed; anything else: ``torch.save`` of the plain state dict), once every file
    read has verified (``verify``). Returns ``{"out", "tensors", "bytes"}``.

    Raises:
        CheckpointError / CheckpointDamagedError: as ``model_state``; nothing is written.
        ModuleNotFoundError: safetensors missing.
    """
    return save_model(model_state(checkpoint, verify), out)


def save_model(sd: dict[str, torch.Tensor], out: str | os.PathLike) -> dict[str, Any]:
    """``export``'s write: ``sd`` to ``out`` under a temporary name beside it, then
    renamed: the name asked for holds a whole file or nothing (a failed write removes
    the temporary file)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        if out.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp))
        else:
            torch.save(sd, tmp)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"out": str(out), "tensors": len(sd), "bytes": out.stat().st_size}


def read_run_state(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """The run state (``progress``, ``counters``, ``data``) of a local checkpoint
    directory, either format (a legacy ``state.pt`` is loaded whole for it)."""
    import json

    from elastic_ddp.checkpoint.layout import RUN_STATE
    from elastic_ddp.checkpoint.state import run_state_of

    d = Path(checkpoint_dir)
    if (d / LEGACY_STATE_FILE).is_file():
        from elastic_ddp.checkpoint.legacy import load_state

        state = load_state(d)
    else:
        state = json.loads((d / RUN_STATE).read_text())
    return run_state_of(state)
