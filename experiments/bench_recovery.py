"""Recovery: plain torchrun (``--max-restarts``, the torchelastic anchor), elastic-ddp's
``restart`` mode and its ``per_step`` mode (torchft), the same job, a worker SIGKILLed
(``--signal SIGTERM``: SIGTERMed, a preemption notice) every ``--kill-every`` seconds, on a
local multi-node Ray cluster.

    .venv/bin/elastic-ddp prepare pycode data/pycode_bench --num-files 4 --max-bytes 3000000
    .venv/bin/python experiments/bench_recovery.py --duration 300 --kill-every 60
    .venv/bin/python experiments/bench_recovery.py --modes per_step --signal SIGTERM
    # two builds at the same work, each from its own tree (Ray's workers put the
    # driver's working directory first on sys.path, before PYTHONPATH):
    cd <tree> && PYTHONPATH=$PWD .venv/bin/python experiments/bench_recovery.py \
        --modes restart --steps 600 --kill-every 30

The job: ``experiments/configs/bench_gpt.yaml`` (2-layer GPT, global batch 32, 2 workers of
one thread each), as many steps as the uninterrupted job runs in ``--duration`` seconds
(from a short torchrun calibration), a checkpoint every ``--ckpt-every`` steps. Ray: a head
node (1 CPU) and two 2-CPU worker nodes (``ray.cluster_utils.Cluster``), one worker each.

Printed per mode:
  * cmd->1st step: from the job's start to the end of its first step (elastic-ddp:
    ``train()`` called in this process, Ray connected; ``bench_startup.py`` measures the
    ``elastic-ddp train`` command against torchrun's, both fresh).
  * kill->1st step: from each kill to the first step computed after it by the new process
    (restart, torchrun: the restarted group; per_step: the replacement, i.e. back in the
    quorum); median and max over the kills.
  * longest gap: the longest time between two consecutive committed steps of a process
    that was not killed (per_step: the survivors', between a kill and the replacement's
    first commit, the whole run's in the JSON line as ``longest_gap_any_s``; restart and
    torchrun: every process restarts, so the gap spans the whole recovery).
  * goodput: seconds in committed training steps / wall seconds (elastic-ddp's own figure;
    torchrun: the steps a later checkpoint covered, from its step log).
  * samples: the ledger audit (elastic-ddp), lost / repeated over the committed steps.
  * restart CPU (restart mode): CPU seconds from each kill to the first step after it, of
    this process and its local cluster's processes by kind (``cpu_windows.TreeCpu``:
    the new workers, their data workers, the controller, Ray's own...), median over the
    restarts: the work a restart costs, which other jobs on the machine stretch less
    than its wall time; and the same over the ``AFTER_S`` seconds after that first step
    (training, and whatever a build starts after the first step).
  * restart phases (restart mode): each restart's kill->1st step split at the
    controller's timeline marks and rank 0's start marks (MLflow artifacts
    ``events/timeline.json``, ``events/attempts.json``), median over the restarts, in
    :data:`RESTART_PHASES` order. ``proc_start`` is the new worker's process creation:
    a process the worker pool started before the group start gives a negative
    ``actor_process_s``. A mark a build does not record (``pg_imported`` is an older
    build's, ``env_start`` and ``torch_imported`` a newer one's) leaves its phase out and
    its time in the next phase.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from elastic_ddp.run_state import Diagnostics

sys.path.insert(0, str(Path(__file__).resolve().parent))  # cluster_faults, when loaded by path
from cluster_faults import children, local_cluster, train_workers  # noqa: E402
from cpu_windows import TreeCpu  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "experiments/configs/bench_gpt.yaml"


def _killer(pids_fn, every: float, stop: threading.Event, kills: list, seed: int = 0,
            sig: int = signal.SIGKILL) -> None:
    """Every ``every`` seconds send ``sig`` to one of ``pids_fn()`` at random; record the time."""
    rng = random.Random(seed)
    while not stop.wait(every):
        pids = pids_fn()
        if not pids:
            continue
        pid = rng.choice(sorted(pids))
        try:
            os.kill(pid, sig)
            kills.append({"t": time.time(), "pid": pid})
        except ProcessLookupError:
            pass


# --------------------------------------------------------------------------- torchrun
def run_torchrun(tmp: Path, steps: int, ckpt_every: int, kill_every: float, restarts: int,
                 sig: int = signal.SIGKILL) -> dict:
    log = tmp / "steps.jsonl"
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node=2",
           f"--max-restarts={restarts}", str(ROOT / "experiments/torchrun_baseline.py"), CONFIG,
           "--set", f"train.max_steps={steps}", "--warmup-steps", "2",
           "--ckpt-dir", str(tmp / "ckpt"), "--ckpt-every", str(ckpt_every), "--step-log", str(log)]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stop, kills = threading.Event(), []
    th = threading.Thread(target=_killer, args=(lambda: children(proc.pid, recursive=False), kill_every, stop, kills,
                                                0, sig), daemon=True)
    th.start()
    out = proc.communicate()[0]
    stop.set()
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed:\n{out[-3000:]}")
    lines = [json.loads(ln) for ln in log.read_text().splitlines()]
    steps_l = [r for r in lines if "step" in r]
    ckpts = [r["ckpt"] for r in lines if "ckpt" in r]
    # An attempt is a run of one pid; its steps past the checkpoint the next attempt
    # resumed from were recomputed, the rest committed.
    attempts: list[list[dict]] = []
    for r in steps_l:
        if not attempts or attempts[-1][0]["pid"] != r["pid"]:
            attempts.append([])
        attempts[-1].append(r)
    committed = 0.0
    for i, a in enumerate(attempts):
        limit = attempts[i + 1][0]["step"] - 1 if i + 1 < len(attempts) else None
        committed += sum(r["dt"] for r in a if limit is None or r["step"] <= limit)
    back = [min((r["t"] for r in steps_l if r["t"] > k["t"]), default=float("nan")) - k["t"] for k in kills]
    committed_t = sorted(r["t"] for i, a in enumerate(attempts) for r in a
                         if i + 1 == len(attempts) or r["step"] < attempts[i + 1][0]["step"])
    return {"cmd_to_first_step_s": steps_l[0]["t"] - t0, "kills": len(kills),
            "kill_to_first_step_s": back, "longest_gap_s": _longest_gap(committed_t),
            "goodput": committed / wall, "samples": "n/a (no ledger)", "wall_s": wall,
            "checkpoints": len(ckpts)}


#: (phase, the mark that ends it), in time order: kill -> ``first_step`` of the attempt after.
RESTART_PHASES = (
    ("detect_teardown_s", "worker_group_starting"),  # failure seen, old group stopped
    ("actor_process_s", "proc_start"),               # placement group, worker process created
    ("worker_boot_s", "env_start"),                  # Ray worker + RayTrainWorker up, master address
    ("torch_import_s", "torch_imported"),            # the worker's first torch import
    ("pg_call_s", "pg_start"),                       # the process-group call arrives
    ("pg_imported_s", "pg_imported"),                # builds that marked their torch import here
    ("pg_init_s", "pg_ready"),                       # init_process_group (gloo, TCP store)
    ("group_callbacks_s", "worker_group_started"),   # after_worker_group_start callbacks
    ("train_fn_launch_s", "enter"),
    ("train_fn_imports_s", "imported"),
    ("job_unpickle_s", "job_loaded"),
    ("trainer_build_s", "built"),                    # model, data readers, optimizer
    ("restore_s", "restored"),                       # checkpoint read + verified
    ("to_ready_s", "ready"),
    ("first_step_s", "first_step"),                  # data pipeline's first batch + the step
)


def restart_phases(uri: str, run_id: str, kills: list) -> dict:
    """Median seconds of each :data:`RESTART_PHASES` phase over the restarts after ``kills``
    (from the run's MLflow artifacts); a phase whose mark is missing is left out and its
    time counts in the next one. {} when the artifacts are missing."""
    import mlflow

    client = mlflow.MlflowClient(uri)
    with tempfile.TemporaryDirectory(prefix="bench-recovery-art-") as d:
        try:
            attempts = json.loads(Path(client.download_artifacts(run_id, "events/attempts.json", d)).read_text())
            timeline = json.loads(Path(client.download_artifacts(run_id, "events/timeline.json", d)).read_text())
        except Exception as e:  # noqa: BLE001 - figures only
            print(f"restart phases: artifacts not readable ({e})", flush=True)
            return {}
    starting = sorted(m["t"] for m in timeline if m["what"] == "worker_group_starting")
    started = sorted(m["t"] for m in timeline if m["what"] == "worker_group_started")
    per: dict[str, list] = {name: [] for name, _ in RESTART_PHASES}
    for k in kills:
        nxt = sorted((a for a in attempts if a.get("first_step", 0) > k["t"] and "enter" in a),
                     key=lambda a: a["first_step"])
        if not nxt or nxt[0]["enter"] < k["t"]:
            continue
        a = dict(nxt[0])
        a["worker_group_starting"] = max((t for t in starting if k["t"] <= t <= a["enter"]), default=None)
        a["worker_group_started"] = max((t for t in started if k["t"] <= t <= a["enter"]), default=None)
        prev = k["t"]
        for name, mark in RESTART_PHASES:
            if a.get(mark) is None:
                continue
            per[name].append(a[mark] - prev)
            prev = a[mark]
    return {name: round(statistics.median(v), 2) for name, v in per.items() if v}


#: Seconds after a restart's first step whose CPU is reported too (``after_cpu_s``): work
#: a build defers past the first step (the data path's processes) is counted there.
AFTER_S = 20.0


def _median_cpu(cpu: TreeCpu, windows: list[tuple[float, float]]) -> dict[str, float]:
    return {k: round(statistics.median(v), 2) for k, v in cpu.by_kind(windows).items()}


def _longest_gap(ts: list[float]) -> float:
    return max((b - a for a, b in zip(ts, ts[1:])), default=float("nan"))


# ------------------------------------------------------------------------- elastic-ddp
def run_elastic(tmp: Path, mode: str, steps: int, ckpt_every: int, kill_every: float,
                sig: int = signal.SIGKILL, overrides: tuple[str, ...] = ()) -> dict:
    from elastic_ddp.config import Config
    from elastic_ddp.data.scan import read_sample_ids
    from elastic_ddp import train
    from elastic_ddp.ledger import audit

    cfg = Config.load(ROOT / CONFIG, [
        # As many epochs as it takes: max_steps ends the job, as it ends torchrun's.
        f"train.max_steps={steps}", "train.epochs=1000", f"train.checkpoint_every_steps={ckpt_every}",
        "train.log_every_steps=10", "scaling.min_workers=1", "scaling.max_workers=2",
        "scaling.cpus_per_worker=2", "scaling.torch_threads=1", "scaling.max_failures=-1",
        "scaling.health_check_interval_s=0.2", "batch.policy=uneven",
        f"scaling.fault_tolerance={mode}", f"run.name=recovery-{mode}",
        f"run.storage_path={tmp / 'ray'}", f"run.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
        f"data.train_path={ROOT / 'data/pycode_bench/train'}", f"data.val_path={ROOT / 'data/pycode_bench/val'}",
        *overrides])
    stop, kills = threading.Event(), []
    th = threading.Thread(target=_killer, args=(lambda: [w["pid"] for w in train_workers()], kill_every, stop,
                                                kills, 0, sig), daemon=True)
    t0 = time.time()
    cpu = TreeCpu(os.getpid())  # this process and the local cluster it started
    th.start()
    try:
        s = train(cfg, progress=False, diagnostics=Diagnostics(ledger_dir=str(tmp / "ledger")))
    finally:
        stop.set()
        cpu.stop()
    wall = time.time() - t0
    lines = {}
    for f in (tmp / "ledger").glob("*.jsonl"):
        recs = [json.loads(ln) for ln in f.read_text().splitlines() if ln.strip()]
        lines[f.name] = (recs[0], recs[1:])
    first = min(r["t"] for _, recs in lines.values() for r in recs if "t" in r)
    if mode == "per_step":
        # Commit lines per replica process. The replacement: the first process started
        # after the kill; survivors: processes that committed steps before and after it.
        back = [min((min((r["t"] for r in recs if "commit" in r), default=float("inf"))
                     for h, recs in lines.values() if h["t"] > k["t"]), default=float("nan")) - k["t"]
                for k in kills]
        # The survivors' longest gap while a replica is being replaced (from a kill to
        # the replacement's first commit); any_gap: over the whole run (epoch ends add
        # the evaluation and a durable checkpoint).
        spans = [(k["t"], k["t"] + b) for k, b in zip(kills, back) if b == b]
        gaps, any_gaps = [], []
        for _, recs in lines.values():
            ts = sorted(r["t"] for r in recs if "commit" in r)
            if ts and any(ts[0] < k["t"] < ts[-1] for k in kills):
                any_gaps.append(_longest_gap(ts))
                gaps.extend(b - a for a, b in zip(ts, ts[1:]) if any(a < hi and b > lo for lo, hi in spans))
        gaps, any_gaps = gaps or [float("nan")], any_gaps or [float("nan")]
    else:
        rank0 = sorted((h["t"], recs) for h, recs in lines.values() if h["rank"] == 0)
        back = [min((r["t"] for _, recs in rank0 for r in recs if r["t"] > k["t"]), default=float("nan")) - k["t"]
                for k in kills]
        gaps = [_longest_gap(sorted(r["t"] for _, recs in rank0 for r in recs))]
    ids = read_sample_ids(ROOT / "data/pycode_bench/train")
    n_epochs = -(-s.steps * 32 // len(ids))
    rep = audit(tmp / "ledger", ids, range(n_epochs))
    done = [e for ep, e in rep["epochs"].items() if ep < n_epochs - 1]  # whole epochs
    rep_n = sum(e["repeated"] for e in rep["epochs"].values())
    lost_n = sum(e["lost"] for e in done)
    return {"cmd_to_first_step_s": first - t0, "kills": len(kills), "kill_to_first_step_s": back,
            "kill_t": [k["t"] for k in kills],
            "longest_gap_s": max(gaps), "goodput": s.goodput, "wall_s": wall,
            # per_step: replica shares computed in a quorum that did not commit (redone).
            **({"longest_gap_any_s": max(any_gaps), "uncommitted_shares": rep["uncommitted_attempts"]}
               if mode == "per_step" else {}),
            "startup": s.startup,
            **({"restart_phases": restart_phases(s.tracking_uri, s.run_id, kills),
                "restart_cpu_s": _median_cpu(cpu, [(k["t"], k["t"] + b) for k, b in zip(kills, back) if b == b]),
                "after_cpu_s": _median_cpu(cpu, [(k["t"] + b, k["t"] + b + AFTER_S)
                                                 for k, b in zip(kills, back) if b == b])}
               if mode == "restart" else {}),
            "samples": f"{rep_n} repeated, {lost_n} lost in {len(done)} whole epochs"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=300, help="seconds of uninterrupted training")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per job, without the calibration (runs of two builds compared at "
                         "the same work: PYTHONPATH picks the elastic_ddp package, the workers' too)")
    ap.add_argument("--kill-every", type=float, default=60)
    ap.add_argument("--ckpt-every", type=int, default=20)
    ap.add_argument("--modes", default="torchrun,restart,per_step")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="more config overrides of the elastic-ddp jobs (e.g. data.shuffle_window_rows=2048: "
                         "more rounds per epoch)")
    ap.add_argument("--signal", default="SIGKILL", choices=["SIGKILL", "SIGTERM"],
                    help="what a worker gets: a crash, or a preemption notice")
    args = ap.parse_args()
    sig = getattr(signal, args.signal)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

    if args.steps:
        steps = args.steps
    else:
        with tempfile.TemporaryDirectory(prefix="bench-recovery-cal-") as tmp:
            cal = run_torchrun(Path(tmp), 40, 1000, 1e9, 0)
        steps_per_s = 38 / max(1e-9, cal["wall_s"] - cal["cmd_to_first_step_s"])
        steps = max(50, int(steps_per_s * args.duration))
        print(f"calibration: {steps_per_s:.2f} steps/s under torchrun -> {steps} steps per job", flush=True)

    rows = {}
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"bench-recovery-{mode}-") as tmp:
            if mode == "torchrun":
                r = run_torchrun(Path(tmp), steps, args.ckpt_every, args.kill_every, 100, sig)
            else:
                with local_cluster(2, 2, log_to_driver=False):
                    r = run_elastic(Path(tmp), mode, steps, args.ckpt_every, args.kill_every, sig, tuple(args.set))
        rows[mode] = r
        print(mode, json.dumps(r), flush=True)

    print(f"\nbench_gpt, 2 workers, {steps} steps, a worker {args.signal}ed every {args.kill_every:.0f} s, "
          f"checkpoint every {args.ckpt_every} steps, load average {os.getloadavg()[0]:.1f}")
    print(f"{'mode':>9} {'cmd->1st s':>10} {'kills':>5} {'kill->1st s (median/max)':>24} "
          f"{'longest gap s':>13} {'goodput':>8} {'wall s':>7}  samples")
    for mode, r in rows.items():
        k = [v for v in r["kill_to_first_step_s"] if v == v]
        ks = f"{statistics.median(k):.1f} / {max(k):.1f}" if k else "-"
        print(f"{mode:>9} {r['cmd_to_first_step_s']:>10.1f} {r['kills']:>5} {ks:>24} "
              f"{r['longest_gap_s']:>13.1f} {r['goodput']:>8.1%} {r['wall_s']:>7.0f}  {r['samples']}")
    for mode, r in rows.items():
        if r.get("restart_phases"):
            print(f"{mode} restart phases (median s): "
                  + ", ".join(f"{k[:-2]} {v:.2f}" for k, v in r["restart_phases"].items()))
        for key, span in (("restart_cpu_s", "kill to first step"), ("after_cpu_s", f"the {AFTER_S:.0f} s after it")):
            if r.get(key):
                print(f"{mode} restart CPU s ({span}, median over the restarts, this process and its "
                      "cluster's): " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r[key].items(), key=lambda kv: -kv[1])))
    if "torchrun" in rows and "restart" in rows:
        t, e = rows["torchrun"], rows["restart"]
        tk = statistics.median([v for v in t["kill_to_first_step_s"] if v == v] or [float("nan")])
        ek = statistics.median([v for v in e["kill_to_first_step_s"] if v == v] or [float("nan")])
        print(f"restart / torchrun: kill->1st {ek / tk:.2f}x (target <= 2x); cmd->1st "
              f"{e['cmd_to_first_step_s'] / t['cmd_to_first_step_s']:.2f}x in-process (train() called "
              "here; the command's own figure: experiments/bench_startup.py)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
