"""MLflow internals the tracking layer needs where MLflow has no public API.

- :func:`anchor_artifacts`: MLflow has no API to change an experiment's artifact
  location, so a sqlite store that was moved or copied (with its ``mlruns/``) would keep
  writing artifacts to the old place. Three ``UPDATE`` statements on the tables MLflow's
  own ORM maps (``experiments``, ``runs``, ``logged_models``), and a clear of the
  per-process artifact repository cache (``mlflow.tracking._tracking_service.utils``).
  Tested with MLflow 3.10-3.18 (the ``mlflow`` range in pyproject.toml): a schema without
  a table is skipped, and a missing cache attribute is ignored (it only saves a stale
  location in this process).
- :func:`tracking_store_schemes`: the URI schemes of MLflow's own tracking stores, a copy
  of what MLflow registers in ``mlflow.tracking._tracking_service.utils``
  (``_tracking_store_registry``; its Unity Catalog schemes, ``databricks-uc`` and ``uc``,
  refuse to be one), and those of installed plugins (entry points of
  ``mlflow.tracking_store``). It buys the refusal of a typo'd ``run.tracking_uri``
  scheme (``htp://``) before anything starts, without importing MLflow (about a second
  of the driver's start-up); MLflow itself fails only when the run is opened. Version
  guard: on an MLflow release of :data:`~elastic_ddp.compat.versions.TESTED_MLFLOW`
  (the copy is compared with MLflow's registry by
  ``tests/unit/driver/test_tracking_store_down.py``); on another, None: every scheme passes and
  MLflow names a bad one itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

# mlflow.tracking._tracking_service.utils registers these (MLflow 3.17 and 3.18).
MLFLOW_STORE_SCHEMES = ("file", "sqlite", "postgresql", "mysql", "mssql", "http", "https",
                        "databricks")
MLFLOW_STORE_PLUGINS = "mlflow.tracking_store"


def tracking_store_schemes() -> Optional[list[str]]:
    """MLflow's tracking store schemes and those of installed plugins; None on an MLflow
    release the copy was not tested on (see the module's note)."""
    from importlib.metadata import entry_points

    from elastic_ddp.compat.versions import TESTED_MLFLOW, tested_release

    if not tested_release("mlflow", TESTED_MLFLOW):
        return None
    plugins = {e.name for e in entry_points(group=MLFLOW_STORE_PLUGINS)}
    return [*MLFLOW_STORE_SCHEMES, *sorted(plugins - set(MLFLOW_STORE_SCHEMES))]


def anchor_artifacts(db: Path, exp_id: str, current: str, root: str = "mlruns") -> bool:
    """Point experiment ``exp_id`` of the sqlite store ``db`` (and its runs' and logged
    models' artifact locations) at ``<db's folder>/<root>/<exp_id>`` when it points
    elsewhere (the store was moved or copied with its ``mlruns/``, or the experiment was
    just created with MLflow's working-directory default). Returns True when it changed
    anything. MLflow has no API to change an experiment's artifact location, hence the
    three UPDATEs of the tables MLflow's own ORM maps (``experiments``, ``runs``,
    ``logged_models``), in one transaction."""
    import sqlite3

    want = str(db.resolve().parent / root / str(exp_id))
    old = current[len("file://"):] if current.startswith("file://") else current
    if old.rstrip("/") == want:
        return False
    con = sqlite3.connect(str(db), timeout=30)
    try:
        with con:
            con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?",
                        (want, int(exp_id)))
            for table, col in (("runs", "artifact_uri"), ("logged_models", "artifact_location")):
                try:
                    con.execute(f"UPDATE {table} SET {col} = ? || substr({col}, ?) "
                                f"WHERE experiment_id = ? AND substr({col}, 1, ?) = ?",
                                (want, len(current) + 1, int(exp_id), len(current), current))
                except sqlite3.OperationalError:  # an older schema without the table
                    pass
    finally:
        con.close()
    try:  # this process's clients keep each run's artifact repository (old location)
        from mlflow.tracking._tracking_service import utils as svc

        svc._artifact_repos_cache.clear()
    except (ImportError, AttributeError):
        pass
    return True
