"""One function run in a daemon thread, its result (or error) handed back to the caller."""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def signals_held():
    """A block that SIGINT and SIGTERM do not interrupt (main thread): a signal that
    arrives inside it is delivered when it ends, once per kind, to the handler that was
    installed at entry (a raising one raises there; ``SIG_DFL`` is raised again). For the
    few statements that must run together or not at all (a thread started, a request sent
    and its reader made), because a raising handler (Ctrl-C's KeyboardInterrupt, the
    CLI's early SIGTERM) would otherwise leave them half done.

    Two layers, because neither alone holds: the block installs recording handlers, since
    blocking the main thread's mask does not stop the kernel from handing a process signal
    to any other thread (a pyarrow or gRPC pool thread) whose mask lets it through, and
    CPython then runs the Python handler in the main thread anyway; and it blocks the
    main thread's mask, so that a thread started inside the block inherits a mask that
    leaves process signals to the threads that take them. Elsewhere (another thread) it
    holds nothing back: only the main thread runs Python signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def record(signum, frame) -> None:
        pending.append(signum)

    before = {}
    for s in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(s) is not None:  # None: a handler set from C, not ours to swap
            before[s] = signal.signal(s, record)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM}) \
        if hasattr(signal, "pthread_sigmask") else None
    try:
        yield
    finally:
        if mask is not None:
            # A signal the mask kept pending is delivered now, to ``record``.
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for s, h in before.items():
            signal.signal(s, h)
        for s in dict.fromkeys(pending):
            h = before[s]
            if callable(h):
                h(s, None)
            elif h == signal.SIG_DFL:
                signal.raise_signal(s)


def start_deferring_signals(thread: threading.Thread) -> None:
    """``thread.start()`` with SIGINT and SIGTERM held back until it returns
    (:func:`signals_held`). A handler that raises inside ``Thread.start`` makes CPython
    3.11 drop the thread from its start-up table while the thread still runs, which then
    prints a ``KeyError`` traceback from it. The new thread keeps the mask, so process
    signals go to threads that take them."""
    with signals_held():
        thread.start()


class Background:
    """``fn(*args)`` in a daemon thread named ``name``; ``result()`` waits for it and
    returns its value or re-raises its exception in the caller's thread."""

    def __init__(self, fn, *args, name: str = "elastic-ddp-background"):
        self._out: list = []
        self._err: list = []
        self._done = threading.Event()

        def run():
            try:
                self._out.append(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to result()
                self._err.append(e)
            finally:
                self._done.set()

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        start_deferring_signals(self._thread)

    def result(self):
        # An Event, not Thread.join: a Ctrl-C that interrupts join() marks the thread
        # stopped while it still runs (CPython 3.11), and a second join() then returns
        # before the result exists. A wait interrupted here can simply be waited again.
        while not self._done.wait(0.5):
            pass
        if self._err:
            raise self._err[0]
        return self._out[0]
