"""The one error a config that cannot run raises (the driver turns it into exit 2)."""


class ConfigError(ValueError):
    """A config that cannot run. The message names the field (or file) and the fix."""
