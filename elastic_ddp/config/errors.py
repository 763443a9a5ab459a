"""The one error a config that cannot run raises (the driver turns it into exit 2)."""

from elastic_ddp.errors import EXIT_BAD_INPUT, ElasticDDPError


class ConfigError(ElasticDDPError, ValueError):
    """A config that cannot run. The message names the field (or file) and the fix."""

    exit_code = EXIT_BAD_INPUT
    kind = "config error"
