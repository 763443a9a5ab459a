"""Command to first step, phase by phase: ``elastic-ddp train`` (restart mode) against plain
``torchrun`` on the same job, both started as fresh commands, on a local multi-node Ray
cluster that is already up (``ray start`` on a real cluster; here ``ray.cluster_utils``).

    .venv/bin/elastic-ddp prepare pycode data/pycode_bench --num-files 4 --max-bytes 3000000
    .venv/bin/python experiments/bench_startup.py --repeat 3

The job: ``experiments/configs/bench_gpt.yaml`` (2-layer GPT, 2 workers of one thread, the
same Ray cluster shape as ``bench_recovery.py``), 3 steps. Each round runs torchrun
(``experiments/torchrun_baseline.py``) and then ``elastic-ddp train --json`` with
``RAY_ADDRESS`` set; the elastic job's phases are its own ``startup.json`` (imports, scan,
driver set-up, Ray Train controller, worker group, model, first step; see
``elastic_ddp.driver.report.STARTUP_PHASES``; its ``total_s`` here also counts the few
milliseconds from the launch to its process's start, as torchrun's does). All rounds share one MLflow store, so the first
round also creates it. Printed: per round, both commands' seconds to the end of the
first step and their ratio; the elastic job's phases, median over the rounds.

``--checkout DIR``: run the elastic job from another checkout of this repository (e.g. a
``git worktree`` of an earlier commit) to measure what a change saved, same machine,
same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "experiments/configs/bench_gpt.yaml"
STEPS = 3


def torchrun_first_step(tmp: Path) -> float:
    """Seconds from launching ``torchrun`` to the end of its first step (rank 0)."""
    log = tmp / "steps.jsonl"
    log.unlink(missing_ok=True)  # the baseline appends to its step log
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node=2",
           str(ROOT / "experiments/torchrun_baseline.py"), CONFIG, "--set", f"train.max_steps={STEPS}",
           "--warmup-steps", "1", "--step-log", str(log)]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"torchrun failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    steps = [json.loads(ln) for ln in log.read_text().splitlines() if '"step"' in ln]
    return steps[0]["t"] - t0


def elastic_startup(tmp: Path, address: str, name: str, checkout: Path) -> dict:
    """``elastic-ddp train --json`` on the cluster at ``address``; its ``startup`` dict
    (seconds per phase, ``total_s`` from the process's start to the end of step 1)."""
    env = dict(os.environ, RAY_ADDRESS=address, PYTHONPATH=str(checkout))
    # An older checkout has the CLI at elastic_ddp/cli.py (no ``python -m elastic_ddp``).
    module = "elastic_ddp.cli" if (checkout / "elastic_ddp" / "cli.py").exists() else "elastic_ddp"
    cmd = [sys.executable, "-m", module, "train", str(checkout / CONFIG), "--json", "--no-progress",
           "--set", f"train.max_steps={STEPS}", "--set", "scaling.min_workers=1",
           "--set", "scaling.max_workers=2", "--set", "scaling.cpus_per_worker=2",
           "--set", "scaling.torch_threads=1", "--set", f"run.name={name}",
           "--set", f"run.storage_path={tmp / 'ray'}", "--set", f"run.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
           "--set", f"data.train_path={ROOT / 'data/pycode_bench/train'}",
           "--set", f"data.val_path={ROOT / 'data/pycode_bench/val'}"]
    from elastic_ddp.driver.preflight import process_start_time

    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # The job counts from its process's start (/proc); torchrun's figure counts from
    # before its launch: the few milliseconds between are added here.
    spawn_s = (process_start_time(p.pid) or t0) - t0
    stdout, stderr = p.communicate(timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"elastic-ddp train failed:\n{stdout[-2000:]}{stderr[-2000:]}")
    out = "\n" + stdout
    startup = json.loads(out[out.rindex("\n{"):])["startup"]  # the summary is printed last
    startup["total_s"] = round(startup["total_s"] + max(0.0, spawn_s), 3)
    preflight = next(f for f in (checkout / "elastic_ddp/driver/preflight.py",
                                 checkout / "elastic_ddp/preflight.py") if f.exists())
    if "CLOCK_BOOTTIME" not in preflight.read_text():
        # A checkout from before c62cc38 took its start from /proc/stat's whole-second
        # btime: it started the clock early by the boot time's fraction of a second.
        for k in ("imports_s", "total_s"):
            startup[k] = round(startup[k] - _btime_error_s(), 3)
    return startup


def _btime_error_s() -> float:
    """How much earlier than the true boot time /proc/stat's ``btime`` (whole seconds) is."""
    btime = next(int(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines()
                 if ln.startswith("btime"))
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) - btime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--checkout", type=Path, default=ROOT,
                    help="the checkout whose elastic_ddp runs the elastic job (default: this one)")
    args = ap.parse_args()
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster()
    c.add_node(num_cpus=1, include_dashboard=False)
    for _ in range(2):
        c.add_node(num_cpus=2)
    c.wait_for_nodes()
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
            for i in range(args.repeat):
                t = torchrun_first_step(Path(tmp))
                e = elastic_startup(Path(tmp), c.address, f"startup-{i}", args.checkout.resolve())
                rows.append((t, e))
                print(f"round {i + 1}: torchrun {t:.1f} s, elastic-ddp {e['total_s']:.1f} s "
                      f"({e['total_s'] / t:.2f}x) {json.dumps(e)}", flush=True)
    finally:
        ray.shutdown()
        c.shutdown()
    print(f"\nbench_gpt, 2 workers, {STEPS} steps, Ray cluster up, {args.repeat} rounds, "
          f"checkout {args.checkout}, load average {os.getloadavg()[0]:.1f}")
    print(f"{'phase':>18} {'median s':>9}  per round")
    for k in rows[0][1]:
        v = [e.get(k, float("nan")) for _, e in rows]
        print(f"{k:>18} {statistics.median(v):>9.2f}  {' '.join(f'{x:.2f}' for x in v)}")
    tr = [t for t, _ in rows]
    print(f"{'torchrun total_s':>18} {statistics.median(tr):>9.2f}  {' '.join(f'{x:.2f}' for x in tr)}")
    ratios = [e["total_s"] / t for t, e in rows]
    print(f"elastic-ddp / torchrun, command to first step: median {statistics.median(ratios):.2f}x "
          f"({' '.join(f'{r:.2f}' for r in ratios)}; target <= 2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
