"""Creating a local sqlite MLflow store safely when several jobs start at once.

MLflow creates a new sqlite store's tables (an Alembic migration) when its first client
in a process opens the file; two processes doing that at the same moment on a fresh
file collide (``table _alembic_tmp_experiments already exists``) and one of them fails.
:func:`create_store_once` opens the store under an exclusive ``flock`` of the database's
directory (no lock file is left behind), so the second process finds the tables made.
What it costs: one lock and one store open per process, before its first MLflow call.
"""

from __future__ import annotations

import fcntl
import os

_done: set[str] = set()


def create_store_once(uri: str) -> None:
    """Open the store ``uri`` once in this process with its directory locked, when it is
    a local ``sqlite:///`` file; any other store is left to MLflow."""
    from elastic_ddp.tracking.store import client, sqlite_path

    db = sqlite_path(uri)
    if db is None or uri in _done or not db.parent.is_dir():
        return
    fd = os.open(db.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        client(uri).search_experiments(max_results=1)  # the tables, made under the lock
        _done.add(uri)
    finally:
        os.close(fd)  # closing the descriptor releases the lock
