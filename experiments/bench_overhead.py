"""What does elastic-ddp cost over plain torchrun DDP? Runs the same job both ways at each
world size and prints steady-state throughput, their ratio, command-to-first-step time
and the data-wait share of step time.

    .venv/bin/python experiments/bench_overhead.py                       # bench_gpt.yaml, N=1,2
    .venv/bin/python experiments/bench_overhead.py --world-sizes 2 --steps 40
    .venv/bin/python experiments/bench_overhead.py --preemption --world-sizes 2   # listening on vs off

Prerequisite (once): ``.venv/bin/elastic-ddp prepare pycode data/pycode_bench --num-files 4
--max-bytes 3000000``.

Why a small GPT and not digits_cnn (``experiments/configs/bench_gpt.yaml``): a digits step
is a few milliseconds, so fixed per-step costs (Python, the log step's metric reduction
and MLflow write, collective latency) would dominate any system and the ratio would
measure Python, not distributed training; and a digits epoch is ~23 steps, so every
measured window would include an epoch-end evaluation and checkpoint. A 2-layer,
128-wide GPT on 128-byte windows, global batch 32, is ~0.1-0.3 s of compute per step on
one core, and its 690-step epoch never ends inside the window.

Definitions (both sides measured the same way, on rank 0, over steps warmup+1..steps):
  * samples/s: wall-clock, everything inside the loop included. elastic: from the MLflow
    timestamps of the ``train/loss`` points at two log steps, so the log steps' metric
    reduction and MLflow write are included; checkpoints are not (the config only
    checkpoints at the end, as the baseline never does). "in-loop" is elastic's own
    ``samples_per_s`` metric (sum of step times only), shown for reference.
  * cmd->1st step: from launching the command (``torchrun ...`` / ``elastic-ddp train
    ...``) to the end of the first optimizer step (the summary's ``startup.total_s``).
  * data wait: share of step time spent gathering rows and making tensors.
The MLflow store is created before the first timed run (a user's second and later
jobs), so cmd->1st step does not include MLflow's one-off schema migration.
Targets: ratio >= 97%, data wait < 2%, elastic cmd->1st step < 15 s.

``--preemption``: no torchrun; the elastic job with ``scaling.preemption_checkpoint``
off and on (the agreement on a notice every ``scaling.notice_agreement_s``, the SIGTERM
handler, Ray Train's preemption watcher), alternated ``--repeats`` times in the same
run, and the ratio of the medians of samples/s (target: on >= 99% of off). ``--parts``
adds the agreement at every step boundary and "on" without Ray Train's watcher
(``PREEMPTION_MODES``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def _timed_run(cmd: list[str], what: str, env: Optional[dict] = None) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``cmd`` from the repo root (``env``: added to this process's environment);
    returns its output and the launch time (epoch s). Raises RuntimeError with the
    output's tail when it fails."""
    t_cmd = time.time()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={**os.environ, **env} if env else None)
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out, t_cmd


def run_baseline(config: str, ws: int, steps: int, warmup: int, overrides: list[str]) -> dict:
    cmd = [str(VENV_BIN / "torchrun"), "--standalone", f"--nproc-per-node={ws}",
           str(ROOT / "experiments" / "torchrun_baseline.py"), config,
           "--warmup-steps", str(warmup), "--set", f"train.max_steps={steps}"]
    out, t_cmd = _timed_run(cmd + [a for o in overrides for a in ("--set", o)], "baseline")
    line = next(l for l in out.stdout.splitlines() if l.startswith("BASELINE_RESULT "))
    res = json.loads(line.split(" ", 1)[1])
    res["cmd_to_first_step_s"] = res["first_step_ts"] - t_cmd
    res["total_s"] = time.time() - t_cmd
    return res


def run_elastic(config: str, ws: int, steps: int, warmup: int, overrides: list[str],
                tmp: Path, env: Optional[dict] = None) -> dict:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    name = f"bench-ws{ws}-{int(time.time())}"
    sets = [f"scaling.min_workers={ws}", f"scaling.max_workers={ws}", f"train.max_steps={steps}",
            f"run.name={name}", f"run.tracking_uri={uri}", f"run.storage_path={tmp / 'ray'}",
            "run.experiment_name=bench", *overrides]
    cmd = [str(VENV_BIN / "elastic-ddp"), "train", config, "--no-progress", "--json"]
    out, t_cmd = _timed_run(cmd + [a for o in sets for a in ("--set", o)], "elastic-ddp", env)
    total = time.time() - t_cmd
    summary = json.loads(out.stdout[out.stdout.index("\n{") + 1:] if not out.stdout.startswith("{")
                         else out.stdout)
    from elastic_ddp.tracking import metric_key

    client = MlflowClient(uri)
    rid = summary["run_id"]
    run = client.get_run(rid)
    # The train/loss points are logged at log steps: their MLflow timestamps give the
    # wall-clock rate between two log steps, everything inside the loop included.
    steps_hist = sorted((int(m.step), m.timestamp / 1000.0)
                        for m in client.get_metric_history(rid, metric_key("train_loss")))
    after = [(s, ts) for s, ts in steps_hist if s >= warmup]
    if len(after) < 2:
        raise ValueError(f"fewer than 2 logged steps in {warmup}..{steps} (train.log_every_steps "
                         f"is {run.data.params.get('train.log_every_steps')}): raise --steps")
    (s_a, ts_a), (s_b, ts_b) = after[0], after[-1]
    cfg_g = int(run.data.params["batch.global_batch_size"])

    def med(key: str) -> float:
        vals = [m.value for m in client.get_metric_history(rid, metric_key(key)) if m.step > warmup]
        return statistics.median(vals) if vals else float("nan")

    # The job's own command-to-first-step profile (report.startup_breakdown): which
    # processes and imports the time goes to; total_s runs from the CLI process's start.
    startup = dict(summary.get("startup") or {})
    first_ts = t_cmd + startup.get("total_s", float("nan"))
    read = re.search(r"read (\d+) train rows in ([\d.]+)s", out.stdout)
    return {
        "world_size": ws, "run_id": rid,
        "samples_per_s": (s_b - s_a) * cfg_g / (ts_b - ts_a),
        "in_loop_samples_per_s": med("samples_per_s"),
        "cmd_to_first_step_s": first_ts - t_cmd,
        "data_wait_frac": med("data_wait_frac"),
        "allreduce_exposed_s": med("allreduce_exposed_s_mean"),
        "step_time_s": med("step_time_s_mean"),
        "startup": startup,
        "worker_read_s": float(read.group(2)) if read else float("nan"),
        "total_s": total,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="experiments/configs/bench_gpt.yaml")
    ap.add_argument("--world-sizes", default="1,2")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10, help="log step that opens the window")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--preemption", action="store_true",
                    help="compare scaling.preemption_checkpoint on and off instead of torchrun")
    ap.add_argument("--repeats", type=int, default=2, help="--preemption: runs of each, alternated")
    ap.add_argument("--parts", action="store_true",
                    help="--preemption: also the agreement at every step, and no preemption watcher")
    args = ap.parse_args()
    if args.preemption:
        return preemption_main(args)

    print(f"load average at start: {os.getloadavg()}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        # Create the MLflow store's tables before timing anything: a fresh sqlite store
        # runs MLflow's schema migrations on first open (seconds; 27 s measured under
        # load), which a user pays once per store, not once per job.
        from mlflow.tracking import MlflowClient

        t = time.time()
        MlflowClient(f"sqlite:///{Path(tmp) / 'mlflow.db'}").search_experiments()
        print(f"MLflow store created (not timed in the table) in {time.time() - t:.1f}s", flush=True)
        for ws in [int(w) for w in args.world_sizes.split(",")]:
            b = run_baseline(args.config, ws, args.steps, args.warmup, args.overrides)
            print(f"[N={ws}] baseline: {json.dumps(b)}", flush=True)
            e = run_elastic(args.config, ws, args.steps, args.warmup, args.overrides, Path(tmp))
            print(f"[N={ws}] elastic:  {json.dumps(e)}", flush=True)
            results.append((ws, b, e))
    print(f"load average at end: {os.getloadavg()}")
    print()
    print(f"config {args.config}, steps {args.warmup + 1}..{args.steps} measured "
          f"(overrides: {args.overrides or 'none'})")
    hdr = (f"{'N':>2} | {'torchrun sps':>12} | {'elastic sps':>11} | {'ratio':>6} | "
           f"{'elastic in-loop':>15} | {'cmd->1st torchrun':>17} | {'cmd->1st elastic':>16} | "
           f"{'data wait torchrun':>18} | {'data wait elastic':>17}")
    print(hdr)
    print("-" * len(hdr))
    for ws, b, e in results:
        print(f"{ws:>2} | {b['samples_per_s']:>12.1f} | {e['samples_per_s']:>11.1f} | "
              f"{e['samples_per_s'] / b['samples_per_s']:>6.1%} | {e['in_loop_samples_per_s']:>15.1f} | "
              f"{b['cmd_to_first_step_s']:>15.1f} s | {e['cmd_to_first_step_s']:>14.1f} s | "
              f"{b['data_wait_frac']:>18.2%} | {e['data_wait_frac']:>17.2%}")
    for ws, b, e in results:
        phases = ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in e["startup"].items() if k != "total_s")
        print(f"N={ws} elastic cmd->1st step {e['startup'].get('total_s', float('nan')):.1f} s: {phases}")
        print(f"N={ws} elastic worker read {e['worker_read_s']:.2f}s; "
              f"exposed all-reduce {e['allreduce_exposed_s'] * 1e3:.2f} ms/step of "
              f"{e['step_time_s'] * 1e3:.1f} ms")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            [{"world_size": ws, "baseline": b, "elastic": e} for ws, b, e in results], indent=1))
    return 0


#: --preemption's modes: (name, environment, overrides). "on" is the product's default;
#: --parts adds the pieces of it: the agreement at every step boundary
#: (scaling.notice_agreement_s=0) and no Ray Train preemption watcher (drains unseen).
PREEMPTION_MODES = {
    "off": ({}, ["scaling.preemption_checkpoint=false"]),
    "on": ({}, ["scaling.preemption_checkpoint=true"]),
    "on, every step": ({}, ["scaling.preemption_checkpoint=true", "scaling.notice_agreement_s=0"]),
    "on, no watcher": ({"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}, ["scaling.preemption_checkpoint=true"]),
}


def preemption_main(args) -> int:
    """The job with the notice handling off and on (and with --parts its pieces), at
    each world size; each repeat runs every mode once, the order rotated and reversed
    from one repeat to the next so that no mode always runs first or after the same one."""
    names = list(PREEMPTION_MODES) if args.parts else ["off", "on"]
    print(f"load average at start: {os.getloadavg()}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-preempt-") as tmp:
        from mlflow.tracking import MlflowClient

        MlflowClient(f"sqlite:///{Path(tmp) / 'mlflow.db'}").search_experiments()
        for ws in [int(w) for w in args.world_sizes.split(",")]:
            got: dict[str, list] = {m: [] for m in names}
            for i in range(args.repeats):
                r = i // 2 % len(names)
                order = names[r:] + names[:r]
                for mode in order if i % 2 == 0 else order[::-1]:
                    env, sets = PREEMPTION_MODES[mode]
                    e = run_elastic(args.config, ws, args.steps, args.warmup, [*args.overrides, *sets],
                                    Path(tmp), env)
                    print(f"[N={ws}] {mode}: {e['samples_per_s']:.1f} samples/s "
                          f"(in-loop {e['in_loop_samples_per_s']:.1f}; load {os.getloadavg()[0]:.2f})",
                          flush=True)
                    got[mode].append(e)
            rows.append((ws, got))
    print(f"load average at end: {os.getloadavg()}")
    print()
    print(f"config {args.config}, steps {args.warmup + 1}..{args.steps} measured, {args.repeats} runs "
          f"of each mode (overrides: {args.overrides or 'none'})")
    hdr = (f"{'N':>2} | {'mode':<15} | {'samples/s median':>16} | {'min..max':>13} | {'/ off':>6} | "
           f"{'in-loop median':>14} | {'in-loop / off':>13}")
    print(hdr)
    print("-" * len(hdr))
    for ws, got in rows:
        med = {m: statistics.median(e["samples_per_s"] for e in got[m]) for m in got}
        loop = {m: statistics.median(e["in_loop_samples_per_s"] for e in got[m]) for m in got}
        for m in names:
            v = [e["samples_per_s"] for e in got[m]]
            print(f"{ws:>2} | {m:<15} | {med[m]:>16.1f} | {min(v):>6.1f}..{max(v):<6.1f} | "
                  f"{med[m] / med['off']:>6.1%} | {loop[m]:>14.1f} | {loop[m] / loop['off']:>13.1%}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([{"world_size": ws, **got} for ws, got in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
