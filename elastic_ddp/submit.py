"""Submit a training job to a running Ray cluster through its job API.

    elastic-ddp submit experiments/configs/digits_cnn.yaml --address http://127.0.0.1:8265 --wait

The job runs ``python -m elastic_ddp.cli train CONFIG --set ...`` on the head node with
the runtime env of ``cluster/runtime_env.yaml``: the working directory (this repo, less
what ``.rayignore`` keeps out) is uploaded and put on every worker's ``PYTHONPATH``, so
the cluster runs exactly this checkout's code; the dependencies come from the cluster's
image. ``${VAR}`` in the runtime env's ``env_vars`` is filled from the submitter's
environment when set there (e.g. ``MLFLOW_TRACKING_URI``), else left for the cluster
node to expand from its own environment (e.g. a Kubernetes secret).

Resubmitting a config with the same ``run.name`` and ``run.storage_path`` resumes: Ray
Train restores the run's checkpoint manager from ``storage_path/name`` and hands the
newest checkpoint to the workers, and ``tracking.open_run`` reopens the same unfinished
MLflow run (a FINISHED run is complete and is never reopened).

Token authentication: when the cluster has it on (Ray's default for new clusters), the
request carries ``Authorization: Bearer <token>``, the token read from
``$RAY_AUTH_TOKEN``, else the file ``$RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``
when ``RAY_AUTH_MODE=token``. The token never enters the job's runtime env or its logs.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

import yaml

from elastic_ddp.config import Config, ConfigError

DEFAULT_RUNTIME_ENV = "cluster/runtime_env.yaml"
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class SubmitError(RuntimeError):
    """The job could not be submitted (unreachable cluster, refused token, bad env)."""


def auth_headers() -> dict[str, str]:
    """The bearer token header for a token-auth cluster, or {} when none is configured.

    Sources, in Ray's own order: ``RAY_AUTH_TOKEN``, the file at ``RAY_AUTH_TOKEN_PATH``,
    and ``~/.ray/auth_token`` (only when ``RAY_AUTH_MODE=token``, so a stray default
    token is never sent to a cluster that did not ask for one). Built here rather than
    left to Ray because Ray adds it only when *this* process's auth mode is "token".
    """
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if not token and path:
        p = Path(path).expanduser()
        if not p.is_file():
            raise SubmitError(f"RAY_AUTH_TOKEN_PATH={path} is not a readable file")
        token = p.read_text().strip()
    if not token and os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        p = Path.home() / ".ray" / "auth_token"
        token = p.read_text().strip() if p.is_file() else ""
    return {"Authorization": f"Bearer {token}"} if token else {}


def is_local_address(address: str) -> bool:
    """True for a job API on this machine (loopback): the cluster then shares this
    machine's file system, so relative paths can be made absolute for it."""
    host = urlparse(address if "://" in address else f"http://{address}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_runtime_env(path: str | os.PathLike, environ: Optional[dict] = None) -> dict[str, Any]:
    """Read a runtime env YAML; fill ``${VAR}`` in ``env_vars`` from ``environ`` (the
    submitter's environment) where set. Unset ones stay ``${VAR}`` for the cluster node
    to expand (Ray expands them from the worker's environment, "" if unset there)."""
    environ = os.environ if environ is None else environ
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"runtime env {p} not found; pass --runtime-env {DEFAULT_RUNTIME_ENV}")
    env = yaml.safe_load(p.read_text()) or {}
    if not isinstance(env, dict):
        raise ConfigError(f"{p}: a runtime env must be a mapping")
    env_vars = {}
    for k, v in (env.get("env_vars") or {}).items():
        v = "" if v is None else str(v)
        env_vars[k] = _VAR.sub(lambda m: environ.get(m.group(1)) or m.group(0), v)
    if env_vars:
        env["env_vars"] = env_vars
    return env


def localize_overrides(cfg: Config, overrides: list[str], cwd: Path) -> list[str]:
    """For a cluster on this machine: ``--set`` overrides that make the config's
    relative data/storage paths and a relative sqlite MLflow store absolute against the
    submitter's directory. Without them the job would resolve them inside its uploaded
    copy of the working dir, which has no data/ (``.rayignore``) and changes with every
    code change, so a resubmission would not find its checkpoints."""
    out = list(overrides)

    def absolute(p: str) -> str:
        return str((cwd / p).resolve())

    for key, value in (("data.train_path", cfg.data.train_path),
                       ("data.val_path", cfg.data.val_path),
                       ("run.storage_path", cfg.run.storage_path)):
        if value and "://" not in value and not Path(value).expanduser().is_absolute():
            out.append(f"{key}={absolute(value)}")
    uri = cfg.run.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        out.append(f"run.tracking_uri=sqlite:///{cwd.resolve() / 'mlflow.db'}")
    elif uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        out.append(f"run.tracking_uri=sqlite:///{absolute(uri[len('sqlite:///'):])}")
    return out


def remote_warnings(cfg: Config) -> list[str]:
    """What will not survive on a remote cluster: relative paths and local stores."""
    warn = []
    for key, value in (("data.train_path", cfg.data.train_path),
                       ("run.storage_path", cfg.run.storage_path)):
        if "://" not in value and not value.startswith("/"):
            warn.append(f"{key}={value!r} is relative: it resolves inside the job's copy of "
                        f"the working dir on the head node; use shared storage (s3://, gs://, "
                        f"an NFS path) so every node and every resubmission sees it")
    uri = cfg.run.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
    if not uri or uri.startswith("sqlite"):
        warn.append("MLflow store is a local sqlite file: set MLFLOW_TRACKING_URI to a "
                    "tracking server the cluster can reach (see cluster/mlflow_server.sh)")
    return warn


def build_entrypoint(config_rel: str, overrides: list[str]) -> str:
    """The job's shell command. ``python -m`` rather than the ``elastic-ddp`` script:
    the uploaded working dir is on the path, an installed console script may not be."""
    parts = ["python", "-m", "elastic_ddp.cli", "train", config_rel]
    for o in overrides:
        parts += ["--set", o]
    return " ".join(shlex.quote(p) for p in parts)


def prepare(config: str, overrides: list[str], address: str,
            runtime_env_path: str = DEFAULT_RUNTIME_ENV, cwd: Optional[Path] = None):
    """Validate the config and build (entrypoint, runtime_env, cfg) without submitting.

    Raises:
        ConfigError: invalid config, runtime env, or a config outside the working dir.
    """
    cwd = (cwd or Path.cwd()).resolve()
    cfg = Config.load(config, overrides)  # refuse a bad config before touching the cluster
    env = load_runtime_env(cwd / runtime_env_path if not Path(runtime_env_path).is_absolute()
                           else runtime_env_path)
    wd = Path(env.get("working_dir", ".")).expanduser()
    wd = (cwd / wd).resolve() if not wd.is_absolute() else wd
    env["working_dir"] = str(wd)
    rel = os.path.relpath(Path(config).resolve(), wd)
    if rel.startswith(".."):
        raise ConfigError(f"config {config} is outside the uploaded working dir {wd}; put it "
                          "under experiments/configs/ (only the working dir reaches the cluster)")
    if is_local_address(address):
        added = localize_overrides(cfg, overrides, cwd)[len(overrides):]
        if added:
            # A loopback address may also be a tunnel (SSH, kubectl port-forward) to a
            # remote cluster, where these paths do not exist: say what was assumed.
            print("elastic-ddp submit: loopback job API, assuming the cluster shares this "
                  "machine's file system: " + " ".join(f"--set {a}" for a in added)
                  + " (pass absolute paths or URIs for a tunnelled remote cluster)",
                  file=sys.stderr)
        overrides = [*overrides, *added]
        cfg = Config.load(config, overrides)
    return build_entrypoint(rel, overrides), env, cfg


def submit(config: str, overrides: list[str], address: str = DEFAULT_ADDRESS,
           runtime_env_path: str = DEFAULT_RUNTIME_ENV, wait: bool = False,
           submission_id: Optional[str] = None, out=sys.stdout) -> int:
    """Submit the job; with ``wait``, stream its logs and return its exit status
    (the driver's exit code: 0 success, 1 training failed, 2 bad config/data)."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    entrypoint, env, cfg = prepare(config, overrides, address, runtime_env_path)
    if not is_local_address(address):
        for w in remote_warnings(cfg):
            print(f"elastic-ddp submit: warning: {w}", file=sys.stderr)
    try:
        client = JobSubmissionClient(address, headers=auth_headers())
    except Exception as e:  # noqa: BLE001 - connection and auth errors, reworded
        raise SubmitError(f"cannot reach the Ray job API at {address}: {e}. Is the cluster "
                          "up (cluster/local_cluster.py status), the address the dashboard "
                          "port, and RAY_AUTH_TOKEN_PATH set for a token-auth cluster?") from e
    sid = submission_id or f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    job_id = client.submit_job(
        entrypoint=entrypoint, runtime_env=env, submission_id=sid,
        metadata={"elastic_ddp.run_name": cfg.run.name, "elastic_ddp.config": str(config)},
    )
    print(f"elastic-ddp submit: job {job_id} submitted to {address}\n  entrypoint: {entrypoint}\n"
          f"  logs: ray job logs --address {address} -f {job_id}\n"
          f"  stop: ray job stop --address {address} {job_id}", file=out, flush=True)
    if not wait:
        return 0
    try:
        _tail(client, job_id, out)
    except KeyboardInterrupt:
        print(f"\nelastic-ddp submit: stopped following; job {job_id} keeps running "
              f"(ray job stop --address {address} {job_id})", file=out)
        return 130
    # The log stream ends when the job does; the status may lag it by a moment.
    deadline = time.time() + 60
    info = client.get_job_info(job_id)
    while not info.status.is_terminal() and time.time() < deadline:
        time.sleep(1)
        info = client.get_job_info(job_id)
    print(f"elastic-ddp submit: job {job_id} {info.status}"
          f"{': ' + info.message if info.message and info.status != JobStatus.SUCCEEDED else ''}",
          file=out, flush=True)
    if info.status == JobStatus.SUCCEEDED:
        return 0
    if info.driver_exit_code not in (None, 0):
        return int(info.driver_exit_code)
    return 1


def _tail(client, job_id: str, out) -> None:
    import asyncio

    async def follow() -> None:
        async for lines in client.tail_job_logs(job_id):
            out.write(lines)
            out.flush()

    asyncio.run(follow())
