"""The driver's dry run of the task (:func:`preflight`): two real rows through the task's
transform and collate, the model's build and its loss, before any worker starts; a
failure names the hook and the error (``TaskError``, the CLI's exit 2). Also the model's
parameter count from a build on the meta device (:func:`count_params`) and the check of
the metric names a task's loss returns (:func:`check_metric_names`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from elastic_ddp.config import Config
from elastic_ddp.tasks.loading import TaskError, build_model
from elastic_ddp.tasks.protocol import Task


def sample_rows(info, n: int = 2) -> dict:
    """The first ``n`` rows of a data set as a Ray Data numpy batch (the columns the
    task reads and the id column, cast to the scanned schema): what ``Task.transform``
    receives, for the dry run."""
    import pyarrow.parquet as pq
    from ray.data.block import BlockAccessor

    from elastic_ddp.paths import uri_to_filesystem

    g = info.row_groups[0]
    fs, path = uri_to_filesystem(info.files[g.file])  # a local path or a URI (s3://...)
    with pq.ParquetFile(fs.open_input_file(path)) as pf:
        t = pf.read_row_group(g.index, columns=info.schema.names)
    t = t.select(info.schema.names).cast(info.schema).slice(0, n)
    return BlockAccessor.for_block(t).to_batch_format("numpy")


@dataclass
class DryRun:
    """What the driver's dry run (:func:`preflight`) leaves for the rest of the job.

    ``sample``: ``{"train": rows, "val": rows}``, one transformed row of each split (numpy
    arrays), the template of an empty batch for a rank whose share of a step or of
    validation is empty. ``n_params``: the model's parameter count (the
    ``model.parameters`` param of the MLflow run); None when the model could not be built.
    ``model``: the CPU module the loss ran on (seeded with ``cfg.seed``), which the driver
    loads the final weights into for the logged MLflow model; None when the dry run ran
    on the meta device (a model over ``CPU_DRY_RUN_PARAMS``) or was left for step 1.
    """

    sample: dict
    n_params: Optional[int] = None
    model: Any = None


def preflight(cfg: Config, task: Task, train_info, val_info=None) -> DryRun:
    """Run the task on two real rows before any worker starts: transform (train and
    val), collate, model build and the loss, whose shape must be [B]. The model is built
    on PyTorch's ``meta`` device first (no memory, no compute) for its parameter count; a
    model of at most ``CPU_DRY_RUN_PARAMS`` parameters then runs on the CPU (a second
    build, kept in the result); a larger one runs on that meta-device build (shapes only),
    and when the meta device cannot run it, on the CPU if it has at most 50M parameters,
    else its loss shape is left for step 1 to check. A model that cannot be built on the
    meta device runs on the CPU. At most two builds either way.

    Returns:
        :class:`DryRun`: the sample rows, the parameter count and the CPU-built model.

    Raises:
        TaskError: the transform, collate, model or loss fails on the sample, or the loss
            is not a per-sample vector; the message names the hook and the error.
    """
    import numpy as np

    from elastic_ddp.tasks.dtypes import passed_through
    from elastic_ddp.tasks.transform import SEQ, TaskTransform

    out, train_rows, sources = {}, None, {}
    for split, info in (("train", train_info), ("val", val_info or train_info)):
        batch = sample_rows(info)
        raw = {k: v for k, v in batch.items() if k in task.input_columns()}
        batch[SEQ] = np.zeros(len(batch[info.id_column]), np.int64)
        try:
            rows = TaskTransform(task, cfg.seed, 0, split, info.id_column)(batch)
        except Exception as e:  # noqa: BLE001 - any failure of the user's code
            raise TaskError(f"{type(task).__name__}.transform failed on the first rows of "
                            f"{info.files[0]} ({split}): {type(e).__name__}: {e}") from e
        rows.pop(SEQ)
        out[split] = {k: v[:1] for k, v in rows.items()}
        if train_rows is None:
            train_rows, sources = rows, passed_through(raw, rows)
    try:
        tensors = task.collate(train_rows)
    except Exception as e:  # noqa: BLE001
        raise TaskError(f"{type(task).__name__}.collate failed on transformed rows: "
                        f"{type(e).__name__}: {e}") from e
    n_params, model = _check_loss(cfg, task, tensors, len(train_rows[train_info.id_column]), sources)
    return DryRun(out, n_params, model)


# Models up to this many parameters are dry-run on the CPU, larger ones on the meta
# device. Why not meta for all: PyTorch's meta kernels for most ops (the initializers,
# an add) are Python decompositions that import torch._dynamo on first use, the driver's
# largest single start-up cost, while a small model's real forward on two rows costs
# less. The price: up to 4 bytes x this many of driver memory, held for the job (the
# same module becomes the logged MLflow model).
CPU_DRY_RUN_PARAMS = 20_000_000
# A model over the meta limit whose meta-device run fails is dry-run on the CPU up to
# this many parameters; a larger one is left for step 1.
CPU_FALLBACK_PARAMS = 50_000_000


def _meta_model(cfg: Config, task: Task):
    """The model built on the meta device with its initializers skipped (they only fill
    values the meta device does not hold, and their meta kernels import torch._dynamo);
    None when the model cannot be built that way.

    Raises:
        TaskError: the factory refuses ``model.kwargs`` (:func:`build_model`).
    """
    import torch
    from torch.overrides import TorchFunctionMode

    class _SkipInit(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            t = args[0] if args else kwargs.get("tensor")
            if getattr(func, "__module__", None) == "torch.nn.init" and getattr(t, "is_meta", False):
                return t
            return func(*args, **kwargs)

    try:
        with torch.device("meta"), _SkipInit():
            return build_model(cfg, task)
    except TaskError:
        raise
    except Exception:  # noqa: BLE001 - preflight then builds it on the CPU, which reports it
        return None


def count_params(cfg: Config, task: Task) -> Optional[int]:
    """The model's parameter count, from one build on the meta device (no memory).
    None when the model cannot be built that way."""
    model = _meta_model(cfg, task)
    return None if model is None else sum(p.numel() for p in model.parameters())


def _check_loss(cfg: Config, task: Task, tensors: dict, n: int,
                sources: Optional[dict] = None) -> tuple[Optional[int], Any]:
    """Run ``task.loss`` on ``tensors`` (``n`` rows); see :func:`preflight` for where.
    Returns (parameter count, the CPU module it ran on, or None)."""
    import torch

    from elastic_ddp.tasks.dtypes import dtype_hint
    from elastic_ddp.tasks.protocol import model_inputs, parameter_dtype, split_loss

    dtype = [None]

    def run(model, device: str) -> None:
        dtype[0] = parameter_dtype(model)
        # As the trainer does: floating inputs in the model's parameter dtype.
        _, extra = split_loss(task.loss(model, model_inputs(tensors, device, dtype[0])), n)
        check_metric_names(task, extra)

    meta = _meta_model(cfg, task)
    n_params = None if meta is None else sum(p.numel() for p in meta.parameters())
    if n_params is not None and n_params > CPU_DRY_RUN_PARAMS:
        try:
            run(meta, "meta")
            return n_params, None
        except TaskError:
            raise
        except ValueError as e:
            if "Task.loss must return" in str(e):
                raise TaskError(str(e)) from None
        except Exception:  # noqa: BLE001 - an op without a meta kernel, or a real error: see CPU
            pass
        if n_params > CPU_FALLBACK_PARAMS:
            return n_params, None
    del meta
    model = None
    try:
        with torch.device("cpu"):
            torch.manual_seed(cfg.seed)
            model = build_model(cfg, task)
        if n_params is None:
            n_params = sum(p.numel() for p in model.parameters())
        run(model, "cpu")
    except TaskError:
        raise
    except ValueError as e:
        if "Task.loss must return" in str(e):
            raise TaskError(str(e)) from None
        raise TaskError(f"{type(task).__name__}.loss failed on two rows of the data: "
                        f"ValueError: {e}") from e
    except Exception as e:  # noqa: BLE001
        first = (str(e).strip().splitlines() or [""])[0]
        raise TaskError(f"{type(task).__name__}.loss failed on two rows of the data: "
                        f"{type(e).__name__}: {first}{dtype_hint(e, tensors, dtype[0], sources or {})}") from e
    return n_params, model


# MLflow's rule for metric names (mlflow.utils.validation.validate_param_and_metric_name and
# path_not_unique), without importing MLflow here: alphanumerics, _ - . space : /, and a
# name that is a plain relative path.
_METRIC_NAME = re.compile(r"^[/\w.\- :]*$")


def check_metric_names(task: Task, extra: dict) -> None:
    """The per-sample metrics ``Task.loss`` returns are logged as ``train_<name>`` and
    ``val_<name>``: refuse names MLflow would refuse (every value logged with them would
    be dropped).

    Raises:
        TaskError: a name MLflow does not accept, naming it and the rule.
    """
    import posixpath

    for name in extra:
        for logged in (f"train_{name}", f"val_{name}"):
            norm = posixpath.normpath(logged)
            if not isinstance(name, str) or not _METRIC_NAME.match(logged) or norm != logged:
                raise TaskError(
                    f"{type(task).__name__}.loss returns a metric named {name!r}, which MLflow "
                    f"refuses as {logged!r} (names may hold only letters, digits, _ - . space : /, "
                    "and no '..' or '//'); rename it in the task")
