"""What ``elastic-ddp submit`` builds before it contacts a cluster: it finds the checkout
from the config (any current directory works), quotes the overrides it generates so
that YAML reads them back unchanged, refuses local-only settings for a remote cluster,
and never puts a credential into the job's entrypoint, runtime env or metadata. Fast:
no Ray cluster; the CLI runs as a real subprocess against addresses that answer
nothing (so only the local checks can decide the outcome).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elastic_ddp.driver.cli import _parser
from elastic_ddp.config import Config, ConfigError
from elastic_ddp.driver.submit import (cleartext_token_warning, has_credentials, load_runtime_env,
                                prepare, yaml_value)

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "experiments" / "configs" / "digits_cnn.yaml"
LOOPBACK = "http://127.0.0.1:8265"
REMOTE = "http://ray-head.invalid:8265"  # .invalid never resolves: nothing is contacted
SHARED = ["data.train_path=/mnt/shared/data/digits/train", "data.val_path=/mnt/shared/data/digits/val",
          "run.storage_path=s3://bucket/elastic-ddp", "run.tracking_uri=http://mlflow.internal:5000"]
SECRET = "s3cr3t-pw-9f2c"
SECRET_URI = f"https://alice:{SECRET}@mlflow.example.com"


def _checkout(parent: Path) -> Path:
    """A minimal checkout under ``parent``: what a job needs and submit looks for."""
    parent.mkdir(parents=True, exist_ok=True)
    for rel in ("elastic_ddp", "experiments/configs", "cluster"):
        shutil.copytree(ROOT / rel, parent / rel, ignore=shutil.ignore_patterns("__pycache__"),
                        dirs_exist_ok=True)
    shutil.copy(ROOT / ".rayignore", parent / ".rayignore")
    return parent


def _job_argv(entrypoint: str) -> list[str]:
    argv = shlex.split(entrypoint)  # the job's shell splits it the same way
    assert argv[:3] == ["python", "-m", "elastic_ddp"]
    return argv[3:]


def _job_config(sub) -> Config:
    """The config the job will load: its own CLI parser, its own Config.load, in its
    working dir."""
    args = _parser().parse_args(_job_argv(sub.entrypoint))
    return Config.load(Path(sub.runtime_env["working_dir"]) / args.config, args.overrides)


def _cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("RAY_", "MLFLOW_")) and k != "PYTHONPATH"}
    exe = Path(sys.executable).parent / "elastic-ddp"
    return subprocess.run([str(exe), "submit", *args], cwd=cwd, env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=180)


# --------------------------------------------------------------------------- from anywhere
def test_prepare_finds_the_checkout_from_the_config_not_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sub = prepare(str(CONFIG), ["train.epochs=1"], LOOPBACK, environ={})
    assert sub.root == ROOT and sub.runtime_env["working_dir"] == str(ROOT)
    assert _job_argv(sub.entrypoint)[:2] == ["train", "experiments/configs/digits_cnn.yaml"]
    cfg = _job_config(sub)
    assert cfg.train.epochs == 1
    assert cfg.data.train_path == str(ROOT / "data/digits/train")  # the checkout's, not tmp's
    assert cfg.run.storage_path == str(ROOT / "ray_results")
    assert cfg.run.tracking_uri == f"sqlite:///{ROOT / 'mlflow.db'}"
    assert sub.metadata["elastic_ddp.config"] == "experiments/configs/digits_cnn.yaml"


def test_cli_submit_from_another_directory_gets_to_the_cluster(tmp_path):
    """From /tmp-like directories the CLI validates, builds the job and only then fails
    to reach a job API that is not there (exit 1, not exit 2 'runtime env
    cluster/runtime_env.yaml not found')."""
    out = _cli(str(CONFIG), "--address", "http://127.0.0.1:9", "--set", "train.epochs=1", cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    assert "cannot reach the Ray job API at http://127.0.0.1:9" in out.stderr
    assert f"data.train_path={ROOT}/data/digits/train" in out.stderr  # the localization note


def test_a_config_outside_any_checkout_is_refused_with_the_fix(tmp_path):
    cfg = tmp_path / "mine.yaml"
    shutil.copy(CONFIG, cfg)
    out = _cli(str(cfg), "--address", "http://127.0.0.1:9", cwd=tmp_path)
    assert out.returncode == 2
    assert "not inside an elastic-ddp checkout" in out.stderr and "experiments/configs/" in out.stderr


# --------------------------------------------------------------------------- quoting
@pytest.mark.parametrize("s", [
    "/home/u/proj #2/data", "/a b/c", "/q?x/y", "/user@host/x", "/c:d/e", "/x: y/z", "/x #y: z",
    "sqlite:////tmp/proj #2/mlflow.db", "/it's/here", '/say "hi"/x', "/[a]/{b}/*c", "/tab\tx",
    "/ünï/cödé", "/trailing #", "/%percent/!bang/&amp", "/back\\slash",
])
def test_yaml_value_round_trips(s):
    v = yaml_value(s)
    assert yaml.safe_load(v) == s
    assert Config.load(CONFIG, [f"data.train_path={v}"]).data.train_path == s  # today's --set parsing


def test_yaml_value_leaves_plain_paths_plain():
    assert yaml_value("/home/u/proj/data/digits/train") == "/home/u/proj/data/digits/train"
    assert yaml_value("sqlite:////home/u/proj/mlflow.db") == "sqlite:////home/u/proj/mlflow.db"


@pytest.mark.parametrize("name", ["proj #2", "my proj", "q?x", "me@host", "a:b", "x: y", "#top"])
def test_generated_overrides_survive_odd_checkout_names(tmp_path, name):
    """The overrides `submit` generates for a checkout in ``proj #2`` (or with
    a space, ?, @, :) reach the job's config unchanged."""
    root = _checkout(tmp_path / name / "repo")
    sub = prepare(str(root / "experiments/configs/digits_cnn.yaml"), [], LOOPBACK, environ={})
    assert sub.root == root.resolve()
    cfg = _job_config(sub)
    assert cfg.data.train_path == str(root / "data/digits/train")
    assert cfg.data.val_path == str(root / "data/digits/val")
    assert cfg.run.storage_path == str(root / "ray_results")
    assert cfg.run.tracking_uri == f"sqlite:///{root / 'mlflow.db'}"


# --------------------------------------------------------------------------- remote refusal
def test_remote_submission_lists_every_local_only_setting(tmp_path):
    sub = prepare(str(CONFIG), [], REMOTE, environ={})
    joined = "\n".join(sub.local_only)
    assert "data.train_path='data/digits/train' is relative" in joined
    assert "data.val_path='data/digits/val' is relative" in joined
    assert "run.storage_path='ray_results' is relative" in joined
    assert "--set" not in sub.entrypoint  # a remote cluster's paths are not this machine's
    # absolute paths of this machine and a local store are refused as well
    local = [f"data.train_path={tmp_path}/train", f"data.val_path={ROOT}/data/digits/val",
             f"run.storage_path={Path.home()}/ray_results", "run.tracking_uri=sqlite:////srv/mlflow.db"]
    joined = "\n".join(prepare(str(CONFIG), local, REMOTE, environ={}).local_only)
    assert "(in the temp directory)" in joined and "(in this checkout)" in joined
    assert "(in your home directory)" in joined and "local MLflow store" in joined
    # an MLflow store inherited from the environment counts too
    env = {"MLFLOW_TRACKING_URI": "sqlite:///mlflow.db"}
    assert any("MLFLOW_TRACKING_URI" in p for p in prepare(str(CONFIG), SHARED[:3], REMOTE, environ=env).local_only)
    assert prepare(str(CONFIG), SHARED, REMOTE, environ={}).local_only == []


def test_cli_refuses_a_remote_submission_with_local_paths(tmp_path):
    out = _cli(str(CONFIG), "--address", REMOTE, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "is not this machine" in out.stderr and "run.storage_path='ray_results' is relative" in out.stderr
    assert "--allow-local-paths" in out.stderr and "cannot reach" not in out.stderr
    # Forced: it goes on to contact the cluster (which does not exist here: exit 1).
    out = _cli(str(CONFIG), "--address", REMOTE, "--allow-local-paths", cwd=tmp_path)
    assert out.returncode == 1 and "cannot reach the Ray job API" in out.stderr, out.stderr
    assert "warning (--allow-local-paths)" in out.stderr
    # Shared paths and a tracking server: no refusal.
    out = _cli(str(CONFIG), "--address", REMOTE, *[a for s in SHARED for a in ("--set", s)], cwd=tmp_path)
    assert out.returncode == 1 and "cannot reach the Ray job API" in out.stderr, out.stderr


# --------------------------------------------------------------------------- secrets
@pytest.mark.parametrize("address,extra", [(LOOPBACK, []), (REMOTE, SHARED[:3])])
def test_tracking_credentials_never_enter_the_job(address, extra):
    sub = prepare(str(CONFIG), extra, address, environ={"MLFLOW_TRACKING_URI": SECRET_URI})
    sent = json.dumps([sub.entrypoint, sub.runtime_env, sub.metadata])
    assert SECRET not in sent and "alice" not in sent
    # left for the node to expand from its own environment
    assert sub.runtime_env["env_vars"]["MLFLOW_TRACKING_URI"] == "${MLFLOW_TRACKING_URI}"
    assert any("carries credentials" in n for n in sub.notes)


def test_a_uri_without_credentials_is_passed_through():
    sub = prepare(str(CONFIG), SHARED[:3], REMOTE, environ={"MLFLOW_TRACKING_URI": "https://mlflow.example.com"})
    assert sub.runtime_env["env_vars"]["MLFLOW_TRACKING_URI"] == "https://mlflow.example.com"
    assert sub.local_only == []


def test_credentials_in_the_config_or_the_runtime_env_file_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="run.tracking_uri carries credentials"):
        prepare(str(CONFIG), [f"run.tracking_uri={SECRET_URI}"], LOOPBACK, environ={})
    env_file = tmp_path / "env.yaml"
    env_file.write_text(yaml.safe_dump({"working_dir": str(ROOT), "env_vars": {"MLFLOW_TRACKING_URI": SECRET_URI}}))
    with pytest.raises(ConfigError, match="env_vars.MLFLOW_TRACKING_URI holds a credential"):
        prepare(str(CONFIG), [], LOOPBACK, runtime_env_path=str(env_file), environ={})
    env_file.write_text(yaml.safe_dump({"env_vars": {"MLFLOW_TRACKING_TOKEN": "${MLFLOW_TRACKING_TOKEN}"}}))
    notes: list[str] = []
    env = load_runtime_env(env_file, {"MLFLOW_TRACKING_TOKEN": "abc"}, notes)
    assert env["env_vars"]["MLFLOW_TRACKING_TOKEN"] == "${MLFLOW_TRACKING_TOKEN}" and notes


@pytest.mark.parametrize("value,secret", [
    (SECRET_URI, True), ("https://token@host/x", True), ("postgresql://mlflow:pw@db:5432/m", True),
    ("https://host/x?access_token=abc", True), ("https://mlflow.example.com:5000", False),
    ("sqlite:////tmp/mlflow.db", False), ("/plain/path", False), ("http://h/x?experiment=3", False),
])
def test_has_credentials(value, secret):
    assert has_credentials(value) is secret


def test_cleartext_token_warning_only_for_http_to_another_machine():
    tok = {"Authorization": "Bearer abc"}
    assert "clear text" in cleartext_token_warning("http://10.0.0.5:8265", tok)
    assert cleartext_token_warning("10.0.0.5:8265", tok) is not None  # scheme-less is http
    assert cleartext_token_warning("https://ray.example.com", tok) is None
    assert cleartext_token_warning("http://127.0.0.1:8265", tok) is None
    assert cleartext_token_warning("http://10.0.0.5:8265", {}) is None


def test_cli_warns_before_sending_a_token_over_http(tmp_path):
    sets = [a for s in SHARED for a in ("--set", s)]
    out = _cli(str(CONFIG), "--address", REMOTE, *sets, cwd=tmp_path, env={"RAY_AUTH_TOKEN": "abc"})
    assert out.returncode == 1 and "warning: sending the Ray auth token in clear text" in out.stderr
    out = _cli(str(CONFIG), "--address", REMOTE, *sets, cwd=tmp_path)  # no token: nothing to leak
    assert out.returncode == 1 and "clear text" not in out.stderr


def test_data_error_inside_a_ray_job_says_where_relative_paths_resolve(tmp_path):
    """The job's `train` resolves relative data paths in its uploaded copy of the working
    dir; there the fix is an absolute path, not `elastic-ddp prepare` (the generic hint)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))}
    cmd = [sys.executable, "-m", "elastic_ddp", "train", str(CONFIG)]
    job = subprocess.run(cmd, cwd=tmp_path, env={**base, "RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"},
                         capture_output=True, text=True, timeout=300)
    assert job.returncode == 2
    assert "data error: data/digits/train: path does not exist" in job.stderr
    assert "this is a Ray job" in job.stderr and "--set data.train_path=/abs/" in job.stderr
    plain = subprocess.run(cmd, cwd=tmp_path, env=base, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 2 and "this is a Ray job" not in plain.stderr


def test_task_file_outside_the_checkout_is_refused_for_a_remote_cluster(tmp_path):
    """A task.path file that the uploaded working dir does not hold would be missing on
    a remote cluster: refused before anything is sent; inside the checkout, an absolute
    path is rewritten relative to the upload."""
    from elastic_ddp.driver.submit import prepare

    repo = Path(__file__).resolve().parents[3]
    outside = tmp_path / "my_task.py"
    outside.write_text("import elastic_ddp\n")
    cfg = str(repo / "experiments/examples/digits_png/config.yaml")
    with pytest.raises(ConfigError, match=r"task\.path=.*outside the uploaded working dir"):
        prepare(cfg, [f"task.path={outside}:T", "data.train_path=s3://b/t", "data.val_path=s3://b/v",
                      "run.storage_path=s3://b/r", "run.tracking_uri=http://mlflow:5000"],
                "http://10.0.0.5:8265", environ={})
    inside = repo / "experiments/examples/digits_png/task.py"
    sub = prepare(cfg, [f"task.path={inside}:DigitsPNG", "data.train_path=s3://b/t",
                        "data.val_path=s3://b/v", "run.storage_path=s3://b/r",
                        "run.tracking_uri=http://mlflow:5000"], "http://10.0.0.5:8265", environ={})
    assert "task.path=experiments/examples/digits_png/task.py:DigitsPNG" in sub.entrypoint
