"""A tracking server that is down (``run.tracking_uri: http://127.0.0.1:<closed port>``,
or the same in ``MLFLOW_TRACKING_URI``): the command exits 2 with one line naming the URI,
the field it came from and the fix, before Ray starts and before any run or store file
exists; a sweep too, before its parent run. The CLI runs as a user runs it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import digits_config

REPO = Path(__file__).resolve().parents[1]


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _cli(args: list[str], env_extra: dict, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), **env_extra)
    env.pop("RAY_ADDRESS", None)
    # The timeout guards the "no hang": MLflow's own retries of a refused server run
    # for minutes.
    return subprocess.run([sys.executable, "-m", "elastic_ddp", *args], capture_output=True,
                          text=True, timeout=240, env=env, cwd=cwd)


@pytest.mark.parametrize("where", ["config", "env"])
@pytest.mark.parametrize("cmd", ["train", "sweep"])
def test_a_tracking_server_that_is_down_exits_2_naming_the_uri(tmp_path, digits_data, where, cmd):
    uri = f"http://127.0.0.1:{_closed_port()}"
    raw = digits_config(digits_data, tmp_path)
    env = {}
    if where == "config":
        raw["run"]["tracking_uri"] = uri
        field = "run.tracking_uri"
    else:
        raw["run"]["tracking_uri"] = None
        env["MLFLOW_TRACKING_URI"] = uri
        field = "MLFLOW_TRACKING_URI"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    extra = ["--world-sizes", "1"] if cmd == "sweep" else []
    p = _cli([cmd, str(path), "--no-progress" if cmd == "train" else "--verbose", *extra], env, tmp_path)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    line = lines[0]
    assert line.startswith(f"elastic-ddp: config error: {field}={uri}: the MLflow tracking store "
                           "does not answer at 127.0.0.1:"), line
    assert "Connection refused" in line and "mlflow server" in line and "sqlite" in line, line
    assert "Traceback" not in p.stderr
    # Nothing started, nothing written: no Ray results, no local store, no artifacts.
    assert not (tmp_path / "ray_results").exists()
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()
    assert "elastic-ddp: run" not in p.stdout  # the launcher's line once a run is open


def test_a_local_store_is_not_refused_by_the_check(tmp_path):
    from elastic_ddp.driver.preflight import check_tracking_store

    for uri in (f"sqlite:///{tmp_path}/m.db", f"file://{tmp_path}/mlruns", str(tmp_path / "mlruns"),
                "databricks"):
        check_tracking_store(uri)  # no connection attempted, no error
    assert list(tmp_path.iterdir()) == []


def test_a_listening_server_passes(tmp_path):
    from elastic_ddp.config import ConfigError
    from elastic_ddp.driver.preflight import check_tracking_store

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    try:
        check_tracking_store(f"http://127.0.0.1:{srv.getsockname()[1]}/")
    finally:
        srv.close()
    with pytest.raises(ConfigError, match="postgresql"):
        check_tracking_store(f"postgresql://u:p@127.0.0.1:{_closed_port()}/db")


@pytest.mark.parametrize("where", ["config", "env"])
def test_a_scheme_mlflow_has_no_store_for_exits_2_naming_the_field_and_the_schemes(tmp_path, where):
    """``htp://`` (a typo of http): one config-error line naming the field, the scheme and
    those MLflow accepts, exit 2, before the data scan, MLflow or Ray start (the data
    path here does not exist: a later check would say so instead)."""
    raw = digits_config(tmp_path / "no-data", tmp_path)
    env = {}
    if where == "config":
        raw["run"]["tracking_uri"], field = "htp://foo", "run.tracking_uri"
    else:
        raw["run"]["tracking_uri"], field = None, "MLFLOW_TRACKING_URI"
        env["MLFLOW_TRACKING_URI"] = "htp://foo"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    p = _cli(["train", str(path), "--no-progress"], env, tmp_path)
    assert p.returncode == 2, (p.stdout, p.stderr)
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith(f"elastic-ddp: config error: {field}='htp://foo': MLflow has no "
                           "tracking store for the scheme 'htp'; use one of file:, sqlite:"), line
    assert "http:, https:" in line and "Traceback" not in p.stderr
    assert not (tmp_path / "ray_results").exists() and not (tmp_path / "mlflow.db").exists()
    assert p.stdout == ""


def test_submit_refuses_the_scheme_before_contacting_the_cluster(tmp_path):
    from elastic_ddp.config import ConfigError
    from elastic_ddp.driver.submit import prepare

    with pytest.raises(ConfigError, match=r"run.tracking_uri='htp://mlflow:5000': MLflow has no "
                                          r"tracking store for the scheme 'htp'"):
        prepare(str(REPO / "experiments/configs/digits_cnn.yaml"),
                ["run.tracking_uri=htp://mlflow:5000"], "http://10.0.0.1:8265", environ={})


def test_the_accepted_schemes_are_mlflows():
    """The schemes the check accepts without importing MLflow are those the installed
    MLflow registers as tracking stores (less Unity Catalog's, which refuse to be one)."""
    from mlflow.tracking._tracking_service import utils

    from elastic_ddp.driver.preflight import accepted_schemes

    registered = set(utils._tracking_store_registry._registry) - {"", "databricks-uc", "uc"}
    assert set(accepted_schemes()) == registered


def test_a_sqlite_store_in_a_missing_directory_is_refused_and_not_created(tmp_path):
    raw = digits_config(tmp_path / "no-data", tmp_path)
    missing = tmp_path / "no" / "such"
    raw["run"]["tracking_uri"] = f"sqlite:///{missing}/m.db"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    p = _cli(["train", str(path), "--no-progress"], {}, tmp_path)
    assert p.returncode == 2, (p.stdout, p.stderr)
    (line,) = p.stderr.strip().splitlines()
    assert line == (f"elastic-ddp: config error: run.tracking_uri=sqlite:///{missing}/m.db: cannot "
                    f"create the MLflow database m.db (the directory {missing} does not exist); "
                    f"create the directory first (mkdir -p {missing}), or point run.tracking_uri "
                    "at a directory you can write"), line
    assert not (tmp_path / "no").exists() and not (tmp_path / "ray_results").exists()
