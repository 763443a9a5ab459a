"""Fencing tokens for the run's lease: a job that lost its lease writes nothing more.

The run's lease (``elastic_ddp.driver.lease``) lets one job live per run, but a job that
was paused (SIGSTOP, a laptop's suspend, a frozen VM, a long GC pause) past the lease's
staleness limit is taken over by the next job of the run while its own processes may
still be running: its workers keep training when only its driver was stopped. Every
write to the run's storage and tracking checks the token first, so that such a job
stops instead of committing checkpoints, pruning them or logging into the new job's
MLflow run.

The token is the lease's *generation*: an integer in the lease record that grows with
every acquisition (a takeover: the previous record's + 1 at least; a new lease: the
clock's seconds, so a lease created after a release is newer too). The job learns it
when it takes the lease and hands it, as a :class:`Fence`, to its workers (the
checkpoint commit, ``ray.train.report`` and the pruning of checkpoints), to its tracker
(MLflow metrics, tags, artifacts) and to its MLflow helper (system metrics).

:meth:`Fence.lost` reads the lease record (one small read: a local file, one GET on
object storage) and says whether it is another job's now: another generation or
another holder. A record that cannot be read (the store briefly unreachable, a node
that does not see a local storage path, a released lease) is not taken for a loss: the
driver's heartbeat, which reads the same record, finds that case. A check and the write
after it are two requests, so a takeover between the two is not excluded; the window is
one request long.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

from elastic_ddp.errors import ElasticDDPError

#: ``elastic-ddp train``'s exit code when another job took the run over.
EXIT_TAKEN_OVER = 4

#: The lease record's fields that name its holder (besides the generation).
HOLDER_KEYS = ("host", "pid", "pid_start", "since")


class FencedError(ElasticDDPError, RuntimeError):
    """This job lost the run's lease to another job: nothing more may be written to the
    run. Its name is in ``positions.FATAL_TYPES``: a worker that raises it is not
    restarted. The message is one line naming the job that took the run over."""

    exit_code = EXIT_TAKEN_OVER


def lease_location(storage: str, run_name: str) -> tuple[Any, str]:
    """``(pyarrow file system, path)`` of the lease record of ``run_name`` in ``storage``
    (``<storage>/.leases/<run_name>.json``)."""
    from elastic_ddp.paths import uri_to_filesystem

    fs, base = uri_to_filesystem(storage)
    return fs, f"{base.rstrip('/')}/.leases/{run_name}.json"


def _iso(t: float) -> str:
    from datetime import datetime

    return datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")


def taken_over_line(run_name: str, rec: dict) -> str:
    """The one line of a fenced job: which job took run ``run_name`` over and when."""
    if rec.get("removed"):  # the heartbeat found no record at all
        return (f"run {run_name!r} lost its lease while this job was not heartbeating (paused or "
                "cut off): its record was removed (another job took the run over and ended, or "
                "it was deleted); this job stopped without writing to the run")
    when = rec.get("since")
    return (f"run {run_name!r} was taken over by another job (host {rec.get('host', '?')}, pid "
            f"{rec.get('pid', '?')}, at {_iso(float(when)) if when else '?'}, lease generation "
            f"{rec.get('generation', '?')}) while this one was not heartbeating (paused or cut "
            "off): this job stopped without writing to the run; the other job continues it")


class Fence:
    """The fencing token of one job: its lease record's ``generation`` and holder.

    Args:
        storage, run_name: where the lease lives (``run.storage_path``, ``run.name``).
        record: the lease record this job wrote when it took the lease (its
            ``generation`` and :data:`HOLDER_KEYS` are kept).

    Picklable (plain values): it travels to the workers and the tracker actor. Once lost,
    it stays lost (:attr:`taken_by`)."""

    def __init__(self, storage: str, run_name: str, record: dict):
        self.storage, self.run_name = storage, run_name
        self.generation = int(record.get("generation") or 0)
        self.holder = {k: record.get(k) for k in HOLDER_KEYS}
        self.taken_by: Optional[dict] = None
        self._checked = 0.0

    def _read(self) -> Optional[dict]:
        """The lease record now; None when there is none or it cannot be read."""
        try:
            fs, path = lease_location(self.storage, self.run_name)
            with fs.open_input_stream(path) as f:
                data = f.read()
            rec = json.loads(data.decode(errors="replace").strip())
        except (OSError, ValueError):
            return None
        return rec if isinstance(rec, dict) else None

    def owns(self, rec: dict) -> bool:
        """Whether lease record ``rec`` is this job's (same generation and holder)."""
        return (int(rec.get("generation") or 0) == self.generation
                and all(rec.get(k) == v for k, v in self.holder.items()))

    def lost(self, every_s: float = 0.0) -> Optional[dict]:
        """The record of the job that took the run over, or None while the lease is this
        job's (or cannot be read). ``every_s``: read at most once in that many seconds
        (a result of None in between is the last read's)."""
        if self.taken_by is not None:
            return self.taken_by
        now = time.monotonic()
        if every_s and now - self._checked < every_s:
            return None
        self._checked = now
        rec = self._read()
        if rec is not None and not self.owns(rec):
            self.taken_by = rec
        return self.taken_by

    def check(self, what: str = "") -> None:
        """Raise :class:`FencedError` (one line; ``what``: the write refused, e.g.
        ``"the checkpoint of step 80"``) when the run was taken over."""
        rec = self.lost()
        if rec is not None:
            refused = f"{what} not written: " if what else ""
            raise FencedError(refused + taken_over_line(self.run_name, rec))


def check(fence: Optional[Fence], what: str = "") -> None:
    """:meth:`Fence.check` where a job has a fence (None: no lease, nothing to check)."""
    if fence is not None:
        fence.check(what)
