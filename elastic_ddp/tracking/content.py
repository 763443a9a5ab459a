"""What a job's MLflow run holds besides metrics: params (:func:`job_params`), the
description and source tags, the data sets as dataset inputs, and the final model as an
MLflow PyTorch model."""

from __future__ import annotations

import getpass
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit, urlunsplit

from elastic_ddp.config import Config

from elastic_ddp.tracking.store import client, log_params, param_text


def job_params(cfg: Config) -> dict[str, str]:
    """The config fields this job uses, as MLflow params (dotted keys, :func:`param_text`
    values). Left out: unset (null) fields; settings of a mode the job does not run
    (PowerSGD fields without ``comm_hook=powersgd``, DDP knobs under fsdp, FSDP's under
    ddp/zero1, ``lr_scaling`` without ``policy=scale_lr``, the windowed order's knobs
    under ``permutation``, ``momentum`` for adamw/lamb, ``betas`` for sgd/lars); where
    things go (``run.tracking_uri``, which may carry credentials, ``run.storage_path``).
    ``model.kwargs``/``task.kwargs`` hold only what the config gives. Added: ``world_size``
    (``2``, or ``1-4`` for an elastic job) and ``parallel.strategy`` always."""
    flat = cfg.to_flat_dict()
    p, o, s = cfg.parallel, cfg.optim, cfg.scaling
    drop = {"run.tracking_uri", "run.storage_path", "run.resume", "run.experiment_name"}
    if p.comm_hook != "powersgd":
        drop |= {"parallel.powersgd_rank", "parallel.powersgd_start_iter"}
    if p.strategy == "fsdp":
        drop |= {"parallel.bucket_cap_mb", "parallel.gradient_as_bucket_view",
                 "parallel.static_graph", "parallel.find_unused_parameters", "parallel.comm_hook"}
    else:
        drop.add("parallel.fsdp_keep_params_between_fwd_bwd")
    if cfg.batch.policy != "scale_lr":
        drop.add("batch.lr_scaling")
    if cfg.data.order == "permutation":
        drop |= {"data.partitions", "data.shuffle_window_rows", "data.block_rows"}
    if o.name in ("adamw", "lamb"):
        drop.add("optim.momentum")
    else:
        drop.add("optim.betas")
    if s.min_workers == s.max_workers:
        drop |= {"scaling.resize_monitor_interval_s", "scaling.grow_checkpoint_timeout_s"}  # elastic jobs only
    out = {"world_size": str(s.max_workers) if s.min_workers == s.max_workers
           else f"{s.min_workers}-{s.max_workers}"}
    for k, v in flat.items():
        if v is None or k in drop or v == {} or v == []:
            continue
        out[k] = param_text(v)
    return out


def describe(cfg: Config) -> str:
    """The run's description (``mlflow.note.content``, the Overview's "Description"):
    what was trained on what, and the command that runs it again."""
    s = cfg.scaling
    ws = str(s.max_workers) if s.min_workers == s.max_workers else f"{s.min_workers}-{s.max_workers}"
    task = cfg.task.path or cfg.model.name
    lines = [f"`{task}` on `{cfg.data.train_path}`, {ws} workers "
             f"({cfg.parallel.strategy}), global batch {cfg.batch.global_batch_size}, "
             f"{cfg.train.epochs} epochs" + (f" (at most {cfg.train.max_steps} steps)"
                                            if cfg.train.max_steps else "") + "."]
    cmd = command_line()
    if cmd:
        lines += ["", f"Command: `{cmd}`"]
    return "\n".join(lines)


def command_line() -> Optional[str]:
    """The ``elastic-ddp ...`` command this process runs, or None (Python API, tests)."""
    if Path(sys.argv[0]).name in ("elastic-ddp", "cli.py") and len(sys.argv) > 1:
        return shlex.join(["elastic-ddp", *sys.argv[1:]])
    return None


def git_info(path: Optional[Path] = None) -> dict[str, str]:
    """Commit, branch, remote URL (without any user:password) and dirty flag of the git
    checkout holding ``path`` (default: this package); {} outside a checkout or without
    git."""
    where = str(path or Path(__file__).resolve().parent)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", where, *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        out = {"commit": git("rev-parse", "HEAD")}
    except (OSError, subprocess.SubprocessError):
        return {}
    for key, args in (("branch", ("rev-parse", "--abbrev-ref", "HEAD")),
                      ("repo_url", ("config", "--get", "remote.origin.url")),
                      ("dirty", ("status", "--porcelain", "--untracked-files=no"))):
        try:
            out[key] = git(*args)
        except (OSError, subprocess.SubprocessError):
            pass
    if out.get("repo_url"):
        u = urlsplit(out["repo_url"])
        if u.scheme and "@" in u.netloc:  # https://user:token@host/... -> https://host/...
            out["repo_url"] = urlunsplit((u.scheme, u.netloc.rsplit("@", 1)[1], u.path, "", ""))
    out["dirty"] = "true" if out.get("dirty") else "false"
    return out


def _script_name() -> str:
    """What runs this process when it is not the CLI: the script's name, or the package of
    a ``python -m pkg`` (``pytest``, not ``__main__.py``)."""
    p = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path("python")
    return p.parent.name if p.name == "__main__.py" and p.parent.name else p.name


def source_tags() -> dict[str, str]:
    """MLflow's "Created by" and "Source" tags, which ``MlflowClient.create_run`` (unlike
    ``mlflow.start_run``) does not set: ``mlflow.user``, ``mlflow.source.type`` (JOB
    inside a Ray job, else LOCAL), ``mlflow.source.name`` (the command), and in a git
    checkout ``mlflow.source.git.commit``/``.branch``/``.repoURL`` and
    ``elastic_ddp.git_dirty`` (uncommitted changes to tracked files); plus
    ``elastic_ddp.version``."""
    from elastic_ddp.version import __version__

    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no login name in some containers
        user = str(os.getuid())
    tags = {"mlflow.user": user,
            "mlflow.source.type": "JOB" if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") else "LOCAL",
            "mlflow.source.name": command_line() or _script_name(),
            "elastic_ddp.version": __version__}
    g = git_info()
    if g:
        tags["mlflow.source.git.commit"] = g["commit"]
        tags["elastic_ddp.git_dirty"] = g["dirty"]
        if g.get("branch") and g["branch"] != "HEAD":
            tags["mlflow.source.git.branch"] = g["branch"]
        if g.get("repo_url"):
            tags["mlflow.source.git.repoURL"] = g["repo_url"]
    return tags



def task_params(task, n_params: Optional[int]) -> dict[str, Any]:
    """The params only the loaded task knows: ``task`` (its class) and
    ``model.parameters`` (``n_params``, the dry run's count: ``tasks.dry_run.DryRun``;
    left out when None, a model that could not be built). Computed where the task is
    loaded (the driver), so that the process that writes them
    (:mod:`elastic_ddp.tracking.opener`) needs neither torch nor the task's modules."""
    if task is None:
        return {}
    out: dict[str, Any] = {"task": f"{type(task).__module__}.{type(task).__qualname__}"}
    if n_params is not None:
        out["model.parameters"] = n_params
    return out


def log_job_inputs(uri: str, run_id: str, cfg: Config, task_params: dict[str, Any], train_info,
                   val_info, resumed: bool) -> None:
    """What the job reads, in its run: the training (and validation) set as dataset
    inputs (:func:`log_dataset`) and, for a new run, the params known only once the task
    and the data are loaded: ``task_params`` (:func:`task_params`),
    ``data.train_rows``/``data.val_rows`` and, when unset, the ``data.partitions`` the
    order uses (``data.ingest.epoch_partitions``)."""
    log_dataset(uri, run_id, train_info, "training")
    if val_info is not None:
        log_dataset(uri, run_id, val_info, "validation")
    if resumed:
        return  # params are write-once; the first submission logged them
    extra: dict[str, Any] = {"data.train_rows": train_info.num_rows}
    if cfg.data.order == "windowed" and cfg.data.partitions is None:
        from elastic_ddp.data.ingest import epoch_partitions

        extra["data.partitions"] = epoch_partitions(train_info, cfg)  # the default, fitted
    if val_info is not None:
        extra["data.val_rows"] = val_info.num_rows
    extra.update(task_params)
    log_params(uri, run_id, extra)


def log_dataset(uri: str, run_id: str, info, context: str) -> None:
    """A data set the job read (``data.scan.DatasetInfo``) as an MLflow dataset input
    (the run's "Datasets" and the experiment's dataset filter): name ``<folder>/<split>``,
    source the Parquet path (``local``), digest the scan's fingerprint (changes when rows
    are added, removed or renumbered), the Arrow schema of the columns read, and a profile
    (rows, files, row groups, compressed bytes read). ``context``: ``training`` or
    ``validation`` (the ``mlflow.data.context`` tag)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    p = Path(info.path)  # for its last two names only: Path() of a URI drops a slash
    path = info.path if "://" in info.path else str(p.resolve())
    source = json.dumps({"uri": path if "://" in path else Path(path).as_uri()})
    profile = {"num_rows": info.num_rows, "num_files": len(info.files),
               "num_row_groups": len(info.row_groups),
               "compressed_bytes_read": int(sum(g.nbytes for g in info.row_groups)),
               "id_column": info.id_column}
    ds = Dataset(name=f"{p.parent.name}/{p.name}" if p.parent.name else p.name,
                 digest=info.fingerprint[:16], source_type="local", source=source,
                 schema=json.dumps({"mlflow_colspec": _colspec(info.schema)}),
                 profile=json.dumps(profile))
    client(uri).log_inputs(run_id, datasets=[DatasetInput(ds, [InputTag("mlflow.data.context", context)])])


def _colspec(schema) -> list[dict[str, Any]]:
    """An Arrow schema as MLflow ColSpec JSON (``{"type", "name", "required"}``; a list
    column as an ``array`` of its element type)."""
    import pyarrow as pa

    def kind(t) -> dict[str, Any]:
        if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            return {"type": "array", "items": kind(t.value_type)}
        if pa.types.is_boolean(t):
            return {"type": "boolean"}
        if pa.types.is_integer(t):
            return {"type": "long" if t.bit_width > 32 else "integer"}
        if pa.types.is_floating(t):
            return {"type": "double" if t.bit_width > 32 else "float"}
        if pa.types.is_binary(t) or pa.types.is_large_binary(t):
            return {"type": "binary"}
        return {"type": "string"}

    return [{"name": f.name, "required": not f.nullable, **kind(f.type)} for f in schema]


def log_model(uri: str, run_id: str, model, example: Optional[tuple] = None, step: int = 0,
              name: str = "model") -> Optional[str]:
    """``model`` (a plain ``nn.Module`` on the CPU) as an MLflow PyTorch model of the run,
    loadable with ``mlflow.pytorch.load_model(f"runs:/{run_id}/{name}")`` or
    ``models:/<model id>``; returns the model id.

    The model is pickled by reference to its classes: elastic_ddp is shipped inside the
    model (``code_paths``) so it loads where elastic_ddp is not installed; a user's task
    module loaded from a file is pickled by value (``tasks.loading``). ``example``:
    (input, output) of one forward call, for the model's signature (tensor specs). The
    pip requirements are given (torch, mlflow) rather than inferred: inference imports the
    model in a subprocess, several seconds for nothing new."""
    import mlflow
    import mlflow.pytorch
    import torch

    signature = None
    if example is not None:
        from mlflow.models import infer_signature

        x, y = example
        if torch.is_tensor(x) and torch.is_tensor(y):
            signature = infer_signature(x.detach().cpu().numpy(), y.detach().cpu().float().numpy())
    import logging

    pkg = Path(__file__).resolve().parent
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    # Its warning that pickled models run code when loaded: true of any full-model pickle,
    # and said once in the README; the weights-only model/model.pt is the safe copy.
    pt_logger = logging.getLogger("mlflow.pytorch")
    pt_level = pt_logger.level
    pt_logger.setLevel(logging.ERROR)
    try:
        # Created here, in the run's experiment: Model.log alone would create it in the
        # process's active (fluent) experiment, "Default", away from its run.
        c = client(uri)
        run = c.get_run(run_id)
        logged = c.create_logged_model(run.info.experiment_id, name=name, source_run_id=run_id,
                                       params=dict(run.data.params))
        info = mlflow.pytorch.log_model(
            model, name=name, run_id=run_id, model_id=logged.model_id, step=step, signature=signature,
            # pickle, not MLflow 3's default pt2 (torch.export): an exported program is
            # traced at the example's batch size; the pickled module takes any batch.
            serialization_format="pickle", code_paths=[str(pkg)],
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}",
                              f"mlflow=={mlflow.__version__}"])
    finally:
        mlflow.set_tracking_uri(previous)
        pt_logger.setLevel(pt_level)
    return info.model_id


