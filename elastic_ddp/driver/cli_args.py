"""The ``elastic-ddp`` command's arguments: its commands, their options, the help texts
(the exit codes and the ``--set`` rules every config command prints). Run by
``driver.cli``."""

from __future__ import annotations

import argparse

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
       either scaling.fault_tolerance); running the same config again resumes it with no
       step recomputed.
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


def build_parser() -> argparse.ArgumentParser:
    """The ``elastic-ddp`` command's parser: every command, its arguments and help."""
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
    pr.add_argument("out_dir", help="directory or object-store URI (s3://bucket/prefix) to "
                                    "write; its train/ and val/ are replaced")
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

    cf = sub.add_parser("config", help="the config reference: every field's key, type, default, description",
                        description="Print every config field (dotted key, type, default and\n"
                                    "description), as the schema declares it. docs/config.md is\n"
                                    "its --markdown output.",
                        formatter_class=fmt)
    cf.add_argument("--describe", action="store_true", required=True,
                    help="print the reference (the one thing this command does)")
    cf.add_argument("--markdown", action="store_true",
                    help="as Markdown tables, one per section (docs/config.md)")

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
