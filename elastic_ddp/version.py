"""The package version (pyproject.toml's ``version``), importable from any layer."""

__version__ = "0.1.0"
