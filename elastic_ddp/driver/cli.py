"""The ``elastic-ddp`` command: thin wrappers over the library.

    elastic-ddp prepare digits data/digits
    elastic-ddp prepare pycode data/pycode --block-size 128
    elastic-ddp plan  experiments/configs/digits_cnn.yaml
    elastic-ddp train experiments/configs/digits_cnn.yaml --set scaling.max_workers=4
    elastic-ddp sweep experiments/configs/digits_cnn.yaml --world-sizes 1,2
    elastic-ddp submit experiments/configs/digits_cnn.yaml --address http://127.0.0.1:8265 --wait
    elastic-ddp config --describe
"""

from __future__ import annotations

import json
import sys
from typing import Any, Optional

from elastic_ddp.driver.cli_args import build_parser as _parser
from elastic_ddp.errors import ElasticDDPError


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "train" and args.json:
        from elastic_ddp.driver.json_out import DocumentStdout

        # Before the config is read: a task module's import may print already.
        with DocumentStdout() as doc:
            args.document = doc
            return _main(args)
    return _main(args)


def _main(args) -> int:
    from elastic_ddp.config import Config

    try:
        if args.cmd == "prepare":
            return _prepare(args)
        if args.cmd == "submit":
            return _submit(args)
        if args.cmd == "export":
            return _export(args)
        if args.cmd == "drain-node":
            return _drain_node(args)
        if args.cmd == "config":
            from elastic_ddp.config import describe

            print(describe.markdown() if args.markdown else describe.text(), end="")
            return 0
        cfg = Config.load(args.config, args.overrides)
        if args.cmd in ("train", "sweep"):
            _route_library_logs(args.ray_logs)
        if args.cmd == "plan":
            return _plan(cfg)
        if args.cmd == "sweep":
            return _sweep(cfg, args)
        return _train(cfg, args)
    except ElasticDDPError as e:
        # One line and the error's own exit code (elastic_ddp.errors): bad input 2, a
        # failed job or an unreachable cluster 1.
        print(e.cli_line() + _ray_job_hint(args, e), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        # The launcher has already closed the MLflow run as KILLED; checkpoints stay.
        from elastic_ddp.driver.stop import EXIT_INTERRUPTED, INTERRUPTED_BEFORE_RUN, JobInterrupted

        msg = (f"interrupted{_SWEEP_STOPPED}" if args.cmd == "sweep" else
               str(e) if isinstance(e, JobInterrupted) else
               INTERRUPTED_BEFORE_RUN if args.cmd == "train" else "interrupted")
        print(f"elastic-ddp: {msg}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BaseException as e:
        from elastic_ddp.driver.stop import JobStopped

        if isinstance(e, JobStopped):  # SIGTERM: a BaseException, as Ctrl-C's is
            msg = f"stopped on SIGTERM{_SWEEP_STOPPED}" if args.cmd == "sweep" else str(e)
            print(f"elastic-ddp: {msg}", file=sys.stderr)
            return e.exit_code
        raise


# A sweep's child runs are never resumed (each sweep names its own): what a stop left.
_SWEEP_STOPPED = (": every MLflow run of the sweep opened by then is closed KILLED; the same "
                  "command starts a new sweep")


def _route_library_logs(ray_logs: bool) -> None:
    """The console shows the job, not the libraries' internals: MLflow's INFO lines
    ("Creating initial MLflow database tables...") only with ``--ray-logs``, which also
    brings Ray's own lines and the workers' output back (``ELASTIC_DDP_RAY_LOGS``, read
    by the launcher); warnings and errors always show."""
    import logging
    import os

    from elastic_ddp.driver.local_ray import RAY_LOGS_ENV

    if ray_logs:
        os.environ[RAY_LOGS_ENV] = "1"
    level = "INFO" if os.environ.get(RAY_LOGS_ENV) else "WARNING"
    # MLflow sets its logger's level when it is imported (later): from this variable.
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", level)
    logging.getLogger("mlflow").setLevel(os.environ["MLFLOW_LOGGING_LEVEL"].upper())


def _ray_job_hint(args, e: ElasticDDPError) -> str:
    """Inside a Ray job (the job supervisor sets RAY_JOB_CONFIG_JSON_ENV_VAR) relative data
    paths resolve in the job's uploaded copy of the working dir, which holds no data/:
    "prepare the data" would be the wrong fix there. Added to a data error of ``train``."""
    import os

    from elastic_ddp.data.listing import DataError

    if (not os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or args.cmd != "train"
            or not isinstance(e, DataError)):
        return ""
    return (f"\nnote: this is a Ray job running in its uploaded copy of the working dir "
            f"({os.getcwd()}), which holds no data/ (.rayignore); relative data paths resolve "
            "there. Pass absolute paths every node sees or URIs, e.g. --set "
            "data.train_path=/abs/data/digits/train (`elastic-ddp submit` does this itself for "
            "a cluster on this machine)")


def _prepare(args) -> int:
    from elastic_ddp.data.prepare import prepare_digits, prepare_pycode
    from elastic_ddp.driver.storage_checks import StorageError, check_out_dir

    try:
        check_out_dir(args.out_dir)  # an object-store OUT_DIR: bucket, credentials, write
        return _prepare_into(args, prepare_digits, prepare_pycode)
    except StorageError as e:
        print(f"elastic-ddp: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if not str(args.out_dir).lower().startswith(("s3://", "gs://", "gcs://")):
            raise
        print(f"elastic-ddp: prepare {args.dataset}: {e}", file=sys.stderr)
        return 2


def _prepare_into(args, prepare_digits, prepare_pycode) -> int:
    if args.dataset == "digits":
        try:
            out = prepare_digits(args.out_dir, **({"num_files": args.num_files} if args.num_files else {}))
        except ModuleNotFoundError as e:
            if e.name != "sklearn":
                raise
            # scikit-learn is an optional extra: only this data set needs it.
            print("elastic-ddp: prepare digits needs scikit-learn, which is not installed: "
                  "pip install 'elastic-ddp[examples]' (or pip install 'scikit-learn>=1.3')",
                  file=sys.stderr)
            return 2
    else:
        kw = {"block_size": args.block_size, "max_bytes": args.max_bytes}
        if args.num_files:
            kw["num_files"] = args.num_files
        out = prepare_pycode(args.out_dir, **kw)
    if args.json:
        print(json.dumps({k: v for k, v in out.items()}, indent=1, default=str))
        return 0
    parts = []
    for split in ("train", "val"):
        if isinstance(out.get(split), dict):
            n = len(out[split]["files"])
            parts.append(f"{split} {out[split]['num_rows']} rows in {n} file{'s' * (n != 1)}")
    print(f"elastic-ddp prepare {args.dataset}: {', '.join(parts)} -> {out.get('out_dir', args.out_dir)}")
    return 0


def _export(args) -> int:
    from elastic_ddp.checkpoint.export import export

    try:  # a CheckpointError: exit 2, in _main
        out = export(args.checkpoint, args.out, verify=not args.no_verify)
    except ModuleNotFoundError as e:
        if e.name != "safetensors":
            raise
        print("elastic-ddp: export to .safetensors needs the safetensors package: "
              "pip install safetensors (or write a .pt file)", file=sys.stderr)
        return 2
    print(f"elastic-ddp export: {out['tensors']} tensors, {out['bytes']} bytes -> {out['out']}")
    return 0


def _drain_node(args) -> int:
    from elastic_ddp.driver.drain import drain

    drain(args.deadline, node_id=args.node_id, wait=not args.no_wait)  # DrainError: exit 2
    return 0


def _submit(args) -> int:
    import os

    from elastic_ddp.driver.submit import DEFAULT_ADDRESS, submit

    address = args.address or os.environ.get("RAY_API_SERVER_ADDRESS") or DEFAULT_ADDRESS
    # SubmitError: exit 1, in _main
    return submit(args.config, args.overrides, address, args.runtime_env, wait=args.wait,
                  submission_id=args.submission_id, allow_local_paths=args.allow_local_paths)


def _fitted_partitions(cfg):
    """(rows, partitions) the job would use for ``data.train_path`` with ``data.partitions``
    unset (``data.ingest.epoch_partitions``), from the Parquet footers and the id column
    alone (no task is loaded); None when the data cannot be read here (a path on the
    cluster only, a bad file: ``train`` names the problem)."""
    from elastic_ddp.data.ingest import epoch_partitions
    from elastic_ddp.data.scan import DataError, scan_parquet

    try:
        info = scan_parquet(cfg.data.train_path, {}, cfg.data.id_column, field="data.train_path")
    except (DataError, OSError, ValueError):
        return None
    return info.num_rows, epoch_partitions(info, cfg)


def _plan(cfg) -> int:
    from elastic_ddp.batching import valid_world_sizes

    b, s, p = cfg.batch, cfg.scaling, cfg.partitions
    print(f"global_batch_size={b.global_batch_size} micro_batch_size<={b.micro_batch_size} "
          f"policy={b.policy} workers {s.min_workers}..{s.max_workers}")
    fitted = _fitted_partitions(cfg) if p > 1 and cfg.data.partitions is None else None
    if fitted is not None:
        rows, p = fitted
        print(f"data.partitions unset: {p} partitions fitted to {cfg.data.train_path} "
              f"({rows} rows; its row groups and data.shuffle_window_rows)")
    if p > 1:
        print(f"data.order=windowed with {p} canonical partitions: the sample order is the same at "
              "every world size <= partitions; a rank reads only its own partitions")
        if cfg.data.partitions is None and fitted is None:
            print("  (data.partitions unset: a data set with fewer than 10 row groups per "
                  "partition, or row groups larger than a window (shuffle_window_rows / "
                  "partitions rows), gets fewer, a divisor of this count; the world sizes "
                  "below keep their balance)")
    else:
        print("data.order=permutation: the same order at every world size; every rank reads "
              "every row")
    print(f"{'world_size':>10} {'global':>7} {'rows/rank':>12} {'grad_accum':>10} {'lr_x':>6}  note")
    for ws, plan, why in valid_world_sizes(b.global_batch_size, b.micro_batch_size, s.min_workers,
                                           s.max_workers, b.policy, b.lr_scaling, p):
        if plan is None:
            print(f"{ws:>10} {'-':>7} {'-':>12} {'-':>10} {'-':>6}  refused: {why}")
            continue
        rows = plan.rows_per_rank
        rr = str(rows[0]) if plan.even else f"{min(rows)}-{max(rows)}"
        if p > 1:
            k = p // ws
            note = (f"{k} partitions per rank" if p % ws == 0 else
                    f"{k}-{k + 1} partitions per rank (exact order, unbalanced)")
        else:
            note = "even" if plan.even else "uneven (loss-weighted, exact mean)"
        if ws == 1 and plan.shards > 1:
            note += f"; as {plan.shards} shards: bitwise the training of world size {plan.shards}"
        print(f"{ws:>10} {plan.global_batch_size:>7} {rr:>12} {plan.grad_accum_steps:>10} "
              f"{plan.lr_multiplier:>6.2f}  {note}")
    return 0


def config_lines(cfg, verbose: bool = False) -> list[str]:
    """The config as printed before a job: every field as indented JSON with
    ``verbose``, else one ``key=value`` line per field that differs from its default
    (``Config.changed_fields``). Each short line is also a valid ``--set`` argument:
    strings as their raw text, other values as JSON (true, null, [1, 8, 8])."""
    if verbose:
        return ["elastic-ddp config:", json.dumps(cfg.model_dump(mode="json"), indent=1)]
    lines = ["elastic-ddp config (fields that differ from the defaults; --verbose for all):"]
    for key, value in cfg.changed_fields().items():
        lines.append(f"  {key}={_set_text(value)}")
    return lines


def _set_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _sweep(cfg, args) -> int:
    from elastic_ddp.driver.sweep import parse_world_sizes, sweep

    world_sizes = parse_world_sizes(args.world_sizes)  # ConfigError (exit 2) before printing
    print("\n".join(config_lines(cfg, args.verbose)), flush=True)
    result = sweep(cfg, world_sizes, progress=args.progress, out_dir=args.out)  # TrainingError: exit 1
    print("\n=== elastic-ddp sweep ===")
    print(result.table)
    print(f"parent MLflow run: {result.parent_run_id} at {result.tracking_uri}; "
          f"artifacts: {', '.join(result.artifacts)}")
    return 0


def _train(cfg, args) -> int:
    from dataclasses import asdict

    from elastic_ddp.driver.launcher import train
    from elastic_ddp.driver.preflight import process_start_time
    from elastic_ddp.driver.report import format_summary

    def show_config(c) -> None:  # once the task and the data passed their checks
        print("\n".join(config_lines(c, args.verbose)), flush=True)

    # TrainingError: exit 1 (2 when no checkpoint of the run verifies), in _main
    summary = train(cfg, progress=not args.no_progress, command_start=process_start_time(),
                    on_validated=show_config)
    if args.json:
        args.document.emit(json.dumps(asdict(summary), indent=1, default=str))
    else:
        print(format_summary(summary))
    if summary.mlflow_run_lost:
        from elastic_ddp.tracking.run_lost import EXIT_RUN_LOST

        print(f"elastic-ddp: {summary.mlflow_run_lost}", file=sys.stderr, flush=True)
        return EXIT_RUN_LOST
    return 0


if __name__ == "__main__":
    sys.exit(main())
