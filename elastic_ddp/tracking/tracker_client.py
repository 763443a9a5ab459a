"""The tracker actor's start on the head node (:func:`start_tracker`), a resumed run's
worker-group starts so far (:func:`attempts_so_far`), and what a worker holds of the
tracker: the fire-and-forget :class:`TrackerClient`."""

from __future__ import annotations

import json
from typing import Any, Optional

from elastic_ddp.tracking.store import ATTEMPTS_TAG, WORLD_SIZES_TAG, run_info
from elastic_ddp.tracking.tracker import JobTracker


def start_tracker(uri: str, run_id: Optional[str] = None, attempts: Optional[dict[str, Any]] = None):
    """The job's :class:`JobTracker` actor on the head node (no CPU reserved). Started by
    the driver as soon as Ray is up, before the run is open, so that its process starts
    while the driver waits for the MLflow helper rather than beside the Ray Train
    controller; ``tracker.bind.remote(run_id, **attempts)`` then names the run. With
    ``run_id`` it is bound at once. ``attempts``: a resumed run's worker-group starts so
    far (:func:`attempts_so_far`, read from the run's tags)."""
    import uuid

    import ray

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from elastic_ddp.compat.ray_nodes import head_node_id

    # On the head node: its loss ends the cluster anyway, while any worker node may be
    # removed mid-job. The driver's own node is not enough: a driver connected to a
    # multi-node cluster on one machine (``ray.cluster_utils``, ``ray start`` several
    # times) may be attached to a worker node's raylet.
    cls = ray.remote(num_cpus=0, max_concurrency=8)(JobTracker)
    return cls.options(
        name=f"elastic-ddp-tracker-{run_id or uuid.uuid4().hex}", get_if_exists=True,
        # Hard affinity: with soft=True Ray placed it on a worker node when the head's
        # worker processes were busy, and removing that node failed the job.
        scheduling_strategy=NodeAffinitySchedulingStrategy(head_node_id(), soft=False),
    ).remote(uri, run_id, **(attempts or {}) if run_id else {})



def attempts_so_far(uri: str, run_id: str) -> dict[str, Any]:
    """A resumed run's worker-group starts so far, from its tags: the keyword arguments
    ``attempts_before``/``world_sizes_before`` of :meth:`JobTracker.bind` ({} when the
    tags are unreadable)."""
    tags = run_info(uri, run_id).data.tags
    try:
        return {"attempts_before": int(tags.get(ATTEMPTS_TAG, 0)),
                "world_sizes_before": [int(w) for w in json.loads(tags.get(WORLD_SIZES_TAG, "[]"))]}
    except (ValueError, TypeError):
        return {}


class TrackerClient:
    """What a worker holds: fire-and-forget calls to the tracker actor; every method is a
    no-op when ``enabled`` is False (all ranks but 0), so callers never branch on rank."""

    def __init__(self, actor, enabled: bool = True):
        self.actor = actor if enabled else None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.actor is not None:
            self.actor.log_metrics.remote({k: float(v) for k, v in metrics.items()}, int(step))

    def set_tags(self, tags: dict[str, Any]) -> None:
        if self.actor is not None:
            self.actor.set_tags.remote(tags)

    def attempt(self, **marks: Any) -> None:
        if self.actor is not None:
            self.actor.attempt.remote(**marks)

    def event(self, event: dict[str, Any]) -> None:
        """An event the run keeps (``events/events.json``), e.g. a rejected checkpoint."""
        if self.actor is not None:
            self.actor.event.remote(event)

    def nonfinite_rows(self, report: dict[str, Any]) -> None:
        """This rank's rows with a non-finite loss (``JobTracker.nonfinite_rows``)."""
        if self.actor is not None:
            self.actor.nonfinite_rows.remote(report)

    def start_attempt(self, world_size: int) -> Optional[dict[str, Any]]:
        """Rank 0: count this worker-group start (``JobTracker.start_attempt``); None on
        other ranks or when the tracker does not answer in 30 s."""
        if self.actor is None:
            return None
        import ray

        try:
            return ray.get(self.actor.start_attempt.remote(int(world_size)), timeout=30)
        except Exception:  # noqa: BLE001 - tracking never fails training
            return None

