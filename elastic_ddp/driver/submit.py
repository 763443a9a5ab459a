"""Submit a training job to a running Ray cluster through its job API.

    elastic-ddp submit experiments/configs/digits_cnn.yaml --address http://127.0.0.1:8265 --wait

The job runs ``python -m elastic_ddp train CONFIG --set ...`` on the head node with
the runtime env of ``cluster/runtime_env.yaml``: the working directory (the checkout
that holds the config, less what ``.rayignore`` keeps out) is uploaded and put on every
worker's ``PYTHONPATH``, so the cluster runs exactly this checkout's code; the
dependencies come from the cluster's image. The checkout is found from the config's own
location (the nearest directory above it holding ``cluster/runtime_env.yaml``), never
from the current directory, so ``submit`` works from anywhere.

Paths: relative paths in the config resolve in the job's copy of the working dir, which
has no data and is new at every submission. For a cluster on this machine (a loopback
address) ``submit`` makes them absolute against the checkout; for any other address it
refuses (exit 2) relative paths, absolute paths of this machine and a local MLflow store
(sqlite, file) unless ``allow_local_paths``. The overrides it generates are quoted so
that YAML reads each back as the same string (``proj #2``: `` #`` starts a comment).

Secrets: the runtime env, entrypoint and metadata of a job are shown to anyone who can
reach the job API (``ray job list``). ``${VAR}`` in the runtime env's ``env_vars`` is
filled from the submitter's environment only for values that carry no credential (no
``user:password@`` in a URL, no token-like variable name); otherwise it stays ``${VAR}``
and the node expands it from its own environment (a Kubernetes Secret, the environment
the cluster was started with). A config whose ``run.tracking_uri`` holds credentials is
refused.

Resubmitting a config with the same ``run.name`` and ``run.storage_path`` resumes: Ray
Train restores the run's checkpoint manager from ``storage_path/name`` and hands the
newest checkpoint to the workers, and ``tracking.open_run`` reopens the same unfinished
MLflow run (a FINISHED run is complete and is never reopened).

Token authentication: when the cluster has it on (Ray's default for new clusters), the
request carries ``Authorization: Bearer <token>``, the token read from
``$RAY_AUTH_TOKEN``, else the file ``$RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``
when ``RAY_AUTH_MODE=token``. The token never enters the job's runtime env or its logs;
sending it over plain ``http://`` to a non-loopback address prints a warning.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

from elastic_ddp.config import Config, ConfigError
from elastic_ddp.driver.submit_checks import (CLUSTER_MLFLOW_FIX, PATH_FIELDS, SECRET_NAME,
                                       cleartext_token_warning, effective_tracking_uri,
                                       has_credentials, is_local_address, is_uri,
                                       local_only_settings, yaml_value)
from elastic_ddp.errors import ElasticDDPError

__all__ = ["Submission", "SubmitError", "auth_headers", "build_entrypoint", "cleartext_token_warning",
           "has_credentials", "is_local_address", "load_runtime_env", "local_only_settings",
           "localize_overrides", "prepare", "project_root", "submit", "yaml_value"]

DEFAULT_RUNTIME_ENV = "cluster/runtime_env.yaml"  # relative to the checkout of the config
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class SubmitError(ElasticDDPError, RuntimeError):
    """The job could not be submitted (unreachable cluster, refused token, bad env)."""

    kind = "submit failed"


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


def project_root(config: str | os.PathLike) -> Path:
    """The checkout a config belongs to: the nearest directory above it that holds
    ``cluster/runtime_env.yaml``. Raises ConfigError when there is none."""
    cfg = Path(config).resolve()
    for d in cfg.parents:
        if (d / DEFAULT_RUNTIME_ENV).is_file():
            return d
    import elastic_ddp

    pkg_root = Path(elastic_ddp.__file__).resolve().parents[1]
    raise ConfigError(
        f"config {config} is not inside an elastic-ddp checkout (no {DEFAULT_RUNTIME_ENV} in "
        f"any directory above it), and only the checkout is uploaded to the cluster; put it "
        f"under {pkg_root}/experiments/configs/, or pass --runtime-env with a working_dir "
        "that holds it")


def load_runtime_env(path: str | os.PathLike, environ: Optional[Mapping[str, str]] = None,
                     notes: Optional[list[str]] = None) -> dict[str, Any]:
    """Read a runtime env YAML; fill ``${VAR}`` in ``env_vars`` from ``environ`` (the
    submitter's environment) where set and safe to publish. Variables with a secret-like
    name, or a value carrying credentials, stay ``${VAR}`` for the cluster node to
    expand (Ray does, "" if unset there); each such case appends a line to ``notes``.

    Raises:
        ConfigError: missing or malformed file, or a literal credential in env_vars.
    """
    environ = os.environ if environ is None else environ
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"runtime env {p} not found; pass --runtime-env FILE (default: "
                          f"{DEFAULT_RUNTIME_ENV} of the config's checkout)")
    env = yaml.safe_load(p.read_text()) or {}
    if not isinstance(env, dict):
        raise ConfigError(f"{p}: a runtime env must be a mapping")
    env_vars = {}
    for k, v in (env.get("env_vars") or {}).items():
        v = "" if v is None else str(v)
        if not _VAR.search(v) and (has_credentials(v) or (SECRET_NAME.search(k) and v)):
            raise ConfigError(f"{p}: env_vars.{k} holds a credential in the file; a job's "
                              "runtime env is readable by anyone who can list jobs. Write "
                              f"{k}: \"${{{k}}}\" and set it in the cluster nodes' environment")

        def fill(m: re.Match) -> str:
            name, value = m.group(1), environ.get(m.group(1))
            if not value:
                return m.group(0)
            if SECRET_NAME.search(name) or has_credentials(value):
                if notes is not None:
                    fix = (CLUSTER_MLFLOW_FIX if name.startswith("MLFLOW_") else
                           f"the job then uses the cluster nodes' own {name}")
                    notes.append(f"{name} in your environment carries credentials, so it is "
                                 "not sent with the job (runtime envs are shown by `ray job "
                                 f"list`); {fix}")
                return m.group(0)
            return value

        env_vars[k] = _VAR.sub(fill, v)
    if env_vars:
        env["env_vars"] = env_vars
    return env


@dataclass
class Submission:
    """What ``submit`` sends: the entrypoint, the runtime env and the metadata, plus what
    it found on the way: ``notes`` (printed) and ``local_only`` (settings a cluster on
    another machine cannot use; refused unless forced)."""

    entrypoint: str
    runtime_env: dict[str, Any]
    metadata: dict[str, str]
    cfg: Config
    root: Path
    notes: list[str] = field(default_factory=list)
    local_only: list[str] = field(default_factory=list)


def localize_overrides(cfg: Config, root: Path, environ: Mapping[str, str]) -> list[str]:
    """For a cluster on this machine: ``--set`` overrides that make the config's
    relative data/storage paths and a missing or relative sqlite MLflow store absolute
    against the checkout ``root``, which is where the job would resolve them had its
    upload carried them. Without them the job resolves them inside its uploaded copy
    of the working dir, which has no data/ (``.rayignore``) and changes with every code
    change, so a resubmission would not find its checkpoints. Values are quoted for YAML."""
    added = []
    for key in PATH_FIELDS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value and not is_uri(value) and not Path(value).expanduser().is_absolute():
            added.append(f"{key}={yaml_value(str((root / value).resolve()))}")
    uri = effective_tracking_uri(cfg, environ)
    if not uri:
        added.append("run.tracking_uri=" + yaml_value(f"sqlite:///{root / 'mlflow.db'}"))
    elif uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        path = (root / uri[len("sqlite:///"):]).resolve()
        added.append("run.tracking_uri=" + yaml_value(f"sqlite:///{path}"))
    return added


def _ship_task_files(cfg: Config, wd: Path, local: bool) -> list[str]:
    """``--set`` overrides that point ``task.path`` / ``model.factory`` files at their copy
    in the uploaded working dir (the job resolves a relative path there).

    Raises:
        ConfigError: a file named there is missing, or outside the working dir for a
            cluster that is not on this machine (only the working dir is uploaded).
    """
    added = []
    for key, spec in (("task.path", cfg.task.path), ("model.factory", cfg.model.factory)):
        if not spec or ":" not in spec:
            continue
        mod, _, attr = spec.rpartition(":")
        if not (mod.endswith(".py") or "/" in mod):
            continue  # an importable module: the image or the working dir provides it
        p = Path(mod).expanduser()
        p = p if p.is_absolute() else (wd / p)
        if not p.is_file():
            raise ConfigError(f"{key}={spec!r}: {p} not found (a relative path is taken from "
                              f"the uploaded working dir {wd})")
        rel = Path(os.path.relpath(p.resolve(), wd))
        if rel.as_posix().startswith(".."):
            if local:
                continue  # this machine's file system: the job reads it where it is
            raise ConfigError(f"{key}={spec!r}: {p} is outside the uploaded working dir {wd}, so "
                              "the cluster would not have it; move it under the checkout (e.g. "
                              "experiments/) or install it in the cluster's image")
        if Path(mod).is_absolute():
            added.append(f"{key}={yaml_value(f'{rel.as_posix()}:{attr}')}")
    return added


def build_entrypoint(config_rel: str, overrides: list[str]) -> str:
    """The job's shell command. ``python -m`` rather than the ``elastic-ddp`` script:
    the uploaded working dir is on the path, an installed console script may not be."""
    parts = ["python", "-m", "elastic_ddp", "train", config_rel]
    for o in overrides:
        parts += ["--set", o]
    return " ".join(shlex.quote(p) for p in parts)


def _root_and_env_file(config: str, runtime_env_path: Optional[str]) -> tuple[Optional[Path], Path]:
    """The config's checkout (None when it has none and a runtime env is given) and the
    runtime env file: by default the checkout's own; a relative ``--runtime-env`` is
    taken from the current directory when it exists there, else from the checkout."""
    try:
        root: Optional[Path] = project_root(config)
    except ConfigError:
        if runtime_env_path is None:
            raise
        root = None
    if runtime_env_path is None:
        return root, root / DEFAULT_RUNTIME_ENV
    p = Path(runtime_env_path).expanduser()
    if p.is_absolute() or p.is_file() or root is None:
        return root, p.resolve()
    return root, root / p


def prepare(config: str, overrides: list[str], address: str,
            runtime_env_path: Optional[str] = None,
            environ: Optional[Mapping[str, str]] = None) -> Submission:
    """Validate the config and build the submission without contacting the cluster.
    A relative ``working_dir`` in the runtime env is relative to the config's checkout.

    Raises:
        ConfigError: invalid config or runtime env, a config outside the working dir,
            or credentials in ``run.tracking_uri``.
    """
    environ = os.environ if environ is None else environ
    cfg = Config.load(config, overrides)  # refuse a bad config before touching the cluster
    if cfg.run.tracking_uri and has_credentials(cfg.run.tracking_uri):
        raise ConfigError("run.tracking_uri carries credentials, which would be shown to "
                          "anyone who can list the cluster's jobs; pass it without them: "
                          + CLUSTER_MLFLOW_FIX)
    if effective_tracking_uri(cfg, environ):
        from elastic_ddp.driver.preflight import check_tracking_scheme

        check_tracking_scheme(effective_tracking_uri(cfg, environ),
                              "run.tracking_uri" if cfg.run.tracking_uri else "MLFLOW_TRACKING_URI")
    root, env_file = _root_and_env_file(config, runtime_env_path)
    notes: list[str] = []
    env = load_runtime_env(env_file, environ, notes)
    wd = Path(env.get("working_dir", ".")).expanduser()
    if not wd.is_absolute():
        wd = ((root or project_root(config)) / wd).resolve()
    env["working_dir"] = str(wd)
    rel = Path(os.path.relpath(Path(config).resolve(), wd)).as_posix()
    if rel.startswith(".."):
        raise ConfigError(f"config {config} is outside the uploaded working dir {wd}; put it "
                          "under experiments/configs/ (only the working dir reaches the cluster)")
    root = root or wd
    overrides = [*overrides, *_ship_task_files(cfg, wd, is_local_address(address))]
    local_only: list[str] = []
    if is_local_address(address):
        added = localize_overrides(cfg, root, environ)
        if added:
            # A loopback address may also be a tunnel (SSH, kubectl port-forward) to a
            # remote cluster, where these paths do not exist: say what was assumed.
            notes.append("loopback job API, assuming the cluster shares this machine's file "
                         "system: " + " ".join(f"--set {shlex.quote(a)}" for a in added)
                         + " (pass absolute paths or URIs for a tunnelled remote cluster)")
        overrides = [*overrides, *added]
        cfg = Config.load(config, overrides)
    else:
        local_only = local_only_settings(cfg, root, environ)
        if not effective_tracking_uri(cfg, environ):
            notes.append("no MLflow store given (run.tracking_uri, MLFLOW_TRACKING_URI): the "
                         "job uses the cluster nodes' MLFLOW_TRACKING_URI; without one it "
                         "writes a sqlite file into its temporary working dir")
    metadata = {"elastic_ddp.run_name": cfg.run.name, "elastic_ddp.config": rel}
    return Submission(build_entrypoint(rel, overrides), env, metadata, cfg, root, notes,
                      local_only)


def submit(config: str, overrides: list[str], address: str = DEFAULT_ADDRESS,
           runtime_env_path: Optional[str] = None, wait: bool = False,
           submission_id: Optional[str] = None, allow_local_paths: bool = False,
           out=sys.stdout) -> int:
    """Submit the job; with ``wait``, stream its logs and return its exit status
    (the driver's exit code: 0 success, 1 training failed, 2 bad config/data).

    Raises:
        ConfigError: what ``prepare`` refuses, and, for a non-loopback address, settings
            only this machine can use (unless ``allow_local_paths``); nothing is sent.
        SubmitError: the job API cannot be reached or refuses the request.
    """
    sub = prepare(config, overrides, address, runtime_env_path)
    for note in sub.notes:
        print(f"elastic-ddp submit: {note}", file=sys.stderr)
    if sub.local_only and not allow_local_paths:
        raise ConfigError(f"{address} is not this machine, and the job would use what only "
                          "this machine has:\n  " + "\n  ".join(sub.local_only)
                          + "\n(--allow-local-paths submits anyway)")
    for w in sub.local_only:
        print(f"elastic-ddp submit: warning (--allow-local-paths): {w}", file=sys.stderr)
    headers = auth_headers()
    if (w := cleartext_token_warning(address, headers)) is not None:
        print(f"elastic-ddp submit: warning: {w}", file=sys.stderr)
    from ray.job_submission import JobStatus, JobSubmissionClient

    from elastic_ddp.driver.network_checks import http_unanswered

    try:
        if why := http_unanswered(address.rstrip("/") + "/api/version"):  # Ray's has no timeout
            raise ConnectionError(why)
        client = JobSubmissionClient(address, headers=headers)
    except Exception as e:  # noqa: BLE001 - connection and auth errors, reworded
        raise SubmitError(f"cannot reach the Ray job API at {address}: {e}. Is the cluster "
                          "up (cluster/local_cluster.py status), the address the dashboard "
                          "port, and RAY_AUTH_TOKEN_PATH set for a token-auth cluster?") from e
    name = sub.cfg.run.name
    sid = submission_id or f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    job_id = client.submit_job(entrypoint=sub.entrypoint, runtime_env=sub.runtime_env,
                               submission_id=sid, metadata=sub.metadata)
    print(f"elastic-ddp submit: job {job_id} submitted to {address}\n  entrypoint: {sub.entrypoint}\n"
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
