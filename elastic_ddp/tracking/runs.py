"""The job's MLflow run: created once, reopened by every later submission of the same job
(its run key: ``run.name`` and the storage path), with its params, source tags and
description."""

from __future__ import annotations

from typing import Any, Optional

from elastic_ddp.config import Config
from elastic_ddp.tracking.content import describe, job_params, source_tags
from elastic_ddp.tracking.store import (RUN_KEY_TAG, STATE_TAG, client, experiment_id, log_params,
                                        retrying, run_key, sqlite_path)

#: ``open_run``'s ``resume_id`` when the caller has not looked for the run itself.
SEARCH = "search"


def find_run(cfg: Config, storage_path: str, uri: str):
    """The job's unfinished run (its run key: ``run.name`` and the storage path), which
    :func:`open_run` would reopen, as an ``mlflow.entities.Run``; None when there is none
    or ``run.resume`` is false. Reads only: no store, experiment or run is created or
    changed (a local sqlite store that does not exist yet holds no run)."""
    from elastic_ddp.tracking.store_init import create_store_once

    db = sqlite_path(uri)
    if not cfg.run.resume or (db is not None and not db.is_file()):
        return None
    create_store_once(uri)
    c = client(uri)
    exp = retrying(c.get_experiment_by_name, cfg.run.experiment_name, what="get experiment")
    if exp is None or exp.lifecycle_stage == "deleted":
        return None
    runs = retrying(c.search_runs, [exp.experiment_id],
                    filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key(cfg, storage_path)}'",
                    order_by=["attributes.start_time DESC"], max_results=1, what="search runs")
    return runs[0] if runs and runs[0].info.status != "FINISHED" else None


def open_run(cfg: Config, storage_path: str, uri: str, parent_run_id: Optional[str] = None,
             params: Optional[dict[str, Any]] = None, tags: Optional[dict[str, str]] = None,
             run_name: Optional[str] = None, resume_id: Optional[str] = SEARCH) -> tuple[str, bool]:
    """Create the job's MLflow run, or reopen the unfinished one with the same run key.

    ``parent_run_id`` makes a new run a child of that run (MLflow's ``mlflow.parentRunId``
    tag; the UI nests it). ``params`` default to :func:`job_params`. A new run gets
    :func:`source_tags` (user, source, git commit) and a description. ``resume_id``: the
    run :func:`find_run` found (None: it found none, a new run is created); by default
    the run is looked for here.

    Returns:
        (run_id, resumed): resumed is True when an earlier submission's run was reopened.
    """
    from elastic_ddp.tracking.store_init import create_store_once

    create_store_once(uri)  # two jobs starting together on a fresh sqlite file
    c = client(uri)
    exp_id = experiment_id(uri, cfg.run.experiment_name)
    if resume_id == SEARCH:
        found = find_run(cfg, storage_path, uri)
        resume_id = found.info.run_id if found is not None else None
    if resume_id is not None:
        retrying(c.update_run, resume_id, status="RUNNING", what="reopen run")
        return resume_id, True
    key = run_key(cfg, storage_path)
    all_tags = {**source_tags(), "mlflow.note.content": describe(cfg), RUN_KEY_TAG: key,
                STATE_TAG: "running", **(tags or {})}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    run = retrying(c.create_run, exp_id, run_name=run_name or cfg.run.name, tags=all_tags,
                   what="create run")
    log_params(uri, run.info.run_id, job_params(cfg) if params is None else params)
    return run.info.run_id, False
