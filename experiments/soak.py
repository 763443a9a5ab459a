"""Soak: the ``bench_gpt`` job on a local multi-node Ray cluster for ``--duration``
seconds while a fault is drawn about every ``--interval`` seconds: a training worker
SIGKILLed, a worker SIGTERMed, a node's pod evicted as Kubernetes evicts it, a node
removed without notice, a node added (and, when asked for, a node drained through
Ray's GCS call alone). Then the figures that say what the faults cost and whether
anything was lost.

    .venv/bin/elastic-ddp prepare pycode data/pycode_bench --num-files 4 --max-bytes 3000000
    .venv/bin/python experiments/soak.py --mode restart                  # 60 min of faults
    .venv/bin/python experiments/soak.py --mode per_step --duration 300  # 5 min

What it does:

1. Starts a ``ray.cluster_utils.Cluster``: a head (1 logical CPU: the driver's Ray calls,
   the Ray Train controller, the tracker) and ``--nodes`` worker nodes (2 logical CPUs
   each). With ``evict`` among the kinds (the default), each worker node is a pod
   (``cluster_faults.Pod``: ``ray start --block`` in a mount namespace of its own, as a
   pod's container runs it; root only), else a node of the ``Cluster``. A training
   worker asks for 2 logical CPUs, so a node holds one worker and a
   worker never lands on the head: removing a node removes a rank. Each worker runs one
   torch thread: the job needs two cores whatever the node count. Ray's own metrics
   collection is off (why: ``cluster_faults.local_cluster``).
2. The job: ``experiments/configs/bench_gpt.yaml`` (a 2-layer byte-level GPT, global
   batch 32, steps of a few hundred ms on one core) with a checkpoint every 20 steps,
   ``min_workers=1``, ``max_workers=2``, unlimited restarts and preemptions, the sample
   ledger on, ``scaling.fault_tolerance=--mode``. Epochs: ``--epochs``, else enough for
   the uninterrupted job to train ``--duration`` seconds at the rate a 30-step calibration
   job measures first (the faults make the job last longer; they stop at ``--duration``).
3. From the first step on, every ``--interval`` x U(0.5, 1.5) seconds, one fault drawn
   from those that are possible now (``--kinds``): ``sigkill`` / ``sigterm`` a random
   training worker process; ``evict`` the pod of a node hosting a worker as the kubelet
   deletes a pod (the shipped preStop hook ``elastic-ddp drain-node --self --deadline
   <--evict-deadline>`` inside the pod, then SIGTERM to its ``ray start``, then SIGKILL
   to what is left after ``--evict-grace`` seconds: a spot reclaim, ``kubectl drain``, a
   scale-down); ``drain`` (not drawn unless named in ``--kinds``) a node hosting a worker
   by Ray's own ``DrainNode`` GCS call with reason ``DRAIN_NODE_REASON_PREEMPTION``
   (what ``ray drain-node --deadline-remaining-seconds 20`` and the autoscaler make),
   then remove it when its deadline passes; ``remove`` a node hosting a worker, no
   notice (a pod: every process SIGKILLed at once); ``add`` a node. Between 1 and
   ``--nodes`` worker nodes stay up (``add`` is drawn
   twice as often as each removal, so the cluster refills).
4. Runs the same job uninterrupted (same config and samples) on the full cluster:
   ``--baseline after`` (default), ``before``, or ``none``; ``--baseline only --epochs N
   --against soak-*.json`` runs it alone later and compares the soaks' val_loss with it.
5. Prints, per fault kind: how many; how many restarted something (a restart event of
   the run, a failure, preemption or resize, follows the fault; a spare node removed or
   a node added while the job runs at its maximum size restart nothing); recovery
   seconds (from the fault to the first step of a process started after its event: the
   restarted group, or in ``per_step`` mode the replacement); stall seconds (the longest
   pause between two trained steps of any process during the fault and its recovery);
   steps recomputed (trained again after it, from the ledger);
   then goodput, the seconds lost per fault with their parts (the job's own
   ``lost_s_per_fault`` and ``goodput_parts``), the ledger audit of every epoch
   (``elastic_ddp.ledger.audit``: samples
   repeated and lost), the product's restart events, and the final val_loss against the
   uninterrupted run's. All of it also goes to ``--out/soak-<mode>.json``.

Exit status: 0 when the job finished, every epoch's audit is clean and the val_loss is
within ``--val-rtol`` of the uninterrupted run's; else 1. Everything runs on this
machine: the figures measure Ray's and elastic-ddp's recovery paths, not a network.
Ctrl-C stops it; the cluster is shut down on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))  # cluster_faults, when loaded by path
from cluster_faults import Pod, _nodisk, add_node, drain_node, local_cluster, train_workers  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "experiments/configs/bench_gpt.yaml"
KINDS = ("sigkill", "sigterm", "drain", "evict", "remove", "add")
#: Drawn unless ``--kinds`` says otherwise: a pod's eviction in place of the bare GCS drain
#: (on Kubernetes nobody calls ``ray drain-node``; the eviction's hook does).
DEFAULT_KINDS = ("sigkill", "sigterm", "evict", "remove", "add")
#: Faults that give notice (the job can commit a checkpoint first).
NOTICE = ("sigterm", "drain", "evict")
LABELS = {"sigkill": "worker SIGKILL", "sigterm": "worker SIGTERM",
          "drain": "node drain + removal", "evict": "pod evicted (hook)",
          "remove": "node removed, no notice", "add": "node added"}
NODE_CPUS = 2  # logical: a worker asks for all of a node's, never the head's one


# --------------------------------------------------------------------- the schedule
def possible(kind: str, nodes: int, max_nodes: int, workers: int) -> bool:
    """Whether ``kind`` can be injected with ``nodes`` worker nodes up (of at most
    ``max_nodes``) and ``workers`` live training worker processes: a kill needs a
    worker, a removal leaves one node at least, an addition needs room."""
    if kind in ("sigkill", "sigterm"):
        return workers > 0
    if kind in ("drain", "evict", "remove"):
        return nodes >= 2
    if kind == "add":
        return nodes < max_nodes
    raise ValueError(f"unknown fault kind {kind!r}; one of {', '.join(KINDS)}")


def draw(rng: random.Random, kinds: tuple[str, ...], nodes: int, max_nodes: int,
         workers: int) -> Optional[str]:
    """The next fault kind, uniform over the possible ones of ``kinds`` with ``add``
    counted twice (a node removed and one added balance out); None when none is
    possible."""
    pool = [k for k in kinds if possible(k, nodes, max_nodes, workers)]
    pool += ["add"] if "add" in pool else []
    return rng.choice(pool) if pool else None


def next_gap(rng: random.Random, interval: float) -> float:
    """Seconds to the next fault: ``interval`` x U(0.5, 1.5)."""
    return interval * rng.uniform(0.5, 1.5)


def parse_kinds(text: str) -> tuple[str, ...]:
    """``"sigkill,drain"`` -> ``("sigkill", "drain")``, in :data:`KINDS` order.

    Raises:
        argparse.ArgumentTypeError: an unknown or no kind."""
    got = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in got if k not in KINDS]
    if bad or not got:
        raise argparse.ArgumentTypeError(f"fault kinds: {', '.join(bad) or '(none)'} not in {', '.join(KINDS)}")
    return tuple(k for k in KINDS if k in got)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("restart", "per_step"), default="restart",
                    help="scaling.fault_tolerance")
    ap.add_argument("--duration", type=float, default=3600.0, help="seconds of faults")
    ap.add_argument("--interval", type=float, default=30.0, help="mean seconds between faults")
    ap.add_argument("--kinds", type=parse_kinds, default=DEFAULT_KINDS,
                    help=f"fault kinds drawn, of {','.join(KINDS)} (default {','.join(DEFAULT_KINDS)})")
    ap.add_argument("--drain-deadline", type=float, default=20.0, help="seconds of notice a drain gives")
    ap.add_argument("--evict-grace", type=float, default=45.0,
                    help="an evicted pod's terminationGracePeriodSeconds: SIGKILL this long after the hook starts")
    ap.add_argument("--evict-deadline", type=float, default=35.0,
                    help="the preStop hook's --deadline (the grace less a margin)")
    ap.add_argument("--nodes", type=int, default=3, help="worker nodes at most (and at the start)")
    ap.add_argument("--epochs", type=int, default=None, help="default: from a calibration run")
    ap.add_argument("--data", default=str(ROOT / "data/pycode_bench"), help="a pycode data set (train/, val/)")
    ap.add_argument("--baseline", choices=("after", "before", "none", "only"), default="after",
                    help="when to run the uninterrupted job (only: it alone, no faults; needs --epochs)")
    ap.add_argument("--against", nargs="*", default=[],
                    help="with --baseline only: soak JSON files whose val_loss to compare with it")
    ap.add_argument("--val-rtol", type=float, default=1e-3,
                    help="relative tolerance of the final val_loss against the uninterrupted run's")
    ap.add_argument("--seed", type=int, default=0, help="seeds the fault schedule")
    ap.add_argument("--out", default="/tmp/elastic-ddp-soak", help="MLflow store, checkpoints, ledgers, JSON")
    ap.add_argument("--set", action="append", default=[], help="more key=value config overrides")
    args = ap.parse_args(argv)
    if args.nodes < 2:
        ap.error("--nodes must be 2 or more (a node can only leave when another stays)")
    if not 0 < args.evict_deadline < args.evict_grace:
        ap.error("--evict-deadline must be above 0 and below --evict-grace (the hook ends before the SIGKILL)")
    args.pods = "evict" in args.kinds
    if args.baseline == "only" and args.epochs is None:
        ap.error("--baseline only needs --epochs (the soak's, printed in its header and JSON)")
    if args.against and args.baseline != "only":
        ap.error("--against goes with --baseline only")
    return args


# ------------------------------------------------------------------------ the faults
@dataclass
class Fault:
    """One injected fault: ``t`` when (seconds since the epoch; a drain: the drain call;
    an eviction: the hook's start), ``until`` when it was over (a drain: its node's
    removal; an eviction: the pod's last process gone), what it hit."""

    kind: str
    t: float
    until: float
    detail: str
    nodes_after: int
    ok: bool = True


@dataclass
class Injector:
    """Draws and injects the faults, from the main thread (Ray's ``Node`` installs a
    SIGTERM handler, which Python allows only there). ``pods``: the worker nodes are
    :class:`cluster_faults.Pod` processes (``args.pods``), else the ``Cluster``'s own
    nodes; :meth:`close` stops the pods."""

    cluster: object
    args: argparse.Namespace
    rng: random.Random
    log: list[Fault] = field(default_factory=list)
    pods: list = field(default_factory=list)
    log_dir: Optional[Path] = None

    def nodes(self) -> list:
        """The worker nodes up now (each with ``node_id``)."""
        return list(self.pods) if self.args.pods else list(self.cluster.worker_nodes)

    def _node_of(self, node_id: str):
        return next((n for n in self.nodes() if n.node_id == node_id), None)

    def _target_node(self):
        """A node hosting a training worker (a random one), else any worker node."""
        hosting = [n for n in (self._node_of(w["node_id"]) for w in train_workers()) if n is not None]
        pool = hosting or self.nodes()
        return self.rng.choice(sorted(pool, key=lambda n: n.node_id))

    def add_node(self):
        """One worker node more: a pod, or a node of the ``Cluster``."""
        if not self.args.pods:
            return add_node(self.cluster, num_cpus=NODE_CPUS)
        log = Path(self.log_dir or "/tmp") / f"pod-{len(self.log)}-{len(self.pods)}-{time.time():.0f}.log"
        pod = Pod(self.cluster.address, NODE_CPUS, log, self.args.evict_grace, self.args.evict_deadline)
        self.pods.append(pod)
        return pod

    def _remove(self, node) -> None:
        """``node`` gone at once, no notice (a pod: every process SIGKILLed)."""
        if self.args.pods:
            self.pods.remove(node)
            node.kill()
        else:
            self.cluster.remove_node(node)

    def close(self) -> None:
        for pod in list(self.pods):
            pod.kill()
        self.pods.clear()

    def inject(self, kind: str, stop: threading.Event) -> Fault:
        t = time.time()
        until, ok = t, True
        try:
            if kind in ("sigkill", "sigterm"):
                w = self.rng.choice(sorted(train_workers(), key=lambda w: w["pid"]))
                os.kill(w["pid"], signal.SIGKILL if kind == "sigkill" else signal.SIGTERM)
                detail = f"pid {w['pid']}"
            elif kind == "drain":
                node = self._target_node()
                drain_node(self.cluster.address, node.node_id, self.args.drain_deadline)
                print(f"[soak] {time.strftime('%H:%M:%S')} drain {node.node_id[:12]} "
                      f"(removal in {self.args.drain_deadline:.0f} s)", flush=True)
                stop.wait(max(0.0, t + self.args.drain_deadline - time.time()))
                self._remove(node)
                until = time.time()
                detail = f"node {node.node_id[:12]}, removed after {until - t:.1f} s"
            elif kind == "evict":
                node = self._target_node()
                self.pods.remove(node)
                try:
                    got = node.evict(hook=True)
                except BaseException:
                    node.kill()
                    raise
                until = time.time()
                hook = (f"hook rc {got['hook_rc']} in {got['hook_s']:.1f} s" if got["hook_s"] is not None
                        else f"hook {got['hook_rc']}")
                gone = (f"ray start exited {got['exited_s']:.1f} s after the start" if got["exited_s"] is not None
                        else "SIGKILLed at the grace")
                detail = f"node {node.node_id[:12]}: {hook}; {gone}"
                if got["hook_rc"] != 0:  # still an eviction: the kubelet goes on without the hook
                    detail += f"; hook said: {got['hook_out'].strip()[-300:]}"
            elif kind == "remove":
                node = self._target_node()
                self._remove(node)
                detail = f"node {node.node_id[:12]}"
            else:
                node = self.add_node()
                detail = f"node {node.node_id[:12]}"
        except Exception as e:  # noqa: BLE001 - the soak goes on; the failure is reported
            detail, ok = f"failed: {type(e).__name__}: {e}", False
        f = Fault(kind, t, until, detail, len(self.nodes()), ok)
        self.log.append(f)
        print(f"[soak] {time.strftime('%H:%M:%S')} {kind} {detail} (worker nodes now "
              f"{f.nodes_after})", flush=True)
        return f

    def run(self, end_t: float, stop: threading.Event) -> None:
        """Faults until ``end_t`` or ``stop`` (the job ended)."""
        while not stop.wait(next_gap(self.rng, self.args.interval)) and time.time() < end_t:
            kind = draw(self.rng, self.args.kinds, len(self.nodes()), self.args.nodes,
                        len(train_workers()))
            if kind is not None:
                self.inject(kind, stop)


# ------------------------------------------------------------------- what they cost
def _ledger_processes(ledger_dir: Path) -> list[dict]:
    """One entry per ledger file (a worker process: an attempt's rank, or a per-step
    replica): its start ``t``, the times of the steps it trained (``steps``: [(t,
    step)], restart mode's step lines, per-step mode's commit lines), and per-step mode's
    shares (``(step, quorum)`` of each step line) and commits (``(step, quorum)`` -> t)."""
    out = []
    for f in sorted(ledger_dir.glob("attempt-*-rank*.jsonl")):
        lines = f.read_text().splitlines()
        if not lines:
            continue
        head = json.loads(lines[0])
        steps, shares, commits = [], set(), {}
        for ln in lines[1:]:
            try:
                rec = json.loads(ln)
            except json.JSONDecodeError:
                continue  # a torn last line
            if "commit" in rec:
                steps.append((float(rec["t"]), int(rec["commit"])))
                commits[(int(rec["commit"]), int(rec["quorum"]))] = float(rec["t"])
            elif "quorum" in rec:
                shares.add((int(rec["step"]), int(rec["quorum"])))
            elif "t" in rec:
                steps.append((float(rec["t"]), int(rec["step"])))
        out.append({"t": float(head["t"]), "rank": int(head["rank"]), "steps": steps,
                    "shares": shares, "commits": commits})
    return out


def ledger_goodput(procs: list[dict], t0: float, t1: float) -> Optional[float]:
    """Goodput of the window [``t0``, ``t1``) (seconds since the epoch) from the ledger
    (:func:`_ledger_processes`): the seconds of the steps the job kept (each step
    number's last training; earlier ones were recomputed) that ended in the window, over
    the window's length. A step's seconds: the gap from its process's previous step (a
    process's first step, which carries its start, and gaps over 5x the median, the
    epoch-end evaluations, count as not training). The product's goodput counts the
    whole run, start-up and the fault-free end included; this one isolates the faults'
    window. None for an empty window."""
    last: dict[int, tuple[float, Optional[float]]] = {}  # step -> (t, seconds) of its last training
    for p in procs:
        seq = sorted(p["steps"])
        for prev, (t, step) in zip([None, *seq], seq):
            if step not in last or last[step][0] < t:
                last[step] = (t, t - prev[0] if prev is not None and prev[1] == step - 1 else None)
    gaps = [d for _, d in last.values() if d is not None]
    if t1 <= t0 or not gaps:
        return None
    cap = 5 * statistics.median(gaps)
    return sum(d for t, d in last.values() if t0 <= t < t1 and d is not None and d <= cap) / (t1 - t0)


RESTART_EVENTS = ("failure", "preemption", "resize")


def fault_events(faults: list[Fault], events: list[dict]) -> list[list[dict]]:
    """The run's restart events (``Summary.events``: failures, preemptions, resizes, as
    the controller decided them) of each fault: an event belongs to the latest fault
    injected before it. A fault with none restarted nothing (a spare node removed, a node
    added while the job ran at its maximum size or while it was restarting anyway)."""
    out: list[list[dict]] = [[] for _ in faults]
    for ev in sorted((e for e in events if e.get("type") in RESTART_EVENTS), key=lambda e: e["t"]):
        i = max((i for i, f in enumerate(faults) if f.t <= ev["t"]), default=None)
        if i is not None:
            out[i].append(ev)
    return out


def per_fault(faults: list[Fault], events: list[dict], ledger_dir: Path, mode: str,
              end_t: float) -> list[dict]:
    """Each fault's cost. With its first restart event (:func:`fault_events`), from the
    ledger: ``recovery_s`` (the fault -> the first step of a process started after that
    event: the restarted group, or in per-step mode the replacement; None when none
    started), ``stall_s`` (the longest gap between consecutive trained steps of any
    process that overlaps the fault and its recovery), ``steps_recomputed`` (restart
    mode: for each of its events, steps the attempt running then trained past the
    checkpoint the next one resumed from, ``ledger.recomputed_after``; an attempt counted
    once). Per-step mode's ``steps_recomputed``:
    steps no quorum committed, or a second quorum committed again, redone after the fault
    and before the next one. A fault without an event: None, None, 0."""
    from elastic_ddp.ledger import read_attempts, recomputed_after

    procs = _ledger_processes(ledger_dir)
    times = sorted({t for p in procs for t, _ in p["steps"]})
    attempts = read_attempts(ledger_dir) if mode == "restart" else []
    # Per-step mode: the time each wasted step was trained again. A share no quorum
    # committed: when its step was first committed (the redo); a step committed by a
    # second quorum (a restart from a durable checkpoint): that commit.
    commit_t: dict[tuple[int, int], float] = {}
    for p in procs:
        commit_t.update(p["commits"])
    first: dict[int, tuple[float, int]] = {}
    for (s, q), t in sorted(commit_t.items(), key=lambda kv: kv[1]):
        first.setdefault(s, (t, q))
    shares = {sq for p in procs for sq in p["shares"]}
    redone = [first[s][0] for s, q in shares if (s, q) not in commit_t and s in first]
    redone += [t for (s, q), t in commit_t.items() if first[s][1] != q]
    rows, charged = [], set()
    for i, (f, evs) in enumerate(zip(faults, fault_events(faults, events))):
        nxt = faults[i + 1].t if i + 1 < len(faults) else end_t
        recovery = stall = None
        recomputed = 0
        if evs:
            t_ev = evs[0]["t"]
            back = min((min((t for t, _ in p["steps"]), default=math.inf) for p in procs if p["t"] > t_ev),
                       default=math.inf)
            recovery = back - f.t if back < math.inf else None
            hi = max(f.until, f.t + recovery if recovery is not None else end_t)
            stall = max((b - a for a, b in zip(times, times[1:]) if b > f.t and a < hi), default=None)
            if mode == "restart":
                # Every restart the fault led to (a removal's failure, then the grow onto
                # a new node) ends an attempt; each attempt's steps count once: a fault
                # during a restart's start (its new group failed before training) finds
                # the attempt that restart ended, already charged to the fault before.
                for ev in evs:
                    r = recomputed_after(attempts, ev["t"])
                    if r is not None and r["attempt"] not in charged:
                        charged.add(r["attempt"])
                        recomputed += r["steps_recomputed"]
        if mode != "restart":
            recomputed = sum(f.t <= t < nxt for t in redone)
        rows.append({**asdict(f), "recovery_s": recovery, "stall_s": stall, "steps_recomputed": recomputed,
                     "events": [{k: e.get(k) for k in ("type", "source", "fell_back", "cause")} for e in evs]})
    return rows


def _spread(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    return f"{statistics.median(xs):.1f} / {max(xs):.1f}" if xs else "-"


def format_table(rows: list[dict]) -> str:
    """Per fault kind: count, recovery and stall seconds (median / max), steps
    recomputed (total / max), and how many faults restarted a process."""
    lines = [f"{'fault':<24} {'count':>5} {'recovery s (med/max)':>21} {'stall s (med/max)':>18} "
             f"{'recomputed (sum/max)':>21} {'restarted':>9}"]
    for kind in KINDS:
        rs = [r for r in rows if r["kind"] == kind and r["ok"]]
        if not rs:
            continue
        rec = [r["steps_recomputed"] for r in rs]
        lines.append(f"{LABELS[kind]:<24} {len(rs):>5} {_spread([r['recovery_s'] for r in rs]):>21} "
                     f"{_spread([r['stall_s'] for r in rs]):>18} {f'{sum(rec)} / {max(rec)}':>21} "
                     f"{sum(r['recovery_s'] is not None for r in rs):>9}")
    failed = [r for r in rows if not r["ok"]]
    if failed:
        lines.append(f"(not injected: {len(failed)}: " + "; ".join(f"{r['kind']} {r['detail']}" for r in failed) + ")")
    return "\n".join(lines)


# ------------------------------------------------------------------------- the jobs
def job_config(args: argparse.Namespace, out: Path, name: str, epochs: int, max_steps=None):
    from elastic_ddp.config import Config

    data = Path(args.data).resolve()
    return Config.load(CONFIG, [
        f"data.train_path={data / 'train'}", f"data.val_path={data / 'val'}",
        f"train.epochs={epochs}", f"train.max_steps={'' if max_steps is None else max_steps}",
        "train.checkpoint_every_steps=20", "train.log_every_steps=10",
        "scaling.min_workers=1", "scaling.max_workers=2", f"scaling.cpus_per_worker={NODE_CPUS}",
        "scaling.torch_threads=1", "scaling.max_failures=-1", "scaling.resize_monitor_interval_s=10",
        "scaling.use_gpu=false", f"scaling.fault_tolerance={args.mode}",
        f"run.name={name}", f"run.storage_path={out / 'ray_results'}",
        f"run.tracking_uri=sqlite:///{out / 'mlflow.db'}", "run.experiment_name=soak", *args.set])


def calibrate(args: argparse.Namespace, out: Path, stamp: str) -> float:
    """Steps per second of the uninterrupted job (a 30-step run; the first 5 steps,
    start-up and warm-up, left out)."""
    from elastic_ddp import train
    from elastic_ddp.run_state import Diagnostics

    ledger = out / "ledger" / f"calibrate-{stamp}"
    train(job_config(args, out, f"soak-calibrate-{args.mode}-{stamp}", 1, 30), progress=False,
          diagnostics=Diagnostics(ledger_dir=str(ledger)))
    ts = sorted(t for p in _ledger_processes(ledger) if p["rank"] == 0 for t, s in p["steps"] if s > 5)
    return (len(ts) - 1) / max(1e-9, ts[-1] - ts[0])


def report_baseline(args: argparse.Namespace, s, out: Path, stamp: str) -> int:
    """``--baseline only``: the uninterrupted job's figures, and its val_loss against each
    ``--against`` soak JSON's (relative difference, within ``--val-rtol`` or not).
    Exit status 0 when every one is within it."""
    val = s.metrics.get("val_loss")
    print(f"\n==== the uninterrupted job: {args.mode} mode, {args.epochs} epochs ====\n"
          f"wall {s.wall_s:.0f} s  goodput {s.goodput:.1%}  steps {s.steps}  world sizes "
          f"{s.world_sizes_seen}  val_loss {val!r}")
    ok = val is not None
    for f in args.against:
        soaked = json.loads(Path(f).read_text())
        v = soaked.get("val_loss")
        if soaked.get("epochs") != args.epochs or v is None or val is None:
            print(f"{f}: not comparable ({soaked.get('epochs')} epochs, val_loss {v})")
            ok = False
            continue
        rel = abs(v - val) / max(1e-12, abs(val))
        ok &= rel <= args.val_rtol
        print(f"{f} ({soaked['args']['mode']} mode): val_loss {v:.6f}: relative difference {rel:.1e} "
              f"({'within' if rel <= args.val_rtol else 'OUTSIDE'} {args.val_rtol:.0e})")
    path = out / f"soak-baseline-{args.mode}-{stamp}.json"
    path.write_text(json.dumps({"epochs": args.epochs, "wall_s": s.wall_s, "goodput": s.goodput,
                                "steps": s.steps, "val_loss": val, "against": args.against}, indent=1))
    print(f"(figures in {path})")
    return 0 if ok else 1


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from elastic_ddp.data.scan import read_sample_ids
    from elastic_ddp import train
    from elastic_ddp.ledger import audit, format_audit
    from elastic_ddp.run_state import Diagnostics

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    ids = read_sample_ids(Path(args.data) / "train")
    steps_per_epoch = -(-len(ids) // 32)  # bench_gpt's global batch
    rng = random.Random(args.seed)
    if args.pods:
        why = _nodisk().namespaces_unavailable()
        if why:
            print(f"[soak] the evict kind needs pods (mount namespaces): {why}; run as root, or leave "
                  f"evict out of --kinds", file=sys.stderr)
            return 2
    with local_cluster(0 if args.pods else args.nodes, NODE_CPUS, log_to_driver=False) as cluster, \
            contextlib.closing(Injector(cluster, args, rng, log_dir=out / "pods" / stamp)) as injector:
        if args.pods:
            injector.log_dir.mkdir(parents=True, exist_ok=True)
            for _ in range(args.nodes):
                injector.add_node()
            print(f"[soak] {args.nodes} worker pods up (logs in {injector.log_dir})", flush=True)
        epochs = args.epochs
        if epochs is None:
            rate = calibrate(args, out, stamp)
            epochs = max(1, math.ceil(args.duration * rate / steps_per_epoch))
            print(f"[soak] calibration: {rate:.2f} steps/s uninterrupted -> {epochs} epochs of "
                  f"{steps_per_epoch} steps", flush=True)
        baseline = None
        if args.baseline == "only":
            return report_baseline(args, train(job_config(args, out, f"soak-baseline-{args.mode}-{stamp}", epochs),
                                               progress=False), out, stamp)
        if args.baseline == "before":
            baseline = train(job_config(args, out, f"soak-baseline-{args.mode}-{stamp}", epochs), progress=False)
        ledger = out / "ledger" / f"soak-{args.mode}-{stamp}"
        cfg = job_config(args, out, f"soak-{args.mode}-{stamp}", epochs)
        stop, result = threading.Event(), {}

        def run_job():
            try:
                result["summary"] = train(cfg, progress=False, diagnostics=Diagnostics(ledger_dir=str(ledger)))
            except BaseException as e:  # noqa: BLE001 - reported in the main thread
                result["error"] = e
            finally:
                stop.set()

        t0 = time.time()
        job = threading.Thread(target=run_job, daemon=True)
        job.start()
        # The faults start with the first step (a ledger file: training has begun).
        while not stop.wait(0.5) and not any(ledger.glob("attempt-*")):
            pass
        t_faults = time.time()
        injector.run(t_faults + args.duration, stop)
        t_faults_end = time.time()
        # The nodes back, for the job's rest and the baseline (faults too: the job may
        # grow on them).
        while len(injector.nodes()) < args.nodes and injector.inject("add", stop).ok:
            pass
        job.join()
        wall = time.time() - t0
        if args.baseline == "after" and "summary" in result:
            baseline = train(job_config(args, out, f"soak-baseline-{args.mode}-{stamp}", epochs), progress=False)
    if "error" in result:
        print(f"[soak] the job failed: {type(result['error']).__name__}: {result['error']}", flush=True)
        return 1
    s = result["summary"]
    rows = per_fault(injector.log, s.events, ledger, args.mode, t0 + wall)
    report = audit(ledger, ids, epochs)
    val = s.metrics.get("val_loss")
    ref = baseline.metrics.get("val_loss") if baseline is not None else None
    rel = abs(val - ref) / max(1e-12, abs(ref)) if val is not None and ref is not None else None
    val_ok = ref is None or (rel is not None and rel <= args.val_rtol)
    events = [{k: e.get(k) for k in ("type", "source", "fell_back", "world_size_before", "world_size_after",
                                     "recovery_s", "resumed_at_step", "steps_recomputed", "cause")}
              for e in s.events]

    print(f"\n==== soak: {args.mode} mode, {t_faults_end - t_faults:.0f} s of faults (every ~{args.interval:.0f} s, "
          f"seed {args.seed}), bench_gpt {epochs} epochs x {steps_per_epoch} steps, "
          f"{args.nodes} worker nodes at most ====")
    for r in rows:
        def num(x):
            return "-" if x is None else f"{x:.1f}"
        print(f"  +{r['t'] - t_faults:6.0f} s {r['kind']:8s} recovery {num(r['recovery_s']):>5} s  stall "
              f"{num(r['stall_s']):>5} s  recomputed {r['steps_recomputed']:3d}  {r['detail']}")
    print(format_table(rows))
    for kinds, label in ((NOTICE, "faults with notice (SIGTERM, drain, eviction)"), (("add",), "grows (node added)")):
        some = [r for r in rows if r["kind"] in kinds and r["ok"] and (kinds != ("add",) or r["recovery_s"] is not None)]
        if some:
            print(f"{label}: {sum(r['steps_recomputed'] == 0 for r in some)} of {len(some)} recomputed 0 steps")
    print(f"wall {wall:.0f} s  goodput {s.goodput:.1%} (committed training-step time / wall time)  "
          f"steps {s.steps}  restarts {s.restarts}  world sizes {s.world_sizes_seen}")
    lost = "-" if s.lost_s_per_fault is None else f"{s.lost_s_per_fault:.1f} s"
    parts = ", ".join(f"{k[:-2] if k.endswith('_s') else k} {v:.1f} s" for k, v in s.goodput_parts.items())
    print(f"lost per fault: {lost} (the job's own lost_s_per_fault); the wall time's parts: {parts}")
    procs = _ledger_processes(ledger)
    g_all, g_faults = ledger_goodput(procs, t0, t0 + wall), ledger_goodput(procs, t_faults, t_faults_end)
    print(f"goodput from the ledger: {g_faults:.1%} during the faults, {g_all:.1%} over the wall time "
          f"(the job's own {s.goodput:.1%}; soak.ledger_goodput)")
    print("restart events (the run's own record):")
    for e in events:
        print(f"  {e['type']:10s} {str(e['source'] or ''):8s} ws {e['world_size_before']}->{e['world_size_after']} "
              f"recovery_s {e['recovery_s']} steps_recomputed {e['steps_recomputed']}"
              f"{'  fell back' if e['fell_back'] else ''}  {str(e['cause'])[:90]}")
    print("ledger audit:")
    print(format_audit(report))
    for p in report.get("problems", []):
        print(f"  problem: {p}")
    if ref is not None:
        print(f"val_loss {val:.6f}, uninterrupted {ref:.6f}: relative difference {rel:.1e} "
              f"({'within' if val_ok else 'OUTSIDE'} {args.val_rtol:.0e})")
    else:
        print(f"val_loss {val} (no uninterrupted run)")
    figures = {"args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
               "epochs": epochs, "wall_s": wall, "faults_s": t_faults_end - t_faults,
               "goodput": s.goodput, "lost_s_per_fault": s.lost_s_per_fault,
               "goodput_parts": s.goodput_parts, "goodput_faults_ledger": g_faults, "goodput_ledger": g_all,
               "t0": t0, "t_faults": t_faults, "t_faults_end": t_faults_end, "steps": s.steps, "restarts": s.restarts,
               "world_sizes_seen": s.world_sizes_seen, "faults": rows, "events": events,
               "audit": {"ok": report["ok"], "problems": report.get("problems", []),
                         "per_epoch": {ep: {k: e[k] for k in ("steps", "repeated", "lost", "unknown")}
                                       for ep, e in report["epochs"].items()}},
               "val_loss": val, "baseline_val_loss": ref, "val_rel_diff": rel}
    path = out / f"soak-{args.mode}-{stamp}.json"
    path.write_text(json.dumps(figures, indent=1, default=str))
    print(f"(figures in {path})")
    return 0 if report["ok"] and val_ok else 1


if __name__ == "__main__":
    sys.exit(main())
