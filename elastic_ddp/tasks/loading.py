"""Find the job's task (and model factory) from the config, and check it on a real sample
before any worker starts.

``task.path`` / ``model.factory`` take ``package.module:Attr`` (importable on the driver)
or ``path/to/file.py:Attr`` (relative to the working directory). A module loaded from a
file, or from outside any installed distribution, is shipped to Ray's workers by value
(cloudpickle), so the workers need no copy of it and no ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from elastic_ddp.config import Config, ConfigError
from elastic_ddp.tasks.protocol import Task

BUILTIN_TASKS = {
    "mlp": "elastic_ddp.tasks.vision:MLPClassifier",
    "cnn": "elastic_ddp.tasks.vision:CNNClassifier",
    "gpt": "elastic_ddp.tasks.lm:ByteGPT",
}


class TaskError(ConfigError):
    """The task cannot run: a bad import path, a missing hook, kwargs it does not take, or
    a loss of the wrong shape. Names the config field and the fix (the CLI exits 2)."""

    kind = "task error"


def resolve_import(spec: str, field: str) -> Any:
    """``"pkg.mod:Attr"`` or ``"file.py:Attr"`` -> the object.

    Raises:
        TaskError: malformed spec, missing file or module (or an error while importing
            it), or no such attribute; the message names ``field``.
    """
    mod_part, sep, attr = spec.rpartition(":")
    if not sep or not mod_part or not attr:
        raise TaskError(f"{field}={spec!r}: expected 'package.module:Name' or "
                        "'path/to/file.py:Name'")
    is_file = mod_part.endswith(".py") or "/" in mod_part
    try:
        if is_file:
            module = _load_file(Path(mod_part), field)
        else:
            module = importlib.import_module(mod_part)
    except TaskError:
        raise
    except ModuleNotFoundError as e:
        if not is_file and (e.name is None or mod_part == e.name or mod_part.startswith(e.name + ".")):
            raise TaskError(f"{field}={spec!r}: module {mod_part!r} not found ({e}); use a path "
                            "to the .py file, or put its directory on PYTHONPATH") from None
        raise TaskError(_import_inside(field, spec, mod_part, is_file, e)) from None
    except Exception as e:  # noqa: BLE001 - the user's module failed to import
        raise TaskError(f"{field}={spec!r}: importing {mod_part!r} failed: "
                        f"{type(e).__name__}: {e}") from e
    obj = getattr(module, attr, None)
    if obj is None:
        have = sorted(n for n in vars(module) if not n.startswith("_"))[:12]
        raise TaskError(f"{field}={spec!r}: {mod_part!r} has no attribute {attr!r} "
                        f"(it defines: {', '.join(have)})")
    _ship_by_value(module)
    return obj


def _import_inside(field: str, spec: str, mod_part: str, is_file: bool,
                   e: ModuleNotFoundError) -> str:
    """The message for a task module that was found but imports a module that is not:
    a file beside a task file (which is shipped by value, alone: README, "Your own
    model"), or a package not installed."""
    missing = e.name or str(e)
    what = f"the task file {mod_part} was found" if is_file else f"module {mod_part!r} was found"
    head = f"{field}={spec!r}: {what}, but its import of {missing!r} failed ({e})"
    top = missing.split(".", 1)[0]
    where = Path(mod_part).expanduser().resolve().parent if is_file else None
    sibling = next((p for p in (where / f"{top}.py", where / top) if p.exists()), None) if where else None
    if sibling is not None:
        return (f"{head}: {sibling.name} lies beside it, and a task file is shipped to the "
                "workers by value, alone, so it must not import sibling files; copy what it "
                f"uses from {sibling.name} into {Path(mod_part).name}, or make {top} an installed "
                "package (pip install -e) in the driver's and the workers' environment")
    return (f"{head}; install {top} in the driver's and the workers' environment, or remove "
            "the import")


def _load_file(path: Path, field: str):
    p = path.expanduser().resolve()
    if not p.is_file():
        raise TaskError(f"{field}: file {path} not found (relative paths are taken from the "
                        f"working directory {Path.cwd()})")
    # The path's hash in the name: two task.py files of different examples are two modules.
    import hashlib

    name = f"elastic_ddp_user_{p.stem}_{hashlib.sha1(str(p).encode()).hexdigest()[:8]}"
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(p):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, p)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _ship_by_value(module) -> None:
    """Pickle the user's module by value to Ray's workers, unless it is installed (in
    site-packages) or part of elastic_ddp: then the workers import it themselves."""
    f = getattr(module, "__file__", "") or ""
    if not f or "site-packages" in f or module.__name__.startswith("elastic_ddp."):
        return
    from ray import cloudpickle

    try:
        cloudpickle.register_pickle_by_value(module)
    except ValueError:  # already registered, or not in sys.modules
        pass


def task_path(cfg: Config) -> str:
    """The task spec: ``task.path``, else the built-in named by ``model.name``."""
    path = cfg.task.path or cfg.model.name
    return BUILTIN_TASKS.get(path, path)


def load_task(cfg: Config, task: Optional[Task] = None) -> Task:
    """The job's task object: ``task`` as given (Python API), or built from
    ``task.path`` with ``task.kwargs``. ``task.path`` may name a Task subclass, a Task
    instance or a callable returning one.

    Raises:
        TaskError: see :func:`resolve_import`; kwargs the task does not take; an object
            that is not a Task; ``loss`` not overridden; no ``build_model`` and no
            ``model.factory``.
    """
    if task is None:
        spec = task_path(cfg)
        obj = resolve_import(spec, "task.path")
        if isinstance(obj, Task):
            if cfg.task.kwargs:
                raise TaskError(f"task.path={spec!r} is an instance; task.kwargs "
                                f"{sorted(cfg.task.kwargs)} cannot be applied (point it at the class)")
            task = obj
        elif callable(obj):
            try:
                task = obj(**cfg.task.kwargs)
            except TypeError as e:
                raise TaskError(f"task.kwargs: {spec} does not take them: {e}") from None
            except (ValueError, KeyError) as e:
                raise TaskError(f"task.kwargs: {e}") from None
        else:
            raise TaskError(f"task.path={spec!r} is a {type(obj).__name__}, not a Task class")
    if not isinstance(task, Task):
        raise TaskError(f"task: {type(task).__name__} is not an elastic_ddp.Task; subclass "
                        "elastic_ddp.Task and implement loss() and build_model()")
    name = type(task).__name__
    if type(task).loss is Task.loss:
        raise TaskError(f"task {name} does not define loss(model, batch) -> per-sample loss [B]")
    if cfg.model.factory is None and type(task).build_model is Task.build_model:
        raise TaskError(f"task {name} does not define build_model(**model.kwargs); define it "
                        "or set model.factory")
    return task


def model_factory(cfg: Config, task: Task) -> Callable[..., Any]:
    """``model.factory`` when set, else ``task.build_model``; called with ``model.kwargs``."""
    if cfg.model.factory:
        fn = resolve_import(cfg.model.factory, "model.factory")
        if not callable(fn):
            raise TaskError(f"model.factory={cfg.model.factory!r} is not callable")
        return fn
    return task.build_model


def build_model(cfg: Config, task: Task):
    """The model from ``model.kwargs``.

    Raises:
        TaskError: the factory refuses the kwargs (names ``model.kwargs``) or fails.
    """
    fn = model_factory(cfg, task)
    try:
        model = fn(**cfg.model.kwargs)
    except TypeError as e:
        sig = _signature(fn)
        raise TaskError(f"model.kwargs {sorted(cfg.model.kwargs)}: {e}; the factory takes {sig}") from None
    except (ValueError, KeyError, AssertionError) as e:
        raise TaskError(f"model.kwargs: {type(e).__name__}: {e}") from None
    import torch.nn as nn

    if not isinstance(model, nn.Module):
        raise TaskError(f"the model factory returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _signature(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(unknown signature)"


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
