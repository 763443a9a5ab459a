"""A resumed run's records of its earlier submissions, kept when a submission adds its own.

The tracker actor writes ``events/events.json``, ``events/attempts.json``,
``events/timeline.json`` and ``warnings/nonfinite_rows.json`` whole, from what it holds. A resubmission's tracker starts
empty, so it is handed what the run holds already (:func:`earlier_records`, read by the
MLflow helper when it reopens the run) and writes those lists first, then its own: every
failure of every submission stays an event of the run.

How the previous submission ended (the ``elastic_ddp.error`` tag of a FAILED or KILLED
run) becomes a ``submission_end`` event, written before the tag is removed: a run that
resumes and finishes carries no error of an attempt that came before.
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
    status = run.info.status
    if error is not None or status in ("FAILED", "KILLED"):
        end = (run.info.end_time or run.info.start_time or 0) / 1000.0
        records["events"].append({"type": "submission_end", "t": end, "status": status,
                                  "cause": error or status.lower()})
        retrying(client(uri).log_text, run_id, json.dumps(records["events"], indent=1), EVENTS,
                 what="log artifact")
    if error is not None:
        retrying(client(uri).delete_tag, run_id, ERROR_TAG, what="delete tag")
    set_tags(uri, run_id, {STATE_TAG: "running"})
    return records


def with_earlier(earlier: dict[str, Any], key: str, current: list) -> str:
    """The artifact text of list ``key``: the earlier submissions' entries, then this one's."""
    return json.dumps(list(earlier.get(key) or []) + list(current), indent=1)
