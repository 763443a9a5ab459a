"""elastic-ddp: elastic PyTorch DDP on Ray Train that loses no sample and repeats none
across failures and resizes, tracked in one MLflow run per job.

    from elastic_ddp import Config, train
    summary = train(Config.load("experiments/configs/digits_cnn.yaml"))
"""

from elastic_ddp.config import Config, ConfigError

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "train", "__version__"]


def train(cfg, **kwargs):
    """Run a training job; see ``elastic_ddp.launcher.train``."""
    from elastic_ddp.launcher import train as _train

    return _train(cfg, **kwargs)
