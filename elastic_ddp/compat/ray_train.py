"""Ray Train V2 internals the controller side uses: the controller and worker-group
callback bases (Ray exports only ``UserCallback``), the retry policy of a worker that dies
while its group starts, and an actor's death time from the GCS.

Version guard: ``compat.versions`` (override ``controller_events``) lists the Ray releases
these were tested on; on any other the launcher leaves ``ControllerEvents`` (their only
user) out of the run, and this module still imports.
"""

from __future__ import annotations

from typing import Optional

try:
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
except ImportError:  # a Ray release that moved them: ControllerEvents only has to be definable
    class ControllerCallback:  # type: ignore[no-redef]
        pass

    class WorkerGroupCallback:  # type: ignore[no-redef]
        pass

__all__ = ["ControllerCallback", "WorkerGroupCallback", "actor_death_time", "retry_worker_deaths_at_start"]


def retry_worker_deaths_at_start() -> None:
    """Make a worker that dies while its group starts a retryable failure (run in the
    controller's process, by ``ControllerEvents.after_controller_start``).

    Ray Train (2.56 to 2.60) turns a ``RayActorError`` raised while it launches the train
    function (``WorkerGroup._start_impl``: ``ray.get(run_train_fn)`` is outside the block that
    wraps actor deaths as ``WorkerGroupStartupFailedError``) into a ``ControllerError``,
    which its failure policy retries only for the startup errors listed in
    ``failure_handling.default.RETRYABLE_CONTROLLER_ERRORS``: a kill in that window ended
    the job. The same death a moment later is an ordinary, retried worker failure.
    Retries of controller errors are bounded by ``FailureConfig.controller_failure_limit``
    (the launcher sets it)."""
    from ray.exceptions import RayActorError
    from ray.train.v2._internal.execution.failure_handling import default

    if RayActorError not in default.RETRYABLE_CONTROLLER_ERRORS:
        default.RETRYABLE_CONTROLLER_ERRORS = (*default.RETRYABLE_CONTROLLER_ERRORS, RayActorError)


def actor_death_time(actor_id: Optional[str]) -> Optional[float]:
    """When the GCS saw actor ``actor_id`` die (seconds since the epoch), or None.

    Ray has no public API for an actor's end time (``ray.util.state.get_actor`` needs the
    dashboard, which a cluster may not run); ``ray._private.state.actors`` reads the GCS
    table. It buys the kill-to-restart figure of every restart; any error gives None."""
    if not actor_id:
        return None
    try:
        import ray._private.state as state

        info = state.actors(actor_id=actor_id)
        end = info.get("EndTime") if isinstance(info, dict) else None
        return end / 1000.0 if end else None
    except Exception:  # noqa: BLE001 - bookkeeping only
        return None
