"""The job's MLflow run deleted (or removed for good) while the job runs.

A person cleaning up the MLflow UI deletes the run of a job that is still training.
MLflow then refuses every write to it (``The run ... must be in the 'active' state``;
``RESOURCE_DOES_NOT_EXIST`` once ``mlflow gc`` removed it). Training goes on: the
checkpoints are the product, and the run can be restored from MLflow's trash. The
tracker finds the loss at its next write (:func:`lost_state`) and stops writing; the
driver skips its closing writes and the command exits :data:`EXIT_RUN_LOST` with
:func:`lost_line`.
"""

from __future__ import annotations

from typing import Any, Optional

# elastic-ddp train's exit code: trained and checkpointed, its MLflow run gone.
EXIT_RUN_LOST = 3

DELETED, REMOVED = "deleted", "removed"


def _refusal(e: BaseException) -> bool:
    """``e`` is a store's refusal of a write to a run that is not active (deleted) or
    not there (removed for good)."""
    code = getattr(e, "error_code", None)
    return "must be in the 'active' state" in str(e) or code == "RESOURCE_DOES_NOT_EXIST"


def lost_state(mlflow_client, run_id: str, error: Optional[BaseException] = None) -> Optional[str]:
    """:data:`DELETED` (the run is in MLflow's trash), :data:`REMOVED` (no such run), or
    None (the run is there and active, or the store cannot tell now). With ``error`` (a
    failed write), the store is asked only when that error is such a refusal; without,
    always (one ``get_run``). A store that does not answer is never taken for a loss."""
    if error is not None and not _refusal(error):
        return None
    try:
        info = mlflow_client.get_run(run_id).info
    except Exception as e:  # noqa: BLE001 - sorted out below
        return REMOVED if getattr(e, "error_code", None) == "RESOURCE_DOES_NOT_EXIST" else None
    return DELETED if info.lifecycle_stage == "deleted" else None


def lost_record(state: str, step: int) -> dict[str, Any]:
    """What the tracker keeps and the driver reads: the state and the newest step the
    tracker had seen when the loss was found."""
    return {"state": state, "step": int(step)}


def notice_text(run_id: str, lost: dict[str, Any]) -> str:
    """The console warning, once, when the tracker finds the loss."""
    return (f"MLflow run {run_id} was {lost['state']} while the job runs (found at step "
            f"{lost['step']}): training goes on and checkpoints are written; its metrics "
            "from here on are not recorded")


def lost_line(run_id: str, uri: str, lost: dict[str, Any], checkpoint: Optional[str],
              run_name: str) -> str:
    """The command's last line for a job that trained while its run was gone: what was
    kept, what was not, and the fix."""
    where = f" (the newest checkpoint: {checkpoint})" if checkpoint else ""
    if lost["state"] == DELETED:
        fix = (f"restore the run from MLflow's trash with `MLFLOW_TRACKING_URI={uri} mlflow runs "
               f"restore --run-id {run_id}` (its metrics after step {lost['step']} are not in "
               "it), or set another run.name to train a new run")
    else:
        fix = ("the run cannot be restored (it was removed from the store, e.g. by `mlflow gc`); "
               "set another run.name to train a new run")
    return (f"the model trained and its checkpoints are kept{where}, but its MLflow run "
            f"{run_id} was {lost['state']} during the job (found at step {lost['step']}): its "
            f"metrics from then on, the final model and the summary are not in MLflow; {fix}")


def run_lost_state(uri: str, run_id: str, error: Optional[BaseException] = None) -> Optional[str]:
    """:func:`lost_state` with a client of the store at ``uri``."""
    from elastic_ddp.tracking.store import client

    return lost_state(client(uri), run_id, error)
