"""One live job per run: a lease on the run, held while the job's driver lives.

A run is ``run.name`` in ``run.storage_path`` (its Ray Train directory and, through the
run key, its MLflow run). A second job of the same run would resume the first one's
*live* MLflow run and train beside it into the same checkpoints, so the driver takes
the lease before the MLflow run is opened and refuses a run whose lease is held
(:class:`RunBusyError`, exit 2), naming the holder. The lease is a small JSON record at
``<storage>/.leases/<run.name>.json``: host, pid, process start time, since, and a
heartbeat time the holder rewrites every :data:`HEARTBEAT_S` seconds from a daemon
thread. A lease whose holder is gone is taken over by the next job of that run (a
resume): on the holder's host, when its process no longer exists (at once); anywhere,
when its heartbeat is older than :data:`STALE_S` seconds.

Exclusive, so two jobs started together cannot both get it:

* a local file system: created with ``link(2)`` of a complete record (atomic; it fails
  when the lease exists);
* ``s3://``: created with a conditional write (``If-None-Match: *``); a stale lease is
  taken over, and the heartbeat rewritten, only if the record is still the version read
  (``If-Match`` its ETag): ``driver.lease_s3``;
* other object stores (``gs://``, ...): no exclusive create through pyarrow, so the
  record is written, read back after a moment, and the job that does not read its own
  record back is refused; a race inside that moment is not excluded (one warning line
  says so).

The record's ``generation`` is the run's fencing token (:mod:`elastic_ddp.fencing`):
larger with every acquisition, handed to the job's workers, tracker and MLflow helper,
which read the record before they write to the run and stop once it is another job's.
The heartbeat finds a takeover too and calls ``on_lost`` (the driver then stops without
writing to the run; ``elastic-ddp train`` exits 4). The staleness limit is
``ELASTIC_DDP_LEASE_STALE_S`` seconds (default 30; every job of a run should see the
same), the heartbeat a sixth of it, at most 5 s.

What it costs: one small write every few seconds for the job's length.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any, Optional

from elastic_ddp.background import start_deferring_signals
from elastic_ddp.config import ConfigError
# STALE_ENV, STALE_S: the lease's setting, read from here as well.
from elastic_ddp.driver.lease_record import (STALE_ENV, STALE_S, holder_alive,  # noqa: F401
                                             holder_exited, iso_time, pid_start, warn_read_back)
from elastic_ddp.errors import ElasticDDPError

HEARTBEAT_S = min(5.0, STALE_S / 6)
_RECORD_BYTES = 1024


class RunBusyError(ConfigError):
    """Another live job holds the run's lease; the message names its host, pid and start
    and the fix (the CLI's exit 2)."""

    kind = "run in use"


class RunLease:
    """The lease of run ``name`` in ``storage`` (a local path or a URI).
    :meth:`acquire` takes it (or raises :class:`RunBusyError`) and starts the heartbeat;
    :meth:`release` stops it and removes the record."""

    def __init__(self, storage: str, name: str):
        from elastic_ddp.paths import uri_to_filesystem

        self.storage, self.name = storage, name
        self.fs, base = uri_to_filesystem(storage)
        self.local = type(self.fs).__name__ == "LocalFileSystem"
        self.dir = f"{base.rstrip('/')}/.leases"
        self.path = f"{self.dir}/{name}.json"
        self.s3 = None  # driver.lease_s3.S3Object on s3:// storage
        self.etag: Optional[str] = None  # the version of the record this job wrote last
        if not self.local:
            from elastic_ddp.driver.lease_s3 import S3Object, is_s3

            if is_s3(storage):
                self.s3 = S3Object(storage, self.path)
        now = time.time()
        # The fencing token (elastic_ddp.fencing): a new lease's generation is the clock's
        # seconds, a takeover's at least the stale record's + 1 (_newer_than).
        self.record = {"host": socket.gethostname(), "pid": os.getpid(),
                       "pid_start": pid_start(os.getpid()), "since": now, "heartbeat": now,
                       "run": name, "generation": int(now)}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.took_over: Optional[dict] = None
        #: The record of the job that took this run over (found by the heartbeat or by
        #: :meth:`lost`); ``on_lost(record)`` is called once when the heartbeat finds it.
        self.taken_by: Optional[dict] = None
        self.on_lost: Optional[Any] = None

    def _newer_than(self, rec: Optional[dict]) -> None:
        """Make this job's generation newer than the record ``rec`` it replaces."""
        seen = int((rec or {}).get("generation") or 0)
        self.record["generation"] = max(int(self.record["generation"]), seen + 1)

    def fence(self):
        """This job's :class:`elastic_ddp.fencing.Fence` (after :meth:`acquire`)."""
        from elastic_ddp.fencing import Fence

        return Fence(self.storage, self.name, self.record)

    def lost(self) -> Optional[dict]:
        """The record of the job that took the run over, or None while the lease is this
        job's (one read of the record; a record that cannot be read counts as this job's)."""
        if self.taken_by is None and self._thread is not None:
            try:
                rec = self._read()
            except OSError:
                return None
            if rec is not None and not self._mine(rec):
                self.taken_by = rec
        return self.taken_by

    def _mine(self, rec: dict) -> bool:
        return all(rec.get(k) == self.record.get(k) for k in ("host", "pid", "pid_start", "since", "generation"))

    # -- reading and judging ---------------------------------------------------------
    def _read(self, path: Optional[str] = None) -> Optional[dict]:
        if self.s3 is not None and path is None:
            return self._read_s3()[0]
        try:
            if self.local:
                with open(path or self.path, "rb") as f:
                    data = f.read()
            else:
                with self.fs.open_input_stream(path or self.path) as f:
                    data = f.read()
        except (FileNotFoundError, OSError):
            return None
        try:
            return json.loads(data.decode(errors="replace").strip())
        except ValueError:
            return {}

    def _busy(self, rec: dict) -> RunBusyError:
        ago = max(0.0, time.time() - float(rec.get("heartbeat") or 0))
        return RunBusyError(
            f"run.name={self.name!r} in {self.storage} is in use by a live job on host "
            f"{rec.get('host', '?')}, pid {rec.get('pid', '?')}, since "
            f"{iso_time(float(rec.get('since') or 0))} (last heartbeat {ago:.0f} s ago); set another "
            f"run.name, or wait for that job to end (a job that stops for {STALE_S:.0f} s is "
            "taken over by the next run of this name, which resumes it)")

    def _read_s3(self) -> tuple[Optional[dict], Optional[str]]:
        """(record, its ETag); (None, None): no lease. Raises LeaseStoreError."""
        data, etag = self.s3.read()
        if data is None:
            return None, None
        try:
            return json.loads(data.decode(errors="replace").strip()), etag
        except ValueError:
            return {}, etag

    # -- taking and giving back ------------------------------------------------------
    def _bytes(self) -> bytes:
        return json.dumps(self.record).encode().ljust(_RECORD_BYTES)

    def _create_local(self) -> bool:
        os.makedirs(self.dir, exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(self._bytes())
        try:
            os.link(tmp, self.path)  # atomic; fails when the lease exists
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def _take_over_local(self, seen: dict) -> None:
        """Move the stale record ``seen`` away, unless what is there now is another one
        (a job that took it over a moment ago): that one is put back."""
        grab = f"{self.path}.{os.getpid()}.takeover"
        try:
            os.rename(self.path, grab)
        except FileNotFoundError:
            return
        if self._read(grab) != seen:
            try:
                os.link(grab, self.path)
            except FileExistsError:
                pass
        os.unlink(grab)

    def _acquire_s3(self) -> bool:
        """One try on S3: create the record, or take a stale one over, each conditional.
        False: the record changed under this try (judge again). Raises RunBusyError."""
        etag = self.s3.create(self._bytes())
        if etag is not None:
            self.etag = etag
            return True
        rec, seen = self._read_s3()
        if rec is None:
            return False  # released meanwhile
        if holder_alive(rec):
            raise self._busy(rec)
        self._newer_than(rec)
        etag = self.s3.replace(self._bytes(), seen)  # only over the stale version read
        if etag is None:
            return False  # another job took it over (or it was released) first
        self.etag, self.took_over = etag, rec
        return True

    def acquire(self) -> "RunLease":
        """Take the lease, or raise :class:`RunBusyError` naming the live holder (a
        ``ConfigError`` naming the key and the store's error where the store fails)."""
        from elastic_ddp.driver.lease_s3 import LeaseStoreError

        try:
            return self._acquire()
        except LeaseStoreError as e:
            raise ConfigError(f"run.storage_path={self.storage}: the run's lease could not be "
                              f"taken: {e}; check the bucket, the credentials and the endpoint "
                              "(AWS_ENDPOINT_URL, AWS_REGION)") from e

    def _acquire(self) -> "RunLease":
        for _ in range(5):
            if self.s3 is not None:
                if self._acquire_s3():
                    break
                continue
            if self.local:
                if self._create_local():
                    break
            else:
                warn_read_back(self.storage)
                rec = self._read()
                if rec is None or not holder_alive(rec):
                    self._newer_than(rec)
                    self.fs.create_dir(self.dir, recursive=True)
                    self._write()
                    time.sleep(1.0)
                    if self._read() == self.record:
                        self.took_over = rec or None
                        break
                    continue
            rec = self._read()
            if rec is None:
                continue  # released meanwhile: try again
            if holder_alive(rec):
                raise self._busy(rec)
            self.took_over = rec
            self._newer_than(rec)
            self._take_over_local(rec)
        else:
            rec = self._read() or {}
            raise self._busy(rec)
        self._thread = threading.Thread(target=self._beat, name="run-lease", daemon=True)
        start_deferring_signals(self._thread)
        return self

    def _write(self) -> None:
        if self.s3 is not None:
            etag = self.s3.replace(self._bytes(), self.etag)
            if etag is None:
                raise _Lost()
            self.etag = etag
            return
        if self.local:
            fd = os.open(self.path, os.O_WRONLY)
            try:
                os.pwrite(fd, self._bytes(), 0)
            finally:
                os.close(fd)
        else:
            with self.fs.open_output_stream(self.path) as f:
                f.write(self._bytes())

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                # S3: the conditional write itself finds a record replaced meanwhile.
                if self.s3 is None and self._read() != self.record:
                    raise _Lost()  # taken over (this job was stopped long enough to look dead)
                self.record["heartbeat"] = time.time()
                self._write()
            except _Lost:
                self._found_lost()
                return
            except OSError:
                pass  # storage briefly unreachable: the next beat tries again

    def _found_lost(self) -> None:
        """The heartbeat found the record replaced (or removed): the job is fenced."""
        try:
            rec = self._read()
        except OSError:
            rec = None
        self.taken_by = self.taken_by or rec or {"removed": True}
        if self.on_lost is not None:
            self.on_lost(self.taken_by)

    def release(self) -> None:
        """Stop the heartbeat and remove the record (only this job's own)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=HEARTBEAT_S + 5)
        try:
            if self.s3 is not None:
                if self.etag is not None:
                    self.s3.delete(self.etag)  # only the version this job wrote last
            elif self._read() == self.record:
                if self.local:
                    os.unlink(self.path)
                    try:
                        os.rmdir(self.dir)
                    except OSError:
                        pass
                else:
                    self.fs.delete_file(self.path)
        except OSError:
            pass

    def describe_takeover(self) -> Optional[str]:
        rec: dict[str, Any] = self.took_over or {}
        if not rec:
            return None
        head = (f"elastic-ddp: run {self.name!r}: took over the lease of the job on host "
                f"{rec.get('host', '?')}, pid {rec.get('pid', '?')} (since "
                f"{iso_time(float(rec.get('since') or 0))}), ")
        if holder_exited(rec):
            return head + "which is gone (its process has exited)"
        ago = max(0.0, time.time() - float(rec.get("heartbeat") or 0))
        return head + (f"whose lease is stale (no heartbeat for {ago:.0f} s); its process may "
                       "still exist (a paused or cut-off job): stop it if it does")


class _Lost(ElasticDDPError):
    """The record on S3 is no longer the version this job wrote: taken over."""


