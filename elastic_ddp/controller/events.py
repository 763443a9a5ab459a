"""Controller-side view of the run: failures, resizes, restarts, and deterministic errors.

Ray Train calls these callbacks in its controller actor (``RunConfig(callbacks=...)``),
not on the workers. They send every event and start-up mark to the job's tracker actor
(``elastic_ddp.tracking.JobTracker``), which writes them into the job's one MLflow run
(``events/events.json``, ``events/timeline.json``) and keeps them for the driver's
summary; the controller never imports MLflow.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

from ray.train.v2.api.callback import UserCallback

from elastic_ddp import notice
from elastic_ddp.compat.ray_grow import grow_event, set_grow_timeout, take_grow
from elastic_ddp.compat.ray_snapshot import skip_missing_deletes
from elastic_ddp.compat.ray_train import (ControllerCallback, ReplicaGroupCallback, WorkerGroupCallback,
                                          actor_death_time, count_notices_as_preemptions,
                                          retry_worker_deaths_at_start, shut_down_failed_starts,
                                          take_preemption, tell_workers)

from elastic_ddp.controller.failures import (classify, likely_cause, primary, signature,
                                             stops_at_once, stragglers)
from elastic_ddp.positions import read_position
from elastic_ddp.errors import ElasticDDPError

EVENTS_ARTIFACT = "events/events.json"
TIMELINE_ARTIFACT = "events/timeline.json"


class DeterministicTrainingError(ElasticDDPError, RuntimeError):
    """The same error (or the same death) at the same step on two attempts in a row, or a
    data/config/checkpoint error: restarting would only spend the failure budget. The
    message names the step, the rank, the phase and the likely cause."""


class StopRequested(ElasticDDPError, RuntimeError):
    """The driver asked the job to stop (its SIGTERM): the checkpoint at the next step
    boundary is committed and the run ends without a restart (``elastic_ddp.notice``)."""


class ElasticEvents(UserCallback):
    """Records failures and preemptions, and stops the job on deterministic errors and on
    the driver's stop (raising from a callback makes Ray Train fail the run without
    retrying: a ControllerError). ``preemption``: notices are checkpointed (``restart``
    mode) or make a replica leave its quorum (``per_step`` mode) and are counted as
    preemptions (``compat.versions.preemption_supported``)."""

    def __init__(self, tracker, run_name: Optional[str] = None, storage: Optional[str] = None,
                 collective_timeout_s: Optional[float] = None, preemption: bool = False,
                 grow_checkpoint_timeout_s: Optional[float] = None):
        self.tracker = tracker
        self.preemption = preemption
        # A grow of a running group checkpoints first (compat.ray_grow): restart mode with
        # notices, elastic jobs; None or 0: off.
        self.grow_checkpoint_timeout_s = grow_checkpoint_timeout_s
        self.run_name, self.storage = run_name, storage
        self.collective_timeout_s = collective_timeout_s
        # rank -> {node_id, node_ip, pid} of the running worker group (ControllerEvents).
        self.workers: Dict[int, Dict[str, Any]] = {}
        self._last_signature: Optional[tuple] = None
        self.events: List[Dict[str, Any]] = []
        self._last_world_size: Optional[int] = None
        self._last_step: int = 0
        self._pending: Dict[int, Exception] = {}
        # (rank, pid) -> the position record of a dead rank of the failure being decided
        # ({}: a live rank), read once: Ray Train's failure policy asks first
        # (died_after_notice), the decision hook next.
        self._dead: Dict[tuple, Dict[str, Any]] = {}
        # Failure/resize events since the last report: their world_size_after is only
        # known once a group reports.
        self._unsettled: List[Dict[str, Any]] = []
        # Controller-side start-up marks (seconds since the epoch): where a start or a
        # restart spends its time before the workers' own marks take over.
        self.timeline: List[Dict[str, Any]] = []

    # -- hooks -----------------------------------------------------------------------
    def after_report(self, run_context, metrics, checkpoint) -> None:
        self._last_world_size = len(metrics)
        if self._unsettled:
            # The world size a decision asked for is not always the one that ran: a
            # restart may first ask for a node that is gone (its placement group never
            # schedules) and then retry smaller. The first report settles it.
            for ev in self._unsettled:
                ev["world_size_after"] = self._last_world_size
            self._unsettled = []
            self.record(None)
        steps = [m.get("step", 0) for m in metrics if isinstance(m, dict)]
        if steps:
            self._last_step = int(max(steps))

    def after_exception(self, run_context, worker_exceptions: Dict[int, Exception]) -> None:
        # Called on every poll that sees errors; the decision hook below records once.
        self._pending = dict(worker_exceptions)

    def on_failure_decision(self, decision) -> None:
        """Record the failure once, naming its cause: the first rank that died (with how,
        where and at which step), else the first real error (not a peer's collateral
        ``Connection closed by peer``). Raise to stop retrying a deterministic failure:
        a fatal error (data, config, checkpoint), or the same fingerprint
        (``failures.signature``: kind, phase, step, error without addresses/ports/pids)
        as the previous attempt's."""
        pending, self._pending = self._pending, {}
        try:
            self._decide(decision, pending)
        finally:
            self._dead = {}

    def _decide(self, decision, pending: Dict[int, Exception]) -> None:
        if self.preemption and self._preempted(decision, pending):
            return
        if "stop" in notice.noted():
            self.record({"type": "failure", "t": time.time(), "decision": "STOP (requested)",
                         "cause": "worker group failure after the driver's stop request",
                         "failed_ranks": sorted(pending)})
            self.flush()
            raise StopRequested("stopped on request (the driver's SIGTERM); the newest checkpoint is kept")
        failures = classify(pending, self._positions(pending), self.workers)
        cause = primary(failures)
        # A collective that timed out: the cause is who did not arrive, not who waited.
        hung = stragglers(failures, self.workers, self._live_positions(pending), self.collective_timeout_s)
        cause = hung[0] if hung else cause
        event: Dict[str, Any] = {
            "type": "failure", "t": time.time(),
            "cause": cause.describe() if cause is not None else "worker group failure",
            "decision": getattr(decision, "value", str(decision)),
            "failed_ranks": sorted(pending), "world_size_before": self._last_world_size,
            "last_checkpoint_step": max(self._last_step, self._stored_step())}
        if cause is not None:
            event.update({"cause_rank": cause.rank, "cause_kind": cause.kind, "step": cause.step,
                          "phase": cause.phase, "node": cause.node, "pid": cause.pid,
                          "signal": cause.signal or None})
        self.record(event)
        if getattr(decision, "value", "") != "RETRY":
            return
        sig = signature(cause)
        stop = None
        if cause is not None and cause.fatal:
            stop = f"not retried (a data/config error: no restart can fix it): {cause.describe()}"
        elif stops_at_once(failures, cause, self._last_world_size, self.storage) is not None:
            stop = stops_at_once(failures, cause, self._last_world_size, self.storage)
        elif sig is not None and sig == self._last_signature:
            what = {"died": "death", "hung": "hang"}.get(cause.kind, "error")
            stop = (f"the same {what} at the same step on two attempts in a row, not retried: "
                    f"{cause.describe()}; {likely_cause(cause)}")
        self._last_signature = sig
        if stop is not None:
            event["decision"] = "STOP (deterministic)"
            self.record(None)
            self.flush()
            raise DeterministicTrainingError(stop)

    def _preempted(self, decision, pending: Dict[int, Exception]) -> bool:
        """Record a ``preemption`` event when Ray Train's failure policy counted this
        failure as one (``compat.ray_train.take_preemption``): a checkpoint committed at a
        notice, or a drained node lost before one; the driver's stop then ends the run.
        False: not a preemption."""
        pre = take_preemption()
        if pre is None:
            return False
        notices = [p for p in map(notice.preempted_in, pre["failures"]) if p is not None]
        first = min(notices, key=lambda p: p.noticed_t) if notices else None
        ranks = sorted({r for p in notices for r in p.ranks})
        # Ranks killed after their own notice, before a checkpoint at it (a SIGTERM, then
        # SIGKILL at the end of a short grace period): rank -> its position record.
        killed = {} if first is not None else {
            r: pos for r, e in pending.items() if (pos := self._dead_position(r, e)).get("notices")}
        ranks = ranks or sorted(killed)
        ip_of = {m.get("node_id"): m.get("node_ip") for m in self.workers.values()}
        node_ids = sorted(set(pre["nodes"]) | ({self.workers.get(r, {}).get("node_id") for r in ranks} - {None}))
        nodes = sorted({str(ip_of.get(n) or n) for n in node_ids})
        deadline = pre["deadline_t"] or (first.deadline_t if first is not None else None)
        event: Dict[str, Any] = {
            "type": "preemption", "t": time.time(), "nodes": nodes, "node_ids": node_ids,
            "deadline_t": deadline,
            "decision": getattr(decision, "value", str(decision)), "failed_ranks": sorted(pending),
            "world_size_before": self._last_world_size, "last_checkpoint_step": self._stored_step()}
        if first is not None:
            event.update(first.as_event())
            event["noticed_ranks"] = ranks
            event["cause"] = (f"{first.source} notice (ranks {ranks}, nodes {', '.join(nodes) or '?'})"
                              f"{first.lead_text()}: {first.what()}")
            if first.left:
                # Per-step mode: the others never stopped; the step it left after was
                # committed by its whole quorum, so nothing is recomputed (the restart
                # join of driver.report does not apply: no attempt restarts).
                event.update({"resumed_at_step": first.step, "steps_recomputed": 0})
        elif killed:
            event.update(self._killed_after_notice(killed, nodes, event["last_checkpoint_step"]))
        else:
            event.update({"source": "drain", "notice_lead_s": None, "fell_back": True,
                          "warning": f"node(s) {', '.join(nodes) or '?'} preempted before a "
                                     "checkpoint at the drain notice was committed (too little "
                                     "notice): resumed from the newest checkpoint, step "
                                     f"{event['last_checkpoint_step']}; the steps after it are "
                                     "recomputed"})
            event["cause"] = (f"node(s) {', '.join(nodes) or '?'} preempted before a checkpoint at the "
                              f"notice was committed (too little notice): resuming from the newest "
                              f"checkpoint, step {event['last_checkpoint_step']}")
        if first is not None:  # the attempt's last step: the checkpoint's (recomputed: 0)
            event["last_step_seen"] = first.step
        self.record(event)
        stop = "stop" in notice.noted() or (first is not None and first.source == "stop")
        if stop:
            event["decision"] = "STOP (requested)"
            self.record(None)
            self.flush()
            raise StopRequested(f"stopped on request (the driver's SIGTERM): {event['cause']}")
        return True

    @staticmethod
    def _killed_after_notice(killed: Dict[int, Dict[str, Any]], nodes: List[str], stored: int) -> Dict[str, Any]:
        """The fields of a ``preemption`` event whose noticed ranks (``killed``: rank ->
        position record with ``notices``) died before the checkpoint at the notice: the
        restart falls back to the newest checkpoint (``fell_back``), step ``stored``."""
        source, noticed_t = min(((k, t) for pos in killed.values() for k, t in pos["notices"].items()),
                                key=lambda kt: kt[1])
        deaths = [pos["t"] for pos in killed.values() if pos.get("t")]
        to_death = round(min(deaths) - noticed_t, 3) if deaths else None
        # The step the dead rank was computing (not committed), or had just finished.
        reached = [int(p["step"]) - (1 if p.get("phase") in ("data read", "training step") else 0)
                   for p in killed.values() if p.get("step") is not None]
        # The death as the GCS saw it: the kill itself came a little earlier.
        lead = f", dead {to_death:.1f} s after it" if to_death is not None else ""
        text = (f"{source} notice on rank(s) {sorted(killed)} (nodes {', '.join(nodes) or '?'}){lead}: "
                f"too little notice for a checkpoint at it (about scaling.notice_agreement_s plus "
                f"one step plus one checkpoint write); "
                f"resuming from the newest checkpoint, step {stored}")
        out: Dict[str, Any] = {
            "source": source, "fell_back": True, "noticed_t": noticed_t, "notice_lead_s": None,
            "notice_to_death_s": to_death, "noticed_ranks": sorted(killed), "cause": text,
            "warning": f"{text}; the steps after it are recomputed"}
        if reached:
            out["last_step_seen"] = max(reached)
        return out

    def died_after_notice(self, rank: int, exc: BaseException) -> bool:
        """Whether ``rank`` (its failure ``exc``) died after it had been given notice
        (its position record holds a notice): Ray Train's failure policy counts the
        failure as a preemption (``compat.ray_train.count_notices_as_preemptions``)."""
        return bool(self._dead_position(rank, exc).get("notices"))

    def _dead_position(self, rank: int, exc: BaseException) -> Dict[str, Any]:
        """The last position record of ``rank`` if ``exc`` says it died (read on its
        node and removed there; {} for a live rank or an unknown record), with the
        actor's death time from the GCS as ``t``: read once per failure."""
        meta = self.workers.get(rank, {})
        key = (rank, meta.get("pid"))
        if key not in self._dead:
            from elastic_ddp.compat.ray_errors import death_of

            dead = death_of(exc)
            rec: Dict[str, Any] = {}
            if dead is not None:
                pos = read_position(meta.get("node_id"), meta.get("pid")) or {}
                if pos and pos.get("run") not in (None, self.run_name) and self.run_name:
                    pos = {}
                t = actor_death_time(getattr(dead, "actor_id", None))
                rec = {**pos, "t": t if t is not None else pos.get("t")}
            self._dead[key] = rec
        return self._dead[key]

    def _stored_step(self) -> int:
        """The newest complete checkpoint in storage: the one the restart resumes from
        (a report the controller had not polled yet when the group failed included)."""
        if not (self.storage and self.run_name):
            return 0
        try:
            from elastic_ddp.checkpoint import checkpoint_step, newest_complete

            ckpt = newest_complete(self.storage, self.run_name)
            return max(0, checkpoint_step(ckpt.path)) if ckpt is not None else 0
        except Exception:  # noqa: BLE001 - bookkeeping only
            return 0

    def _positions(self, pending: Dict[int, Exception]) -> Dict[int, dict]:
        """The last position record of every dead rank in ``pending`` (read on its node),
        with the actor's death time from the GCS as ``t`` (who died first)."""
        from elastic_ddp.compat.ray_errors import death_of

        return {rank: self._dead_position(rank, exc) for rank, exc in pending.items()
                if death_of(exc) is not None}

    def _live_positions(self, pending: Dict[int, Exception]) -> Dict[int, dict]:
        """The position records of the group's ranks that raised nothing (left in place:
        those processes still run)."""
        out: Dict[int, dict] = {}
        for rank, meta in self.workers.items():
            if rank not in pending:
                pos = read_position(meta.get("node_id"), meta.get("pid"), remove=False) or {}
                if not (pos and pos.get("run") not in (None, self.run_name) and self.run_name):
                    out[rank] = pos
        return out

    @property
    def open_failure(self) -> Optional[Dict[str, Any]]:
        """The latest failure no group has reported after (None: all settled)."""
        return next((e for e in reversed(self._unsettled) if e["type"] in ("failure", "preemption")), None)

    # -- shared ----------------------------------------------------------------------
    def mark(self, what: str, **extra: Any) -> None:
        """A controller timeline mark (``events/timeline.json``)."""
        mark = {"what": what, "t": time.time(), **extra}
        self.timeline.append(mark)
        self.tracker.event.remote(None, mark)

    def record(self, event: Optional[Dict[str, Any]]) -> None:
        """Append ``event`` (None: re-send the unsettled ones' updates) to the tracker."""
        if event is not None:
            event["index"] = len(self.events)
            self.events.append(event)
            if event["type"] in ("failure", "resize", "preemption"):
                self._unsettled.append(event)
            self.tracker.event.remote(dict(event))
        else:
            for ev in self.events:
                self.tracker.update_event.remote(ev["index"], dict(ev))

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until the tracker has everything sent so far (the controller calls it
        before it finishes, so the driver reads complete lists)."""
        import ray

        ref = self.tracker.snapshot.remote()
        if not isinstance(ref, ray.ObjectRef):
            return  # a tracker called in-process (tests): nothing in flight
        try:
            ray.get(ref, timeout=timeout_s)
        except Exception:  # noqa: BLE001 - tracking must never fail the run
            pass


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
