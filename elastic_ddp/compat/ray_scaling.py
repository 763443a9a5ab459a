"""Ray Train's elastic scaling policy sized on the nodes that can take a worker now:
alive and not being drained (``count_usable_nodes_only``, override ``usable_node_count``
of ``compat.versions``; Ray 2.60's ``ElasticScalingPolicy`` internals), and the GCS
query it and the per-step capacity wait (``compat.ray_capacity``) share."""

from __future__ import annotations

import threading


def usable_nodes() -> set:
    """The ids (hex) of the nodes that are alive and not being drained now: two GCS calls
    (``ray.nodes``; the draining nodes, ``compat.ray_train.draining_nodes``).

    Raises: what the GCS calls raise."""
    import ray

    from elastic_ddp.compat.ray_train import draining_nodes

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")} - draining_nodes()


def count_usable_nodes_only(policy) -> bool:
    """Make Ray Train's elastic scaling ``policy`` count only the nodes that are alive
    and not being drained now (:func:`usable_nodes`, asked at each decision); True when
    it was changed (False: a policy without those methods, or changed already).

    Ray Train 2.60's ``ElasticScalingPolicy`` counts the workers that fit on the nodes Ray
    Data's ``AutoscalingCoordinator`` reserved for it, and that view lists every node
    ``ray.nodes()`` calls alive, refreshed every 20 s: a node being drained stays in it
    until it is gone, and a removed one up to 20 s longer. After a drain's checkpoint or
    a node's loss, a restart sized by it asks for a worker there, and so does the resize
    monitor's grow of the smaller group that runs meanwhile; the placement group cannot
    be placed, the attempt fails after ``scaling.placement_timeout_s`` (25 s) and is
    retried, again and again while the drained node lives. Here a group that is not
    running is sized on the usable nodes, and a running one grows only onto them; a
    running group is never shrunk by this count (a group on a draining node leaves
    through its notice's checkpoint, not a resize from the last periodic one). Costs two
    GCS calls per decision."""
    count = getattr(policy, "_count_possible_workers", None)
    idle = getattr(policy, "make_decision_for_non_running_worker_group", None)
    running = getattr(policy, "make_decision_for_running_worker_group", None)
    if None in (count, idle, running) or getattr(idle, "_elastic_ddp", False):
        return False
    deciding = threading.local()  # .on: inside a decision; .size: the running group's workers

    def counted(reserved: dict) -> int:
        if not getattr(deciding, "on", False):
            return count(reserved)
        try:
            usable = usable_nodes()
        except Exception:  # noqa: BLE001 - the GCS did not answer: Ray's own count
            return count(reserved)
        n = count({node: r for node, r in reserved.items() if node in usable})
        size = getattr(deciding, "size", None)
        return n if size is None or n >= size else min(size, count(reserved))

    def decide(fn, size, *args):
        deciding.on, deciding.size = True, size
        try:
            return fn(*args)
        finally:
            deciding.on, deciding.size = False, None

    def idle_decision():
        return decide(idle, None)

    def running_decision(worker_group_state, worker_group_status):
        return decide(running, worker_group_state.num_workers, worker_group_state, worker_group_status)

    idle_decision._elastic_ddp = True
    policy._count_possible_workers = counted
    policy.make_decision_for_non_running_worker_group = idle_decision
    policy.make_decision_for_running_worker_group = running_decision
    return True
