"""The typed config tree (:mod:`~elastic_ddp.config.schema`), ``--set`` overrides
(:mod:`~elastic_ddp.config.overrides`) and :class:`ConfigError`.

    from elastic_ddp.config import Config, ConfigError
"""

from elastic_ddp.config.errors import ConfigError
from elastic_ddp.config.schema import Config

__all__ = ["Config", "ConfigError"]
