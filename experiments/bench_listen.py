"""What does the workers' notice agreement (``worker.notice.NoticeListener``) cost per
step boundary? Two real gloo ranks (processes, one thread each) run a synthetic step (a
few matmuls, then a 1 MiB gradient all-reduce) in blocks, alternating: no listener, an
agreement at every boundary (``interval_s=0``), and the spread one ("default":
``AGREE_EVERY_S``, or ``--interval-s``); printed: each mode's median block time per step, its ratio to no
listener, the median of the paired per-round ratios with its 95% bootstrap interval
(``paired_ratio``: the blocks of one alternation round share the machine's load), and
the mean time spent inside ``agreed()`` per boundary (the read's wait, the local
sources, the tensor and the all-reduce's start).

    .venv/bin/python experiments/bench_listen.py                  # 30 blocks of 20 steps
    .venv/bin/python experiments/bench_listen.py --matmuls 64 --interval-s 0.5

The job's own figure (Ray Train's watcher and the SIGTERM handler included) is
``experiments/bench_overhead.py --preemption``.
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
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
MODES = ("off", "every step", "default")


def rank_main(rank: int, init: str, matmuls: int, blocks: int, steps: int,
              interval_s: Optional[float]) -> None:
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from elastic_ddp.worker.notice import NoticeListener

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    trainer = SimpleNamespace(rank=rank, world_size=2, device=torch.device("cpu"))
    listeners = {"every step": NoticeListener(trainer, install=False, interval_s=0.0),
                 "default": NoticeListener(trainer, install=False, interval_s=interval_s)}
    a, w, grad = torch.randn(256, 256), torch.randn(256, 256), torch.randn(256 * 1024)
    per_step = {m: [] for m in MODES}
    inside = {m: 0.0 for m in MODES}
    calls = {m: 0 for m in MODES}
    for b in range(blocks):
        for mode in MODES if b % 2 == 0 else MODES[::-1]:
            lst = listeners.get(mode)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                for _ in range(matmuls):
                    a @ w
                dist.all_reduce(grad)
                if lst is not None:
                    t = time.perf_counter()
                    lst.agreed()
                    inside[mode] += time.perf_counter() - t
                    calls[mode] += 1
            per_step[mode].append((time.perf_counter() - t0) / steps)
    for lst in listeners.values():
        lst._finish()
    dist.barrier()
    print("RESULT " + json.dumps({"per_step": per_step, "inside_s": inside, "calls": calls,
                                  "every": listeners["default"].every,
                                  "agreements": {m: l.agreements for m, l in listeners.items()}}),
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--matmuls", type=int, default=16, help="256x256 matmuls per step")
    ap.add_argument("--blocks", type=int, default=30, help="blocks of each mode, alternated")
    ap.add_argument("--steps", type=int, default=20, help="steps per block")
    ap.add_argument("--interval-s", type=float, default=None,
                    help="'default' mode's interval (default: AGREE_EVERY_S)")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--init", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.init, args.matmuls, args.blocks, args.steps, args.interval_s)
        return 0
    print(f"load average at start: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-listen-") as tmp:
        init = f"file://{Path(tmp) / 'store'}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
        cmd = [sys.executable, __file__, "--init", init, "--matmuls", str(args.matmuls),
               "--blocks", str(args.blocks), "--steps", str(args.steps),
               *(["--interval-s", str(args.interval_s)] if args.interval_s is not None else [])]
        procs = [subprocess.Popen(cmd + ["--rank", str(r)], stdout=subprocess.PIPE, text=True, env=env)
                 for r in (0, 1)]
        outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        print("\n".join(outs))
        return 1
    res = [json.loads(next(l for l in o.splitlines() if l.startswith("RESULT "))[7:]) for o in outs]
    print(f"load average at end: {os.getloadavg()}")
    print(f"{args.blocks} blocks of {args.steps} steps per mode, alternated; a step: {args.matmuls} "
          f"256x256 matmuls + a 1 MiB all-reduce; 'default': an agreement every "
          f"{res[0]['every']} boundaries ({res[0]['agreements']['default']} started)")
    # A block's time: the slower rank's (the all-reduce holds them together).
    blocks = {m: [max(ts) for ts in zip(*(r["per_step"][m] for r in res))] for m in MODES}
    off = statistics.median(blocks["off"])
    print(f"{'mode':<11} | {'ms/step (median block)':>22} | {'/ off':>6} | {'paired rate / off, 95% CI':>27} "
          f"| {'in agreed() per boundary':>24}")
    for m in MODES:
        med = statistics.median(blocks[m])
        ins = max(r["inside_s"][m] / r["calls"][m] for r in res) if res[0]["calls"][m] else 0.0
        lo, mid, hi = paired_ratio(blocks["off"], blocks[m])
        ci = f"{mid:.1%} [{lo:.1%}, {hi:.1%}]"
        print(f"{m:<11} | {med * 1e3:>22.2f} | {off / med:>6.1%} | {ci:>27} | {ins * 1e6:>21.0f} us")
    return 0


def paired_ratio(off: list[float], on: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """The steps/s of ``on`` relative to ``off`` from blocks run back to back (block b of
    each mode in the same alternation round, so a change of the machine's load hits
    both): the median over rounds of ``off[b] / on[b]`` (seconds per step, so the ratio
    of rates), and its 95% percentile-bootstrap interval (``resamples`` resamplings of
    the rounds; Efron & Tibshirani, "An Introduction to the Bootstrap", 1993, ch. 13).
    Returns (low, median, high)."""
    import random

    ratios = [a / b for a, b in zip(off, on)]
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return meds[int(0.025 * resamples)], statistics.median(ratios), meds[int(0.975 * resamples) - 1]


if __name__ == "__main__":
    sys.exit(main())
