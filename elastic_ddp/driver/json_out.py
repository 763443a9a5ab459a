"""``elastic-ddp train --json``: standard output holds the JSON document and nothing else.

Lines reach file descriptor 1 by more ways than Python's ``sys.stdout``: Ray's driver
prints the raylet's warnings (``WARNING: 8 PYTHON worker processes have been started``,
ANSI-coloured) and, with ``--ray-logs``, the workers' output from its own threads; Ray's
C++ core worker and the processes this one starts (the local Ray's GCS and raylet, the
MLflow helper) write to the descriptor they inherit; a task module or a library may
``print`` at import. So the descriptor itself is redirected: for the whole job fd 1
points at fd 2 (what was printed still shows, on stderr), and the document goes to a
duplicate of the original fd 1 kept aside.
"""

from __future__ import annotations

import os
import sys
from typing import Optional


def _stdout_fd() -> Optional[int]:
    """1 when ``sys.stdout`` writes to file descriptor 1 (a console, a pipe, a file);
    None when it is something else (pytest's capture, an embedding program's stream),
    where redirecting the descriptor would not move what ``print`` writes."""
    try:
        return 1 if sys.stdout.fileno() == 1 else None
    except (AttributeError, OSError, ValueError):
        return None


class DocumentStdout:
    """``with DocumentStdout() as doc: ...; doc.emit(text)``: inside the block fd 1 is
    fd 2; ``emit`` writes ``text`` and a newline to the original standard output.

    On exit fd 1 is pointed back at the original output unless Ray is still connected in
    this process: its threads (the raylet's messages) and its shutdown at interpreter
    exit may still print, and nothing may follow the document. With ``sys.stdout`` not
    on fd 1 (see :func:`_stdout_fd`) nothing is redirected: ``print`` goes where the
    caller pointed ``sys.stdout``, and ``emit`` is a ``print``."""

    def __init__(self):
        self._saved: Optional[int] = None

    def __enter__(self) -> "DocumentStdout":
        if _stdout_fd() is None:
            return self
        sys.stdout.flush()
        self._saved = os.dup(1)
        os.set_inheritable(self._saved, False)  # no child process writes to it
        os.dup2(2, 1)
        return self

    def emit(self, text: str) -> None:
        if self._saved is None:
            print(text, flush=True)
            return
        sys.stdout.flush()  # what print() buffered goes to stderr, before the document
        data = (text + "\n").encode()
        while data:
            data = data[os.write(self._saved, data):]

    def __exit__(self, *exc) -> None:
        if self._saved is None:
            return
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            os.dup2(self._saved, 1)
        os.close(self._saved)
        self._saved = None
