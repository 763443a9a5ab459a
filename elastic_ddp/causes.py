"""What an error's own text says about its cause, shared by the workers (where an error
is raised) and the Ray Train controller (where it is judged): whether it was raised in the
task's code, whether the storage is full or read-only, whether the error says that no
restart can fix it (and which config field does). Standard library only.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional


def error_origin(exc: BaseException) -> str:
    """Where ``exc`` was raised: ``"task"`` when its traceback passes through the task's
    code (a file outside elastic_ddp, the standard library and site-packages, or a built-in
    task in ``elastic_ddp/tasks/``), ``"library"`` when it does not (elastic-ddp, PyTorch,
    Ray), ``""`` without a traceback."""
    import sysconfig
    import traceback

    tb = exc.__traceback__
    if tb is None:
        return ""
    pkg = str(Path(__file__).resolve().parent)  # this module sits at the package's root
    builtin_tasks = os.path.join(pkg, "tasks") + os.sep
    lib = tuple(str(Path(p).resolve()) for p in {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")})
    for frame in traceback.extract_tb(tb):
        if not frame.filename or frame.filename.startswith("<"):
            continue
        f = str(Path(frame.filename).resolve())
        if f.startswith(builtin_tasks):
            return "task"
        if "site-packages" in f or "dist-packages" in f or f.startswith(lib) or f.startswith(pkg + os.sep):
            continue
        return "task"
    return "library"


_STORAGE = ((re.compile(r"\[Errno 28\]|No space left on device|ENOSPC"), "full (no space left on the device)"),
            (re.compile(r"\[Errno 122\]|Disk quota exceeded|EDQUOT"), "full (the disk quota is exceeded)"),
            (re.compile(r"\[Errno 30\]|Read-only file system|EROFS"), "read-only"))


def storage_problem(message: str, storage: Optional[str] = None) -> Optional[str]:
    """"the storage at PATH is full ..." for a disk-full, quota or read-only error (the
    path from the error, else ``storage``), with the fix; None for any other error."""
    for pattern, what in _STORAGE:
        if pattern.search(message):
            m = re.search(r"\] [^:']*: '([^']+)'", message)
            path = m.group(1) if m else (storage or "run.storage_path")
            return (f"the storage at {path} is {what}: free space there or set run.storage_path "
                    "to a volume with room (the checkpoints written so far are kept; rerunning the "
                    "same run.name resumes)" if what != "read-only" else
                    f"the storage at {path} is read-only: set run.storage_path to a writable "
                    "directory or URI, or remount it read-write")
    return None


# Errors whose own text says no restart can fix them, with the config field that does.
_SAYS_SO = (
    (re.compile(r"find_unused_parameters|Expected to have finished reduction in the prior iteration"),
     "the model has parameters that get no gradient in a step (DDP's unused-parameter error): "
     "set parallel.find_unused_parameters=true (--set parallel.find_unused_parameters=true), or "
     "make every parameter take part in the loss"),
)
# Shape and dtype errors: deterministic when every rank raised the same one at one step.
SHAPE_OR_DTYPE = re.compile(
    r"shapes cannot be multiplied|size mismatch|must match the size of tensor|is invalid for input "
    r"of size|Expected input batch_size|to have \d+ channels|expected input\[|must have the same "
    r"dtype|type \(.*\) should be the same|expected scalar type|target dtype to be|scalar types: "
    r"Long, Int")


def says_so(message: str) -> Optional[str]:
    """The fix when ``message`` says that no restart can help, else None."""
    for pattern, fix in _SAYS_SO:
        if pattern.search(message):
            return fix
    return None


def first_line(text: str) -> str:
    """The first non-blank line of ``text`` ("" for none)."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""


def clip(text: str, limit: int = 400, tail: int = 200) -> str:
    """``text`` at most about ``limit`` characters: its start and its last ``tail``
    characters around `` [... N characters ...] ``. An error's fix is its last sentence,
    so the end is kept, never cut off."""
    if len(text) <= limit:
        return text
    head = max(0, limit - tail)
    return f"{text[:head]} [... {len(text) - head - tail} characters ...] {text[-tail:]}"
