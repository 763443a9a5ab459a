"""Whether the ``bench_gpt`` job ends with the same weights at world sizes 1 and 2: the
job trained uninterrupted on a local Ray cluster of one worker node (world size 1) or of
two (world size 2), in either mode, and every run's final checkpoint compared tensor by
tensor with the first run's.

    .venv/bin/elastic-ddp prepare pycode data/pycode_bench --num-files 4 --max-bytes 3000000
    .venv/bin/python experiments/exact_world_sizes.py --steps 200 \
        --runs restart:1,restart:2,per_step:2

The job is ``experiments/configs/bench_gpt.yaml`` with ``experiments/soak.py``'s
settings (``min_workers`` 1, ``max_workers`` 2, ``torch_threads`` 1, a checkpoint every
20 steps), ``train.max_steps=--steps``. A worker asks for both logical CPUs of a worker
node, so the node count sets the world size; the config is the same in every run. A
``per_step`` job starts all ``max_workers`` replicas, so ``per_step:1`` runs with
``min_workers = max_workers = 1`` (the same sample order: ``data.partitions`` is fitted
alike for up to 4 workers); ``restart:1`` is the same arithmetic as a quorum
of one replica of a ``max_workers = 2`` job.

Printed per run: its final val_loss and the relative difference to the first run's; how
many model and optimizer tensors are equal (``torch.equal``) to the first run's, and the
largest absolute and relative difference of those that are not. Exit status 0 when
every tensor of every run equals the first run's. Figures also go to
``--out/exact-world-sizes-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))  # cluster_faults, when loaded by path
from cluster_faults import local_cluster  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "experiments/configs/bench_gpt.yaml"
NODE_CPUS = 2


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(ROOT / "data/pycode_bench"))
    ap.add_argument("--out", default=str(ROOT / "outputs/exact"))
    ap.add_argument("--steps", type=int, default=200, help="train.max_steps of each run")
    ap.add_argument("--runs", default="restart:1,restart:2,per_step:2",
                    help="MODE:WORLD_SIZE, comma-separated; the first is the reference")
    ap.add_argument("--set", action="append", default=[], help="more config overrides K=V")
    return ap.parse_args(argv)


def job_config(args: argparse.Namespace, out: Path, name: str, mode: str, ws: int):
    from elastic_ddp.config import Config

    data = Path(args.data).resolve()
    cfg = Config.load(CONFIG, [
        f"data.train_path={data / 'train'}", f"data.val_path={data / 'val'}",
        "train.epochs=1", f"train.max_steps={args.steps}",
        "train.checkpoint_every_steps=20", "train.log_every_steps=10",
        "scaling.min_workers=1", "scaling.max_workers=2", f"scaling.cpus_per_worker={NODE_CPUS}",
        "scaling.torch_threads=1", "scaling.max_failures=0", "scaling.use_gpu=false",
        f"scaling.fault_tolerance={mode}",
        f"run.name={name}", f"run.storage_path={out / 'ray_results'}",
        f"run.tracking_uri=sqlite:///{out / 'mlflow.db'}", "run.experiment_name=exact", *args.set])
    if mode == "per_step" and ws == 1:  # every replica of a per_step job must start
        raw = cfg.model_dump(mode="json")
        raw["scaling"]["min_workers"] = raw["scaling"]["max_workers"] = 1
        cfg = Config.from_dict(raw, source="per_step at world size 1")
    return cfg


def final_state(summary) -> dict:
    """The final checkpoint's model (``model.``) and optimizer (``optimizer.``) tensors."""
    from elastic_ddp.checkpoint.dcp_io import load_prefix

    return {"model": load_prefix(summary.checkpoint_path, "model."),
            "optimizer": load_prefix(summary.checkpoint_path, "optim.")}


def compare(a: dict, b: dict) -> dict:
    """Per part (model, optimizer): tensors, how many are ``torch.equal``, the largest
    absolute difference and the largest relative one (to the larger magnitude)."""
    import torch

    out = {}
    for part in ("model", "optimizer"):
        x, y = a[part], b[part]
        if sorted(x) != sorted(y):
            raise RuntimeError(f"{part}: the runs' checkpoints hold different keys")
        equal, max_abs, max_rel = 0, 0.0, 0.0
        for k in x:
            if torch.equal(x[k], y[k]):
                equal += 1
                continue
            d = (x[k].double() - y[k].double()).abs()
            max_abs = max(max_abs, float(d.max()))
            scale = torch.maximum(x[k].double().abs(), y[k].double().abs()).clamp_min(1e-30)
            max_rel = max(max_rel, float((d / scale).max()))
        out[part] = {"tensors": len(x), "equal": equal, "max_abs_diff": max_abs, "max_rel_diff": max_rel}
    return out


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from elastic_ddp import train

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = [(m.strip(), int(w)) for m, w in (r.split(":") for r in args.runs.split(",") if r.strip())]
    figures: dict = {"args": vars(args), "runs": []}
    ref = None
    for mode, ws in runs:
        with local_cluster(ws, NODE_CPUS, log_to_driver=False):
            t = time.time()
            s = train(job_config(args, out, f"exact-{mode}-ws{ws}-{stamp}", mode, ws), progress=False)
            wall = time.time() - t
        state = final_state(s)
        ref = ref or (s, state)
        cmp = compare(ref[1], state)
        val, ref_val = s.metrics["val_loss"], ref[0].metrics["val_loss"]
        rel = abs(val - ref_val) / max(1e-12, abs(ref_val))
        figures["runs"].append({"mode": mode, "world_size": ws, "steps": s.steps,
                                "world_sizes_seen": s.world_sizes_seen, "val_loss": val,
                                "val_rel_diff": rel, "wall_s": wall, **cmp})
        m, o = cmp["model"], cmp["optimizer"]
        print(f"==== {mode} ws={ws} ({s.steps} steps, world sizes {s.world_sizes_seen}, {wall:.0f} s): "
              f"val_loss {val!r}, relative difference to {runs[0][0]} ws={runs[0][1]} {rel:.1e}; "
              f"model tensors equal {m['equal']}/{m['tensors']} (max abs diff {m['max_abs_diff']:.1e}, "
              f"rel {m['max_rel_diff']:.1e}); optimizer tensors equal {o['equal']}/{o['tensors']} "
              f"(max abs diff {o['max_abs_diff']:.1e})", flush=True)
    path = out / f"exact-world-sizes-{stamp}.json"
    path.write_text(json.dumps(figures, indent=1, default=str))
    print(f"(figures in {path})")
    exact = all(r[p]["equal"] == r[p]["tensors"] for r in figures["runs"] for p in ("model", "optimizer"))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
