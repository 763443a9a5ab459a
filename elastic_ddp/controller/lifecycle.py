"""Ray Train's controller, worker-group and replica-group callbacks of the job
(:class:`ControllerEvents`): the controller's start (where the seam's patches of Ray
Train are put in place), the worker groups' starts and shutdowns as timeline marks, the
ranks' nodes and pids, and Ray Train's failure and resize decisions, all fed to the
job's :class:`~elastic_ddp.controller.events.ElasticEvents`.
"""

from __future__ import annotations

import time
from typing import Any, Dict

from elastic_ddp import notice
from elastic_ddp.compat.ray_grow import grow_event, set_grow_timeout, take_grow
from elastic_ddp.compat.ray_snapshot import skip_missing_deletes
from elastic_ddp.compat.ray_train import (ControllerCallback, ReplicaGroupCallback, WorkerGroupCallback,
                                          count_notices_as_preemptions, retry_worker_deaths_at_start,
                                          shut_down_failed_starts, tell_workers)
from elastic_ddp.controller.events import ElasticEvents


def _worker_meta(workers) -> Dict[int, Dict[str, Any]]:
    """rank -> {node_id, node_ip, pid, hostname} of Ray Train ``Worker`` objects."""
    return {(w.distributed_context.world_rank if w.distributed_context else i):
            {"node_id": w.metadata.node_id, "node_ip": w.metadata.node_ip,
             "pid": w.metadata.pid, "hostname": w.metadata.hostname}
            for i, w in enumerate(workers)}


class ControllerEvents(ControllerCallback, WorkerGroupCallback, ReplicaGroupCallback):
    """Feeds Ray Train's failure and resize decisions (elastic grow/shrink) and its
    worker-group start marks to the ``ElasticEvents`` sink. A separate object because Ray
    Train routes a callback that is a ``UserCallback`` only to the user hooks."""

    def __init__(self, sink: ElasticEvents):
        self.sink = sink

    def after_controller_start(self, train_run_context) -> None:
        retry_worker_deaths_at_start()
        shut_down_failed_starts()
        skip_missing_deletes()  # a listed checkpoint gone: its pruning skipped (compat.ray_snapshot)
        if self.sink.preemption:
            count_notices_as_preemptions(lambda e: notice.preempted_in(e) is not None,
                                         self.sink.died_after_notice)
        # Read by the controller right after this hook (compat.ray_controller.EnvController).
        set_grow_timeout(self.sink.grow_checkpoint_timeout_s if self.sink.preemption else None,
                         notice.request_grow, notice.GROW_METRIC)
        self.sink.mark("controller_started")

    def before_worker_group_start(self, worker_group_context) -> None:
        # Next: placement group, worker actors, then the torch process group.
        self.sink.mark("worker_group_starting", world_size=int(worker_group_context.num_workers))

    def after_worker_group_start(self, worker_group) -> None:
        try:
            # For the driver's clean-up (compat.ray_placement_groups).
            pg = worker_group.get_worker_group_state().placement_group_handle.placement_group
            extra = {"placement_group": pg.id.hex()}
        except Exception:  # noqa: BLE001 - bookkeeping only
            extra = {}
        self.sink.mark("worker_group_started", **extra)
        if "stop" in notice.noted():  # the driver's stop came while no group ran
            tell_workers(worker_group, notice.request_stop)
        try:
            workers = worker_group.get_workers()
            self.sink.workers = _worker_meta(workers)
            if self.sink._last_world_size is None:
                # The first group: a failure before its first report has this size.
                self.sink._last_world_size = len(workers)
        except Exception:  # noqa: BLE001 - bookkeeping only
            self.sink.workers = {}

    def after_replica_group_start(self, replica_group) -> None:
        # Per-step mode: one replica replaced alone (no worker-group start): its node and
        # pid, for the next failure's or notice's event.
        try:
            workers = replica_group.get_workers()
            if workers and all(w.distributed_context for w in workers):
                self.sink.workers.update(_worker_meta(workers))
        except Exception:  # noqa: BLE001 - bookkeeping only
            pass

    def before_worker_group_shutdown(self, worker_group) -> None:
        # A restart's teardown: from here to worker_group_stopped.
        self.sink.mark("worker_group_stopping")

    def after_worker_group_shutdown(self, worker_group_context) -> None:
        self.sink.mark("worker_group_stopped")

    def after_controller_finish(self, result) -> None:
        self.sink.flush()

    def before_controller_abort(self) -> None:
        self.sink.flush(timeout_s=5.0)

    def before_controller_execute_failure_decision(self, failure_decision) -> None:
        self.sink.on_failure_decision(failure_decision)

    def before_controller_execute_resize_decision(self, resize_decision) -> None:
        if self.sink._last_world_size is None:
            return  # the first worker group of this controller, not a resize
        failure = self.sink.open_failure
        new_size = int(resize_decision.num_workers)
        if failure is not None:
            # Restarting after a failure is executed as a resize: annotate, not a new event.
            # Provisional: the first report after it sets the size that actually ran.
            failure["world_size_requested"] = new_size
            failure["world_size_after"] = new_size
            self.sink.record(None)
        else:
            event = {"type": "resize", "t": time.time(),
                     "world_size_before": self.sink._last_world_size,
                     "world_size_after": new_size,
                     "world_size_requested": new_size,
                     "last_checkpoint_step": self.sink._last_step}
            grow = take_grow()
            if grow is not None:
                event.update(grow_event(grow))
            self.sink.record(event)
        # The group being started has this size even if it dies before its first
        # report (else the next failure would name the size of the group before it).
        self.sink._last_world_size = new_size
