"""The files under cluster/ (and .rayignore) are correct without a cluster: every YAML
parses, every command they run is a real ``elastic-ddp`` subcommand on a config that
exists and validates, the runtime env is one Ray accepts, the upload keeps data and
checkpoints out, nothing looks like a committed secret, and local scripts bind to
127.0.0.1. Fast: no Ray cluster is started.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
import yaml

from elastic_ddp.driver.cli import _parser
from elastic_ddp.config import Config

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "cluster"


def _yaml_docs(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _load_local_cluster():
    spec = importlib.util.spec_from_file_location("local_cluster", CLUSTER / "local_cluster.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- YAML
YAMLS = sorted(CLUSTER.rglob("*.yaml"))


def test_cluster_dir_has_the_expected_files():
    names = {p.relative_to(CLUSTER).as_posix() for p in CLUSTER.rglob("*") if p.is_file()}
    for need in ("runtime_env.yaml", "local_cluster.py", "mlflow_server.sh", "README.md",
                 "kuberay/raycluster.yaml", "kuberay/rayjob.yaml", "launcher/aws-gpu.yaml"):
        assert need in names


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_yaml_parses_to_mappings(path):
    docs = _yaml_docs(path)
    assert docs, f"{path} is empty"
    assert all(isinstance(d, dict) for d in docs)


# --------------------------------------------------------------------------- commands
def _commands(text: str) -> list[list[str]]:
    """Every ``elastic-ddp ...`` / ``python -m elastic_ddp ...`` command in a text,
    as argv after the program name (line continuations joined, shell operators cut)."""
    text = text.replace("\\\n", " ")
    out = []
    for m in re.finditer(r"(?:elastic-ddp|python -m elastic_ddp\.cli)\s+(prepare|plan|train|submit)\b([^\n`;&|#]*)", text):
        argv = [m.group(1), *shlex.split(m.group(2))]
        if len(argv) > 1:  # a bare mention in prose ("as `elastic-ddp train`") is no command
            out.append(argv)
    return out


def _command_sources() -> dict[str, str]:
    src = {}
    job = _yaml_docs(CLUSTER / "kuberay" / "rayjob.yaml")[0]
    src["rayjob entrypoint"] = "elastic-ddp " + job["spec"]["entrypoint"].split("elastic-ddp ", 1)[1]
    launcher = _yaml_docs(CLUSTER / "launcher" / "aws-gpu.yaml")[0]
    src["launcher setup_commands"] = "\n".join(launcher["setup_commands"])
    src["launcher comments"] = (CLUSTER / "launcher" / "aws-gpu.yaml").read_text()
    src["README"] = (CLUSTER / "README.md").read_text()
    return src


def test_entrypoints_are_real_subcommands_on_valid_configs():
    """Each command parses with the real CLI parser; for train/plan/submit the config
    file exists in this repo and loads with its --set overrides (so every dotted key
    exists in Config and every value validates)."""
    parser = _parser()
    checked = 0
    for where, text in _command_sources().items():
        cmds = _commands(text)
        assert cmds, f"no elastic-ddp command found in {where}"
        for argv in cmds:
            args = parser.parse_args(argv)  # SystemExit on an unknown subcommand/flag
            if args.cmd in ("train", "plan", "submit"):
                # `submit ~/elastic-ddp/experiments/configs/x.yaml` from another directory
                # names a checkout elsewhere: check the preset of the same name here.
                rel = args.config
                if "experiments/configs/" in rel and not rel.startswith("experiments/"):
                    rel = "experiments/configs/" + rel.split("experiments/configs/", 1)[1]
                cfg_path = ROOT / rel
                assert cfg_path.is_file(), f"{where}: config {args.config} is not in this repo"
                Config.load(cfg_path, args.overrides)
                checked += 1
    assert checked >= 3


def test_rayjob_entrypoint_trains_on_shared_storage():
    job = _yaml_docs(CLUSTER / "kuberay" / "rayjob.yaml")[0]
    argv = _commands("elastic-ddp " + job["spec"]["entrypoint"].split("elastic-ddp ", 1)[1])[0]
    assert argv[0] == "train"
    args = _parser().parse_args(argv)
    cfg = Config.load(ROOT / args.config, args.overrides)
    cluster = _yaml_docs(CLUSTER / "kuberay" / "raycluster.yaml")[0]
    mounts = {m["mountPath"] for c in cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"]
              for m in c.get("volumeMounts", [])}
    # Checkpoints and data on a path every pod mounts (or an object-store URI).
    for p in (cfg.run.storage_path, cfg.data.train_path):
        assert "://" in p or any(p.startswith(m + "/") for m in mounts), p
    assert cfg.scaling.min_workers < cfg.scaling.max_workers  # elastic
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]


def test_commands_finder_rejects_unknown_keys():
    """The validation above can fail: a misspelt key is refused by Config.load."""
    (argv,) = _commands("elastic-ddp train experiments/configs/digits_cnn.yaml --set scaling.max_wrkers=4")
    args = _parser().parse_args(argv)
    from elastic_ddp.config import ConfigError

    with pytest.raises(ConfigError, match="max_wrkers"):
        Config.load(ROOT / args.config, args.overrides)


# --------------------------------------------------------------------------- runtime env
def test_runtime_env_is_valid_for_ray_and_carries_no_literal_uri():
    from ray.runtime_env import RuntimeEnv

    from elastic_ddp.driver.submit import load_runtime_env

    raw = yaml.safe_load((CLUSTER / "runtime_env.yaml").read_text())
    assert raw["working_dir"] == "."
    assert raw["env_vars"]["MLFLOW_TRACKING_URI"] == "${MLFLOW_TRACKING_URI}"
    assert all(isinstance(v, str) for v in raw["env_vars"].values())
    RuntimeEnv(**raw)  # Ray's own validation of field names and types

    filled = load_runtime_env(CLUSTER / "runtime_env.yaml",
                              {"MLFLOW_TRACKING_URI": "http://mlflow.internal:5000"})
    assert filled["env_vars"]["MLFLOW_TRACKING_URI"] == "http://mlflow.internal:5000"
    # Unset in the submitter's env: left for the cluster node to expand.
    left = load_runtime_env(CLUSTER / "runtime_env.yaml", {})
    assert left["env_vars"]["MLFLOW_TRACKING_URI"] == "${MLFLOW_TRACKING_URI}"


def test_rayignore_keeps_data_and_stores_out_but_keeps_the_package(tmp_path):
    """Ray's own packaging, with only .rayignore (no .gitignore), over a tree holding
    every kind of output: none of them is uploaded; the package (including its
    ``elastic_ddp/data`` subpackage, which a bare ``data/`` pattern would drop) is."""
    from ray._private.runtime_env.packaging import _zip_files

    tree = tmp_path / "repo"
    files = {
        "data/digits/train/part-0.parquet": False, "ray_results/run/checkpoint_1/state.pt": False,
        "checkpoints/a/state.pt": False, "mlruns/0/meta.yaml": False, "mlflow.db": False,
        ".venv/bin/python": False, "outputs/x.txt": False,
        "elastic_ddp/data/scan.py": True, "elastic_ddp/driver/cli.py": True,
        "experiments/configs/digits_cnn.yaml": True,
    }
    for rel in files:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text("x")
    shutil.copy(ROOT / ".rayignore", tree / ".rayignore")
    out = tmp_path / "pkg.zip"
    _zip_files(str(tree), [], str(out), include_gitignore=False)
    names = set(zipfile.ZipFile(out).namelist())
    for rel, uploaded in files.items():
        assert (rel in names) == uploaded, f"{rel}: uploaded={rel in names}, expected {uploaded}"


def test_repo_upload_is_small_and_complete():
    """What `elastic-ddp submit` uploads from this checkout: the package and configs, a
    few hundred kB, whatever data, stores or venv lie in the working tree."""
    from ray._private.runtime_env.packaging import _zip_files

    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"edc-upload-{os.getpid()}.zip"
    try:
        _zip_files(str(ROOT), [], str(out), include_gitignore=True)
        names = zipfile.ZipFile(out).namelist()
        size = out.stat().st_size
    finally:
        out.unlink(missing_ok=True)
    assert "elastic_ddp/driver/cli.py" in names and "elastic_ddp/data/scan.py" in names
    assert "experiments/configs/digits_cnn.yaml" in names and "cluster/runtime_env.yaml" in names
    assert not [n for n in names if n.split("/")[0] in ("data", ".venv", "mlruns", "ray_results", ".git")]
    assert "mlflow.db" not in names
    assert size < 5 * 1024 * 1024, f"upload is {size} bytes"


# --------------------------------------------------------------------------- secrets
SECRET_PATTERNS = [
    ("AWS access key id", re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b")),
    ("AWS secret key", re.compile(r"aws_secret_access_key\s*[:=]\s*['\"]?[A-Za-z0-9/+]{20,}", re.I)),
    ("private key", re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")),
    ("password literal", re.compile(r"password\s*[:=]\s*['\"]?(?!\$|\{|<|['\"]?\s*$)[^\s'\"]{3,}", re.I)),
    ("token literal", re.compile(r"(token|secret|api[_-]?key)['\"]?\s*[:=]\s*['\"]?[A-Za-z0-9_\-]{24,}", re.I)),
    ("GitHub/Slack token", re.compile(r"\b(ghp_[A-Za-z0-9]{30,}|xox[bp]-[A-Za-z0-9-]{10,})")),
    ("credentials in URL", re.compile(r"://[^/\s:@]+:[^/\s@$]+@")),
]


def _secrets_in(text: str) -> list[str]:
    return [name for name, rx in SECRET_PATTERNS if rx.search(text)]


@pytest.mark.parametrize("bad", [
    "aws_access_key_id: AKIAABCDEFGHIJKLMNOP",
    "password: hunter2hunter2",
    'RAY_AUTH_TOKEN="f3b2c1d0e9f8a7b6c5d4e3f2a1b0c9d8"',
    "MLFLOW_TRACKING_URI=postgresql://mlflow:s3cret@db:5432/mlflow",
    "-----BEGIN RSA PRIVATE KEY-----",
])
def test_secret_scanner_catches_planted_secrets(bad):
    assert _secrets_in(bad), bad


def test_no_file_under_cluster_looks_like_a_secret():
    files = [p for p in CLUSTER.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    files.append(ROOT / ".rayignore")
    hits = {p.relative_to(ROOT).as_posix(): _secrets_in(p.read_text()) for p in files}
    assert not {k: v for k, v in hits.items() if v}


def test_kuberay_takes_secrets_from_kubernetes_secrets():
    cluster = _yaml_docs(CLUSTER / "kuberay" / "raycluster.yaml")[0]
    assert cluster["spec"]["authOptions"]["mode"] == "token"
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    for g in groups:
        for c in g["template"]["spec"]["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            assert "value" not in env["MLFLOW_TRACKING_URI"]
            assert env["MLFLOW_TRACKING_URI"]["valueFrom"]["secretKeyRef"]["name"]
    gpu = cluster["spec"]["workerGroupSpecs"][0]
    assert gpu["minReplicas"] <= gpu["replicas"] <= gpu["maxReplicas"] and gpu["minReplicas"] < gpu["maxReplicas"]
    c = gpu["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    env = {e["name"] for e in c["env"]}
    assert {"NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING"} <= env


def test_launcher_config_is_elastic_and_keeps_the_cuda_torch():
    cfg = _yaml_docs(CLUSTER / "launcher" / "aws-gpu.yaml")[0]
    gpu = cfg["available_node_types"]["gpu_worker"]
    assert gpu["min_workers"] < gpu["max_workers"] <= cfg["max_workers"]
    assert cfg["available_node_types"]["head"]["resources"]["CPU"] == 0
    setup = "\n".join(cfg["setup_commands"])
    # Installing torch from PyPI here could replace the AMI's CUDA build.
    assert not re.search(r"pip install[^\n]*\btorch\b", setup)
    head = " ".join(cfg["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "RAY_AUTH_MODE=token" in head
    assert "RAY_AUTH_MODE=token" in " ".join(cfg["worker_start_ray_commands"])


# --------------------------------------------------------------------------- local scripts
def test_local_cluster_binds_to_loopback_with_token_auth(tmp_path):
    lc = _load_local_cluster()
    assert lc.HOST == "127.0.0.1"
    c = lc.LocalCluster(Path("/tmp") / f"edc-t{os.getpid()}")
    cmd = c.node_command("head", c.head_args(6390, 8266, 0, 128))
    joined = " ".join(cmd)
    assert "--node-ip-address 127.0.0.1" in joined
    assert "--dashboard-host 127.0.0.1" in joined
    assert "--block" in cmd  # stoppable by process group, never by `ray stop`
    assert c.env()["RAY_AUTH_MODE"] == "token"
    assert c.env()["RAY_AUTH_TOKEN_PATH"].endswith("auth_token")
    # No command line of the script runs `ray stop` (it would kill other users' Ray).
    src = (CLUSTER / "local_cluster.py").read_text()
    assert not re.search(r'(_ray_exe\(\)|"ray")\s*,\s*"stop"', src)
    assert "os.killpg" in src


def test_node_commands_take_no_fixed_port_and_keep_the_node_on_loopback():
    """Ray's fixed defaults (GCS 6379, client 10001, dashboard agent 52365, metrics
    44217/44227) collide when two clusters share the machine: every port is passed free
    or 0, and every node runs `ray start` through the loopback wrapper."""
    lc = _load_local_cluster()
    c = lc.LocalCluster(Path("/tmp") / f"edc-t{os.getpid()}")
    head = c.node_command("head", c.head_args(lc.free_port(), lc.free_port(), 0, 128))
    worker = c.node_command("worker1", ["--address", "127.0.0.1:1234"])
    for cmd in (head, worker):
        assert cmd[1:3] == [str(CLUSTER / "local_cluster.py"), "_ray_start"]
        args = dict(zip(cmd[3::1], cmd[4::1]))
        assert args["--node-ip-address"] == "127.0.0.1"
        for flag in ("--node-manager-port", "--object-manager-port", "--metrics-export-port",
                     "--dashboard-agent-grpc-port", "--runtime-env-agent-port"):
            assert args[flag] == "0", flag
        assert int(args["--dashboard-agent-listen-port"]) not in (0, 52365)
    args = dict(zip(head[3:], head[4:]))
    assert int(args["--ray-client-server-port"]) != 10001 and int(args["--port"]) != 6379
    env = c.node_env(head=True)
    assert {int(env["AUTOSCALER_METRIC_PORT"]), int(env["DASHBOARD_METRIC_PORT"])}.isdisjoint({44217, 44227})
    assert c.node_env(head=False) == {}


def _other_users_dir(tmp_path: Path) -> Path:
    """A directory owned by someone else: as root, one handed to uid 65534 (nobody);
    otherwise /, which root owns."""
    if os.getuid() != 0:
        return Path("/")
    d = tmp_path / "theirs"
    d.mkdir(mode=0o777)
    os.chown(d, 65534, 65534)
    return d


def test_cluster_dir_is_private_and_refused_when_foreign_or_a_symlink(tmp_path):
    from elastic_ddp.driver.local_ray import PrivateDirError, check_private_dir

    mine = tmp_path / "mine"
    check_private_dir(mine, create=True)
    assert oct(mine.stat().st_mode & 0o777) == "0o700" and mine.stat().st_uid == os.getuid()
    mine.chmod(0o755)  # ours but open: narrowed
    check_private_dir(mine)
    assert oct(mine.stat().st_mode & 0o777) == "0o700"
    link = tmp_path / "link"
    link.symlink_to(mine)
    with pytest.raises(PrivateDirError, match="is a symlink"):
        check_private_dir(link, create=True)
    with pytest.raises(PrivateDirError, match="belongs to uid .*, not to you"):
        check_private_dir(_other_users_dir(tmp_path), create=True)


def test_local_cluster_cli_refuses_a_foreign_cluster_dir_with_exit_2():
    # Short paths: the cluster dir must fit Ray's socket-path limit to get this far.
    tmp_path = Path(tempfile.mkdtemp(prefix="edc-", dir="/tmp"))
    theirs = _other_users_dir(tmp_path)
    for cmd in (["status"], ["start", "1", "1"]):
        out = subprocess.run([sys.executable, str(CLUSTER / "local_cluster.py"), "--dir", str(theirs), *cmd],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        assert f"cluster dir {theirs} belongs to uid" in out.stderr and "--dir" in out.stderr
    link = tmp_path / "l"
    link.symlink_to(tmp_path)
    out = subprocess.run([sys.executable, str(CLUSTER / "local_cluster.py"), "--dir", str(link), "status"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "is a symlink" in out.stderr
    shutil.rmtree(tmp_path)


def test_token_file_is_created_exclusively_and_never_through_a_symlink(tmp_path):
    from elastic_ddp.driver.local_ray import write_token

    victim = tmp_path / "victim"
    victim.write_text("keep")
    token = tmp_path / "auth_token"
    token.symlink_to(victim)  # planted: writing through it would overwrite the victim
    write_token(token)
    assert victim.read_text() == "keep"
    assert not token.is_symlink() and oct(token.stat().st_mode & 0o777) == "0o600"
    assert len(token.read_text()) == 64
    # An earlier cluster's token, readable by others: replaced by a new file (a new inode,
    # 0600 from its creation), never rewritten in place with its old mode.
    token.unlink()
    token.write_text("old")
    token.chmod(0o644)
    old_inode = token.stat().st_ino
    write_token(token)
    assert token.read_text() != "old" and oct(token.stat().st_mode & 0o777) == "0o600"
    assert token.stat().st_ino != old_inode or token.stat().st_mode & 0o077 == 0


def test_mlflow_server_script_binds_to_loopback_by_default(tmp_path):
    """Run the script with MLFLOW=echo: it prints the server command it would exec."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["MLFLOW"] = "echo"
    out = subprocess.run(["bash", str(CLUSTER / "mlflow_server.sh")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[out.index("--host") + 1] == "127.0.0.1"
    assert out[out.index("--backend-store-uri") + 1] == f"sqlite:///{tmp_path}/mlflow-server.db"
    env.update(MLFLOW_BACKEND_STORE_URI="postgresql://mlflow@db/mlflow",
               MLFLOW_ARTIFACTS_DESTINATION="s3://bucket/mlflow")
    out = subprocess.run(["bash", str(CLUSTER / "mlflow_server.sh")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[out.index("--backend-store-uri") + 1] == "postgresql://mlflow@db/mlflow"
    assert out[out.index("--artifacts-destination") + 1] == "s3://bucket/mlflow"


# --------------------------------------------------------------------------- launcher checks
def _launcher_python_checks() -> list[str]:
    """The launcher's setup commands that run ``python -c`` on torch, as written."""
    cfg = _yaml_docs(CLUSTER / "launcher" / "aws-gpu.yaml")[0]
    return [c for c in cfg["setup_commands"] if re.match(r"python -c ", c) and "torch" in c]


def _run_setup_command(cmd: str, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    """Run one setup command the way the launcher does (bash on the node), with this
    venv's python first on PATH as the node's python."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=120)


def test_launcher_torch_checks_pass_with_the_installed_torch():
    """Every torch check of the setup commands passes with torch 2.13 (installed here)."""
    import torch

    assert tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 10)
    checks = _launcher_python_checks()
    assert any("assert" in c for c in checks)
    for cmd in checks:
        out = _run_setup_command(cmd)
        assert out.returncode == 0, f"{cmd}\n{out.stderr}"


@pytest.mark.parametrize("version,ok", [("2.3.1", False), ("1.13.1+cu117", False), ("2.4.0", True),
                                        ("2.10.0+cu128", True), ("3.0.0a0+git1234", True)])
def test_launcher_torch_version_check_against_a_fake_torch(tmp_path, version, ok):
    """The same command lines against a stand-in ``torch`` package whose ``__version__``
    is a plain ``str``: below 2.4 the check fails, naming the version; 2.4 and above it
    passes. (Real torch has made ``__version__`` a ``TorchVersion`` with numeric
    comparisons since 1.10, which is why ``torch.__version__ >= '2.4'`` passes on torch
    2.13; as a string comparison it fails for 2.10 and later, as this stand-in shows.
    The check compares integers itself.)"""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        f"import types\n__version__ = {version!r}\nversion = types.SimpleNamespace(cuda='12.8')\n")
    (version_checks,) = [c for c in _launcher_python_checks() if "assert" in c]
    out = _run_setup_command(version_checks, pythonpath=str(tmp_path))
    assert (out.returncode == 0) == ok, out.stderr
    if not ok:
        assert f"need torch>=2.4, have {version}" in out.stderr
