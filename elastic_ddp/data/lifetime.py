"""The processes of ``data.reader: dataloader``'s DataLoader workers: how they start
(:func:`worker_context`: forked by a forkserver) and that they end with the trainer that
uses them, however it ends (a SIGKILL included).

Why the end needs saying: the workers are forked by the trainer's multiprocessing
forkserver, not by the trainer. Every process the forkserver
forks inherits the write end of the forkserver's "alive" pipe, and the forkserver exits
only when every copy is closed; a DataLoader worker in turn watches its parent, the
forkserver, not the trainer. A trainer killed with SIGKILL (a worker kill, the OOM
killer) left both waiting on each other: its forkserver (parent pid 1) and its workers,
a few hundred MB each, lived on for as long as the node did, one set per restart.

What is done: each DataLoader worker runs :func:`watch_trainer` (its ``worker_init_fn``),
a daemon thread that waits for the trainer's process to end and then ends the worker.
Once the workers are gone the forkserver's pipe has no writer left and it exits too, as
does the trainer's multiprocessing resource tracker. On Linux the thread blocks on a
pidfd of the trainer (``os.pidfd_open``: woken when it exits, no polling); elsewhere it
checks the trainer every :data:`POLL_S` seconds.
"""

from __future__ import annotations

import os
import threading

#: Seconds between two checks of the trainer where no pidfd is available.
POLL_S = 1.0
# Modules a data worker needs, imported once by the forkserver its workers fork from.
WORKER_PRELOAD = ["numpy", "pyarrow.parquet", "torch", "ray.data.block", "elastic_ddp.data.chunks"]


def worker_context():
    """The multiprocessing context of the DataLoader workers: ``forkserver``, its server
    started now (it imports ``WORKER_PRELOAD`` in the background). A worker forked from
    this process instead would inherit locks that its other threads (the training step,
    Ray's core worker) may hold at that moment: torch's seeding of a new worker waits
    forever on such a lock. The server is a fresh single-threaded process, started once
    per process; what it costs: its imports (seconds, once) and, per worker, unpickling
    the dataset (the task is cloudpickled, like for Ray's tasks)."""
    import multiprocessing as mp
    import multiprocessing.forkserver as fs

    ctx = mp.get_context("forkserver")
    # The preload list is read only when the server starts: once it runs, this is a no-op.
    ctx.set_forkserver_preload(WORKER_PRELOAD)
    fs.ensure_running()
    return ctx


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's (a reused pid): not ours to watch
        return True
    return False


def wait_for_exit(pid: int) -> None:
    """Return once process ``pid`` has ended (at once when it is not running)."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd (not Linux 5.3+): poll
        stop = threading.Event()
        while not _gone(pid):
            stop.wait(POLL_S)
        return
    try:
        p = select.poll()
        p.register(fd, select.POLLIN)
        while not p.poll():
            pass
    finally:
        os.close(fd)


def _end_when_gone(pid: int) -> None:
    import signal

    wait_for_exit(pid)
    # The trainer is gone: nothing waits for this worker's output or its clean-up.
    os.kill(os.getpid(), signal.SIGKILL)


def watch_trainer(trainer_pid: int, worker_id: int = 0) -> None:
    """A DataLoader ``worker_init_fn`` (bound to ``trainer_pid`` with ``functools.partial``):
    end this worker process when the trainer's process ``trainer_pid`` ends."""
    threading.Thread(target=_end_when_gone, args=(int(trainer_pid),), daemon=True,
                     name="elastic-ddp-trainer-watch").start()
