"""elastic-ddp: elastic PyTorch DDP on Ray Train that loses no sample and repeats none
across failures and resizes, tracked in one MLflow run per job.

    from elastic_ddp import Config, train
    summary = train(Config.load("experiments/configs/digits_cnn.yaml"))

Bring your own model and data by subclassing :class:`Task` (see
``elastic_ddp.tasks.protocol``) and passing ``train(cfg, task=MyTask())`` or
``task.path: "my_task.py:MyTask"`` in the config.

The names in ``__all__`` are the public API (README.md, "Public API"); every other
module and name of the package is internal and may change in any release. Every error
the package raises derives from :class:`ElasticDDPError` and carries the CLI's exit code
(``elastic_ddp.errors``).
"""

from typing import Any, Callable, Optional

from elastic_ddp.checkpoint import CheckpointCorruptError, CheckpointError
from elastic_ddp.config import Config, ConfigError
from elastic_ddp.errors import ElasticDDPError
from elastic_ddp.run_state import Diagnostics
from elastic_ddp.tasks.protocol import Column, Task, TransformContext, pad_sequences
from elastic_ddp.version import __version__

# Imported on first use (PEP 562 module __getattr__): their modules bring pyarrow,
# numpy, Ray or MLflow, which `import elastic_ddp` does not (tests/unit/driver/test_startup_imports.py).
_LAZY = {
    "Summary": "elastic_ddp.driver.report",
    "TrainingError": "elastic_ddp.driver.job",
    "ResumeError": "elastic_ddp.driver.resume",
    "RunBusyError": "elastic_ddp.driver.lease",
    "StorageError": "elastic_ddp.driver.storage_checks",
    "SubmitError": "elastic_ddp.driver.submit",
    "DataError": "elastic_ddp.data.listing",
    "TaskError": "elastic_ddp.tasks.loading",
    "TrackingSetupError": "elastic_ddp.tracking.store",
    "LedgerError": "elastic_ddp.ledger.files",
    "audit": "elastic_ddp.ledger.audit",
    "audit_per_step": "elastic_ddp.ledger.audit",
    "format_audit": "elastic_ddp.ledger.audit",
}

__all__ = ["CheckpointCorruptError", "CheckpointError", "Column", "Config", "ConfigError",
           "Diagnostics", "ElasticDDPError", "Task", "TransformContext", "pad_sequences",
           "train", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic_ddp' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def train(cfg: Config, task: Optional[Task] = None, progress: bool = True,
          parent_run_id: Optional[str] = None, command_start: Optional[float] = None,
          on_validated: Optional[Callable[[Config], None]] = None,
          diagnostics: Optional[Diagnostics] = None):
    """Run one training job to the end and return its :class:`Summary`.

    ``task``: a :class:`Task` (default: the config's ``task.path`` / ``model.name``);
    ``progress``: the progress line on stderr; ``diagnostics``: the sample ledger and
    fault injection of tests and experiments. The other arguments and the errors raised
    (``ConfigError`` and its kinds before any work starts, ``DataError``,
    ``TrainingError``; ``JobStopped`` and ``KeyboardInterrupt`` on a stop): see
    :func:`elastic_ddp.driver.launcher.train`."""
    from elastic_ddp.driver import launcher

    return launcher.train(cfg, task=task, progress=progress, parent_run_id=parent_run_id,
                          command_start=command_start, on_validated=on_validated,
                          diagnostics=diagnostics)
