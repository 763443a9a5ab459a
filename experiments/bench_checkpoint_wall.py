"""The wall-clock cost of a checkpoint (``bench_checkpoint.py --wall-steps N``): the same
job (N training steps of the widened gpt task on 2 gloo ranks under ``torchrun``) without
checkpoints and with one every 2 steps, per way of writing it, side by side in one run:

    none      no checkpoint
    sync      ``CheckpointManager.save`` synchronous
    thread    asynchronous, serialised in a thread of the rank (``checkpoint_writer: thread``)
    process   asynchronous, serialised in a process of the rank's own, nice +10
              (``checkpoint_writer: process``)

Cost per checkpoint = (the job's wall time - the job's without checkpoints) / checkpoints,
and its ratio to the synchronous one. Each job first trains a step and writes one
checkpoint (waited for; not timed: the stager's buffers, the writer process), then the
timed steps, polling the checkpoint in flight at each step boundary as the worker does,
and waits for the last one inside the timed window. ``--repeat`` rounds, the ways in
turn within a round (a machine's load drifts alike over all of them); medians.

    .venv/bin/python experiments/bench_checkpoint.py --wall-steps 12 --sizes 12x1024 --strategies ddp,fsdp
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("none", "sync", "thread", "process")


def wall_worker(args, s, step, store: Path, rank: int, ws: int) -> None:
    """One rank of one job (``--path wall:<mode>:<steps>``); rank 0 prints RESULT."""
    import torch.distributed as dist

    from elastic_ddp.checkpoint.manager import CheckpointManager

    _, mode, steps = args.path.split(":")
    steps = int(steps)
    conf = {"train": {"checkpoint_writer": "process" if mode == "process" else "thread"}}
    m = CheckpointManager(str(store), "run", conf, rank, ws, collective=True,
                          log=lambda _: None, strategy_name=args.strategy)
    asynchronous = mode in ("thread", "process")
    if mode != "none":  # the warm-up checkpoint
        m.save(0, s, {"progress": {}}, report=False, asynchronous=asynchronous)
        m.wait()
    dist.barrier()
    t0 = time.perf_counter()
    saved = 0
    for k in range(1, steps + 1):
        step()
        m.poll()
        if mode != "none" and k % 2 == 0:
            m.save(k, s, {"progress": {}}, report=False, asynchronous=asynchronous)
            saved += 1
    m.wait()
    dist.barrier()
    wall = time.perf_counter() - t0
    if rank == 0:
        print("RESULT " + json.dumps({"wall_s": wall, "checkpoints": saved}), flush=True)
    dist.destroy_process_group()


def run_wall(sizes: str, strategies: str, steps: int, repeat: int, modes: list[str],
             root: Path, script: Path) -> None:
    """Print, per size and strategy, each way's wall time, cost per checkpoint and its
    ratio to the synchronous one."""
    import os

    print(f"{'size':>7} {'strat':>5} {'way':>8} {'wall s':>8} {'cost s/ckpt':>11} {'vs sync':>7}"
          f"   ({steps} steps, a checkpoint every 2; medians of {repeat})", flush=True)
    for size in sizes.split(","):
        for strategy in strategies.split(","):
            walls: dict[str, list[float]] = {m: [] for m in modes}
            nck = {}
            for _ in range(repeat):
                for mode in modes:
                    with tempfile.TemporaryDirectory(prefix="bench-wall-") as out:
                        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
                            x for x in (str(root), os.environ.get("PYTHONPATH", "")) if x))
                        cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone",
                               "--nproc_per_node", "2", str(script), "--worker", "--size", size,
                               "--strategy", strategy, "--path", f"wall:{mode}:{steps}",
                               "--repeat", "0", "--out", out]
                        p = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                           timeout=3600, check=False)
                    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
                    if line is None:
                        raise RuntimeError(f"{size} {strategy} {mode} failed:\n{p.stderr[-3000:]}")
                    r = json.loads(line[len("RESULT "):])
                    walls[mode].append(r["wall_s"])
                    nck[mode] = r["checkpoints"]
            med = {m: statistics.median(v) for m, v in walls.items()}
            base = med.get("none")
            cost = {m: (med[m] - base) / nck[m] for m in modes if m != "none" and base is not None and nck[m]}
            for mode in modes:
                c = cost.get(mode)
                ratio = (f"{c / cost['sync']:.2f}x" if c is not None and cost.get("sync") else "-")
                print(f"{size:>7} {strategy:>5} {mode:>8} {med[mode]:>8.2f} "
                      f"{(f'{c:.2f}' if c is not None else '-'):>11} {ratio:>7}", flush=True)
