"""Every job input is pickled on the driver before anything starts.

The task object (its transform and hooks with it), the model factory and the kwargs
reach the Ray Train workers and Ray Data's map tasks pickled (Ray's cloudpickle). An
object that cannot be pickled (a ``threading.Lock``, an open file, a socket, a database
connection held by the task) would otherwise fail only once the workers start, after the
MLflow run is open, with a ``TypeError`` that names neither the task nor the attribute.

:func:`check_picklable` pickles each input once (the same cost the launcher pays when it
ships them) and, on a failure, walks the object (attributes, dict items, list items, a
function's closure and the globals it uses) to the innermost part that still fails, so
the message names a path such as ``task.lock: threading.Lock``.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterator, Optional

from elastic_ddp.config import Config

# What the user wrote, for CPython's internal type names.
_TYPE_NAMES = {"_thread.lock": "threading.Lock", "_thread.RLock": "threading.RLock",
               "_io.TextIOWrapper": "an open file (io.TextIOWrapper)",
               "_io.BufferedReader": "an open file (io.BufferedReader)",
               "_io.BufferedWriter": "an open file (io.BufferedWriter)",
               "_io.BufferedRandom": "an open file (io.BufferedRandom)",
               "_io.FileIO": "an open file (io.FileIO)", "socket.socket": "socket.socket",
               "sqlite3.Connection": "sqlite3.Connection", "generator": "a generator"}
_MAX_DEPTH = 8
_MAX_NODES = 2000


def type_name(obj: Any) -> str:
    """``threading.Lock`` for a lock, ``module.Class`` for anything else."""
    t = type(obj)
    name = f"{t.__module__}.{t.__qualname__}" if t.__module__ != "builtins" else t.__qualname__
    return _TYPE_NAMES.get(name, name)


def _dumps(obj: Any) -> Optional[BaseException]:
    from ray import cloudpickle

    try:
        cloudpickle.dumps(obj)
    except Exception as e:  # noqa: BLE001 - any pickling failure is reported
        return e
    return None


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    """(path suffix, part) of what pickling ``obj`` pickles, as far as it can be seen."""
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            yield (f".{k}" if isinstance(k, str) and k.isidentifier() else f"[{k!r}]"), v
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(list(obj)):
            yield f"[{i}]", v
        return
    if inspect.ismethod(obj):
        yield ".__self__", obj.__self__
        yield ".__func__", obj.__func__
        return
    if inspect.isfunction(obj):
        try:
            cv = inspect.getclosurevars(obj)
        except (TypeError, ValueError):
            return
        for name, v in {**cv.nonlocals, **cv.globals}.items():
            if not inspect.ismodule(v):
                yield f".<{'closure' if name in cv.nonlocals else 'global'} {name}>", v
        return
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        for k, v in list(state.items()):
            yield f".{k}", v
    for k in getattr(type(obj), "__slots__", ()) or ():
        if isinstance(k, str) and hasattr(obj, k):
            yield f".{k}", getattr(obj, k)
    if not isinstance(obj, type):
        # A class shipped by value (a task.py file) takes its methods' globals along.
        for k, v in list(vars(type(obj)).items()):
            if inspect.isfunction(v):
                yield f".{k}", v


def find_unpicklable(obj: Any, path: str) -> Optional[tuple[str, Any, BaseException]]:
    """(path, part, error) of the innermost part of ``obj`` that cannot be pickled, or
    None when ``obj`` pickles. ``path`` names ``obj`` (``task``, ``model.factory``)."""
    err = _dumps(obj)
    if err is None:
        return None
    seen: set[int] = set()
    budget = [_MAX_NODES]

    def walk(o: Any, p: str, e: BaseException, depth: int) -> tuple[str, Any, BaseException]:
        seen.add(id(o))
        if depth >= _MAX_DEPTH:
            return p, o, e
        for suffix, child in _children(o):
            if id(child) in seen or budget[0] <= 0:
                continue
            budget[0] -= 1
            ce = _dumps(child)
            if ce is not None:
                return walk(child, p + suffix, ce, depth + 1)
        return p, o, e

    return walk(obj, path, err, 0)


def check_picklable(cfg: Config, task, factory=None) -> None:
    """Pickle the task, ``task.kwargs``, ``model.kwargs`` and the model factory (when it
    is not the task's own ``build_model``) as the launcher ships them.

    Raises:
        TaskError: one of them cannot be pickled; names the object path, its type, the
            pickling error and the fix.
    """
    from elastic_ddp.tasks.loading import TaskError

    inputs = [("task", task), ("task.kwargs", dict(cfg.task.kwargs)),
              ("model.kwargs", dict(cfg.model.kwargs))]
    if factory is not None and getattr(factory, "__self__", None) is not task:
        inputs.append(("model.factory", factory))
    for root, obj in inputs:
        found = find_unpicklable(obj, root)
        if found is None:
            continue
        path, part, err = found
        first = (str(err).strip().splitlines() or [""])[0][:300]
        where = ("create it where it is used (in build_model, transform or loss, or a property "
                 "that opens it on first use), or leave it out of the pickled state "
                 "(__getstate__/__setstate__)")
        raise TaskError(f"{path}: {type_name(part)} cannot be pickled ({type(err).__name__}: "
                        f"{first}); every job input is pickled to the Ray workers and Ray Data "
                        f"tasks: {where}")
