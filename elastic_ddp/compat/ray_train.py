"""Ray Train V2 internals the controller side uses: the controller and worker-group
callback bases (Ray exports only ``UserCallback``), the retry policy and the clean-up of a
worker that dies while its group starts, and an actor's death time from the GCS.

Version guard: ``compat.versions`` (override ``controller_events``) lists the Ray releases
these were tested on; on any other the launcher leaves ``ControllerEvents`` (their only
user) out of the run, and this module still imports.
"""

from __future__ import annotations

import functools
from typing import Optional

try:
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
except ImportError:  # a Ray release that moved them: ControllerEvents only has to be definable
    class ControllerCallback:  # type: ignore[no-redef]
        pass

    class WorkerGroupCallback:  # type: ignore[no-redef]
        pass

try:
    # A replica group started or replaced alone (per-step mode): after_replica_group_start.
    from ray.train.v2._internal.execution.callback import ReplicaGroupCallback
except ImportError:
    class ReplicaGroupCallback:  # type: ignore[no-redef]
        pass

__all__ = ["ControllerCallback", "ReplicaGroupCallback", "WorkerGroupCallback", "actor_death_time",
           "count_notices_as_preemptions", "host_preemption_watcher", "local_preemption_info", "node_drain",
           "retry_worker_deaths_at_start", "run_in_main_thread", "shut_down_failed_starts",
           "take_preemption", "tell_workers", "user_error"]


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


def shut_down_failed_starts() -> None:
    """Make a worker group whose start fails after its state was built shut that state
    down: its workers, its synchronization actor and its placement group (run in the
    controller's process, by ``ControllerEvents.after_controller_start``).

    Ray Train (2.60) cleans up a failed ``WorkerGroup._start`` only while the group's state
    is unbuilt, and builds it before the ``after_worker_group_start`` callbacks (the
    backend's process-group set-up among them). A worker that dies in one of those (a
    SIGKILL or a lost node while the group starts) fails the start with the placement
    group and the other workers left running, held by no worker group the controller
    knows: every retry then waits for the resources they hold, and a job whose retries
    need them never starts again."""
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    orig = WorkerGroup._start
    if getattr(orig, "_elastic_ddp", False):
        return

    def _start(self):
        try:
            return orig(self)
        except BaseException:
            state = getattr(self, "_worker_group_state", None)
            if state is not None:  # built, then a callback failed: nobody else will
                self._worker_group_state = None
                try:
                    state.shutdown()
                except Exception:  # noqa: BLE001 - the start's own error is what matters
                    pass
            raise

    _start._elastic_ddp = True
    WorkerGroup._start = _start


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


# ------------------------------------------------------------------ preemption (Ray 2.60)
# What these buy: a notice (node drain, a worker's SIGTERM, the driver's stop) becomes a
# checkpoint at the next step boundary (restart mode) or a replica leaving its quorum
# there (per-step mode), and a restart or replacement charged to the preemption budget
# (FailureConfig.max_preemption_failures), not to max_failures. Version guard:
# compat.versions.PREEMPTION_RAY (and preemption_supported); elsewhere none is called.

def user_error(exc: BaseException) -> Optional[BaseException]:
    """The train function's own error inside Ray Train's ``UserExceptionWithTraceback``
    (what ``WorkerGroupError.worker_failures`` holds), or None for any other exception."""
    if type(exc).__name__ == "UserExceptionWithTraceback":
        return getattr(exc, "_base_exc", None)
    return None


_last_preemption: list = []
_predicates: dict = {}


def count_notices_as_preemptions(is_notice, died_after_notice=None) -> None:
    """Make a worker group whose failed ranks all raised a notice's error
    (``is_notice(exc)``: ``notice.Preempted``, the checkpoint at a notice committed), or
    in which a rank died after it was given notice (``died_after_notice(rank, exc)``: a
    SIGTERM, then a kill before the checkpoint at the notice; whatever the other ranks
    raised, as Ray counts a reclaimed node's deaths) a preemption for Ray Train's failure
    policy (charged to ``max_preemption_failures``, as Ray charges a node reclaim), and
    keep every error the policy counts as a preemption for :func:`take_preemption` (run in
    the controller's process, by ``ControllerEvents.after_controller_start``; a later call
    replaces the predicates).

    Ray Train 2.60's ``failure_handling.default._is_preemption_failure`` decides which
    budget a failure spends; it knows ``PreemptionError`` and a reclaimed node's actor
    deaths, not a train function that ended on a notice."""
    from ray.train.v2._internal.execution.failure_handling import default
    from ray.train.v2.api.exceptions import WorkerGroupError

    _predicates.update(is_notice=is_notice, died_after_notice=died_after_notice)
    orig = default._is_preemption_failure
    if getattr(orig, "_elastic_ddp", False):
        return

    def is_preemption(error) -> bool:
        failures = error.worker_failures if isinstance(error, WorkerGroupError) else {}
        died = _predicates.get("died_after_notice")
        ours = bool(failures) and (
            all(_predicates["is_notice"](e) for e in failures.values())
            or (died is not None and any(died(r, e) for r, e in failures.items())))
        if ours or orig(error):
            _last_preemption[:] = [error]
            return True
        return False

    is_preemption._elastic_ddp = True
    default._is_preemption_failure = is_preemption


def take_preemption() -> Optional[dict]:
    """The last failure counted as a preemption (since the previous call), as
    ``{"nodes": [node ids], "deadline_t": s or None, "drain_timed_out": bool,
    "failures": [each failed rank's exception]}`` (nodes and deadline: of a drain Ray
    Train's watcher saw); None when there was none."""
    if not _last_preemption:
        return None
    error = _last_preemption.pop()
    info = getattr(error, "preemption_info", None)
    return {"nodes": list(info.preempted_node_ids) if info is not None else [],
            "deadline_t": info.deadline_ms / 1000.0 if info is not None and info.deadline_ms else None,
            "drain_timed_out": bool(getattr(error, "drain_timed_out", False)),
            "failures": list(getattr(error, "worker_failures", {}).values())}


def local_preemption_info() -> Optional[dict]:
    """On a worker: the node drain Ray Train's preemption watcher reported to this
    worker, without the barrier ``ray.train.get_preemption_info()`` is (a round trip to
    the controller's process per call): ``{"deadline_t": s or None, "nodes": [...],
    "ranks": [...]}``, or None."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        info = get_train_context().preemption_context.preemption_info
    except Exception:  # noqa: BLE001 - no notice is the safe answer
        return None
    if info is None:
        return None
    return {"deadline_t": info.deadline_ms / 1000.0 if info.deadline_ms else None,
            "nodes": list(info.preempted_node_ids), "ranks": list(info.preempted_ranks)}


def draining_nodes() -> set:
    """The ids (hex) of the nodes Ray Core is draining now (the GCS call of
    :func:`node_drain`).

    Raises: what the GCS call raises."""
    import ray._private.state as state

    return set(state.state.get_draining_nodes() or {})


def node_drain(node_id: str) -> Optional[dict]:
    """Whether Ray Core is draining node ``node_id`` (hex): ``{"deadline_t": s or
    None}``, or None (not draining, or the GCS did not answer).

    One GCS call (``ray._private.state.state.get_draining_nodes``, what Ray Train's
    preemption watcher polls; Ray has no public API for it). Per-step mode's replicas
    ask it themselves: Ray Train runs no watcher for replica groups."""
    try:
        import ray._private.state as state

        drained = state.state.get_draining_nodes() or {}
    except Exception:  # noqa: BLE001 - no notice is the safe answer; asked again next poll
        return None
    if node_id not in drained:
        return None
    deadline_ms = drained[node_id]  # 0: no deadline
    return {"deadline_t": deadline_ms / 1000.0 if deadline_ms else None}


def host_preemption_watcher(callbacks: list) -> int:
    """Replace Ray Train's ``PreemptionCallback`` in ``callbacks`` (a Ray Train
    controller's worker-group callbacks, changed in place) by one that runs Ray's
    ``PreemptionWatcher`` in this process, the controller's; returns how many it replaced
    (0 on a Ray without the watcher).

    Ray Train 2.60 starts the watcher as an actor at every worker-group start: a fresh
    Python process that imports Ray and Ray Train (pandas among them) on the cluster's
    cores while the new workers boot, restore and take their first step, and that is
    killed at the group's end. Here the same watcher object (its poll thread: one GCS
    call every ``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S``, and on a drain one
    ``mark_preempt`` call per worker) lives in the controller's process, built per
    group as Ray builds it and stopped at the same points (the group's shutdown and
    abort, the next group's start). What it costs: the poll thread shares the
    controller's process; building the watcher asks the GCS for the node table once
    (Ray's TPU-slice map) on the controller's event loop."""
    try:
        from ray.train.v2._internal.callbacks.preemption_callback import PreemptionCallback
    except ImportError:
        return 0
    hits = [i for i, c in enumerate(callbacks) if type(c) is PreemptionCallback]
    for i in hits:
        callbacks[i] = _hosted_preemption_callback()()
    return len(hits)


@functools.lru_cache(maxsize=None)
def _hosted_preemption_callback():
    from ray.train.v2._internal.callbacks.preemption_callback import PreemptionCallback
    from ray.train.v2._internal.execution.preemption import PreemptionWatcher

    class HostedPreemptionCallback(PreemptionCallback):
        """Ray's ``PreemptionCallback`` (2.60) with its watcher in this process."""

        def after_worker_group_start(self, worker_group) -> None:
            self._stop_watcher()
            node_to_ranks: dict = {}
            by_rank: dict = {}
            for w in worker_group.get_workers():
                rank = w.distributed_context.world_rank
                node_to_ranks.setdefault(w.metadata.node_id, []).append(rank)
                by_rank[rank] = w.actor
            self._watcher = PreemptionWatcher(node_to_ranks=node_to_ranks, poll_interval_s=self._poll_interval_s,
                                              worker_actors_by_rank=by_rank)

        def _stop_watcher(self) -> None:
            watcher, self._watcher = self._watcher, None
            if watcher is not None:
                watcher._stop_event.set()  # its poll thread ends within one poll interval

    return HostedPreemptionCallback


def run_in_main_thread(fn, *args):
    """Run ``fn(*args)`` in this Ray Train worker's main thread (where signal handlers
    are installed) and return its result: the train function runs in a thread of its
    own, and the worker actor's ``execute`` method runs on the main thread."""
    import ray

    return ray.get(ray.get_runtime_context().current_actor.execute.remote(fn, *args), timeout=120)


def tell_workers(worker_group, fn) -> int:
    """Run ``fn()`` in the main thread of every worker of ``worker_group`` (Ray Train's
    ``WorkerGroup``), without waiting; returns how many were told."""
    workers = worker_group.get_workers() if worker_group is not None else []
    for w in workers:
        w.actor.execute.remote(fn)
    return len(workers)
