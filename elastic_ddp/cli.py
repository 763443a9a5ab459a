"""The ``elastic-ddp`` command: thin wrappers over the library.

    elastic-ddp prepare digits data/digits
    elastic-ddp prepare pycode data/pycode --block-size 128
    elastic-ddp plan  experiments/configs/digits_cnn.yaml
    elastic-ddp train experiments/configs/digits_cnn.yaml --set scaling.max_workers=4
    elastic-ddp sweep experiments/configs/digits_cnn.yaml --world-sizes 1,2
    elastic-ddp submit experiments/configs/digits_cnn.yaml --address http://127.0.0.1:8265 --wait

Exit codes: 0 success, 1 training failed, 2 bad config or data (nothing was started).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elastic-ddp", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    pr = sub.add_parser("prepare", help="write a real data set as sharded Parquet")
    pr.add_argument("dataset", choices=["digits", "pycode"])
    pr.add_argument("out_dir")
    pr.add_argument("--num-files", type=int, default=None)
    pr.add_argument("--block-size", type=int, default=128, help="pycode: tokens per window")
    pr.add_argument("--max-bytes", type=int, default=None, help="pycode: cap the corpus")

    for name, helptext in (("train", "run a training job"), ("plan", "valid world sizes for a config")):
        sp = sub.add_parser(name, help=helptext)
        sp.add_argument("config", help="YAML preset, e.g. experiments/configs/digits_cnn.yaml")
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set scaling.max_workers=4 (repeatable)")
        if name == "train":
            sp.add_argument("--no-progress", action="store_true", help="plain log lines only")
            sp.add_argument("--json", action="store_true", help="print the summary as JSON")

    sb = sub.add_parser("submit", help="submit `train CONFIG` as a job to a running Ray cluster")
    sb.add_argument("config", help="YAML preset inside a checkout, e.g. experiments/configs/digits_cnn.yaml "
                                   "(from any directory: the checkout holding it is uploaded)")
    sb.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field (repeatable); validated before submitting")
    sb.add_argument("--address", default=None,
                    help="job API (dashboard) URL; default $RAY_API_SERVER_ADDRESS, else "
                         "http://127.0.0.1:8265")
    sb.add_argument("--runtime-env", default=None,
                    help="runtime env YAML (default: cluster/runtime_env.yaml of the config's checkout)")
    sb.add_argument("--allow-local-paths", action="store_true",
                    help="submit to a non-loopback address even with relative or this machine's "
                         "data/storage paths or a local MLflow store (refused otherwise, exit 2)")
    sb.add_argument("--submission-id", default=None, help="job id (default: run name + time)")
    sb.add_argument("--wait", action="store_true", help="follow the logs; exit with the job's status")

    sw = sub.add_parser("sweep", help="run a config at several fixed world sizes; scaling table + plots")
    sw.add_argument("config", help="YAML preset, e.g. experiments/configs/digits_cnn.yaml")
    sw.add_argument("--world-sizes", default="1,2", help="comma-separated, e.g. 1,2,4 (default 1,2)")
    sw.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field, e.g. --set train.max_steps=100 (repeatable)")
    sw.add_argument("--out", default=None, help="also keep the plots and table in this directory")
    sw.add_argument("--progress", action="store_true", help="show each run's progress line")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    from elastic_ddp.config import Config, ConfigError

    try:
        if args.cmd == "prepare":
            return _prepare(args)
        if args.cmd == "submit":
            return _submit(args)
        cfg = Config.load(args.config, args.overrides)
        if args.cmd == "plan":
            return _plan(cfg)
        if args.cmd == "sweep":
            return _sweep(cfg, args)
        return _train(cfg, args)
    except ConfigError as e:
        print(f"elastic-ddp: config error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - map known input errors to exit 2
        from elastic_ddp.data.scan import DataError

        if isinstance(e, DataError):
            print(f"elastic-ddp: data error: {e}{_ray_job_hint(args)}", file=sys.stderr)
            return 2
        raise


def _ray_job_hint(args) -> str:
    """Inside a Ray job (the job supervisor sets RAY_JOB_CONFIG_JSON_ENV_VAR) relative data
    paths resolve in the job's uploaded copy of the working dir, which holds no data/:
    "prepare the data" would be the wrong fix there."""
    import os

    if not os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or args.cmd != "train":
        return ""
    return (f"\nnote: this is a Ray job running in its uploaded copy of the working dir "
            f"({os.getcwd()}), which holds no data/ (.rayignore); relative data paths resolve "
            "there. Pass absolute paths every node sees or URIs, e.g. --set "
            "data.train_path=/abs/data/digits/train (`elastic-ddp submit` does this itself for "
            "a cluster on this machine)")


def _prepare(args) -> int:
    from elastic_ddp.data.prepare import prepare_digits, prepare_pycode

    if args.dataset == "digits":
        out = prepare_digits(args.out_dir, **({"num_files": args.num_files} if args.num_files else {}))
    else:
        kw = {"block_size": args.block_size, "max_bytes": args.max_bytes}
        if args.num_files:
            kw["num_files"] = args.num_files
        out = prepare_pycode(args.out_dir, **kw)
    print(json.dumps({k: v for k, v in out.items()}, indent=1, default=str))
    return 0


def _submit(args) -> int:
    import os

    from elastic_ddp.submit import DEFAULT_ADDRESS, SubmitError, submit

    address = args.address or os.environ.get("RAY_API_SERVER_ADDRESS") or DEFAULT_ADDRESS
    try:
        return submit(args.config, args.overrides, address, args.runtime_env, wait=args.wait,
                      submission_id=args.submission_id, allow_local_paths=args.allow_local_paths)
    except SubmitError as e:
        print(f"elastic-ddp: submit failed: {e}", file=sys.stderr)
        return 1


def _plan(cfg) -> int:
    from elastic_ddp.batching import valid_world_sizes

    b, s = cfg.batch, cfg.scaling
    print(f"global_batch_size={b.global_batch_size} micro_batch_size<={b.micro_batch_size} "
          f"policy={b.policy} workers {s.min_workers}..{s.max_workers}")
    print(f"{'world_size':>10} {'global':>7} {'rows/rank':>12} {'grad_accum':>10} {'lr_x':>6}  note")
    for ws, plan, why in valid_world_sizes(b.global_batch_size, b.micro_batch_size,
                                           s.min_workers, s.max_workers, b.policy, b.lr_scaling):
        if plan is None:
            print(f"{ws:>10} {'-':>7} {'-':>12} {'-':>10} {'-':>6}  refused: {why}")
            continue
        rows = plan.rows_per_rank
        rr = str(rows[0]) if plan.even else f"{min(rows)}-{max(rows)}"
        print(f"{ws:>10} {plan.global_batch_size:>7} {rr:>12} {plan.grad_accum_steps:>10} "
              f"{plan.lr_multiplier:>6.2f}  {'even' if plan.even else 'uneven (loss-weighted, exact mean)'}")
    return 0


def _sweep(cfg, args) -> int:
    from elastic_ddp.launcher import TrainingError
    from elastic_ddp.sweep import parse_world_sizes, sweep

    try:
        result = sweep(cfg, parse_world_sizes(args.world_sizes), progress=args.progress,
                       out_dir=args.out)
    except TrainingError as e:
        print(f"elastic-ddp: {e}", file=sys.stderr)
        return 1
    print("\n=== elastic-ddp sweep ===")
    print(result.table)
    print(f"parent MLflow run: {result.parent_run_id} at {result.tracking_uri}; "
          f"artifacts: {', '.join(result.artifacts)}")
    return 0


def _train(cfg, args) -> int:
    from dataclasses import asdict

    from elastic_ddp.launcher import TrainingError, process_start_time, train

    print("elastic-ddp config:\n" + json.dumps(cfg.model_dump(mode="json"), indent=1), flush=True)
    try:
        summary = train(cfg, progress=not args.no_progress, command_start=process_start_time())
    except TrainingError as e:
        print(f"elastic-ddp: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(asdict(summary), indent=1, default=str))
    else:
        metrics = " ".join(f"{k}={v:.4f}" for k, v in summary.metrics.items())
        print("\n=== elastic-ddp summary ===")
        print(f"validation:       {metrics}")
        print(f"steps / epochs:   {summary.steps} / {summary.epochs}")
        print(f"wall time:        {summary.wall_s:.1f} s   goodput {summary.goodput:.2%} "
              "(committed training-step time / wall time, start-up and checkpoints included)")
        print(f"world size per attempt: {summary.world_sizes_seen}   restarts: {summary.restarts}")
        if summary.startup:
            print(f"command to first step: {summary.startup['total_s']:.1f} s (" + ", ".join(
                f"{k.removesuffix('_s')} {v:.1f}" for k, v in summary.startup.items() if k != "total_s") + ")")
        for ev in summary.events:
            print(f"  event: {ev.get('type')} cause={ev.get('cause', '')!s:.80} "
                  f"recovery_s={ev.get('recovery_s')} steps_recomputed={ev.get('steps_recomputed')}")
        print(f"MLflow run:       {summary.run_id} at {summary.tracking_uri}")
        print(f"open the UI:      {summary.mlflow_ui_command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
