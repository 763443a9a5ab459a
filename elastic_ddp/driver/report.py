"""What a person sees of a job: the progress line, the closing summary (with goodput and
its parts, ``driver.goodput``), recovery times of restart events, and the
command-to-first-step profile.
Reads the tracker actor's in-memory record (``tracking.JobTracker.snapshot``), never
MLflow metric histories.
"""

from __future__ import annotations

import os
import shlex
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from elastic_ddp.background import start_deferring_signals
# Re-exported: the report's callers and tests import them from here.
from elastic_ddp.driver.goodput import (RECOVERIES, RESTARTS, faults, goodput,  # noqa: F401
                                        goodput_parts, lost_s_per_fault)


@dataclass
class Summary:
    """What a finished job reports (also logged to MLflow as ``summary.json``).

    Attributes:
        metrics: the final ``val_*`` metrics.
        steps, epochs: optimizer steps and epochs done.
        wall_s: seconds from the job's first start (its MLflow run's start) to the end.
        goodput: see :func:`goodput`.
        goodput_parts: the wall time split into the committed training and the rest
            (:func:`goodput_parts`); {} where the job recorded no first step.
        lost_s_per_fault: seconds lost per fault (:func:`lost_s_per_fault`); None
            without faults.
        events: restart events with ``recovery_s``, ``resumed_at_step``, ``steps_recomputed``.
        startup: command-to-first-step phases in seconds (:func:`startup_breakdown`).
        tracking: metrics delayed or dropped while the store was unavailable.
        model_id: the MLflow logged model of the final weights (``models:/<id>``), or None.
        nonfinite: the rows whose loss was not finite in a skipped step
            (:func:`nonfinite_summary`), {} when none was.
        mlflow_run_lost: None, or the line saying that the job's MLflow run was deleted
            or removed while it trained, and the fix (``tracking.run_lost.lost_line``);
            ``elastic-ddp train`` then exits 3.
    """

    run_id: str
    tracking_uri: str
    experiment_id: str
    metrics: dict[str, float]
    steps: int
    epochs: int
    wall_s: float
    world_sizes_seen: list[int]
    restarts: int
    goodput: float
    events: list[dict] = field(default_factory=list)
    startup: dict[str, float] = field(default_factory=dict)
    checkpoint_path: Optional[str] = None
    mlflow_ui_command: str = ""
    skipped_steps: int = 0
    tracking: dict[str, Any] = field(default_factory=dict)
    epochs_done: float = 0.0  # epochs + the finished share of the last one (max_steps)
    model_id: Optional[str] = None
    nonfinite: dict[str, Any] = field(default_factory=dict)
    goodput_parts: dict[str, float] = field(default_factory=dict)
    mlflow_run_lost: Optional[str] = None
    lost_s_per_fault: Optional[float] = None


def nonfinite_summary(rows: list[dict], id_column: str, shown: int = 8) -> dict[str, Any]:
    """The tracker's rows with a non-finite loss (``tracking.nonfinite``, one entry per
    row and skipped step, the id under ``id_column``) summed up: ``reported`` entries,
    ``distinct`` ids, the first ``shown`` of them in ``ids``, and the ``id_column``;
    {} for none."""
    if not rows:
        return {}
    ids = list(dict.fromkeys(r.get(id_column) for r in rows))
    return {"reported": len(rows), "distinct": len(ids), "ids": ids[:shown], "id_column": id_column}


def recovery_events(snapshot: dict, ledger_attempts: Optional[list] = None) -> list[dict]:
    """The controller's events joined with the attempts' first-step times.

    Per restart or resume (:data:`RECOVERIES`): ``recovery_s`` = first step of the next
    attempt - the event's time (worker start, checkpoint load, data and the first step
    included; a resume's time is its command's start, so Ray's start counts too);
    ``resumed_at_step``; ``steps_recomputed`` = steps the failed attempt ran past the
    checkpoint the next one resumed from (a per-step replica's leave, ``left_quorum``,
    keeps its own: 0; per-step mode: the failed rank's replacement, resumed at the step
    before its first commit). From the ledger (``ledger_attempts``,
    ``elastic_ddp.ledger.read_attempts``) it is exact; without it, a lower bound from the
    steps the tracker saw (logged every ``train.log_every_steps``); None for a resume
    whose previous submission left no step (it did not close its run).
    """
    events = [dict(e) for e in snapshot.get("events", [])]
    attempts = sorted((a for a in snapshot.get("attempts", []) if "first_step" in a),
                      key=lambda a: a["first_step"])
    prev_attempt = None
    for ev in events:
        nxt = [a for a in attempts if a["first_step"] > ev["t"]]
        # Per-step mode (attempts name their replica's rank): the failure's recovery is the
        # replacement of a failed rank. It resumes at the step before its first commit:
        # a live quorum's step when it healed from a survivor (nothing recomputed), the
        # restored checkpoint's when none was left.
        failed = set(ev.get("failed_ranks") or ())
        if failed and any("rank" in a for a in nxt):
            nxt = [{**a, "resumed_from": int(a.get("step", 1)) - 1} for a in nxt if a.get("rank") in failed]
        # Not a restart: a rejected checkpoint, a config change on resume, or a per-step
        # replica that left its quorum
        # (the others never stopped; the event carries its own resumed_at_step and
        # steps_recomputed).
        if not nxt or ev.get("type") not in RECOVERIES or ev.get("left_quorum"):
            continue
        ev["recovery_s"] = round(nxt[0]["first_step"] - ev["t"], 3)
        ev["resumed_at_step"] = int(nxt[0].get("resumed_from", nxt[0].get("step", 1) - 1))
        if nxt[0].get("checkpoint"):
            ev["resumed_from_checkpoint"] = nxt[0]["checkpoint"]
        seen = ev.get("last_step_seen", 0)
        ev["steps_recomputed"] = None if seen is None else max(0, int(seen) - ev["resumed_at_step"])
        if ledger_attempts:
            from elastic_ddp.ledger import recomputed_after

            exact = recomputed_after(ledger_attempts, ev["t"])
            if exact is not None and exact["resumed_from"] == ev["resumed_at_step"]:
                ev["steps_recomputed"] = 0 if exact["attempt"] == prev_attempt else exact["steps_recomputed"]
                prev_attempt = exact["attempt"]
    return events


# (phase, from mark, to mark): consecutive, so the phases add up to the total.
# Each phase ends at its mark and starts at the mark before it in time (the first at
# process_start): connected to a running cluster the driver reaches Ray before it scans
# (launcher.train), on a local Ray after.
STARTUP_PHASES = (
    ("imports_s", "train_called"),               # interpreter + imports
    ("scan_s", "scanned"),                       # footers, task dry run
    ("ray_init_s", "ray_ready"),                 # Ray up or connected; controller host, tracker
    ("driver_setup_s", "fit_called"),            # MLflow run (helper), trainer
    ("controller_s", "controller_started"),      # controller built (and its process, if late)
    ("scheduling_s", "worker_group_starting"),
    ("worker_group_s", "worker_group_started"),  # actors + process group
    ("train_fn_launch_s", "enter"),
    ("model_data_s", "ready"),                   # model, checkpoint load
    ("first_step_s", "first_step"),              # data pipeline + the first step
)


def startup_breakdown(snapshot: dict, marks: dict) -> dict[str, float]:
    """Seconds from the command's start to the end of the first optimizer step of the
    first attempt this process launched, split into :data:`STARTUP_PHASES` (driver
    marks, the controller's timeline, rank 0's attempt marks). A missing mark's phase is
    left out and its time counts in the next phase; ``total_s`` is always the whole
    span, the sum of the phases. {} when no step ran."""
    if "fit_called" not in marks:
        return {}
    fit = marks["fit_called"]
    attempts = sorted((a for a in snapshot.get("attempts", [])
                       if a.get("first_step", 0) >= fit and "enter" in a), key=lambda a: a["first_step"])
    if not attempts:
        return {}
    t = dict(marks)
    t.update({k: attempts[0][k] for k in ("enter", "ready", "first_step")})
    until = t["enter"]
    for what in ("worker_group_started", "worker_group_starting", "controller_started"):
        ts = [m["t"] for m in snapshot.get("timeline", []) if m["what"] == what and fit <= m["t"] <= until]
        if ts:
            t[what] = max(ts) if what != "controller_started" else min(ts)
            until = t[what]
    ends = sorted((t[mark], name) for name, mark in STARTUP_PHASES if mark in t)
    prev, seconds = t["process_start"], {}
    for when, name in ends:
        seconds[name] = round(when - prev, 3)
        prev = when
    out = {name: seconds[name] for name, _ in STARTUP_PHASES if name in seconds}
    out["total_s"] = round(t["first_step"] - t["process_start"], 3)
    return out


def mlflow_ui_command(uri: str, experiment_id: str, run_id: str) -> str:
    """The shell command that opens the MLflow UI on this store, and the run's URL."""
    store = shlex.quote(uri)
    # The mlflow script beside this interpreter: it is on PATH only in an activated venv.
    exe = Path(sys.executable).with_name("mlflow")
    mlflow_cmd = shlex.quote(str(exe)) if exe.exists() else "mlflow"
    return (f"{mlflow_cmd} ui --backend-store-uri {store} --host 127.0.0.1 --port 5000  "
            f"# then open http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{run_id}")


def format_summary(s: Summary) -> str:
    """The closing summary as printed by ``elastic-ddp train``."""
    metrics = " ".join(f"{k}={v:.4f}" for k, v in s.metrics.items()) or "(no validation split)"
    lines = ["", "=== elastic-ddp summary ===",
             f"validation:       {metrics}",
             f"steps / epochs:   {s.steps} / {s.epochs_done:.2f}",
             *_goodput_lines(s),
             f"world sizes seen: {' -> '.join(map(str, s.world_sizes_seen)) or '-'}"
             f"   restarts: {s.restarts}"]
    if s.skipped_steps:
        why = "non-finite gradient"
        if s.nonfinite:
            nf = s.nonfinite
            more = f" and {nf['distinct'] - len(nf['ids'])} more" if nf["distinct"] > len(nf["ids"]) else ""
            why += (f"; rows with a non-finite loss: {nf['id_column']} "
                    f"{', '.join(map(str, nf['ids']))}{more}, each in the run's "
                    "warnings/nonfinite_rows.json")
        lines.append(f"skipped steps:    {s.skipped_steps} ({why})")
    if s.startup:
        lines.append(f"command to first step: {s.startup['total_s']:.1f} s (" + ", ".join(
            f"{k.removesuffix('_s')} {v:.1f}" for k, v in s.startup.items() if k != "total_s") + ")")
    for ev in s.events:
        if ev.get("type") == "checkpoint_rejected":
            lines.append(f"  checkpoint rejected: {ev.get('checkpoint')}: "
                         f"{', '.join(ev.get('bad_files', []))}")
            continue
        if ev.get("type") == "config_change":
            lines.append(f"  config changed on resume (step {ev.get('step')}): " + ", ".join(
                f"{k} {a} -> {b}" for k, (a, b) in (ev.get("changes") or {}).items()))
            continue
        lines.append(f"  event: {ev.get('type')} cause={ev.get('cause', '')!s:.80} "
                     f"recovery_s={ev.get('recovery_s')} steps_recomputed={ev.get('steps_recomputed')}")
    if s.tracking.get("delayed") or s.tracking.get("dropped"):
        lines.append(f"tracking:         {s.tracking.get('delayed', 0)} metric values delayed, "
                     f"{s.tracking.get('dropped', 0)} dropped ({s.tracking.get('last_error')})")
    if s.mlflow_run_lost:
        lines.append(f"MLflow run:       {s.run_id} at {s.tracking_uri}: "
                     f"{(s.tracking.get('run_lost') or {}).get('state', 'deleted')} during the job")
    else:
        lines += [f"MLflow run:       {s.run_id} at {s.tracking_uri}",
                  f"open the UI:      {s.mlflow_ui_command}"]
    return "\n".join(lines)


def _goodput_lines(s: Summary) -> list[str]:
    """Wall time and goodput, with its committed training seconds, and a line that says
    where the rest of the wall time went (:func:`goodput_parts`)."""
    g = s.goodput_parts
    if not g:
        return [f"wall time:        {s.wall_s:.1f} s   goodput {s.goodput:.2%} (committed "
                "training-step time / wall time)"]
    parts = ([f"earlier submissions {g['earlier_s']:.1f} s (and the time between them)"]
             if g.get("earlier_s") else [])
    parts += [f"start-up {g['startup_s']:.1f} s (command to first step)",
              f"restarts {g['restarts_s']:.1f} s"]
    parts += [f"{name} {g[k]:.1f} s" for k, name in (("recomputed_s", "recomputed steps"),
                                                  ("checkpoint_s", "checkpoint blocking"),
                                                  ("eval_s", "evaluation")) if g.get(k)]
    parts += [f"other {g['other_s']:.1f} s (lost steps not recomputed, the job's end)"]
    lines = [f"wall time:        {s.wall_s:.1f} s   goodput {s.goodput:.2%} (committed training steps "
             f"{g['training_s']:.1f} s / wall time"
             + (f"; of it data wait {g['data_wait_s']:.1f} s)" if g.get("data_wait_s") else ")"),
             f"  not training:   {s.wall_s - g['training_s']:.1f} s = " + " + ".join(parts)]
    if s.lost_s_per_fault is not None:
        lines.append(f"  lost per fault: {s.lost_s_per_fault:.1f} s (not training, less start-up and "
                     f"evaluation, over {faults(s.events)} fault(s))")
    return lines


class ProgressDisplay:
    """Driver-side progress: polls the tracker actor's latest metrics every ``period``
    seconds. A rich live bar on a terminal, a plain line every ``line_every`` steps
    otherwise (no colour codes off a terminal); ``show=False``: no progress at all.

    Either way it prints each of the tracker's notices once, as it arrives, to stderr
    (``elastic-ddp: warning: ...``; above the live bar on a terminal), and once more polls
    for them on exit, so that a notice raised after the last poll is printed too.

    Once ``__exit__`` has returned, the poller makes no Ray call: every call holds
    ``_ray_lock`` and checks ``_closed``, which ``__exit__`` sets under that lock. A call
    made after the caller's ``ray.shutdown()`` would start Ray again (Ray's auto-init
    connects to the newest local cluster), leaving a connection nobody shuts down."""

    def __init__(self, tracker, total_steps: int, period: float = 2.0, show: bool = True):
        self.tracker, self.total, self.period, self.show = tracker, total_steps, period, show
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._last = -1
        self._notices_seen = 0
        self._notice_lock = threading.Lock()
        self._ray_lock = threading.Lock()
        self._closed = False

    def __enter__(self):
        start_deferring_signals(self._thread)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)
        self._print_notices(timeout=5)
        with self._ray_lock:  # waits for a poll in flight (each is bounded by its timeout)
            self._closed = True

    def _ask(self, method: str, *args, timeout: float):
        """``ray.get`` of one tracker call, or None once closed, without Ray, or on error
        (display only: an unreachable tracker is skipped). Holds ``_ray_lock``."""
        import ray

        with self._ray_lock:
            if self._closed or not ray.is_initialized():
                return None
            try:
                return ray.get(getattr(self.tracker, method).remote(*args), timeout=timeout)
            except Exception:  # noqa: BLE001 - display only
                return None

    def _print_notices(self, timeout: float = 10) -> None:
        """Print the notices not printed yet."""
        with self._notice_lock:
            new = self._ask("get_notices", self._notices_seen, timeout=timeout)
            if new is None:
                return
            for n in new:
                print(f"elastic-ddp: warning: {n['message']}", file=sys.stderr, flush=True)
            self._notices_seen += len(new)

    def _loop(self) -> None:
        tty = self.show and sys.stdout.isatty() and os.environ.get("TERM") != "dumb"
        bar = task = None
        if tty:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            bar = Progress(TextColumn("{task.description}"), BarColumn(),
                           TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn())
            task = bar.add_task("training", total=self.total)
            bar.start()
        line_every = max(1, self.total // 10)
        try:
            while not self._stop.wait(self.period):
                self._print_notices()
                if not self.show:
                    continue
                m = self._ask("progress", timeout=10)
                if m is None:
                    continue
                step = int(m.get("step", 0))
                if step == 0:
                    continue  # nothing trained yet: no line of nan and zeros
                # epoch: the 1-based epoch the step is in, as the trainer logs it.
                desc = (f"epoch {int(m.get('epoch', 0))} step {step}/{self.total} loss "
                        f"{m.get('train_loss', float('nan')):.4f} {m.get('samples_per_s', 0):.0f} "
                        f"samples/s world_size {int(m.get('world_size', 0))}")
                if bar is not None:
                    bar.update(task, completed=step, description=desc)
                elif step // line_every != self._last // line_every or self._last < 0:
                    print(desc, flush=True)
                self._last = step
        finally:
            if bar is not None:
                bar.stop()
