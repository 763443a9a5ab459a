"""A damaged checkpoint met as a user meets it, through the CLI on a real local Ray
cluster: a zeroed file (same size) and a truncated file in the two newest checkpoints ->
the rerun says so on the console as it finds them (once each), resumes from the one
before, and its summary names each bad file and checkpoint; the damaged ones are kept,
marked rejected. With no checkpoint left that verifies, the rerun exits 2 before Ray
starts, naming them and the fix, and leaves the MLflow run as it was.

The three CLI jobs are separate driver processes that join one local Ray cluster (the
module's head, ``RAY_ADDRESS``), as jobs on a running cluster do; a CLI job that starts
its own local Ray is tested by test_console, test_lease_jobs and test_failure_causes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import digits_config, mlflow_runs
from helpers import add_node

pytestmark = pytest.mark.ray

RUN = "verify-cli"


@pytest.fixture(scope="module")
def cluster():
    """One local Ray head (4 logical CPUs: 2 workers plus Ray Data's read tasks) that
    every CLI job of the module joins: a Ray start per job (and its shutdown) is paid
    once. This process does not connect; the head's own processes are stopped at the
    end (``Cluster.shutdown``: the processes it started, by their handles)."""
    from ray.cluster_utils import Cluster

    c = Cluster()
    try:
        add_node(c, num_cpus=4, include_dashboard=False)
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()


def _cli(cfg: dict, tmp_path: Path, address: str, *extra: str) -> subprocess.CompletedProcess:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "RAY_ADDRESS": address}
    return subprocess.run([sys.executable, "-m", "elastic_ddp", "train", str(path),
                           "--no-progress", *extra], capture_output=True, text=True,
                          timeout=900, env=env)


def _ckpts(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "ray_results" / RUN).glob("checkpoint_step*"))


def _interrupted(tmp_path: Path) -> None:
    """Mark the job's MLflow run KILLED, as a Ctrl-C after its last checkpoint leaves it:
    running the same config again then resumes it (a FINISHED run starts a new one)."""
    from mlflow.tracking import MlflowClient

    (run,) = mlflow_runs(tmp_path)
    MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").set_terminated(run.info.run_id, "KILLED")


@pytest.mark.timeout(1200)  # three CLI jobs
def test_damaged_checkpoints_are_named_and_the_previous_one_resumed(cluster, digits_data, tmp_path,
                                                                    mlflow_store):
    from mlflow.tracking import MlflowClient

    # 23 steps an epoch: checkpoints at 5, 10, 15, 20 and the epoch's end, 23.
    extra = {"run": {"name": RUN}, "scaling": {"max_failures": 0},
             "train": {"epochs": 1, "checkpoint_every_steps": 5, "log_every_steps": 1,
                       "keep_checkpoints": 4}}
    first = _cli(digits_config(digits_data, tmp_path, extra), tmp_path, cluster.address)
    assert first.returncode == 0, first.stderr[-3000:]
    ckpts = _ckpts(tmp_path)
    assert [c.name[-2:] for c in ckpts] == ["10", "15", "20", "23"], ckpts
    zeroed = ckpts[-1] / "__1_0.distcp"
    zeroed.write_bytes(b"\0" * zeroed.stat().st_size)
    cut = ckpts[-2] / "__0_0.distcp"
    with open(cut, "r+b") as f:
        f.truncate(cut.stat().st_size // 2)

    # The same config again (the run KILLED): it resumes and trains the epoch's rest.
    _interrupted(tmp_path)
    second = _cli(digits_config(digits_data, tmp_path, extra), tmp_path, cluster.address)
    assert second.returncode == 0, second.stderr[-3000:]
    out = second.stdout
    assert f"checkpoint rejected: {ckpts[-1]}: __1_0.distcp (xxh3_64" in out, out[-3000:]
    assert f"checkpoint rejected: {ckpts[-2]}: __0_0.distcp (" in out, out[-3000:]
    # Said as it was found (the driver's check, before Ray), once each; kept, marked.
    for c, f in ((ckpts[-1], "__1_0.distcp (xxh3_64"), (ckpts[-2], "__0_0.distcp (")):
        warning = f"elastic-ddp: warning: checkpoint {c} fails its checksums: {f}"
        assert second.stderr.count(warning) == 1, second.stderr[-3000:]
        assert (c / "rejected.json").is_file()
    # Resumed from step 15: steps 16..23 were trained (and logged) twice, 1..15 once.
    (run,) = mlflow_runs(tmp_path)
    hist = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(
        run.info.run_id, "train/loss")
    twice = sorted({m.step for m in hist if sum(h.step == m.step for h in hist) == 2})
    assert twice == list(range(16, 24)) and max(m.step for m in hist) == 23, twice
    assert run.info.status == "FINISHED"

    # No checkpoint that verifies: refused, exit 2, each bad file named.
    _interrupted(tmp_path)
    for c in _ckpts(tmp_path):
        (c / "__0_0.distcp").write_bytes(b"\0" * (c / "__0_0.distcp").stat().st_size)
    third = _cli(digits_config(digits_data, tmp_path, extra), tmp_path, cluster.address)
    assert third.returncode == 2, (third.returncode, third.stderr[-3000:])
    (line,) = [ln for ln in third.stderr.splitlines() if "resume refused" in ln]
    assert line.startswith(f"elastic-ddp: resume refused: no checkpoint of run '{RUN}' verifies: ")
    assert "__0_0.distcp (xxh3_64" in line, line
    assert line.endswith("Restore the files from a copy, or start a new run (another run.name)"), line
    assert "MLflow run" not in third.stdout  # refused before the run was reopened
    (run,) = mlflow_runs(tmp_path)
    assert run.info.status == "KILLED" and "elastic_ddp.error" not in run.data.tags, run.data.tags
