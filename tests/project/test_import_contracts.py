"""The import rules in pyproject.toml (``[tool.importlinter]``), checked by import-linter:
the package keeps them, and each contract fails when its rule is broken in a copy of it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command as c; "
        "sys.exit(c(['--no-cache']))"]


def lint(cwd: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(cwd)}
    return subprocess.run(LINT, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_package_keeps_every_import_contract():
    out = lint(ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("contracts")
    shutil.copytree(ROOT / "elastic_ddp", d / "elastic_ddp",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "tests" / "contracts", d / "tests" / "contracts")
    shutil.copy(ROOT / "pyproject.toml", d / "pyproject.toml")
    return d


@pytest.mark.parametrize("module, line, contract", [
    ("data/order.py", "from elastic_ddp.worker import trainer", "no import upward"),
    ("controller/events.py", "import torch", "imports neither torch nor MLflow"),
    ("tracking/store.py", "from elastic_ddp.tracking import runs", "No import circle"),
    ("data/scan.py", "from ray._private import services", "Private dependency APIs"),
    # A private name reached through a module imported by name, not by its dotted path.
    ("parallel/strategies.py", "from torch.distributed.algorithms.ddp_comm_hooks import default_hooks; "
     "default_hooks._x", "Private dependency APIs"),
    ("worker/trainer.py", "import mlflow", "MLflow is used by the tracking layer"),
    ("driver/launcher.py", "import mlflow", "MLflow is used by the tracking layer"),
])
def test_a_broken_rule_breaks_its_contract(copy, module, line, contract):
    path = copy / "elastic_ddp" / module
    original = path.read_text()
    path.write_text(original + f"\n{line}  # a broken rule\n")
    try:
        out = lint(copy)
    finally:
        path.write_text(original)
    assert out.returncode != 0, out.stdout[-3000:]
    broken = [ln for ln in out.stdout.splitlines() if ln.endswith("BROKEN")]
    # An upward import is a circle too: the rule's own contract must be among the broken.
    assert any(contract in b for b in broken), out.stdout[-3000:]


def test_the_mlflow_contract_lists_every_module_but_tracking_and_compat():
    import ast
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    listed = next(c for c in contracts if c["name"].startswith("MLflow is used"))["source_modules"]
    pkg = ROOT / "elastic_ddp"
    top = {p.stem if p.suffix == ".py" else p.name for p in pkg.iterdir()
           if (p.suffix == ".py" or (p / "__init__.py").exists()) and p.name != "__init__.py"}
    assert sorted(listed) == sorted(f"elastic_ddp.{m}" for m in top - {"tracking", "compat"})
    # The root package itself (a forbidden contract's source module is a package: listed
    # as "elastic_ddp" it would take tracking/ in).
    tree = ast.parse((pkg / "__init__.py").read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "mlflow" not in roots


def test_the_private_api_rule_sees_names_reached_through_an_imported_module(tmp_path):
    from contracts.private_api import private_uses

    src = tmp_path / "m.py"
    src.write_text("from torch.distributed.algorithms.ddp_comm_hooks import default_hooks\n"
                   "from ray.util import state as st\n"
                   "import ray\n"
                   "def f(manager):\n"
                   "    default_hooks._compress_hook(1, None, None)\n"
                   "    st._private_helper\n"
                   "    default_hooks.fp16_compress_hook\n"
                   "    ray.__version__\n"
                   "    return manager._quorum_id\n")
    assert private_uses(src, "elastic_ddp") == [
        (5, "torch.distributed.algorithms.ddp_comm_hooks.default_hooks._compress_hook"),
        (6, "ray.util.state._private_helper")]
