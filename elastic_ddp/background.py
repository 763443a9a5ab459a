"""One function run in a daemon thread, its result (or error) handed back to the caller."""

from __future__ import annotations

import threading


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
        self._thread.start()

    def result(self):
        # An Event, not Thread.join: a Ctrl-C that interrupts join() marks the thread
        # stopped while it still runs (CPython 3.11), and a second join() then returns
        # before the result exists. A wait interrupted here can simply be waited again.
        while not self._done.wait(0.5):
            pass
        if self._err:
            raise self._err[0]
        return self._out[0]
