"""Ray Train's checkpoint-manager snapshot against checkpoints that are gone or incomplete.

Ray Train (``ray.train.v2``'s private ``CheckpointManager``) lists every checkpoint it
registered in ``<run dir>/checkpoint_manager_snapshot.json``. A directory it lists can go
under it: the pruning of a job that lost the run's lease before it noticed
(``elastic_ddp.fencing``), a person cleaning up, a bucket's lifecycle rule. Ray Train then
fails the controller twice over:

* at a start, a listed directory that is gone fails its load of the snapshot
  (``CheckpointManagerInitializationError``): :func:`drop_missing_checkpoints` (the
  driver, before ``fit``) removes such entries, and those whose ``manifest.json`` is
  missing (a write that never finished: never restored from), from the snapshot first
  and returns their names, which the launcher records as an event;
* while it runs, its pruning deletes each listed directory through a helper that raises
  ``FileNotFoundError: Path not found`` for one that is gone:
  :func:`skip_missing_deletes` (the controller's process, at its start) makes that
  delete a skipped one, with a line in the controller's log.

What it buys: a run whose listed checkpoints lost a directory resumes from the newest
one that is left instead of failing. What it costs: one listing of the run's directory
and a rewrite of a small JSON file at a resume.

Version guard: the snapshot's format and the deleting helper are Ray 2.60's
(:data:`SNAPSHOT_RAY`); on another release both functions do nothing (Ray Train's own
behaviour).
"""

from __future__ import annotations

import json
from typing import Any

from elastic_ddp.compat.versions import SNAPSHOT_RAY

SNAPSHOT = "checkpoint_manager_snapshot.json"
_NAME = "checkpoint_dir_name"


def _applies() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.__version__ in SNAPSHOT_RAY


def _usable(fs, run_dir: str, name: str) -> bool:
    import pyarrow.fs as pafs

    return fs.get_file_info(f"{run_dir}/{name}/manifest.json").type == pafs.FileType.File


def drop_missing_checkpoints(fs, run_dir: str) -> list[str]:
    """Remove from the snapshot in ``run_dir`` (on pyarrow file system ``fs``) every
    checkpoint whose directory is gone or has no manifest; returns their names (empty:
    the snapshot was left as it was, also when there is none or it cannot be read).

    The lists Ray keeps in step are kept in step (``checkpoint_report_indices`` with
    ``checkpoint_results``, ``pending_validation_specs`` with
    ``pending_training_results``); a removed latest checkpoint is replaced by the newest
    one left."""
    if not _applies():
        return []
    path = f"{run_dir.rstrip('/')}/{SNAPSHOT}"
    try:
        with fs.open_input_stream(path) as f:
            state: dict[str, Any] = json.loads(f.read().decode())
        results = list(state["checkpoint_results"])
        indices = list(state["checkpoint_report_indices"])
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if len(results) != len(indices):
        return []
    gone = sorted({r[_NAME] for r in results if not _usable(fs, run_dir, r[_NAME])})
    if not gone:
        return []
    kept = [(r, i) for r, i in zip(results, indices) if r[_NAME] not in gone]
    state["checkpoint_results"] = [r for r, _ in kept]
    state["checkpoint_report_indices"] = [i for _, i in kept]
    latest = state.get("latest_checkpoint_result")
    if latest is not None and latest.get(_NAME) in gone:
        state["latest_checkpoint_result"] = max(kept, key=lambda p: p[1])[0] if kept else None
    pending = list(state.get("pending_training_results") or [])
    specs = list(state.get("pending_validation_specs") or [])
    if len(pending) == len(specs):
        both = [(r, s) for r, s in zip(pending, specs) if r.get(_NAME) not in gone]
        state["pending_training_results"] = [r for r, _ in both]
        state["pending_validation_specs"] = [s for _, s in both]
    for key in ("validated_checkpoint_dir_names", "timed_out_validation_checkpoint_dir_names",
                "failed_validation_checkpoint_dir_names"):
        if isinstance(state.get(key), list):
            state[key] = [n for n in state[key] if n not in gone]
    tmp = f"{path}.tmp"
    with fs.open_output_stream(tmp) as f:
        f.write(json.dumps(state).encode())
    fs.move(tmp, path)
    return gone


def skip_missing_deletes() -> None:
    """Make Ray Train's pruning skip a listed checkpoint directory that is gone (run in
    the controller's process, by ``ControllerEvents.after_controller_start``), with one
    line in the controller's log naming it."""
    if not _applies():
        return
    from ray.train.v2._internal.execution.checkpoint import checkpoint_manager as cm

    delete = cm.delete_fs_path
    if getattr(delete, "_elastic_ddp", False):
        return

    def delete_if_there(fs, fs_path: str) -> None:
        import pyarrow.fs as pafs

        if fs.get_file_info(fs_path).type == pafs.FileType.NotFound:
            print(f"elastic-ddp: checkpoint {fs_path} listed by Ray Train is gone already; "
                  "its deletion skipped", flush=True)
            return
        delete(fs=fs, fs_path=fs_path)

    delete_if_there._elastic_ddp = True  # type: ignore[attr-defined]
    delete_if_there.__wrapped__ = delete  # type: ignore[attr-defined]
    cm.delete_fs_path = delete_if_there
