"""The oldest Ray release the project supports, in a virtualenv of its own: the digits job
through the ``elastic-ddp`` command, and a rank SIGKILLed mid-step that resumes with every
sample used once per epoch, on that Ray's own controller code with elastic-ddp's overrides
(``elastic_ddp.compat.versions``): no warning line but the one its version plan gives for
the overrides not tested on that release (on 2.56 to 2.59: the two tested on 2.60 only,
which README.md's Ray range note names).

Slow tier (``-m slow``). The virtualenv (torch, the oldest Ray, the project's other
dependencies) is built once and reused while its recipe holds, under
``$ELASTIC_DDP_TEST_VENVS`` (default ``~/.cache/elastic-ddp/test-venvs``); this checkout
is reinstalled into it on every run. ``ELASTIC_DDP_TEST_RAY=<version>`` runs the same
checks on another Ray release (what adding a release to the tested list takes).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_ddp.compat.versions import TESTED_RAY, ray_plan, release_key
from elastic_ddp.data.scan import read_sample_ids
from elastic_ddp.ledger import audit, format_audit

# A first run builds the virtualenv (minutes: torch and Ray are large wheels).
# It starts a local Ray cluster of its own (the `ray` marker: the serial pass).
pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[3]
RAY = os.environ.get("ELASTIC_DDP_TEST_RAY") or min(TESTED_RAY, key=release_key)
VENVS = Path(os.environ.get("ELASTIC_DDP_TEST_VENVS") or Path.home() / ".cache/elastic-ddp/test-venvs")


def _pip(venv: Path, *args: str) -> None:
    p = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", *args],
                       env=_env(), capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]


def _copy_checkout(dest: Path) -> Path:
    """This checkout's package and its build files, copied: a build leaves build/ and
    *.egg-info beside its sources, which must not land in the checkout."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    shutil.copytree(REPO / "elastic_ddp", dest / "elastic_ddp", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _requirements() -> str:
    """pyproject.toml's runtime dependencies and its examples extra, as written there."""
    text = (REPO / "pyproject.toml").read_text()
    deps = text[text.index("\ndependencies = ["):]
    return deps[:deps.index("\n]") + 2] + next(line for line in text.splitlines() if line.startswith("examples ="))


def _venv() -> Path:
    """The virtualenv for ``RAY`` with this checkout installed into it afresh; built here
    (this torch first, then this checkout's dependencies with ``RAY`` pinned, and the
    examples extra for ``prepare digits``) unless one from the same recipe (Python, torch,
    Ray, :func:`_requirements`) exists."""
    import torch

    torch_spec = f"torch=={torch.__version__.split('+')[0]}"
    key = hashlib.sha256("\n".join([sys.version, torch_spec, RAY, _requirements()]).encode()).hexdigest()[:16]
    venv = VENVS / f"ray-{RAY}"
    stamp = venv / "elastic-ddp-recipe"
    src = _copy_checkout(VENVS / f"src-ray-{RAY}")
    if not (stamp.exists() and stamp.read_text() == key):
        # The stamp goes first and comes back last: a build or a removal cut short leaves
        # no virtualenv that looks finished.
        stamp.unlink(missing_ok=True)
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        _pip(venv, torch_spec)  # alone first, so that pip resolves no other torch build
        _pip(venv, f"{src}[examples]", f"ray[train,data]=={RAY}", "setuptools>=77", "wheel")
        stamp.write_text(key)
    _pip(venv, "--no-deps", "--no-build-isolation", "--force-reinstall", str(src))
    return venv


def _env() -> dict:
    """The test's environment without what would point the job elsewhere: this checkout
    on PYTHONPATH (the venv's own install must be what runs) or a running Ray."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    return {**env, "PYTHONUNBUFFERED": "1"}


def _run(args: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    p = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    print(p.stdout[-4000:], p.stderr[-4000:])
    return p


# Rank 1 SIGKILLs itself before step 12 (faults.Fault "step"); the job's ledger records
# every rank's sample ids per step for the audit.
RESUME = """
import json, sys
from elastic_ddp.config import Config
from elastic_ddp import train
from elastic_ddp.run_state import Diagnostics
cfg = Config.load(sys.argv[1], overrides=sys.argv[4:])
s = train(cfg, progress=False, diagnostics=Diagnostics(
    ledger_dir=sys.argv[2], fault={"rank": 1, "at_step": 12, "where": "step", "marker": sys.argv[3]}))
print(json.dumps({"steps": s.steps, "restarts": s.restarts, "run_id": s.run_id}))
"""


# A measure of this machine's load, not of the Ray release: a restart pays the data
# pipeline's start again, and on a loaded 2-core machine the median data wait can pass
# its threshold (tracking.data_wait).
DATA_WAIT = "elastic-ddp: warning: the training step waits for its data"


def _warnings(stderr: str) -> list[str]:
    """The lines of ``stderr`` that say "warning" (elastic-ddp's own start with
    ``elastic-ddp: warning:``), but the data-wait one."""
    return [line for line in stderr.splitlines() if "warning" in line and not line.startswith(DATA_WAIT)]


def _mlflow_status(tmp: Path, run_id: str) -> str:
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}").get_run(run_id).info.status


def test_the_oldest_supported_ray_runs_the_digits_job_and_resumes_a_killed_rank_exactly(tmp_path):
    venv = _venv()
    bin_ = venv / "bin"
    probe = _run([str(bin_ / "python"), "-c",
                  "import ray, elastic_ddp; print(ray.__version__, elastic_ddp.__file__)"], tmp_path)
    version, where = probe.stdout.split()
    assert version == RAY and where.startswith(str(venv)), probe.stdout

    data = tmp_path / "digits"
    assert _run([str(bin_ / "elastic-ddp"), "prepare", "digits", str(data)], tmp_path).returncode == 0
    preset = str(REPO / "experiments/configs/digits_cnn.yaml")
    sets = [f"data.train_path={data / 'train'}", f"data.val_path={data / 'val'}",
            f"run.storage_path={tmp_path / 'ray_results'}",
            f"run.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            "train.epochs=2", "train.checkpoint_every_steps=5"]

    # The digits job, through the command a user runs: on this Ray's own controller code
    # with every override tested on it applied, and the one line naming the others.
    plan = ray_plan(RAY)
    expected = [plan.warning] if plan.warning else []
    p = _run([str(bin_ / "elastic-ddp"), "train", preset, "--no-progress", "--json",
              *[a for s in sets for a in ("--set", s)]], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert _warnings(p.stderr) == expected, p.stderr
    summary = json.loads(p.stdout)  # --json: the document alone on stdout
    assert summary["steps"] == 46 and summary["restarts"] == 0, summary
    assert _mlflow_status(tmp_path, summary["run_id"]) == "FINISHED"

    # A rank SIGKILLed mid-step: the group restarts from the step-10 checkpoint and
    # every sample is used once per epoch, none lost, none repeated.
    ledger, marker = tmp_path / "ledger", tmp_path / "fired"
    p = _run([str(bin_ / "python"), "-c", RESUME, preset, str(ledger), str(marker),
              *sets, "run.name=digits-resume"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert _warnings(p.stderr) == expected, p.stderr
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert marker.exists() and s["steps"] == 46 and s["restarts"] == 1, s
    report = audit(ledger, read_sample_ids(data / "train"), 2)
    print(format_audit(report))
    assert report["ok"], format_audit(report)
    assert [a["resumed_from"] for a in report["attempts"]] == [0, 10]
    assert all(e["lost"] == 0 and e["repeated"] == 0 for e in report["epochs"].values())
    assert _mlflow_status(tmp_path, s["run_id"]) == "FINISHED"
