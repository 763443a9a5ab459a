"""The run lease's record judged: its staleness limit, whether its holder lives, and the
lines that name it (``driver.lease``).

A record is ``{"host", "pid", "pid_start", "since", "heartbeat", "run", "generation"}``
(times in seconds since the epoch; ``pid_start`` in clock ticks since boot, from /proc).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Optional

from elastic_ddp.config import ConfigError


def _stale_s() -> float:
    """``ELASTIC_DDP_LEASE_STALE_S`` (seconds, > 0), else 30."""
    raw = os.environ.get(STALE_ENV, "").strip()
    try:
        value = float(raw) if raw else 30.0
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ConfigError(f"{STALE_ENV}={raw!r}: not a number of seconds above 0; unset it for "
                          "the default of 30")
    return value


#: Seconds without a heartbeat after which a lease is stale (taken over by the next job of
#: the run); the environment variable sets it for every job of the run alike.
STALE_ENV = "ELASTIC_DDP_LEASE_STALE_S"
STALE_S = _stale_s()


def iso_time(t: float) -> str:
    """``t`` (seconds since the epoch) as a local ISO 8601 time."""
    from datetime import datetime

    return datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")


def pid_start(pid: int) -> Optional[float]:
    """When process ``pid`` started, in clock ticks since boot (/proc), None elsewhere: a
    reused pid has another start."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            return float(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def holder_alive(rec: dict, now: Optional[float] = None) -> bool:
    """Whether the holder of ``rec`` still lives: its heartbeat is recent and, on this
    host, its process (the same pid with the same start time) still exists."""
    now = time.time() if now is None else now
    if not rec:
        return False
    if rec.get("host") == socket.gethostname() and rec.get("pid"):
        if not os.path.exists(f"/proc/{int(rec['pid'])}"):
            try:
                os.kill(int(rec["pid"]), 0)
            except ProcessLookupError:
                return False
            except OSError:
                pass
        start = pid_start(int(rec["pid"]))
        if start is not None and rec.get("pid_start") is not None and start != rec["pid_start"]:
            return False  # the pid was reused by another process
    return now - float(rec.get("heartbeat") or 0) < STALE_S


def holder_exited(rec: dict) -> bool:
    """Whether the holder of lease record ``rec`` is known to have exited: it ran on this
    host and its pid is gone or belongs to another process now. Elsewhere it is unknown."""
    if rec.get("host") != socket.gethostname() or not rec.get("pid"):
        return False
    pid = int(rec["pid"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass
    start = pid_start(pid)
    return start is not None and rec.get("pid_start") is not None and start != rec["pid_start"]


_warned_read_back: set[str] = set()


def warn_read_back(storage: str) -> None:
    """The one warning line (per process and scheme) that a lease is taken without an
    exclusive create on this store."""
    from urllib.parse import urlsplit

    scheme = urlsplit(storage).scheme or "this storage"
    if scheme in _warned_read_back:
        return
    _warned_read_back.add(scheme)
    print(f"elastic-ddp: warning: {scheme}:// has no exclusive create here: the run's lease "
          "is written and read back after 1 s, so two jobs of one run started within that "
          "second could both hold it (s3:// and local storage take it exclusively)",
          file=sys.stderr, flush=True)
