"""The job's MLflow run: created once, reopened by every later submission of the same job
(its run key: ``run.name`` and the storage path), with its params, source tags and
description."""

from __future__ import annotations

from typing import Any, Optional

from elastic_ddp.config import Config
from elastic_ddp.tracking.content import describe, job_params, source_tags
from elastic_ddp.tracking.store import (RUN_KEY_TAG, STATE_TAG, client, experiment_id, log_params,
                                        retrying, run_key)


def open_run(cfg: Config, storage_path: str, uri: str, parent_run_id: Optional[str] = None,
             params: Optional[dict[str, Any]] = None, tags: Optional[dict[str, str]] = None,
             run_name: Optional[str] = None) -> tuple[str, bool]:
    """Create the job's MLflow run, or reopen the unfinished one with the same run key.

    ``parent_run_id`` makes a new run a child of that run (MLflow's ``mlflow.parentRunId``
    tag; the UI nests it). ``params`` default to :func:`job_params`. A new run gets
    :func:`source_tags` (user, source, git commit) and a description.

    Returns:
        (run_id, resumed): resumed is True when an earlier submission's run was reopened.
    """
    from elastic_ddp.tracking.store_init import create_store_once

    create_store_once(uri)  # two jobs starting together on a fresh sqlite file
    c = client(uri)
    exp_id = experiment_id(uri, cfg.run.experiment_name)
    key = run_key(cfg, storage_path)
    if cfg.run.resume:
        runs = retrying(c.search_runs, [exp_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{key}'",
                        order_by=["attributes.start_time DESC"], max_results=1, what="search runs")
        if runs and runs[0].info.status != "FINISHED":
            retrying(c.update_run, runs[0].info.run_id, status="RUNNING", what="reopen run")
            return runs[0].info.run_id, True
    all_tags = {**source_tags(), "mlflow.note.content": describe(cfg), RUN_KEY_TAG: key,
                STATE_TAG: "running", **(tags or {})}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    run = retrying(c.create_run, exp_id, run_name=run_name or cfg.run.name, tags=all_tags,
                   what="create run")
    log_params(uri, run.info.run_id, job_params(cfg) if params is None else params)
    return run.info.run_id, False
