"""A resumed run's records of its earlier submissions, kept when a submission adds its own.

The tracker actor writes ``events/events.json``, ``events/attempts.json``,
``events/timeline.json`` and ``warnings/nonfinite_rows.json`` whole, from what it holds.
A resubmission's tracker starts empty, so it is handed what the run holds already
(:func:`earlier_records`, read by the MLflow helper when it reopens the run) and writes
those lists first, then its own: every failure of every submission stays an event of the
run.

How the previous submission ended (the ``elastic_ddp.error`` tag of a FAILED or KILLED
run, and the ``elastic_ddp.last_step`` it had logged) becomes a ``submission_end`` event,
written before the tags are removed: a run that resumes and finishes carries no error of
an attempt that came before. The new submission records a ``resume`` event
(:func:`resume_event`), whose recovery the summary's table reports as a restart's.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from elastic_ddp.tracking.nonfinite import NONFINITE_FILE
from elastic_ddp.tracking.store import STATE_TAG, client, retrying, set_tags

EVENTS = "events/events.json"
ATTEMPTS = "events/attempts.json"
TIMELINE = "events/timeline.json"
NONFINITE = NONFINITE_FILE
ERROR_TAG = "elastic_ddp.error"
#: The newest step a submission that did not finish had logged (set as it closes its run).
LAST_STEP_TAG = "elastic_ddp.last_step"
_BAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
#: The artifact of each list the tracker keeps.
FILES = {"events": EVENTS, "attempts": ATTEMPTS, "timeline": TIMELINE, "nonfinite": NONFINITE}


def read_records(uri: str, run_id: str) -> dict[str, list]:
    """The run's ``events``, ``attempts``, ``timeline`` and ``nonfinite`` lists as its artifacts hold
    them ([] for one it does not have or cannot be read as a JSON list)."""
    import os

    out: dict[str, list] = {}
    c = client(uri)
    # MLflow draws a progress bar per download on stderr (the driver's console).
    bar = os.environ.get(_BAR)
    os.environ[_BAR] = "false"
    try:
        with tempfile.TemporaryDirectory(prefix="elastic-ddp-history-") as d:
            for key, path in FILES.items():
                try:
                    local = c.download_artifacts(run_id, path, d)
                    value = json.loads(Path(local).read_text())
                except Exception:  # noqa: BLE001 - absent (a run that never got that far) or unreadable
                    value = []
                out[key] = value if isinstance(value, list) else []
    finally:
        if bar is None:
            os.environ.pop(_BAR, None)
        else:
            os.environ[_BAR] = bar
    return out


def earlier_records(uri: str, run_id: str) -> dict[str, list]:
    """What a run about to be reopened holds of its earlier submissions, for its tracker
    (``JobTracker.bind(history=...)``). The previous submission's end (its status and
    ``elastic_ddp.error`` tag, when it failed or was stopped) is appended to the events
    as a ``submission_end`` event and written to ``events/events.json``; only then is
    the tag removed. Called before the run is marked RUNNING again (its status and end
    time are the previous submission's)."""
    run = retrying(client(uri).get_run, run_id, what="get run")
    records = read_records(uri, run_id)
    error = run.data.tags.get(ERROR_TAG)
    last_step = run.data.tags.get(LAST_STEP_TAG)
    status = run.info.status
    if error is not None or status in ("FAILED", "KILLED"):
        end = (run.info.end_time or run.info.start_time or 0) / 1000.0
        ev = {"type": "submission_end", "t": end, "status": status, "cause": error or status.lower()}
        if last_step is not None and last_step.isdigit():
            ev["last_step_seen"] = int(last_step)
        records["events"].append(ev)
        retrying(client(uri).log_text, run_id, json.dumps(records["events"], indent=1), EVENTS,
                 what="log artifact")
    for tag in (ERROR_TAG, LAST_STEP_TAG):
        if run.data.tags.get(tag) is not None:
            retrying(client(uri).delete_tag, run_id, tag, what="delete tag")
    set_tags(uri, run_id, {STATE_TAG: "running"})
    return records


def resume_event(history: dict[str, list], t: float) -> dict[str, Any]:
    """The ``resume`` event of a submission that reopens its run, at ``t`` (its command's
    start): the cause is how the previous submission ended (the ``submission_end`` event
    :func:`earlier_records` added; a previous submission that did not close its run, a
    driver killed or its node lost, left none), ``last_step_seen`` the newest step it
    logged (None where unknown). ``report.recovery_events`` adds its recovery: seconds to
    this submission's first step, the step resumed at and the steps recomputed."""
    events = (history or {}).get("events") or []
    prev = events[-1] if events and events[-1].get("type") == "submission_end" else {}
    ev = {"type": "resume", "t": t, "last_step_seen": prev.get("last_step_seen"),
          "cause": prev.get("cause") or "the previous submission did not close its run"}
    if prev:
        ev["previous_status"] = prev.get("status")
    return ev


def with_earlier(earlier: dict[str, Any], key: str, current: list) -> str:
    """The artifact text of list ``key``: the earlier submissions' entries, then this one's."""
    return json.dumps(list(earlier.get(key) or []) + list(current), indent=1)
