"""The ``elastic-ddp`` command: thin wrappers over the library.

    elastic-ddp prepare digits data/digits
    elastic-ddp prepare pycode data/pycode --block-size 128
    elastic-ddp plan  experiments/configs/digits_cnn.yaml
    elastic-ddp train experiments/configs/digits_cnn.yaml --set scaling.max_workers=4
    elastic-ddp sweep experiments/configs/digits_cnn.yaml --world-sizes 1,2
    elastic-ddp submit experiments/configs/digits_cnn.yaml --address http://127.0.0.1:8265 --wait
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional

EXIT_CODES = """\
exit codes:
  0    ok
  1    training failed (its MLflow run is marked FAILED; checkpoints are kept), or
       submit could not reach the cluster
  2    bad config, data or arguments, or a missing optional dependency: no MLflow
       run, no local Ray (on a running cluster the job's two actors are stopped);
       or a run that cannot resume (no checkpoint of it verifies, or its config or
       model differs where a resume keeps it): its MLflow run is left as it was
  3    trained and checkpointed, but the job's MLflow run was deleted (or removed) while
       it trained: its later metrics and the final model are not in MLflow; the last
       line names the fix (restore the run from MLflow's trash, or another run.name)
  130  interrupted (Ctrl-C); running the same config again resumes an unfinished job
  143  stopped by SIGTERM at a checkpoint committed at the next step boundary (Ray 2.60,
       restart mode); running the same config again resumes it with no step recomputed.
       Also SIGTERM before training started (checks, data scan, MLflow run creation,
       Ray start-up): nothing to checkpoint, a run opened by then is marked KILLED
"""

SET_RULES = """\
--set KEY=VALUE is typed by the field it sets: a string field takes the text as is
(2024, @nightly, 'run #2' stay strings; empty is refused), a bool field only true or
false, a number field a number, a list or dict field YAML flow syntax ([1, 8, 8]), an
optional field null or an empty value for None; free-form (dict[str, Any]) values are
read as YAML scalars (64 is an int; quote for a string: '64'). Unknown keys are refused.
"""

_CONFIG_EPILOG = EXIT_CODES + "\n" + SET_RULES
_RAY_LOGS_HELP = ("also print Ray's and MLflow's own log lines and the workers' output "
                  "(default: they go to Ray's session logs, /tmp/ray/session_latest/logs/; "
                  "same as ELASTIC_DDP_RAY_LOGS=1)")
_SET_HELP = ("override a config field, repeatable; the value is typed by the field "
             "(see below), e.g. --set {example}")


def _add_config_args(sp: argparse.ArgumentParser, example: str, config_help: str = "") -> None:
    sp.add_argument("config", help=config_help or "YAML preset, e.g. experiments/configs/digits_cnn.yaml")
    sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help=_SET_HELP.format(example=example))


def _parser() -> argparse.ArgumentParser:
    from elastic_ddp import __version__

    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="elastic-ddp", formatter_class=fmt, epilog=_CONFIG_EPILOG,
        description="Elastic PyTorch DDP on Ray Train, one MLflow run per job. "
                    "`elastic-ddp COMMAND -h` for a command's arguments.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    pr = sub.add_parser("prepare", help="write a real data set as sharded Parquet",
                        description="Write a real data set as sharded Parquet with a sample_id\n"
                                    "column: train/ and val/ under OUT_DIR.",
                        epilog=EXIT_CODES, formatter_class=fmt)
    pr.add_argument("dataset", choices=["digits", "pycode"],
                    help="digits: scikit-learn's 1,797 8x8 images (needs the 'examples' extra); "
                         "pycode: byte windows of this Python's standard library")
    pr.add_argument("out_dir", help="directory to write; its train/ and val/ are replaced")
    pr.add_argument("--num-files", type=int, default=None,
                    help="training Parquet files to shard into (default: digits 4, pycode 8)")
    pr.add_argument("--block-size", type=int, default=128,
                    help="pycode: context length in bytes; windows hold block_size+1 (default 128)")
    pr.add_argument("--max-bytes", type=int, default=None,
                    help="pycode: cap the corpus at this many bytes (default: all, ~30 MB)")
    pr.add_argument("--json", action="store_true",
                    help="print what was written (files, rows) as JSON instead of one line")

    tr = sub.add_parser("train", help="run a training job",
                        description="Run a training job on a local Ray cluster (or the one\n"
                                    "RAY_ADDRESS names), tracked as one MLflow run.",
                        epilog=_CONFIG_EPILOG, formatter_class=fmt)
    _add_config_args(tr, "scaling.max_workers=4")
    tr.add_argument("--no-progress", action="store_true",
                    help="no progress display (off a terminal it is already plain lines, "
                         "one every few seconds, instead of a live bar)")
    tr.add_argument("--json", action="store_true",
                    help="print the summary as JSON: the only thing on stdout (the config, "
                         "progress, Ray's and other libraries' lines go to stderr)")
    tr.add_argument("--verbose", action="store_true",
                    help="print every config field (default: only those that differ from "
                         "the defaults)")
    tr.add_argument("--ray-logs", action="store_true", help=_RAY_LOGS_HELP)

    pl = sub.add_parser("plan", help="valid world sizes for a config",
                        description="The world sizes in [min_workers, max_workers] the batch\n"
                                    "settings allow, with rows per rank and grad accumulation.",
                        epilog=_CONFIG_EPILOG, formatter_class=fmt)
    _add_config_args(pl, "scaling.max_workers=8")

    sb = sub.add_parser("submit", help="submit `train CONFIG` as a job to a running Ray cluster",
                        epilog=_CONFIG_EPILOG, formatter_class=fmt)
    _add_config_args(sb, "train.epochs=3; validated before submitting",
                     "YAML preset inside a checkout, e.g. experiments/configs/digits_cnn.yaml "
                     "(from any directory: the checkout holding it is uploaded)")
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

    ex = sub.add_parser("export", help="write a checkpoint's model alone as one file",
                        description="Write the model of a checkpoint (a checkpoint_step<k> directory\n"
                                    "of the run's storage path) as one plain PyTorch state dict\n"
                                    "(torch.load(OUT, weights_only=True) -> model.load_state_dict),\n"
                                    "or safetensors when OUT ends in .safetensors. The optimizer\n"
                                    "state is not read. Every file read is first checked against\n"
                                    "the checkpoint's manifest (sizes, checksums).",
                        epilog=EXIT_CODES, formatter_class=fmt)
    ex.add_argument("checkpoint", help="checkpoint directory or URI, e.g. "
                    "ray_results/RUN/checkpoint_step00000120, s3://bucket/runs/RUN/checkpoint_step00000120")
    ex.add_argument("out", help="file to write (.pt, or .safetensors: needs the safetensors package)")
    ex.add_argument("--no-verify", action="store_true",
                    help="skip the checks of the files read against the checkpoint's manifest "
                         "(sizes, XXH3 checksums; by default a checkpoint that fails them is "
                         "refused, exit 2); reads an incomplete checkpoint as it is")

    dn = sub.add_parser("drain-node", help="drain this pod's Ray node before it stops (a preStop hook)",
                        description="Drain the Ray node of this container as a preemption with a\n"
                                    "deadline (Ray's DRAIN_NODE_REASON_PREEMPTION), then wait until no\n"
                                    "Ray Train worker is left on it or the deadline passes. Run it as a\n"
                                    "worker pod's preStop hook (cluster/kuberay/): the eviction becomes a\n"
                                    "notice, the job checkpoints at the next step boundary and moves off.",
                        formatter_class=fmt)
    who = dn.add_mutually_exclusive_group(required=True)
    who.add_argument("--self", dest="self_node", action="store_true",
                     help="the Ray node whose raylet runs in this container (mount namespace)")
    who.add_argument("--node-id", default=None, help="a Ray node on this host, by hex id")
    dn.add_argument("--deadline", type=int, required=True, metavar="SECONDS",
                    help="seconds until the node is stopped: the pod's "
                         "terminationGracePeriodSeconds less a margin (e.g. 100 for 120)")
    dn.add_argument("--no-wait", action="store_true",
                    help="return once the drain is accepted, without waiting for the workers")

    sw = sub.add_parser("sweep", help="run a config at several fixed world sizes; scaling table + plots",
                        epilog=_CONFIG_EPILOG, formatter_class=fmt)
    _add_config_args(sw, "train.max_steps=100")
    sw.add_argument("--world-sizes", default="1,2", help="comma-separated, e.g. 1,2,4 (default 1,2)")
    sw.add_argument("--out", default=None, help="also keep the plots and table in this directory")
    sw.add_argument("--progress", action="store_true", help="show each run's progress line")
    sw.add_argument("--verbose", action="store_true",
                    help="print every config field (default: only those that differ from "
                         "the defaults)")
    sw.add_argument("--ray-logs", action="store_true", help=_RAY_LOGS_HELP)
    return p


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
    from elastic_ddp.config import Config, ConfigError

    try:
        if args.cmd == "prepare":
            return _prepare(args)
        if args.cmd == "submit":
            return _submit(args)
        if args.cmd == "export":
            return _export(args)
        if args.cmd == "drain-node":
            return _drain_node(args)
        cfg = Config.load(args.config, args.overrides)
        if args.cmd in ("train", "sweep"):
            _route_library_logs(args.ray_logs)
        if args.cmd == "plan":
            return _plan(cfg)
        if args.cmd == "sweep":
            return _sweep(cfg, args)
        return _train(cfg, args)
    except ConfigError as e:
        from elastic_ddp.driver.lease import RunBusyError
        from elastic_ddp.driver.resume import ResumeError
        from elastic_ddp.tasks.loading import TaskError

        kind = ("task error" if isinstance(e, TaskError) else
                "run in use" if isinstance(e, RunBusyError) else
                "resume refused" if isinstance(e, ResumeError) else "config error")
        print(f"elastic-ddp: {kind}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        # The launcher has already closed the MLflow run as KILLED; checkpoints stay.
        from elastic_ddp.driver.stop import INTERRUPTED_BEFORE_RUN, JobInterrupted

        msg = (f"interrupted{_SWEEP_STOPPED}" if args.cmd == "sweep" else
               str(e) if isinstance(e, JobInterrupted) else
               INTERRUPTED_BEFORE_RUN if args.cmd == "train" else "interrupted")
        print(f"elastic-ddp: {msg}", file=sys.stderr)
        return 130
    except BaseException as e:
        from elastic_ddp.driver.stop import EXIT_STOPPED, JobStopped

        if isinstance(e, JobStopped):  # SIGTERM: a BaseException, as Ctrl-C's is
            msg = f"stopped on SIGTERM{_SWEEP_STOPPED}" if args.cmd == "sweep" else str(e)
            print(f"elastic-ddp: {msg}", file=sys.stderr)
            return EXIT_STOPPED
        if not isinstance(e, Exception):
            raise
        from elastic_ddp.data.scan import DataError
        from elastic_ddp.fencing import EXIT_TAKEN_OVER, FencedError

        if isinstance(e, FencedError):  # another job took the run over: one line
            print(f"elastic-ddp: {e}", file=sys.stderr)
            return EXIT_TAKEN_OVER
        if isinstance(e, DataError):  # known input errors: exit 2
            print(f"elastic-ddp: data error: {e}{_ray_job_hint(args)}", file=sys.stderr)
            return 2
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
    from elastic_ddp.checkpoint import CheckpointError
    from elastic_ddp.checkpoint.export import export

    try:
        out = export(args.checkpoint, args.out, verify=not args.no_verify)
    except CheckpointError as e:
        print(f"elastic-ddp: checkpoint error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if e.name != "safetensors":
            raise
        print("elastic-ddp: export to .safetensors needs the safetensors package: "
              "pip install safetensors (or write a .pt file)", file=sys.stderr)
        return 2
    print(f"elastic-ddp export: {out['tensors']} tensors, {out['bytes']} bytes -> {out['out']}")
    return 0


def _drain_node(args) -> int:
    from elastic_ddp.driver.drain import DrainError, drain

    try:
        drain(args.deadline, node_id=args.node_id, wait=not args.no_wait)
    except DrainError as e:
        print(f"elastic-ddp: drain-node: {e}", file=sys.stderr)
        return 2
    return 0


def _submit(args) -> int:
    import os

    from elastic_ddp.driver.submit import DEFAULT_ADDRESS, SubmitError, submit

    address = args.address or os.environ.get("RAY_API_SERVER_ADDRESS") or DEFAULT_ADDRESS
    try:
        return submit(args.config, args.overrides, address, args.runtime_env, wait=args.wait,
                      submission_id=args.submission_id, allow_local_paths=args.allow_local_paths)
    except SubmitError as e:
        print(f"elastic-ddp: submit failed: {e}", file=sys.stderr)
        return 1


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
    from elastic_ddp.driver.launcher import TrainingError
    from elastic_ddp.driver.sweep import parse_world_sizes, sweep

    world_sizes = parse_world_sizes(args.world_sizes)  # ConfigError (exit 2) before printing
    print("\n".join(config_lines(cfg, args.verbose)), flush=True)
    try:
        result = sweep(cfg, world_sizes, progress=args.progress, out_dir=args.out)
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

    from elastic_ddp.driver.launcher import TrainingError, process_start_time, train
    from elastic_ddp.driver.report import format_summary

    def show_config(c) -> None:  # once the task and the data passed their checks
        print("\n".join(config_lines(c, args.verbose)), flush=True)

    try:
        summary = train(cfg, progress=not args.no_progress, command_start=process_start_time(),
                        on_validated=show_config)
    except TrainingError as e:
        print(f"elastic-ddp: {e}", file=sys.stderr)
        # No checkpoint of the run verifies: bad input on storage, refused as such.
        return 2 if "CheckpointCorruptError" in str(e) else 1
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
