"""The end of a job on the driver: the final model, goodput, recovery and start-up
tables into the job's MLflow run, and the summary the CLI prints; or, for a job that
failed or was stopped, its run closed as FAILED or KILLED."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from elastic_ddp import tracking
from elastic_ddp.config import Config
from elastic_ddp.tracking.history import LAST_STEP_TAG
from elastic_ddp.tracking.run_lost import DELETED, REMOVED, lost_line, lost_record, run_lost_state
from elastic_ddp.driver.report import (Summary, goodput, goodput_parts, lost_s_per_fault,
                                         mlflow_ui_command, nonfinite_summary, recovery_events,
                                         startup_breakdown)



def _as_location(storage: str, path: str) -> str:
    """``path`` (a checkpoint's path on the storage's file system, as Ray Train names it:
    ``bucket/prefix/...`` on an object store) as a user gives it back to elastic-ddp
    (``elastic-ddp export``): with the storage URI's scheme on an object store
    (``s3://bucket/prefix/...``), unchanged on local disk."""
    from elastic_ddp.paths import is_uri

    scheme = storage.split("://", 1)[0].lower() if is_uri(storage) else ""
    if scheme in ("", "file") or is_uri(path):
        return path
    return f"{scheme}://{path}"

def finish_job(cfg: Config, uri: str, run_id: str, tracker, result, t0: float,
               ledger_dir: Optional[str], marks: dict, task=None, sample=None, n_train: int = 1,
               storage: str = "", model=None) -> Summary:
    """Close a finished job: flush the tracker, read the newest complete checkpoint, log
    the final model (``model/model.pt`` and an MLflow PyTorch model), goodput, wall
    seconds, start-up and recovery tables into the run, mark it FINISHED, and return the
    :class:`~elastic_ddp.driver.report.Summary`. ``t0``: the job's start (seconds since the
    epoch); ``n_train``: training rows (the fractional epochs of a ``max_steps`` run);
    ``model``: the module the driver's dry run built on the CPU (``tasks.dry_run.DryRun``),
    which takes the final weights for the MLflow model; None: the model is built here.

    A run deleted or removed under the job (the tracker found it, or it is found here)
    gets no more writes: the summary's ``mlflow_run_lost`` holds the line that says so
    and names the fix (``tracking.run_lost``); the checkpoints are all there."""
    import ray

    from elastic_ddp.checkpoint import checkpoint_step, newest_complete

    # Everything the workers and the controller sent, written before the run is read back.
    ray.get(tracker.flush.remote(60), timeout=90)
    snap = ray.get(tracker.snapshot.remote())
    lost = snap.get("run_lost")
    seen = int(snap["latest"].get("step", 0))
    run = None
    try:
        run = tracking.run_info(uri, run_id)
    except Exception as e:  # noqa: BLE001 - a removed run is the one error expected here
        if run_lost_state(uri, run_id, e) is None:
            raise
        lost = lost or lost_record(REMOVED, seen)
    if run is not None and run.info.lifecycle_stage == "deleted" and not lost:
        lost = lost_record(DELETED, seen)

    def write(fn, *args, **kwargs) -> None:
        """One write to the run; none once the run is lost, and a write refused because
        the run was deleted meanwhile marks it lost (any other error is raised)."""
        nonlocal lost
        if lost:
            return
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - sorted out below
            state = run_lost_state(uri, run_id, e)
            if state is None:
                raise
            lost = lost_record(state, seen)

    # The job's wall time runs from its MLflow run's first start: a resubmitted job's
    # committed seconds span every submission, and so must the time they are divided by.
    wall_start = min(t0, run.info.start_time / 1000.0) if run is not None else t0
    wall = time.time() - wall_start
    attempts = None
    if ledger_dir:
        from elastic_ddp.ledger import LedgerError, read_attempts

        try:
            attempts = read_attempts(ledger_dir)
        except LedgerError:
            attempts = None
    events = recovery_events(snap, attempts)
    startup = startup_breakdown(snap, marks)
    state: dict = {}
    weights = None
    ckpt = result.checkpoint
    model_id = None
    # A newer complete one in storage: written by a partial per-step quorum, or persisted
    # by a worker just before the controller stopped polling.
    newer = newest_complete(storage, cfg.run.name, checkpoint_step(ckpt.path) if ckpt else -1) \
        if storage else None
    ckpt = newer or ckpt
    if ckpt is not None:
        import tempfile

        from elastic_ddp.checkpoint.export import model_state, read_run_state, save_model

        with ckpt.as_directory() as d, tempfile.TemporaryDirectory(prefix="elastic-ddp-model-") as out:
            state = read_run_state(d)
            # The final model alone, loadable in plain PyTorch (no DDP "module." prefix);
            # the optimizer state is never read.
            weights = model_state(d)
            save_model(weights, Path(out) / "model.pt")
            write(tracking.log_artifact, uri, run_id, str(Path(out) / "model.pt"), "model")
            for name in ("config.json", "run_state.json"):
                if (Path(d) / name).is_file():
                    write(tracking.log_artifact, uri, run_id, str(Path(d) / name), "model")
    counters = state.get("counters", {})
    progress = state.get("progress", {})
    gp = goodput(counters.get("committed_train_s", 0.0), wall)
    step = int(progress.get("step", 0))
    parts = goodput_parts(snap, marks, wall_start, wall, counters.get("committed_train_s", 0.0), events,
                          steps=step)
    per_fault = lost_s_per_fault(parts, wall, events)
    if weights is not None and task is not None and not lost:
        model_id = _log_mlflow_model(cfg, uri, run_id, task, weights, sample, step, model)
    # One value each, at the last step: scalars of the whole job (the UI's "Model
    # metrics" section); the start-up phases are a table, not eleven one-bar charts.
    write(tracking.log_metrics, uri, run_id, {"goodput": gp, "wall_s": wall,
                                              **({"startup_s": startup["total_s"]} if startup else {}),
                                              **({"lost_s_per_fault": per_fault} if per_fault is not None else {})},
          step)
    for ev in events:  # at the step training resumed from: on the loss curve's axis
        if "recovery_s" in ev:
            write(tracking.log_metrics, uri, run_id, {"recovery_s": ev["recovery_s"]},
                  ev.get("resumed_at_step", 0))
    rows = [_event_row(e) for e in events if e.get("type") != "config_change"]
    if rows:
        write(tracking.log_table, uri, run_id, rows, "events/recovery.json")
    if startup:
        started = tracking.iso_time(marks.get("process_start", t0))
        write(tracking.log_table, uri, run_id, [
            {"phase": k.removesuffix("_s"), "seconds": v, "submission_started": started}
            for k, v in startup.items()], "startup.json")
    metrics = {k: v for k, v in snap["latest"].items() if k.startswith("val_")}
    summary = Summary(
        run_id=run_id, tracking_uri=uri, experiment_id=run.info.experiment_id if run is not None else "",
        metrics=dict(sorted(metrics.items())), steps=step, epochs=int(progress.get("epoch", 0)),
        wall_s=wall, world_sizes_seen=counters.get("world_sizes_seen", []),
        restarts=int(counters.get("restarts", 0)), goodput=gp, goodput_parts=parts, events=events,
        startup=startup,
        checkpoint_path=_as_location(cfg.run.storage_path, ckpt.path) if ckpt is not None else None,
        mlflow_ui_command=mlflow_ui_command(uri, run.info.experiment_id, run_id) if run is not None else "",
        skipped_steps=int(counters.get("skipped_steps", 0)),
        epochs_done=int(progress.get("epoch", 0)) + progress.get("cursor", 0) / max(1, n_train),
        tracking={k: snap.get(k) for k in ("delayed", "dropped", "last_error", "unavailable_s", "run_lost")},
        model_id=model_id, nonfinite=nonfinite_summary(snap.get("nonfinite", []), cfg.data.id_column),
        lost_s_per_fault=per_fault)
    write(tracking.log_text, uri, run_id, json.dumps(asdict(summary), indent=1, default=str), "summary.json")
    write(tracking.finish_run, uri, run_id, ok=True)
    if lost:
        summary.mlflow_run_lost = lost_line(run_id, uri, lost, summary.checkpoint_path, cfg.run.name)
    return summary


def _event_row(ev: dict) -> dict:
    """A restart event as a table row: its time as ISO text (never a number of seconds
    since the epoch), the cause, the world sizes, recovery and recomputed steps."""
    row = {"index": ev.get("index"), "type": ev.get("type"), "time": tracking.iso_time(ev["t"]),
           "cause": ev.get("cause", ""), "world_size_before": ev.get("world_size_before"),
           "world_size_after": ev.get("world_size_after"),
           "resumed_at_step": ev.get("resumed_at_step"), "recovery_s": ev.get("recovery_s"),
           "steps_recomputed": ev.get("steps_recomputed")}
    row.update({k: v for k, v in ev.items() if k not in row and k != "t"})
    return row


def _log_mlflow_model(cfg: Config, uri: str, run_id: str, task, weights: dict, sample,
                      step: int, model=None) -> Optional[str]:
    """Load the final weights into ``model`` (the dry run's CPU module), or into the job's
    model built from its task when there is none, and log it as an MLflow PyTorch model;
    its signature comes from one forward call on the val sample row. A model that cannot
    be built, loaded or pickled is reported and skipped (the plain ``model/model.pt`` is
    there either way).

    Without a dry-run module (a model over ``tasks.dry_run.CPU_DRY_RUN_PARAMS``) the
    model is built on the meta device and takes ``weights``' tensors as its own
    (``load_state_dict(assign=True)``), so the driver holds one copy of the weights, not
    two; a model whose build leaves tensors outside its state dict (non-persistent
    buffers) is built on the CPU instead, at the cost of a second copy."""
    import sys

    try:
        if model is None:
            model = _module_holding(cfg, task, weights)
        else:
            # Strict: every parameter and persistent buffer (batch-norm statistics too) is
            # replaced by the checkpoint's.
            model.load_state_dict(weights)
        model.eval()
        example = _forward_example(model, task, sample)
        return tracking.log_model(uri, run_id, model, example, step)
    except Exception as e:  # noqa: BLE001 - the run's other records matter more
        print(f"elastic-ddp: warning: the final model was not logged as an MLflow model "
              f"({type(e).__name__}: {str(e)[:300]}); model/model.pt holds its weights",
              file=sys.stderr, flush=True)
        return None


def _module_holding(cfg: Config, task, weights: dict):
    """The job's model with ``weights`` as its parameters and buffers (strict: every
    entry used, none missing). Raises what the build or ``load_state_dict`` raises."""
    import itertools

    import torch

    from elastic_ddp.tasks.loading import build_model

    with torch.device("meta"):
        model = build_model(cfg, task)
    model.load_state_dict(weights, assign=True)
    if not any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        return model
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, task)
    model.load_state_dict(weights)
    return model


def _forward_example(model, task, sample) -> Optional[tuple]:
    """(input, output) of the model's forward on one sample row, seen through a forward
    hook while the task evaluates it (the task decides how a batch reaches the model);
    None unless both are single tensors."""
    import torch

    if not sample or "val" not in sample:
        return None
    seen: list = []
    handle = model.register_forward_hook(lambda m, args, out: seen.append((args, out)))
    try:
        with torch.no_grad():
            task.evaluate(model, task.collate(sample["val"]))
    except Exception:  # noqa: BLE001 - no signature then
        return None
    finally:
        handle.remove()
    if not seen:
        return None
    args, out = seen[0]
    if len(args) == 1 and torch.is_tensor(args[0]) and torch.is_tensor(out):
        return args[0], out
    return None


def after_failed_fit(tracker) -> None:
    """A controller that died (rather than failed) leaves its placement group reserved
    (where Ray Train's own placement-group cleaner is kept, that removes it)."""
    import ray

    from elastic_ddp.compat.ray_placement_groups import (driver_removes_placement_groups,
                                                remove_leftover_placement_groups)
    from elastic_ddp.compat.versions import ray_plan

    if not driver_removes_placement_groups(ray_plan()):
        return
    try:
        timeline = ray.get(tracker.snapshot.remote(), timeout=10)["timeline"]
        removed = remove_leftover_placement_groups(timeline)
    except Exception:  # noqa: BLE001 - the job's own error is the one to raise
        return
    if removed:
        print(f"elastic-ddp: removed {len(removed)} placement group(s) the stopped Ray Train "
              "controller left reserved", flush=True)


def close_failed(uri: str, run_id: str, tracker, msg: str, status: str, opener=None) -> None:
    """Close the job's run as ``status`` (FAILED, KILLED) with ``msg`` as its error and
    the newest step the tracker saw (``elastic_ddp.last_step``, for the resume's
    recovery event), after the MLflow helper (``opener``) and the tracker's buffered
    metrics; a store that does not answer leaves a warning, never an error in place of
    the job's own."""
    import ray

    if opener is not None:
        opener.finish()

    tags = {}
    if tracker is not None:
        try:
            ray.get(tracker.flush.remote(30), timeout=40)
            step = ray.get(tracker.progress.remote(), timeout=10).get("step")
            if step:  # how far it got: a resume's steps recomputed (history.resume_event)
                tags[LAST_STEP_TAG] = int(step)
        except Exception:  # noqa: BLE001 - closing the run matters more than the last metrics
            pass
    try:
        tracking.finish_run(uri, run_id, ok=False, error=msg, status=status, tags=tags)
    except Exception as e:  # noqa: BLE001 - the job's own error is the one to raise
        import sys

        print(f"elastic-ddp: warning: could not mark MLflow run {run_id} {status} "
              f"({type(e).__name__}: {e}); it may still read RUNNING", file=sys.stderr, flush=True)
