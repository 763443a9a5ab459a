"""Chaos run: a digits job on a local multi-node Ray cluster while workers die and nodes
leave and join; then the figures that say whether elastic training lost anything.

    .venv/bin/python experiments/chaos.py --nodes 3 --duration 180 --out /tmp/chaos

What it does:

1. Starts a ``ray.cluster_utils.Cluster``: a head with 1 CPU (driver, Ray Train
   controller, Ray Data reads) and ``--nodes`` worker nodes with 2 CPUs each. A training
   worker asks for 2 CPUs, so one node holds one worker: removing a node removes a rank.
2. Runs ``experiments/configs/digits_cnn.yaml`` (data prepared into ``--out/data``) with
   ``scaling.min_workers=1, max_workers=--nodes``, ``batch.policy=uneven`` (the global
   batch is kept at every world size), unlimited restarts and the sample ledger on.
3. From a thread, for ``--duration`` seconds, at random intervals of about
   ``--interval`` seconds: SIGKILLs a random training worker process (found as a
   ``ray::RayTrainWorker`` child of one of this cluster's raylets, never another
   cluster's), or removes a random worker node, or adds one back (keeping 1..nodes
   worker nodes). The job runs on to the end after the chaos stops.
4. Prints: goodput (committed step time / wall time), each failure/resize event with
   its recovery seconds and steps recomputed, the ledger audit (samples repeated / lost
   per epoch), the world sizes seen and the final val metrics. Also writes them to
   ``--out/chaos.json``.

Everything runs on this machine: the figures measure Ray's and our recovery paths, not
a network. Kill it with Ctrl-C; the cluster is shut down on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

from elastic_ddp.run_state import Diagnostics

sys.path.insert(0, str(Path(__file__).resolve().parent))  # cluster_faults, when loaded by path
from cluster_faults import add_node, local_cluster, train_worker_pids  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class Chaos:
    """Random faults for ``duration`` seconds; ``log`` records what was done and when.
    ``run`` must be called from the main thread: Ray's ``Node`` (``add_node``) installs
    a SIGTERM handler, which Python allows only there."""

    def __init__(self, cluster, max_nodes: int, duration: float, interval: float,
                 seed: int, node_cpus: int):
        self.cluster, self.max_nodes, self.duration = cluster, max_nodes, duration
        self.interval, self.node_cpus = interval, node_cpus
        self.rng = random.Random(seed)
        self.log: list[dict] = []
        self.stop = threading.Event()

    def run(self) -> None:
        end = time.time() + self.duration
        while not self.stop.wait(self.interval * self.rng.uniform(0.5, 1.5)):
            if time.time() > end:
                break
            n = len(self.cluster.worker_nodes)
            actions = ["kill_worker"]
            if n > 1:
                actions.append("remove_node")
            if n < self.max_nodes:
                actions += ["add_node", "add_node"]  # favour refilling the cluster
            action = self.rng.choice(actions)
            t = time.time()
            try:
                if action == "kill_worker":
                    pids = train_worker_pids(self.cluster)
                    if not pids:
                        continue
                    pid = self.rng.choice(pids)
                    os.kill(pid, signal.SIGKILL)
                    detail = f"pid {pid}"
                elif action == "remove_node":
                    node = self.rng.choice(sorted(self.cluster.worker_nodes,
                                                  key=lambda x: x.unique_id))
                    self.cluster.remove_node(node)
                    detail = node.unique_id
                else:
                    node = add_node(self.cluster, num_cpus=self.node_cpus)
                    detail = node.unique_id
            except Exception as e:  # noqa: BLE001 - chaos goes on; the error is logged
                detail = f"failed: {type(e).__name__}: {e}"
            self.log.append({"t": t, "action": action, "detail": detail,
                             "nodes_after": len(self.cluster.worker_nodes)})
            print(f"[chaos] {time.strftime('%H:%M:%S')} {action} {detail} "
                  f"(worker nodes now {len(self.cluster.worker_nodes)})", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3, help="worker nodes (and max_workers)")
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of chaos")
    ap.add_argument("--interval", type=float, default=25.0, help="mean seconds between faults")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0, help="seeds the chaos schedule")
    ap.add_argument("--out", default="/tmp/elastic-ddp-chaos", help="data, MLflow, checkpoints")
    ap.add_argument("--config", default=str(REPO / "experiments/configs/digits_cnn.yaml"))
    ap.add_argument("--set", action="append", default=[], help="extra key=value overrides")
    args = ap.parse_args(argv)

    from elastic_ddp.config import Config
    from elastic_ddp.data.prepare import prepare_digits
    from elastic_ddp.data.scan import read_sample_ids
    from elastic_ddp import train
    from elastic_ddp.ledger import audit, format_audit

    out = Path(args.out).resolve()
    data = out / "data"
    if not (data / "train").is_dir():
        prepare_digits(data, num_files=1, val_fraction=0.2, seed=0)
    run_name = f"chaos-{int(time.time())}"
    node_cpus = 2
    cfg = Config.load(args.config, [
        f"data.train_path={data / 'train'}", f"data.val_path={data / 'val'}",
        "batch.policy=uneven", f"train.epochs={args.epochs}",
        "train.checkpoint_every_steps=10", "train.log_every_steps=5",
        "scaling.min_workers=1", f"scaling.max_workers={args.nodes}",
        f"scaling.cpus_per_worker={node_cpus}", "scaling.torch_threads=1",
        "scaling.max_failures=-1", "scaling.resize_monitor_interval_s=10",
        "scaling.use_gpu=false", "scaling.collective_timeout_s=30",
        f"run.name={run_name}", f"run.storage_path={out / 'ray_results'}",
        f"run.tracking_uri=sqlite:///{out / 'mlflow.db'}", "run.experiment_name=chaos",
        *args.set,
    ])
    ledger = out / "ledger" / run_name

    with local_cluster(args.nodes, node_cpus) as cluster:
        chaos = Chaos(cluster, args.nodes, args.duration, args.interval, args.seed, node_cpus)
        result: dict = {}

        def run_training():
            try:
                result["summary"] = train(cfg, diagnostics=Diagnostics(ledger_dir=str(ledger)), progress=False)
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                result["error"] = e
            finally:
                chaos.stop.set()

        t0 = time.time()
        trainer = threading.Thread(target=run_training, daemon=True)
        trainer.start()
        # The chaos starts with the first ledger file (training has begun; the data read
        # before it is not what this run measures) and stops with the job.
        while not chaos.stop.wait(0.5) and not any(ledger.glob("attempt-*")):
            pass
        chaos.run()
        trainer.join()
        if "error" in result:
            raise result["error"]
        summary = result["summary"]
        wall = time.time() - t0
        ids = read_sample_ids(data / "train")
        report = audit(ledger, ids, args.epochs)
        figures = {
            "wall_s": round(wall, 1), "goodput": round(summary.goodput, 3),
            "restarts": summary.restarts, "world_sizes_seen": summary.world_sizes_seen,
            "val": summary.metrics, "chaos": chaos.log,
            "events": [{k: e.get(k) for k in ("type", "cause", "world_size_before",
                                              "world_size_after", "recovery_s",
                                              "resumed_at_step", "steps_recomputed")}
                       for e in summary.events],
            "ledger": {"ok": report["ok"], "world_sizes": report["world_sizes"],
                       "per_epoch": {ep: {k: e[k] for k in ("repeated", "lost", "steps")}
                                     for ep, e in report["epochs"].items()}},
        }
        (out / "chaos.json").write_text(json.dumps(figures, indent=1, default=str))
        print("\n==== chaos figures ====")
        print(f"wall {figures['wall_s']} s  goodput {figures['goodput']}  restarts "
              f"{figures['restarts']}  world sizes {summary.world_sizes_seen}")
        print(f"faults injected: {len(chaos.log)}: "
              + ", ".join(f"{c['action']}" for c in chaos.log))
        for e in figures["events"]:
            print(f"  {e['type']:8s} ws {e['world_size_before']}->{e['world_size_after']} "
                  f"recovery_s {e['recovery_s']} resumed_at {e['resumed_at_step']} "
                  f"steps_recomputed {e['steps_recomputed']}  {str(e['cause'])[:80]}")
        print(format_audit(report))
        print("val: " + " ".join(f"{k}={v:.4f}" for k, v in summary.metrics.items()))
        print(f"(figures in {out / 'chaos.json'})")
        return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
