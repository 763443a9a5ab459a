"""A dead controller's placement groups, removed by the driver.

Ray Train's ``PlacementGroupCleaner`` is a detached actor (one more Python process per
job, which the controller waits for after the first worker group starts) that removes
the group's placement group if the controller dies without cleaning up while the driver
lives on. Where the default-callback trim (``compat.ray_trainer.trainer_class``) drops
it, the driver removes them instead, after a ``fit`` that raised
(``driver.finish.after_failed_fit``), from the groups ``controller.events.ControllerEvents``
records.

What it costs: ``ray._raylet.PlacementGroupID`` (private) to name a recorded group;
it runs where the overrides ``default_callbacks`` and ``controller_events`` of
``compat.versions`` apply, elsewhere Ray's cleaner is kept.
"""

from __future__ import annotations


def driver_removes_placement_groups(plan) -> bool:
    """Whether the driver, not Ray Train's ``PlacementGroupCleaner``, removes a dead
    controller's placement groups under ``plan``: it finds them in the marks of
    ``controller.events.ControllerEvents``."""
    return plan.applies("default_callbacks") and plan.applies("controller_events")


def remove_leftover_placement_groups(timeline: list) -> list[str]:
    """Remove the placement groups of this job's worker groups (``placement_group`` in the
    controller's ``worker_group_started`` marks, ``controller.events.ControllerEvents``) that are
    still reserved. Ray Train's controller removes them itself when it stops; one that
    died (its process killed) leaves its group reserved, and with it the CPUs the next
    job of this driver (a sweep's next trial) needs, until the driver exits.

    Returns: the ids (hex) removed."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    removed = []
    table = placement_group_table()
    for mark in timeline:
        h = mark.get("placement_group")
        if h and table.get(h, {}).get("state", "REMOVED") != "REMOVED":
            remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(h))))
            removed.append(h)
    return removed
