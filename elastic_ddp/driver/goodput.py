"""Goodput (its one definition), where the wall time went (:func:`goodput_parts`) and
the seconds lost per fault (:func:`lost_s_per_fault`), from what the job records: the
tracker's snapshot, the driver's marks and the restart events."""

from __future__ import annotations

from typing import Optional


#: The event types that restart the workers (the others: ``checkpoint_rejected``,
#: ``config_change``, recorded without a restart of their own).
RESTARTS = ("failure", "resize", "preemption")
#: The events with a recovery (:func:`recovery_events`): the restarts, and the ``resume``
#: of a run whose previous submission did not finish (``tracking.history.resume_event``).
RECOVERIES = RESTARTS + ("resume",)


def goodput(committed_train_s: float, wall_s: float) -> float:
    """Goodput = seconds spent in training steps that a checkpoint committed / wall
    seconds since the job's first start (start-up, evaluation, checkpoint writes,
    recomputed steps and restarts all count against it). The same definition as
    Google's "ML goodput" (productive training time over elapsed time; Google Cloud,
    "Goodput: measuring ML productivity", 2024) at step granularity."""
    return committed_train_s / max(1e-9, wall_s)


def goodput_parts(snapshot: dict, marks: dict, wall_start: float, wall_s: float,
                  committed_s: float, events: list[dict], steps: int = 0) -> dict[str, float]:
    """Where the wall time of :func:`goodput` went, from what the job records (seconds;
    the parts but ``data_wait_s`` sum to ``wall_s``; ``wall_start``: its start, seconds
    since the epoch; ``steps``: the optimizer steps the job committed):

    - ``training_s``: training steps a checkpoint committed (``committed_s``);
    - ``earlier_s``: a resumed run's time before this submission started that its
      committed training does not account for: the earlier submissions' start-up,
      restarts and lost steps, and the time between submissions (the committed seconds
      at the restore come with this submission's first attempt, ``committed_s``);
    - ``startup_s``: from this submission's start (the command's) to the end of its first
      optimizer step (:func:`startup_breakdown`'s span);
    - ``restarts_s``: the restart events' recovery (``recovery_s`` of :func:`recovery_events`,
      overlapping ones counted once); a per-step replica's replacement is left out (the
      other replicas trained meanwhile);
    - ``recomputed_s``: steps run again after a restart (the events' ``steps_recomputed``)
      at the committed steps' mean time (``committed_s / steps``; 0 without ``steps``);
    - ``eval_s``, ``checkpoint_s``: evaluation, and the training loop blocked by
      checkpoint saves (the tracker's ``seconds``, ``tracking.totals``);
    - ``other_s``: the rest: steps run but never committed nor recomputed (a failed
      attempt's last ones, which no checkpoint covered), the end of the job, what no
      part measures (floored at 0);
    - ``data_wait_s``: of ``training_s``, the steps' data wait (``tracking.totals``): not
      a part of the sum.

    {} when no attempt of this submission reached its first step."""
    fit = marks.get("fit_called", marks.get("process_start", wall_start))
    attempts = sorted((a for a in snapshot.get("attempts", []) if a.get("first_step", 0) >= fit),
                      key=lambda a: a["first_step"])
    if not attempts:
        return {}
    start = max(marks.get("process_start", wall_start), wall_start)
    earlier = max(0.0, start - wall_start - float(attempts[0].get("committed_s", 0.0)))
    startup = max(0.0, attempts[0]["first_step"] - start)
    per_replica = any("rank" in a for a in snapshot.get("attempts", []))
    spans = sorted((e["t"], e["t"] + e["recovery_s"]) for e in events
                   if e.get("type") in RESTARTS and e.get("recovery_s") is not None
                   and not (per_replica and e.get("failed_ranks")))
    restarts, end = 0.0, float("-inf")
    for a, b in spans:
        restarts += max(0.0, b - max(a, end))
        end = max(end, b)
    step_s = committed_s / steps if steps > 0 else 0.0
    recomputed = step_s * sum(int(e.get("steps_recomputed") or 0) for e in events
                              if e.get("type") in RECOVERIES)
    secs = snapshot.get("seconds") or {}
    out = {"training_s": committed_s, "earlier_s": earlier, "startup_s": startup, "restarts_s": restarts,
           "recomputed_s": recomputed, "eval_s": float(secs.get("eval_s", 0.0)),
           "checkpoint_s": float(secs.get("checkpoint_s", 0.0))}
    out["other_s"] = max(0.0, wall_s - sum(out.values()))
    out["data_wait_s"] = float(secs.get("data_wait_s", 0.0))
    return {k: round(v, 3) for k, v in out.items()}


def faults(events: list[dict]) -> int:
    """The job's faults: its restart events (failures, resizes, preemptions; in per-step
    mode a replica's replacement is a ``failure`` event of its own)."""
    return sum(1 for e in events if e.get("type") in RESTARTS)


def lost_s_per_fault(parts: dict[str, float], wall_s: float, events: list[dict]) -> Optional[float]:
    """Seconds lost per fault: ``(wall_s - training_s - startup_s - eval_s) / faults``:
    the wall time not in committed training steps, less the job's own start-up and its
    evaluation (which a job without faults pays too), over :func:`faults`. What remains
    in the numerator: restarts, recomputed steps, checkpoint blocking, the earlier
    submissions' time and the rest (``goodput_parts``). None without faults or parts."""
    n = faults(events)
    if not parts or n == 0:
        return None
    lost = wall_s - parts["training_s"] - parts["startup_s"] - parts.get("eval_s", 0.0)
    return round(max(0.0, lost) / n, 3)
