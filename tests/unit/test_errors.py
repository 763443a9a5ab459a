"""One error hierarchy: every exception class of the package derives from
``ElasticDDPError`` and carries the exit code ``elastic-ddp`` maps it to; the public API
(``elastic_ddp.__all__``) exports what a user calls and catches."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import elastic_ddp
from elastic_ddp import ElasticDDPError
from elastic_ddp.driver import cli

# Exception classes that deliberately do not derive from ElasticDDPError, with why.
NOT_DERIVED = {
    "elastic_ddp.driver.stop.JobStopped": "SIGTERM's stop: a BaseException, as KeyboardInterrupt "
                                          "is, so that it passes every `except Exception`",
    "elastic_ddp.driver.stop.StoppedBeforeTraining": "a JobStopped",
    "elastic_ddp.driver.stop.JobInterrupted": "Ctrl-C's stop: a KeyboardInterrupt",
}


def _exception_classes() -> dict[str, type]:
    out = {}
    for info in pkgutil.walk_packages(elastic_ddp.__path__, "elastic_ddp."):
        if info.name.endswith("__main__"):  # runs the CLI
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name:
                out[f"{info.name}.{name}"] = obj
    return out


def test_every_exception_class_of_the_package_derives_from_the_base():
    classes = _exception_classes()
    assert len(classes) > 25 and set(NOT_DERIVED) <= set(classes)  # the walk found them
    stray = [n for n, c in classes.items() if not issubclass(c, ElasticDDPError) and n not in NOT_DERIVED]
    assert stray == [], f"derive these from elastic_ddp.errors.ElasticDDPError: {stray}"
    assert not any(issubclass(classes[n], ElasticDDPError) for n in NOT_DERIVED)
    # The stops keep their exit codes as attributes too.
    assert classes["elastic_ddp.driver.stop.JobStopped"].exit_code == 143
    assert classes["elastic_ddp.driver.stop.JobInterrupted"].exit_code == 130


def test_errors_keep_their_builtin_bases_and_the_readme_exit_codes():
    from elastic_ddp import (CheckpointCorruptError, CheckpointError, ConfigError, DataError, ResumeError,
                             RunBusyError, StorageError, SubmitError, TaskError, TrackingSetupError,
                             TrainingError)
    from elastic_ddp.driver.drain import DrainError
    from elastic_ddp.driver.lease_s3 import LeaseStoreError

    for cls, builtin, code in [(ConfigError, ValueError, 2), (TaskError, ValueError, 2),
                               (RunBusyError, ValueError, 2), (ResumeError, ValueError, 2),
                               (StorageError, ValueError, 2), (TrackingSetupError, ValueError, 2),
                               (DataError, ValueError, 2), (CheckpointError, RuntimeError, 2),
                               (CheckpointCorruptError, RuntimeError, 2), (DrainError, Exception, 2),
                               (TrainingError, RuntimeError, 1), (SubmitError, RuntimeError, 1),
                               (LeaseStoreError, OSError, 1)]:
        assert issubclass(cls, builtin) and cls.exit_code == code, cls
    # A job whose checkpoints all fail their checksums: bad input on storage.
    assert TrainingError("training failed: ... CheckpointCorruptError: none verifies").exit_code == 2
    import pickle

    back = pickle.loads(pickle.dumps(TrainingError("x CheckpointCorruptError y")))
    assert back.exit_code == 2 and str(back) == "x CheckpointCorruptError y"


def test_the_public_api_names_resolve_and_nothing_else_is_exported():
    for name in elastic_ddp.__all__:
        assert getattr(elastic_ddp, name) is not None, name
    assert {"train", "Config", "Task", "Column", "Summary", "Diagnostics", "ElasticDDPError",
            "ConfigError", "TrainingError", "audit"} <= set(elastic_ddp.__all__)
    from elastic_ddp.driver.report import Summary
    from elastic_ddp.ledger.audit import audit

    assert elastic_ddp.Summary is Summary and elastic_ddp.audit is audit
    with pytest.raises(AttributeError, match="no attribute 'launcher'"):
        elastic_ddp.__getattr__("launcher")
    # The public train takes the launcher's arguments by the same names.
    from elastic_ddp.driver import launcher

    assert (list(inspect.signature(elastic_ddp.train).parameters)
            == list(inspect.signature(launcher.train).parameters))


def _raise(e: BaseException):
    def cmd(args):
        raise e
    return cmd


@pytest.mark.parametrize("error, code, line", [
    ("ConfigError('data.train_path: no such dir')", 2, "elastic-ddp: config error: data.train_path: no such dir"),
    ("TaskError('task.path: no module x')", 2, "elastic-ddp: task error: task.path: no module x"),
    ("RunBusyError('held by pid 7')", 2, "elastic-ddp: run in use: held by pid 7"),
    ("ResumeError('model differs')", 2, "elastic-ddp: resume refused: model differs"),
    ("DataError('f.parquet: no column y')", 2, "elastic-ddp: data error: f.parquet: no column y"),
    ("CheckpointError('no manifest')", 2, "elastic-ddp: checkpoint error: no manifest"),
    ("SubmitError('cannot reach')", 1, "elastic-ddp: submit failed: cannot reach"),
    ("TrainingError('training failed (MLflow run r marked FAILED): boom')", 1,
     "elastic-ddp: training failed (MLflow run r marked FAILED): boom"),
    ("TrainingError('training failed: CheckpointCorruptError: none verifies')", 2,
     "elastic-ddp: training failed: CheckpointCorruptError: none verifies"),
])
def test_the_cli_maps_an_error_to_its_exit_code_and_one_line(error, code, line, monkeypatch, capsys):
    import elastic_ddp as edp

    monkeypatch.setattr(cli, "_prepare", _raise(eval(error, vars(edp) | {n: getattr(edp, n) for n in edp.__all__})))
    assert cli.main(["prepare", "digits", "out"]) == code
    assert capsys.readouterr().err.strip() == line


def test_the_cli_exits_with_the_stops_codes_and_reraises_what_is_not_the_packages(monkeypatch, capsys):
    from elastic_ddp.driver.stop import JobInterrupted, JobStopped

    monkeypatch.setattr(cli, "_prepare", _raise(JobStopped("stopped on SIGTERM at a checkpoint")))
    assert cli.main(["prepare", "digits", "out"]) == 143
    monkeypatch.setattr(cli, "_prepare", _raise(JobInterrupted("interrupted (MLflow run r KILLED)")))
    assert cli.main(["prepare", "digits", "out"]) == 130
    assert capsys.readouterr().err.splitlines() == ["elastic-ddp: stopped on SIGTERM at a checkpoint",
                                                    "elastic-ddp: interrupted (MLflow run r KILLED)"]
    monkeypatch.setattr(cli, "_prepare", _raise(ZeroDivisionError("a bug")))
    with pytest.raises(ZeroDivisionError):  # a traceback, not a line that hides a bug
        cli.main(["prepare", "digits", "out"])


def test_real_commands_exit_by_their_errors_code(tmp_path, capsys):
    # export of a directory that is no checkpoint: CheckpointError, exit 2.
    assert cli.main(["export", str(tmp_path), str(tmp_path / "out.pt")]) == 2
    assert capsys.readouterr().err.startswith("elastic-ddp: checkpoint error: ")
    # drain-node with a deadline below a second: DrainError, exit 2, before any node lookup.
    assert cli.main(["drain-node", "--self", "--deadline", "0"]) == 2
    assert capsys.readouterr().err.strip() == ("elastic-ddp: drain-node: --deadline must be at "
                                               "least 1 second, got 0")
