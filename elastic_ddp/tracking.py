"""MLflow: one run per training job, kept across restarts, resizes and resubmissions.

The driver opens (or reopens) the run and passes its id to the workers; rank 0 logs
through ``RankZeroTracker`` (a no-op object on every other rank, so the loop has no
``if rank == 0``); the controller-side callback logs restart events into the same run.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

from elastic_ddp.config import Config

RUN_KEY_TAG = "elastic_ddp.run_key"
STATE_TAG = "elastic_ddp.state"


def default_tracking_uri(cfg: Optional[Config] = None) -> str:
    """The MLflow tracking URI: the config's, else $MLFLOW_TRACKING_URI, else a sqlite
    store at an absolute path in the working directory (Ray workers change their working
    directory, so a relative URI would open a different store on each of them)."""
    if cfg is not None and cfg.run.tracking_uri:
        uri = cfg.run.tracking_uri
    else:
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = f"sqlite:///{Path(uri[len('sqlite:///'):]).resolve()}"
    return uri


def run_key(cfg: Config, storage_path: str) -> str:
    """Identity of a job across resubmissions: its Ray run name and storage path."""
    return hashlib.sha1(f"{cfg.run.name}|{storage_path}".encode()).hexdigest()[:16]


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def open_run(cfg: Config, storage_path: str, uri: str,
             parent_run_id: Optional[str] = None) -> tuple[str, bool]:
    """Create the job's MLflow run, or reopen the unfinished one with the same run key.

    ``parent_run_id`` makes a new run a child of that run (MLflow's ``mlflow.parentRunId``
    tag; the UI nests it), as ``elastic-ddp sweep`` does for each world size.

    Returns:
        (run_id, resumed): resumed is True when an earlier submission's run was reopened.
    """
    client = _client(uri)
    exp = client.get_experiment_by_name(cfg.run.experiment_name)
    exp_id = exp.experiment_id if exp else client.create_experiment(cfg.run.experiment_name)
    key = run_key(cfg, storage_path)
    if cfg.run.resume:
        runs = client.search_runs(
            [exp_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{key}'",
            order_by=["attributes.start_time DESC"], max_results=1,
        )
        if runs and runs[0].info.status != "FINISHED":
            client.update_run(runs[0].info.run_id, status="RUNNING")
            return runs[0].info.run_id, True
    tags = {RUN_KEY_TAG: key, STATE_TAG: "running"}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    run = client.create_run(exp_id, run_name=cfg.run.name, tags=tags)
    from mlflow.entities import Param

    params = [Param(k, str(v)[:6000]) for k, v in cfg.to_flat_dict().items()]
    for i in range(0, len(params), 100):
        client.log_batch(run.info.run_id, params=params[i:i + 100])
    return run.info.run_id, False


def finish_run(uri: str, run_id: str, ok: bool, error: str | None = None,
               status: str | None = None) -> None:
    """Close the run as FINISHED or FAILED; a failed run keeps the error as a tag so the
    store never holds a run that looks alive but is not."""
    client = _client(uri)
    if error:
        client.set_tag(run_id, "elastic_ddp.error", error[:5000])
    client.set_tag(run_id, STATE_TAG, "finished" if ok else "failed")
    client.set_terminated(run_id, status=status or ("FINISHED" if ok else "FAILED"))


class RankZeroTracker:
    """Logs to the job's MLflow run from one process; every method is a no-op when
    ``enabled`` is False (all ranks but 0), so callers never branch on rank.

    Metrics are buffered and sent with ``log_batch`` on ``flush`` (one sqlite transaction
    per flush instead of one per value).
    """

    def __init__(self, uri: str, run_id: str, enabled: bool = True):
        self.enabled = enabled
        self.run_id = run_id
        self._client = _client(uri) if enabled else None
        self._pending: list[Any] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self._pending.extend(Metric(k, float(v), ts, int(step)) for k, v in metrics.items())

    def flush(self) -> None:
        if not self.enabled or not self._pending:
            return
        for i in range(0, len(self._pending), 500):
            self._client.log_batch(self.run_id, metrics=self._pending[i:i + 500])
        self._pending.clear()

    def set_tags(self, tags: dict[str, Any]) -> None:
        if self.enabled:
            from mlflow.entities import RunTag

            self._client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        if self.enabled:
            self._client.log_text(self.run_id, json.dumps(obj, indent=2, default=str),
                                  artifact_file)

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        if self.enabled:
            self._client.log_artifact(self.run_id, local_path, artifact_path)


def latest_metrics(uri: str, run_id: str) -> dict[str, float]:
    """The run's latest value of every metric (the driver's progress display polls it)."""
    return dict(_client(uri).get_run(run_id).data.metrics)
