"""A resumed run, checked on the driver before Ray starts or its MLflow run is touched:
its checkpoints verify, and this job's config and model fit the one it resumes from.

The rule for a config that differs from the run's (the newest checkpoint that verifies
holds its config as ``config.json``; a run without a checkpoint has its MLflow params):

- refused, exit 2, naming each field: what changes the model or its optimizer state,
  the order of the samples, or the run's length (:data:`FIXED`, and the epoch order's
  settings and data in the checkpoint's run state unless ``data.on_change:
  restart_epoch``), and a model whose parameters do not fit the checkpoint's (the
  task's code changed);
- allowed, with one warning line naming each ``old -> new`` and a ``config_change``
  event and the ``elastic_ddp.config_changes`` tag in the run: every other field (the
  learning rate and the rest of ``optim``, logging and checkpoint cadence, scaling,
  parallelism, the data reader). MLflow params are write-once: they keep the values the
  run started with.

Checkpoints are checked newest first, as a restore takes them: every file's size
against the manifest (a stat each), and on local storage the checksums of every file
of a checkpoint of up to :data:`VERIFY_BYTES` (read at memory speed, about 1-2.5 GB/s
on a loaded 2-core machine from the page cache, which the workers' restore then reads
from). A newer checkpoint that fails is named in a warning as it is found and marked
rejected (``checkpoint.layout.mark_rejected``), so that the workers never try it; with
checkpoints and none that verifies the job is refused, naming every bad file.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from elastic_ddp.config import Config, ConfigError

#: Checksums in the driver for checkpoints of up to this many bytes on local storage
#: (larger ones and object stores: sizes here, checksums in the workers' restore).
VERIFY_BYTES = 1 << 30
#: Fields a resume keeps (a prefix ends in "."): the model, the optimizer's state, the
#: samples each step takes, the run's length.
FIXED = ("task.", "model.", "optim.name", "batch.global_batch_size", "batch.policy",
         "train.epochs", "train.max_steps", "data.id_column")
#: The epoch order's fields: refused through the checkpoint's data identity (or, without
#: a checkpoint, as FIXED) unless ``data.on_change: restart_epoch``.
ORDER = ("seed", "data.order", "data.partitions", "data.shuffle_window_rows", "data.block_rows")
#: Not compared: the run's identity and where it lives.
IGNORED = ("run.", "world_size")
CONFIG_CHANGES_TAG = "elastic_ddp.config_changes"


class ResumeError(ConfigError):
    """The run cannot resume with this job (exit 2): no checkpoint of it verifies, or
    the config or the model differs where a resume must keep it. Nothing was started or
    changed: the run stays resumable with its own config."""

    kind = "resume refused"


@dataclass
class ResumeCheck:
    """What :func:`check_resume` found: the checkpoint the workers will restore (None: the
    run has none), its step, the allowed config changes (``field: (old, new)`` as text),
    and the events and tags to record in the run."""

    path: Optional[str] = None
    step: int = 0
    changes: dict[str, tuple[str, str]] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)


def _is(key: str, names) -> bool:
    return any(key == n or (n.endswith(".") and key.startswith(n)) for n in names)


def flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A config's JSON tree (``config.json``) as dotted keys, as ``Config.to_flat_dict``
    makes them (a ``kwargs`` dict's entries too)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            out.update(flat(v, key))
        else:
            out[key] = v
    return out


def _text(v: Any) -> str:
    from elastic_ddp.tracking.store import param_text

    return param_text(v)


def config_diff(old: dict[str, Any], new: dict[str, Any], order_fixed: bool) -> tuple[dict, dict]:
    """(refused, allowed): ``field: (old, new)`` as text, for the keys both hold.
    ``order_fixed``: the epoch order's fields are refused here (no checkpoint's data
    identity to compare instead)."""
    refused, allowed = {}, {}
    # A kwargs entry given on one side only is a change; another field missing on one
    # side is a field of another mode's (params) or version, not compared.
    keys = [k for k in dict.fromkeys([*new, *old]) if (k in new and k in old) or ".kwargs." in k]
    for k in keys:
        if _is(k, IGNORED):
            continue
        a = _text(old[k]) if k in old else "unset"
        b = _text(new[k]) if k in new else "unset"
        if a == b:
            continue
        fixed = _is(k, FIXED) or (order_fixed and _is(k, ORDER))
        if not fixed and _is(k, ORDER):
            continue  # compared through the checkpoint's data identity
        (refused if fixed else allowed)[k] = (a, b)
    return refused, allowed


def _changes_text(changes: dict) -> str:
    return ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changes.items())


def _verify(fs, path: str, manifest: dict, local: bool) -> list[str]:
    """The bad files of the checkpoint at ``path``: sizes, then checksums where affordable."""
    from elastic_ddp.checkpoint.checksum import bad_files, size_mismatches
    from elastic_ddp.checkpoint.layout import LEGACY_FORMAT, is_complete

    if manifest.get("format") == LEGACY_FORMAT or "state_bytes" in manifest:
        return [] if is_complete(fs, path, manifest) else ["state.pt (not the size its manifest names)"]
    names = sorted(manifest["files"])
    bad = size_mismatches(fs, path, manifest, names)
    if not bad and local and sum(int(r["bytes"]) for r in manifest["files"].values()) <= VERIFY_BYTES:
        bad = bad_files(fs, path, manifest, names)
    return bad


def _read_json(fs, path: str) -> Optional[dict]:
    try:
        with fs.open_input_stream(path) as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


def _warn(text: str) -> None:
    print(f"elastic-ddp: warning: {text}", file=sys.stderr, flush=True)


def newest_that_verifies(storage: str, run_name: str) -> tuple[Optional[str], Optional[dict], list[dict]]:
    """(path, manifest) of the run's newest checkpoint that verifies, and the
    ``checkpoint_rejected`` events of the newer ones that do not (each warned about as
    it is found and marked rejected; one rejected before is skipped silently, or used
    again, its mark removed, when it now verifies in full).

    Raises:
        ResumeError: checkpoints exist and none verifies (none is marked then).
    """
    import pyarrow.fs as pafs

    from elastic_ddp.checkpoint.layout import (REJECTED, complete_checkpoints, mark_rejected,
                                               none_verifies, read_manifest, rejected_paths,
                                               rejected_reasons, run_dir)

    fs, _ = run_dir(storage, run_name)
    local = isinstance(fs, pafs.LocalFileSystem)
    cands = [p for _, p in complete_checkpoints(storage, run_name, sizes=False, rejected=True)]
    marked = rejected_paths(fs, cands)
    bad_ones: list[tuple[str, list[str], bool]] = []  # (path, bad files, rejected before)
    for path in cands:
        try:
            manifest = read_manifest(fs, path)
            bad = _verify(fs, path, manifest, local)
        except (OSError, ValueError, KeyError, TypeError) as e:
            manifest, bad = None, [f"manifest.json (unreadable: {type(e).__name__}: {e})"]
        if path in marked:
            if bad or not local:  # still bad, or not checked in full here: stays rejected
                bad_ones.append((path, bad or rejected_reasons(fs, path) or [], True))
                continue
            fs.delete_file(f"{path}/{REJECTED}")  # restored from a copy: it verifies again
        if bad:
            bad_ones.append((path, bad, False))
            continue
        events = []
        for p, b, before in bad_ones:
            if before:
                continue
            text = f"checkpoint {p} fails its checksums: {', '.join(b)}; trying the previous checkpoint"
            _warn(text)
            mark_rejected(fs, p, b, by="the driver's check before a resume")
            events.append({"type": "checkpoint_rejected", "t": time.time(), "checkpoint": p,
                           "bad_files": b, "cause": f"elastic-ddp: warning: {text}", "by": "driver"})
        return path, manifest, events
    if bad_ones:
        raise ResumeError(none_verifies(run_name, [(p, b) for p, b, _ in bad_ones]))
    return None, None, []


def model_misfit(fs, path: str, model) -> list[str]:
    """How ``model``'s parameters and buffers differ from the ``model.*`` entries of the
    DCP checkpoint at ``path`` (its ``.metadata`` alone is read): shapes, missing and
    extra names; [] when they fit."""
    import os
    import tempfile

    from torch.distributed.checkpoint import FileSystemReader

    with tempfile.TemporaryDirectory(prefix="elastic-ddp-meta-") as d:
        with fs.open_input_stream(f"{path}/.metadata") as src, open(os.path.join(d, ".metadata"), "wb") as out:
            out.write(src.read())
        meta = FileSystemReader(d).read_metadata()
    held = {k[len("model."):]: list(v.size) for k, v in meta.state_dict_metadata.items()
            if k.startswith("model.") and hasattr(v, "size")}
    mine = {k: list(t.shape) for k, t in model.state_dict().items()}
    out = [f"{k}: {held[k]} in the checkpoint, {mine[k]} here" for k in mine
           if k in held and held[k] != mine[k]]
    missing = sorted(set(held) - set(mine))
    extra = sorted(set(mine) - set(held))
    if missing:
        out.append("only in the checkpoint: " + ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else ""))
    if extra:
        out.append("only in this model: " + ", ".join(extra[:5]) + (" ..." if len(extra) > 5 else ""))
    return out


def check_resume(cfg: Config, found: dict, storage: str, fingerprint: str,
                 model: Callable[[], Any]) -> ResumeCheck:
    """Check the resume of the run ``found`` (``tracking.opener.find_job_run``) by this
    job: ``fingerprint``: this job's training data's; ``model()``: this job's model (on
    any device; shapes are read). Prints a warning line for each newer checkpoint that
    fails and for allowed config changes.

    Raises:
        ResumeError: see :class:`ResumeError`, naming the fields or files and the fix.
    """
    from elastic_ddp.checkpoint.layout import CONFIG, LEGACY_FORMAT, RUN_STATE, run_dir
    from elastic_ddp.run_state import DATA_FIELDS, data_identity
    from elastic_ddp.tracking.content import job_params

    name = found.get("ray_run_name") or cfg.run.name
    path, manifest, events = newest_that_verifies(storage, name)
    out = ResumeCheck(path=path, step=int((manifest or {}).get("step") or 0), events=events)
    fs, _ = run_dir(storage, name)
    old_cfg = _read_json(fs, f"{path}/{CONFIG}") if path else None
    where = (f"its checkpoint at step {out.step} ({path})" if path else
             f"its MLflow run {found['run_id']} (its params: the run has no checkpoint yet)")
    if old_cfg is not None:
        refused, allowed = config_diff(flat(old_cfg), cfg.to_flat_dict(), order_fixed=False)
    else:
        refused, allowed = config_diff(found.get("params") or {}, job_params(cfg), order_fixed=path is None)
    fix = (f"Resume it with its own config (the same values: config.json beside the checkpoint, "
           f"or the run's params), or set another run.name to start a new run with this one")
    if refused:
        raise ResumeError(
            f"run {cfg.run.name!r} cannot resume with this config: it differs from {where} in "
            f"{_changes_text(refused)}; a resume keeps what changes the model or its optimizer "
            f"state, the samples of each step or the run's length. {fix}")
    state = _read_json(fs, f"{path}/{RUN_STATE}") if path else None
    if state and isinstance(state.get("data"), dict):
        mine = data_identity(cfg, fingerprint)
        differ = {k: (state["data"].get(k), mine[k]) for k in mine if state["data"].get(k) != mine[k]}
        if differ and cfg.data.on_change == "restart_epoch":  # allowed: the epoch restarts
            allowed.update({DATA_FIELDS[k] if k != "fingerprint" else "training data":
                            (_text(a), _text(b)) if k != "fingerprint" else
                            (f"fingerprint {str(a)[:12]}", f"{str(b)[:12]} (the epoch restarts)")
                            for k, (a, b) in differ.items()})
        elif differ:
            what = ", ".join(DATA_FIELDS.get(k, k) + ("" if k == "fingerprint" else f" {a} -> {b}")
                             for k, (a, b) in differ.items())
            raise ResumeError(
                f"run {cfg.run.name!r}: {where} was written on other data or another sample "
                f"order ({what}): resuming at its cursor would repeat and skip samples. Resume "
                "with the same data and order, set data.on_change=restart_epoch to keep the "
                "weights and restart the epoch, or set another run.name")
    if path and manifest and manifest.get("format") != LEGACY_FORMAT and "state_bytes" not in manifest:
        try:
            mine = model()
        except Exception:  # noqa: BLE001 - a model only its workers can build: they check it
            mine = None
        misfit = model_misfit(fs, path, mine) if mine is not None else []
        if misfit:
            raise ResumeError(
                f"run {cfg.run.name!r}: {where} does not fit this job's model ("
                + "; ".join(misfit[:6]) + ("; ..." if len(misfit) > 6 else "")
                + "): the task's code or its model changed since it was written. Resume with the "
                "code and config that wrote it, or set another run.name")
    if allowed:
        out.changes = allowed
        at = f"step {out.step}" if path else "its start (no checkpoint yet)"
        text = (f"run {cfg.run.name!r} resumes from {at} with a changed config: "
                f"{_changes_text(allowed)}; its MLflow params keep the values it started with, "
                f"the change is recorded in its events (events/events.json) and tag "
                f"{CONFIG_CHANGES_TAG}")
        _warn(text)
        out.events.append({"type": "config_change", "t": time.time(), "step": out.step,
                           "changes": {k: [a, b] for k, (a, b) in allowed.items()}, "cause": text})
        before = (found.get("tags") or {}).get(CONFIG_CHANGES_TAG, "")
        line = f"at step {out.step}: {_changes_text(allowed)}"
        # One line per resume; the newest kept where a tag's length would be exceeded.
        out.tags[CONFIG_CHANGES_TAG] = (f"{before}\n{line}" if before else line)[-4000:]
    return out
