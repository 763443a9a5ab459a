"""elastic-ddp: elastic PyTorch DDP on Ray Train that loses no sample and repeats none
across failures and resizes, tracked in one MLflow run per job.

    from elastic_ddp import Config, train
    summary = train(Config.load("experiments/configs/digits_cnn.yaml"))

Bring your own model and data by subclassing :class:`Task` (see
``elastic_ddp.tasks.protocol``) and passing ``train(cfg, task=MyTask())`` or
``task.path: "my_task.py:MyTask"`` in the config.
"""

from elastic_ddp.config import Config, ConfigError
from elastic_ddp.run_state import Diagnostics
from elastic_ddp.tasks.protocol import Column, Task, TransformContext, pad_sequences

from elastic_ddp.version import __version__
__all__ = ["Column", "Config", "ConfigError", "Diagnostics", "Task", "TransformContext", "pad_sequences",
           "train", "__version__"]


def train(cfg, task=None, **kwargs):
    """Run a training job; see :func:`elastic_ddp.driver.launcher.train`."""
    from elastic_ddp.driver.launcher import train as _train

    return _train(cfg, task=task, **kwargs)
