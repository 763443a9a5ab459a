"""Every parallel strategy and comm hook, end to end on Ray at world size 2, against ddp.

    .venv/bin/python experiments/strategies.py --config experiments/configs/pycode_gpt.yaml \
        --set train.max_steps=60 --set train.eval_max_batches=8

For each (strategy, comm hook) it runs the same config as its own MLflow run and prints:
final validation loss and its relative difference to plain ddp (issue target: within
2%), steady-state samples/s, peak memory per worker (max over ranks), and the model-state
memory the ZeRO paper predicts for that stage (``parallel.zero_memory_bytes``; fp32 AdamW;
activations and the Python/torch runtime are extra, which is why the measured RSS is
larger). Runs sequentially on one local Ray cluster.

``--seeds 0,1,2,3,4`` repeats every variant per seed (``seed`` sets the init and the sample
order) and adds the paired comparison: per seed, (variant - ddp) / ddp of the same seed,
then its mean and standard error over seeds. A small model's final val loss moves by
several percent under any perturbation of its trajectory (a different seed, or the
rounding of a compressed all-reduce), so one seed cannot tell a hook's cost from noise.
"""

from __future__ import annotations

import argparse
import statistics
import time

VARIANTS = [("ddp", "none"), ("zero1", "none"), ("fsdp", "none"), ("ddp", "bf16"),
            ("ddp", "fp16"), ("ddp", "powersgd")]
STAGE = {"ddp": 0, "zero1": 1, "fsdp": 3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="experiments/configs/pycode_gpt.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--only", default="", help="comma list like ddp/none,zero1/none")
    ap.add_argument("--seeds", default="", help="comma list of seeds; default: the config's")
    args = ap.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [None]

    import ray
    from mlflow.tracking import MlflowClient

    from elastic_ddp.config import Config
    from elastic_ddp import train
    from elastic_ddp.models import build_model
    from elastic_ddp.parallel.strategies import zero_memory_bytes

    ray.init(address="local", num_cpus=args.world_size + 2, include_dashboard=False,
             logging_level="WARNING")
    variants = VARIANTS
    if args.only:
        wanted = {tuple(v.split("/")) for v in args.only.split(",")}
        variants = [v for v in VARIANTS if v in wanted]
    rows = []
    stamp = time.strftime("%H%M%S")
    for seed, (strategy, hook) in ((sd, v) for sd in seeds for v in variants):
        extra = [] if seed is None else [f"seed={seed}"]
        cfg = Config.load(args.config, args.overrides + extra + [
            f"parallel.strategy={strategy}", f"parallel.comm_hook={hook}",
            f"scaling.min_workers={args.world_size}", f"scaling.max_workers={args.world_size}",
            f"run.name=strategies-{stamp}-{strategy}-{hook}-s{cfg_seed(seed)}", "run.resume=false"])
        t = time.time()
        s = train(cfg, progress=False)
        client = MlflowClient(s.tracking_uri)
        hist = lambda k: [m.value for m in client.get_metric_history(s.run_id, k)]  # noqa: E731
        sps = hist("samples_per_s")[1:] or hist("samples_per_s")
        mem = hist("worker/peak_mem_mib_max")
        n_params = sum(p.numel() for p in build_model(cfg.model).parameters())
        rows.append({
            "seed": cfg.seed, "strategy": strategy, "hook": hook, "val_loss": s.metrics.get("val_loss", float("nan")),
            "samples_per_s": statistics.median(sps) if sps else float("nan"),
            "peak_mem_mib": max(mem) if mem else float("nan"),
            "zero_model_state_mib": zero_memory_bytes(n_params, args.world_size, STAGE[strategy]) / 2**20,
            "wall_s": time.time() - t,
        })
    ray.shutdown()
    ref = {r["seed"]: r["val_loss"] for r in rows if r["strategy"] == "ddp" and r["hook"] == "none"}
    print(f"\n{'seed':>4} {'strategy':>8} {'hook':>9} {'val_loss':>9} {'vs ddp':>8} {'samples/s':>10} "
          f"{'peak MiB':>9} {'ZeRO model-state MiB':>21} {'wall s':>7}")
    for r in rows:
        base = ref.get(r["seed"])
        r["rel"] = (r["val_loss"] - base) / base if base else float("nan")
        print(f"{r['seed']:>4} {r['strategy']:>8} {r['hook']:>9} {r['val_loss']:>9.4f} {r['rel']:>+8.2%} "
              f"{r['samples_per_s']:>10.1f} {r['peak_mem_mib']:>9.0f} "
              f"{r['zero_model_state_mib']:>21.2f} {r['wall_s']:>7.0f}")
    if len(seeds) > 1:
        print(f"\nover seeds {args.seeds}: mean val_loss, and the paired difference to ddp "
              f"(mean +- standard error over seeds)")
        for strategy, hook in variants:
            mine = [r for r in rows if (r["strategy"], r["hook"]) == (strategy, hook)]
            rel = [r["rel"] for r in mine]
            se = statistics.stdev(rel) / len(rel) ** 0.5 if len(rel) > 1 else float("nan")
            print(f"{strategy:>8} {hook:>9} {statistics.mean(r['val_loss'] for r in mine):>9.4f} "
                  f"{statistics.mean(rel):>+8.2%} +- {se:.2%}")


def cfg_seed(seed) -> str:
    return "cfg" if seed is None else str(seed)


if __name__ == "__main__":
    main()
