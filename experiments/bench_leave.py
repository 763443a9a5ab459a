"""Per-step mode: what the survivors pay when a replica goes, SIGTERM (a notice: the
replica leaves its quorum after one more step) against SIGKILL (a crash), the same job.

    .venv/bin/elastic-ddp prepare digits data/digits
    .venv/bin/python experiments/bench_leave.py --step-s 0.15 --repeats 2

The job: ``experiments/configs/digits_cnn.yaml`` in ``per_step`` mode, 2 replicas (a step
commits with 1), ``--epochs`` epochs of 23 steps, each step at least ``--step-s`` seconds (a sleep:
the arithmetic is that of the digits CNN). Ray: a head node (1 CPU) and three 2-CPU worker
nodes (``ray.cluster_utils.Cluster``), one worker per node. Once both replicas committed 5
steps together the highest-pid worker gets the signal.

Printed per run, from the sample ledger (per-step commit lines of every replica process):

  * gap at the loss: the survivor's time from its commit of the last step the lost replica
    committed to its next commit (one step, the lighthouse's wait, the quorum's
    reconfiguration and the reader switching to the lost replica's partitions);
  * longest gap alone: the survivor's longest gap between two commits from the signal to
    the replacement's first commit (the replacement's heal included; not the first step
    of an epoch, which opens the epoch's windows after the evaluation);
  * redone: replica shares computed in a quorum that did not commit (the audit's
    ``uncommitted_attempts``); the event: its type, and ``steps_recomputed``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "experiments/configs/digits_cnn.yaml"


def _workers() -> list[int]:
    import ray._private.state as state

    return sorted(int(i["Pid"]) for i in state.actors(actor_state_name="ALIVE").values()
                  if i["ActorClassName"] == "RayTrainWorker" and i["Pid"])


def _commits(ledger: Path) -> list[tuple[dict, list[dict]]]:
    out = []
    for f in sorted(ledger.glob("attempt-*.jsonl")):
        recs = []
        for ln in f.read_text().splitlines():
            try:
                recs.append(json.loads(ln))
            except ValueError:
                pass  # a line being written
        if recs:
            out.append((recs[0], [r for r in recs[1:] if "commit" in r]))
    return out


def run(tmp: Path, sig: int, step_s: float, epochs: int) -> dict:
    from elastic_ddp.config import Config
    from elastic_ddp.data.scan import read_sample_ids
    from elastic_ddp import train
    from elastic_ddp.ledger import audit
    from elastic_ddp.run_state import Diagnostics

    name = f"leave-{signal.Signals(sig).name.lower()}"
    cfg = Config.load(ROOT / CONFIG, [
        f"train.epochs={epochs}", "train.checkpoint_every_steps=1000", "train.log_every_steps=2",
        "model.kwargs.hidden=32", "batch.policy=uneven", "scaling.fault_tolerance=per_step",
        "scaling.min_workers=1", "scaling.max_workers=2", "scaling.cpus_per_worker=2",
        "scaling.torch_threads=1", "scaling.max_failures=1", "scaling.health_check_interval_s=0.2",
        f"run.name={name}", f"run.storage_path={tmp / 'ray'}",
        f"run.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
        f"data.train_path={ROOT / 'data/digits/train'}", f"data.val_path={ROOT / 'data/digits/val'}"])
    ledger = tmp / "ledger"
    box: dict = {}

    def job():
        try:
            box["summary"] = train(cfg, progress=False, diagnostics=Diagnostics(
                ledger_dir=str(ledger), fault={"rank": -1, "at_step": 0, "where": "none", "step_s": step_s}))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    th = threading.Thread(target=job, daemon=True)
    th.start()

    def together() -> bool:  # both replicas committed 5 steps in one quorum
        files = _commits(ledger) if ledger.is_dir() else []
        return sum(1 for _, cs in files if sum(1 for c in cs if c["n"] == 2) >= 5) >= 2

    while th.is_alive() and not together():
        time.sleep(0.05)
    pid = _workers()[-1]
    t_sig = time.time()
    os.kill(pid, sig)
    th.join(900)
    if "error" in box:
        raise box["error"]
    s = box["summary"]
    files = _commits(ledger)
    spans = [(h, cs) for h, cs in files if cs]
    survivor = next(cs for h, cs in spans if h["t"] < t_sig and cs[-1]["commit"] == s.steps
                    and cs[0]["t"] < t_sig)
    lost = next(cs for h, cs in spans if h["t"] < t_sig and cs is not survivor)
    later = [cs for h, cs in spans if h["t"] > t_sig]
    joined = min((cs[0]["t"] for cs in later), default=float("inf"))
    last = lost[-1]["commit"]
    before = max(c["t"] for c in survivor if c["commit"] <= last)
    after = min(c["t"] for c in survivor if c["commit"] > last)
    per_epoch = s.steps // epochs
    # Not the first step of an epoch: its reader opens the epoch's windows, and the
    # evaluation and checkpoint of the epoch before come first.
    alone = max((b["t"] - a["t"] for a, b in zip(survivor, survivor[1:])
                 if b["t"] > t_sig and a["t"] < joined and b["commit"] % per_epoch != 1), default=float("nan"))
    rep = audit(ledger, read_sample_ids(ROOT / "data/digits/train"), epochs)
    ev = next((e for e in s.events if e["type"] in ("preemption", "failure")), {})
    return {"signal": signal.Signals(sig).name, "gap_at_loss_s": round(after - before, 3),
            "longest_gap_alone_s": round(alone, 3), "redone_shares": rep["uncommitted_attempts"],
            "ok": rep["ok"], "event": ev.get("type"), "steps_recomputed": ev.get("steps_recomputed"),
            "replacement_first_commit_after_signal_s": round(joined - t_sig, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--step-s", type=float, default=0.15, help="seconds a step takes at least")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=6, help="23 steps each")
    ap.add_argument("--signals", default="SIGTERM,SIGKILL")
    ap.add_argument("--keep", help="a directory to keep each run's ledger, store and checkpoints in")
    args = ap.parse_args()
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray
    from ray.cluster_utils import Cluster

    rows = []
    for _ in range(args.repeats):
        for name in args.signals.split(","):
            c = Cluster()
            c.add_node(num_cpus=1, include_dashboard=False)
            for _ in range(3):
                c.add_node(num_cpus=2, object_store_memory=100 * 2**20)
            c.wait_for_nodes()
            ray.init(address=c.address, logging_level="WARNING", log_to_driver=False)
            try:
                if args.keep:
                    tmp = Path(args.keep) / f"{name}-{len(rows)}"
                    tmp.mkdir(parents=True)
                    r = run(tmp, getattr(signal, name), args.step_s, args.epochs)
                else:
                    with tempfile.TemporaryDirectory(prefix="bench-leave-") as tmp:
                        r = run(Path(tmp), getattr(signal, name), args.step_s, args.epochs)
            finally:
                ray.shutdown()
                c.shutdown()
            rows.append(r)
            print(json.dumps(r), flush=True)
    print(f"\nper_step digits, 2 replicas, steps >= {args.step_s} s, one worker signalled once both committed 5 steps together, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'signal':>8} {'gap at loss s (median/max)':>27} {'longest alone s':>16} {'redone':>7}  event")
    for name in args.signals.split(","):
        rs = [r for r in rows if r["signal"] == name]
        g = [r["gap_at_loss_s"] for r in rs]
        print(f"{name:>8} {statistics.median(g):>17.2f} / {max(g):<7.2f} "
              f"{max(r['longest_gap_alone_s'] for r in rs):>16.2f} {max(r['redone_shares'] for r in rs):>7}  "
              f"{', '.join(sorted({str(r['event']) for r in rs}))}, steps_recomputed "
              f"{sorted({str(r['steps_recomputed']) for r in rs})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
