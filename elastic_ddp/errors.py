"""The base of every error elastic-ddp raises to a caller, and the exit code it maps to.

    from elastic_ddp import ConfigError, ElasticDDPError, train

    try:
        summary = train(cfg)
    except ConfigError as e:       # bad input, found before any work starts (exit 2)
        ...
    except ElasticDDPError as e:   # any other error of the package: e.exit_code
        ...

Each error class keeps the built-in base callers may catch it by (``ConfigError`` is a
``ValueError``, ``CheckpointError`` a ``RuntimeError``, ``LeaseStoreError`` an
``OSError``) beside this one. ``elastic-ddp`` prints such an error as one line,
``elastic-ddp: <kind>: <message>``, and exits with its :attr:`ElasticDDPError.exit_code`
(README.md, "Exit codes").

Not derived from it, on purpose: the two stops, which must pass every ``except
Exception`` on their way out as Ctrl-C's ``KeyboardInterrupt`` does:
``elastic_ddp.driver.stop.JobStopped`` (SIGTERM, a ``BaseException``, exit 143) and
``JobInterrupted`` (Ctrl-C after the run was opened, a ``KeyboardInterrupt``, exit 130).

This module imports nothing: every layer of the package may import it, the Ray Train
controller included.
"""

from __future__ import annotations

#: Exit status of an error that is the job's failure, not its input's (the MLflow run,
#: if opened, is FAILED; checkpoints are kept).
EXIT_FAILED = 1
#: Exit status of bad input (config, data, arguments, a run that cannot resume), found
#: before any work starts.
EXIT_BAD_INPUT = 2


class ElasticDDPError(Exception):
    """An error elastic-ddp raises to its caller.

    Class attributes (a subclass sets its own; an instance may override them):
        exit_code: what ``elastic-ddp`` exits with on this error (1: the job failed; 2:
            bad input, before any work started).
        kind: the words ``elastic-ddp`` prints before the message (``"config error"``);
            empty when the message says it itself (``"training failed ..."``).
    """

    exit_code: int = EXIT_FAILED
    kind: str = ""

    def cli_line(self) -> str:
        """The one line ``elastic-ddp`` prints to stderr for this error."""
        return f"elastic-ddp: {self.kind}: {self}" if self.kind else f"elastic-ddp: {self}"
