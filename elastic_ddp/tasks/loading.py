"""Find the job's task (and model factory) from the config, and build its model. The
dry run that checks them on a real sample before any worker starts: ``tasks.dry_run``.

``task.path`` / ``model.factory`` take ``package.module:Attr`` (importable on the driver)
or ``path/to/file.py:Attr`` (relative to the working directory). A module loaded from a
file, or from outside any installed distribution, is shipped to Ray's workers by value
(cloudpickle), so the workers need no copy of it and no ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
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
