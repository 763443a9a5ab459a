"""Data of any size: the product's reader against plain Ray Data on the same files, at
several data-set sizes.

    .venv/bin/python experiments/bench_data.py --sizes 0.4,2,8 --out data/bench_data

For each size (GB of Parquet, generated locally under ``--out`` from the standard
library's source: 129-byte windows, files of 1M rows, row groups of 8192 rows; never
committed), runs the same job twice on a local Ray cluster, 2 gloo workers, the gpt
preset's model (2 layers, 128 wide), global batch 32, ``--steps`` steps, one worker
SIGKILLed before step ``--kill-at``:

* ``elastic``: ``elastic_ddp.train`` (windowed order, per-rank Ray Data pipelines).
* ``plain``: ``ray.data.read_parquet(files)`` handed to the same ``TorchTrainer`` with Ray
  Train's default streaming split, ``iter_torch_batches`` per worker, the same model and
  optimizer; after the kill it restarts its epoch from the start (Ray Data has no
  mid-epoch resume).

Columns: data set size; command to first step (seconds from the job's start, in this
process, to the end of step 1); peak RSS per worker (VmHWM, max over ranks and
attempts); bytes per rank (elastic: what its epoch plan reads per rank over a whole
epoch, bounded by <= 1.1 x data/N + one window; plain: not planned, it
streams); samples/s at steady state, wall clock from the end of step kill/2 + 1 to the end
of step kill - 1 on the slowest rank, everything between steps included (the product's
metric logging, checkpoints every 10 steps and ledger; step ends from the ledger and, in
the plain job, from its loop); data-wait share
of step time; recovery seconds from the kill to the first step after it; and for the
elastic run, the ledger audit (samples lost/repeated). Then the time to open a reader
at cursor 0, mid-epoch and 90% into the epoch of the largest set (no training).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
from elastic_ddp.run_state import Diagnostics

ROW_BYTES = 129
ROWS_PER_FILE = 1 << 20
ROW_GROUP = 8192


def generate(out: Path, gb: float) -> Path:
    """``out/<gb>GB/train`` (and a small ``val``) of 129-byte windows of the stdlib's
    source, at about ``gb`` GB of Parquet; reused when present."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = out / f"{gb:g}GB"
    if (d / "done").exists():
        return d
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = np.frombuffer(b"\n".join(p.read_bytes() for p in sorted(stdlib.rglob("*.py"))
                                      if "site-packages" not in p.parts), dtype=np.uint8)
    n = int(gb * 1e9 / (ROW_BYTES + 8 + 4 * 0.3))  # Parquet's bytes per row, measured
    for split, rows in (("train", n), ("val", 4096)):
        (d / split).mkdir(parents=True, exist_ok=True)
        for f, start in enumerate(range(0, rows, ROWS_PER_FILE)):
            k = min(ROWS_PER_FILE, rows - start)
            ids = np.arange(start, start + k, dtype=np.int64) + (0 if split == "train" else 10**12)
            offs = (ids * 7919) % (len(corpus) - ROW_BYTES)
            x = corpus[offs[:, None] + np.arange(ROW_BYTES)]
            col = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), ROW_BYTES)
            pq.write_table(pa.table({"sample_id": ids, "x": col}), d / split / f"part-{f:05d}.parquet",
                           row_group_size=ROW_GROUP)
    (d / "done").write_text("ok")
    return d


def _config(data: Path, tmp: Path, name: str, steps: int):
    from elastic_ddp.config import Config

    return Config.from_dict({
        "data": {"train_path": str(data / "train"), "val_path": str(data / "val")},
        "task": {"kwargs": {"column": "x", "block_size": 128}},
        "model": {"name": "gpt", "kwargs": {"n_layer": 2, "n_head": 4, "n_embd": 128}},
        "optim": {"lr": 1e-3, "warmup_steps": 5},
        "batch": {"global_batch_size": 32, "micro_batch_size": 16},
        "train": {"epochs": 1, "max_steps": steps, "log_every_steps": 5,
                  "checkpoint_every_steps": 10, "eval_max_batches": 1},
        "scaling": {"min_workers": 2, "max_workers": 2, "max_failures": 2, "torch_threads": 1},
        "run": {"name": name, "storage_path": str(tmp / "ray"), "experiment_name": "bench-data",
                "tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}"},
    })


def run_elastic(data: Path, tmp: Path, steps: int, kill_at: int) -> dict:
    from elastic_ddp.data.ingest import epoch_order
    from elastic_ddp import train
    from elastic_ddp.driver.launcher import prepare
    from elastic_ddp.ledger import audit
    from elastic_ddp.tracking import metric_history, metric_key

    cfg = _config(data, tmp, f"elastic-{data.name}", steps)
    t0 = time.time()
    s = train(cfg, progress=False, diagnostics=Diagnostics(ledger_dir=str(tmp / "ledger"), fault={"rank": 1, "at_step": kill_at, "where": "step", "marker": str(tmp / "fired")}))
    uri, rid = cfg.run.tracking_uri, s.run_id
    hist = {k: metric_history(uri, rid, metric_key(k))
            for k in ("peak_mem_mib_max", "samples_per_s", "data_wait_frac")}
    steady = lambda k: [v for st, v in hist[k] if kill_at // 2 < st < kill_at]  # noqa: E731
    info = prepare(cfg).train_info
    order = epoch_order(info, cfg, 0)
    from elastic_ddp.data.ingest import window_bytes

    per_rank = [window_bytes(info, order.rank_windows(r, 2, 0)) for r in range(2)]
    whole = sum(g.nbytes for g in info.row_groups)
    window = max(cfg.data.shuffle_window_rows / cfg.partitions, ROW_GROUP) * whole / info.num_rows
    # The run stops inside its epoch: the audit checks that no committed step repeated a
    # sample and that the committed steps used exactly steps x 32 distinct samples.
    used = _committed_ids(tmp / "ledger")
    rep = audit(tmp / "ledger", used, 1)
    ep = rep["epochs"][0]
    return {"cmd_to_first_step_s": s.startup.get("total_s", float("nan")) - s.startup.get("imports_s", 0),
            "peak_rss_mib": max(v for _, v in hist["peak_mem_mib_max"]),
            "bytes_per_rank_epoch": max(per_rank), "bound": 1.1 * whole / 2 + window,
            "samples_per_s": _wall_samples_per_s(_ledger_step_ends(tmp / "ledger"), kill_at // 2 + 1,
                                                 kill_at - 1),
            "data_wait_frac": float(np.median(steady("data_wait_frac"))),
            "recovery_s": s.events[0]["recovery_s"] if s.events else float("nan"),
            "audit": f"{ep['repeated']} repeated, {len(used)}/{steps * 32} samples",
            "wall_s": time.time() - t0}


def _committed_ids(ledger: Path):
    """The ids the committed steps used (for data sets too big to list every id: the
    audit then checks repeats only)."""
    from elastic_ddp.ledger import read_attempts

    out = set()
    for a in read_attempts(ledger):
        for rows in a.steps.values():
            for _, _, ids in rows:
                out.update(ids.tolist())
    return np.array(sorted(out), dtype=np.int64)


def _plain_train_func(config: dict) -> None:
    """Plain Ray Data: the streaming split of ``read_parquet``, the same model."""
    import ray.train
    import torch

    from elastic_ddp.metrics import peak_rss_bytes
    from elastic_ddp.tasks.nets import GPT

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(GPT(256, 128, 2, 4, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    marker = Path(config["marker"])
    first = Path(config["first"]) / f"first-{time.time_ns()}-{rank}"
    it = ray.train.get_dataset_shard("train").iter_torch_batches(batch_size=16, dtypes={"x": torch.int64})
    step, t_wait, t_step, times = 0, 0.0, 0.0, []
    t = time.perf_counter()
    for batch in it:
        t_data = time.perf_counter()
        if step + 1 == config["kill_at"] and rank == 1 and not marker.exists():
            marker.write_text(json.dumps({"t": time.time()}))
            os.kill(os.getpid(), 9)
        tok = batch["x"]
        logits = model(tok[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tok[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        now = time.perf_counter()
        if step == 1:
            first.write_text(str(time.time()))
        if config["kill_at"] // 2 < step < config["kill_at"]:
            t_wait += t_data - t
            t_step += now - t
            times.append((step, time.time()))
        t = now
        if step >= config["steps"]:
            break
    if times:  # the attempt that ran the steady-state window (before the kill) reports
        (Path(config["first"]).parent / f"stats-{rank}.json").write_text(json.dumps(
            {"data_wait_frac": t_wait / max(t_step, 1e-9), "ends": times}))
    rss = Path(config["first"]).parent / f"rss-{rank}-{time.time_ns()}"
    rss.write_text(str(peak_rss_bytes() / 2**20))


def _wall_samples_per_s(ends: list[dict], a: int, b: int, batch: int = 32) -> float:
    """Steady samples/s over steps (a, b] of wall-clock time, everything between the
    steps included (the product's metric logging, checkpoints and ledger; the plain job's
    loop): ``(b - a) x batch / (end(b) - end(a))``, the slowest rank. ``ends``: per rank,
    step -> the step's end, seconds since the epoch."""
    return min((b - a) * batch / (e[b] - e[a]) for e in ends if a in e and b in e)


def _ledger_step_ends(ledger: Path) -> list[dict]:
    """Per rank, step -> end time (the ledger's ``t``) in the job's first attempt."""
    out = []
    files = sorted(ledger.glob("attempt-*-rank*.jsonl"))
    heads = [json.loads(f.read_text().splitlines()[0]) for f in files]
    first = min(h["t"] for h in heads)
    first_key = [h.get("attempt") for h in heads if h["t"] == first][0]
    for f, h in zip(files, heads):
        if h.get("attempt") != first_key:
            continue
        ends = {}
        for ln in f.read_text().splitlines()[1:]:
            try:
                rec = json.loads(ln)
            except json.JSONDecodeError:
                continue  # the killed rank's torn last line
            if "step" in rec and "t" in rec:
                ends[int(rec["step"])] = float(rec["t"])
        out.append(ends)
    return out


def run_plain(data: Path, tmp: Path, steps: int, kill_at: int) -> dict:
    import ray.data
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    files = sorted(str(p) for p in (data / "train").glob("*.parquet"))
    (tmp / "first").mkdir(parents=True, exist_ok=True)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    t0 = time.time()
    trainer = TorchTrainer(
        _plain_train_func, train_loop_config={"marker": str(tmp / "plain-fired"), "first": str(tmp / "first"),
                                              "kill_at": kill_at, "steps": steps},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=f"plain-{data.name}-{int(t0)}", storage_path=str(tmp / "ray"),
                             failure_config=FailureConfig(max_failures=2)),
        datasets={"train": ray.data.read_parquet(files, columns=["x"])})
    trainer.fit()
    firsts = sorted(float(p.read_text()) for p in (tmp / "first").iterdir())
    kill_t = json.loads((tmp / "plain-fired").read_text())["t"]
    stats = [json.loads(p.read_text()) for p in tmp.glob("stats-*.json")]
    rss = max(float(p.read_text()) for p in tmp.glob("rss-*"))
    return {"cmd_to_first_step_s": firsts[0] - t0, "peak_rss_mib": rss,
            "bytes_per_rank_epoch": float("nan"), "bound": float("nan"),
            "samples_per_s": _wall_samples_per_s([{int(k): v for k, v in s["ends"]} for s in stats],
                                                 kill_at // 2 + 1, kill_at - 1),
            "data_wait_frac": max(s["data_wait_frac"] for s in stats),
            "recovery_s": min(t for t in firsts if t > kill_t) - kill_t, "audit": "n/a (no ledger)",
            "wall_s": time.time() - t0}


def resume_open_times(data: Path, tmp: Path) -> dict:
    """Seconds from opening rank 0's reader (Ray Data pipeline) at a cursor to holding the
    first step's rows, at cursor 0, mid-epoch and 90% into the epoch."""
    from elastic_ddp.data.readers import open_train_reader
    from elastic_ddp.driver.launcher import prepare

    cfg = _config(data, tmp, "open", 10)
    prep = prepare(cfg)
    task, info, sample = prep.task, prep.train_info, prep.sample
    out = {}
    for frac in (0.0, 0.5, 0.9):
        cursor = int(info.num_rows * frac) // 32 * 32
        t = time.perf_counter()
        _, reader = open_train_reader(info, task, cfg, 0, 2, 0, cursor, 32, template=sample["train"])
        reader.take(cursor, 32)
        out[f"{frac:.0%}"] = round(time.perf_counter() - t, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="0.4,2,8", help="GB of Parquet per data set")
    ap.add_argument("--out", default="data/bench_data")
    ap.add_argument("--steps", type=int, default=140)
    ap.add_argument("--kill-at", type=int, default=100)
    ap.add_argument("--only", default="elastic,plain")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs per reader and size, alternating elastic and plain (the "
                         "samples/s ratio is then the median over the pairs)")
    args = ap.parse_args()

    from elastic_ddp.driver.local_ray import init_local_ray

    sizes = [float(s) for s in args.sizes.split(",")]
    dirs = {gb: generate(Path(args.out), gb) for gb in sizes}
    init_local_ray(num_cpus=4, configure_logging=True, logging_level="WARNING", log_to_driver=False)
    rows = []
    for gb in sizes:
        for rep in range(args.repeat):
            for kind in args.only.split(","):
                with tempfile.TemporaryDirectory(prefix=f"bench-data-{kind}-") as tmp:
                    fn = run_elastic if kind == "elastic" else run_plain
                    r = fn(dirs[gb], Path(tmp), args.steps, args.kill_at)
                    r.update(size_gb=gb, kind=kind, rep=rep)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    print(f"\n2 workers, gpt 2x128, global batch 32, {args.steps} steps, worker SIGKILLed before step "
          f"{args.kill_at}; {ROW_GROUP}-row row groups")
    print(f"{'GB':>5} {'reader':>8} {'cmd->1st s':>10} {'peak RSS MiB':>12} {'bytes/rank/epoch':>17} "
          f"{'bound':>10} {'samples/s':>9} {'data wait':>9} {'recovery s':>10}  audit")
    for r in rows:
        print(f"{r['size_gb']:>5g} {r['kind']:>8} {r['cmd_to_first_step_s']:>10.1f} {r['peak_rss_mib']:>12.0f} "
              f"{r['bytes_per_rank_epoch'] / 1e9:>15.2f}GB {r['bound'] / 1e9:>8.2f}GB "
              f"{r['samples_per_s']:>9.1f} {r['data_wait_frac']:>9.2%} {r['recovery_s']:>10.1f}  {r['audit']}")
    for gb in sizes:  # run-to-run noise on shared cores: the ratio per adjacent pair
        sps = {(r["kind"], r["rep"]): r["samples_per_s"] for r in rows if r["size_gb"] == gb}
        ratios = [sps[("elastic", k)] / sps[("plain", k)] for k in range(args.repeat)
                  if ("elastic", k) in sps and ("plain", k) in sps]
        if ratios:
            print(f"{gb:g} GB samples/s elastic / plain per pair: "
                  f"{', '.join(f'{x:.0%}' for x in ratios)}; median {float(np.median(ratios)):.0%}")
    print("reader open -> first step's rows on the largest set, by cursor position:",
          resume_open_times(dirs[sizes[-1]], Path(tempfile.mkdtemp())))


if __name__ == "__main__":
    sys.exit(main())
