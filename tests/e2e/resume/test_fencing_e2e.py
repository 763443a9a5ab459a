"""A paused job taken over writes nothing more to its run (``elastic_ddp.fencing``), as a
user meets it: ``elastic-ddp train`` stopped with SIGSTOP (Ctrl-Z, a laptop's suspend, a
frozen VM) while its workers train on; the same command started again takes the run over
once the lease is stale; the first job, continued with SIGCONT, stops without writing to
the run and exits 4 with one line naming the job that took it over, while the second
finishes the run. Real processes, a real local Ray per job, real checkpoints and a real
MLflow store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from conftest import digits_config, mlflow_runs

REPO = Path(__file__).resolve().parents[3]
STALE_S = 6


def _runner(tmp: Path, cfg: Path) -> Path:
    """``elastic-ddp train CFG --no-progress`` through the CLI's own ``main``, with the
    sample ledger of every rank (``Diagnostics.ledger_dir``, shared by both jobs: one run)
    and steps of at least 0.25 s (``Fault``'s ``step_s``), so that the first job's
    workers are still training when the second one takes the run over."""
    script = tmp / "run_job.py"
    script.write_text(textwrap.dedent(f"""
        import functools, sys
        from elastic_ddp.driver import launcher
        from elastic_ddp.run_state import Diagnostics

        launcher.train = functools.partial(launcher.train, diagnostics=Diagnostics(
            ledger_dir={str(tmp / 'ledger')!r},
            fault={{"rank": 0, "where": "none", "at_step": 0, "step_s": 0.25,
                    "marker": {str(tmp / 'unused')!r}}}))
        from elastic_ddp.driver.cli import main
        sys.exit(main(["train", {str(cfg)!r}, "--no-progress"]))
    """))
    return script


def _start(script: Path, cwd: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), ELASTIC_DDP_LEASE_STALE_S=str(STALE_S))
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)


def _wait_for(what, timeout_s: float, why: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {why}")


@pytest.mark.ray
@pytest.mark.slow  # two jobs, each with its own local Ray: about 2-4 minutes
def test_a_paused_job_taken_over_writes_nothing_more_and_exits_naming_the_new_job(tmp_path, digits_data):
    from mlflow.tracking import MlflowClient

    from elastic_ddp.ledger import audit, format_audit
    from elastic_ddp.data.scan import read_sample_ids
    from elastic_ddp.tracking.store import metric_key

    name = "paused"
    raw = digits_config(digits_data, tmp_path, {
        "scaling": {"min_workers": 1, "max_workers": 1},
        "train": {"epochs": 5, "checkpoint_every_steps": 4, "log_every_steps": 4,
                  "keep_checkpoints": 2, "async_checkpoint": False},
        "run": {"name": name}})
    raw["data"]["val_path"] = None
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    script = _runner(tmp_path, cfg)
    root = tmp_path / "ray_results" / name
    a = _start(script, tmp_path)
    b = None
    try:
        _wait_for(lambda: list(root.glob("checkpoint_*/manifest.json")), 300,
                  "job A's first checkpoint")
        a.send_signal(signal.SIGSTOP)  # the driver only: its workers train on
        time.sleep(STALE_S + 1)  # A's lease goes stale
        b = _start(script, tmp_path)
        # B takes the run over, then resumes it; A's workers meet the fence at their next
        # checkpoint, A's tracker at its next write.
        lines: list[str] = []

        def resumed():
            line = b.stdout.readline()
            lines.append(line)
            assert line or b.poll() is None, ("".join(lines), b.stderr.read()[-3000:])
            return "(resumed)" in line

        _wait_for(resumed, 300, "job B to resume the run")
        out_b = "".join(lines)
        assert (f"took over the lease of the job on host {os.uname().nodename}, pid {a.pid}"
                in out_b), out_b
        assert "whose lease is stale" in out_b and "which is gone" not in out_b, out_b
        time.sleep(5)
        a.send_signal(signal.SIGCONT)
        out_a, err_a = a.communicate(timeout=180)
        rest, err_b = b.communicate(timeout=400)
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.communicate()
    print("job A:", out_a[-2000:], err_a[-3000:], sep="\n")
    assert b.returncode == 0, err_b[-3000:]
    # A: exit 4, one line naming B.
    assert a.returncode == 4, (a.returncode, err_a[-3000:])
    last = err_a.strip().splitlines()[-1]
    assert last.startswith(f"elastic-ddp: run {name!r} was taken over by another job (host "
                           f"{os.uname().nodename}, pid {b.pid}, at "), last
    assert "this job stopped without writing to the run" in last, last
    assert "Traceback" not in err_a, err_a[-3000:]
    # One MLflow run, FINISHED by B, with one set of steps: none of A's after B's resume.
    runs = mlflow_runs(tmp_path)
    assert [r.info.status for r in runs] == ["FINISHED"], [(r.info.status, r.data.tags) for r in runs]
    assert "elastic_ddp.error" not in runs[0].data.tags, runs[0].data.tags
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, metric_key("train_loss"))]
    assert len(steps) == len(set(steps)), sorted(steps)
    # One checkpoint per step (a fenced commit would have made a second, ..._r1), each complete.
    dirs = sorted(p.name for p in root.glob("checkpoint_step*"))
    assert dirs and not [d for d in dirs if "_r" in d], dirs
    assert all((root / d / "manifest.json").exists() for d in dirs), dirs
    # The ledger of the run: every sample once per epoch in committed steps.
    report = audit(tmp_path / "ledger", read_sample_ids(digits_data / "train"), 5)
    assert report["ok"], format_audit(report)
    assert not (tmp_path / "ray_results" / ".leases" / f"{name}.json").exists()
