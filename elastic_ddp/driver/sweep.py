"""Scaling sweep: the same job at several fixed world sizes, as child runs of one parent
MLflow run, with a table and plots of quality, time to accuracy and where the time goes.

    elastic-ddp sweep experiments/configs/digits_cnn.yaml --world-sizes 1,2 --set train.max_steps=60

Each world size N runs ``train`` with ``scaling.min_workers = max_workers = N`` under its
own Ray run name (so it never resumes another's checkpoints) and a fresh MLflow run
tagged ``mlflow.parentRunId``. The parent run gets, as artifacts under ``sweep/``:
``sweep_table.txt`` (the printed table), ``sweep.json``, ``sweep_table.json`` (an
``mlflow.log_table`` table, one row per world size), ``quality.png`` (the validation
metric against seconds since each child's start, with the time-to-target per world
size), ``throughput.png`` (measured vs the linear ideal), ``scaling_efficiency.png`` and
``step_breakdown.png`` (stacked per-step seconds: data wait, compute, exposed all-reduce,
optimizer, other). The plots are also logged as MLflow images (``log_image``), so the
parent's "Model metrics" tab shows them first (section ``plots``), and its metrics are
keyed by world size: ``<metric>/ws<N>`` (``val_acc/ws2``, ``val_loss/ws2``,
``time_to_target_s/ws2``, ``samples_per_s/ws2``, ``scaling_efficiency/ws2``), one
section per metric with one chart per world size, never a world size used as a step.
Comparing the children side by side in one chart is MLflow's own view: select them in
the experiment's runs table, then the chart view.

Time to target: the target is the worst final value of the validation metric
(``val_acc``, higher is better, else ``val_loss``, lower is better) among the children,
so every world size reaches it; ``time_to_target_s`` is the time from a child's MLflow
run start (start-up included) to the first evaluation that reached it.

Steady-state figures are the median over a child run's metric windows after step 1 (the
first window holds warm-up: allocator growth, DDP bucket rebuild, gloo connection set-up);
a median, not a mean, so one window hit by a noisy neighbour does not move it.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from elastic_ddp.config import Config, ConfigError
from elastic_ddp.driver.sweep_plots import plot_quality, plot_sweep
from elastic_ddp.metrics import scaling_efficiency, step_breakdown

# Metrics read back from each child run (see worker._Window for their meaning).
_STEADY_KEYS = (
    "samples_per_s", "tokens_per_s", "step_time_s_mean", "step_time_s_max",
    "data_wait_s_mean", "fwd_bwd_s_mean", "allreduce_exposed_s_mean", "optimizer_s_mean",
    "allreduce_s_min", "allreduce_busbw_GBps", "allreduce_bytes_per_step", "data_wait_frac",
)


@dataclass
class SweepRow:
    """One world size's steady-state figures (seconds per optimizer step, mean over
    ranks unless named ``_max``)."""

    world_size: int
    run_id: str
    samples_per_s: float
    tokens_per_s: Optional[float]
    efficiency: float
    step_time_s: float
    step_time_s_max: float
    breakdown: dict[str, float]
    allreduce_s: float
    allreduce_bytes_per_step: float
    busbw_GBps: float
    peak_mem_mib_max: float
    wall_s: float
    quality: dict[str, float] = field(default_factory=dict)
    time_to_target_s: Optional[float] = None


@dataclass
class SweepResult:
    """``target``: (validation metric, value) every world size reached, or None without
    a validation split."""

    parent_run_id: str
    tracking_uri: str
    rows: list[SweepRow]
    table: str
    artifacts: list[str] = field(default_factory=list)
    target: Optional[tuple[str, float]] = None


def parse_world_sizes(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4] (sorted, unique). Raises ConfigError on anything else."""
    try:
        sizes = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise ConfigError(f"--world-sizes {text!r}: expected comma-separated integers, "
                          "e.g. --world-sizes 1,2,4") from None
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"--world-sizes {text!r}: need at least one size, each >= 1")
    return sizes


def child_config(cfg: Config, world_size: int, tag: str) -> Config:
    """``cfg`` pinned to ``world_size`` workers under a run name unique to this sweep.

    Raises:
        ConfigError: the batch settings cannot run at ``world_size`` (checked for every
            size before anything starts).
    """
    raw = cfg.model_dump(mode="json")
    if cfg.data.order == "windowed" and cfg.data.partitions is None:
        # Every child on the parent's order (batching.fit_partitions would give a child
        # of 5 or more workers another count than one of 4 or fewer on few row groups).
        raw["data"]["partitions"] = cfg.partitions
    raw["scaling"]["min_workers"] = raw["scaling"]["max_workers"] = world_size
    raw["run"]["name"] = f"{cfg.run.name}-sweep-{tag}-ws{world_size}"
    raw["run"]["resume"] = False
    return Config.from_dict(raw, source=f"sweep world_size={world_size}")


def steady_metrics(uri: str, run_id: str) -> dict[str, float]:
    """Median of each metric in ``_STEADY_KEYS`` over the run's log windows after step 1
    (all windows when there is no other), and the max of ``peak_mem_mib_max``."""
    from elastic_ddp.tracking import metric_history, metric_key

    out: dict[str, float] = {}
    for key in _STEADY_KEYS + ("peak_mem_mib_max", "wall_s"):
        hist = metric_history(uri, run_id, metric_key(key))
        if not hist:
            continue
        later = [v for step, v in hist if step > 1] or [v for _, v in hist]
        out[key] = max(later) if key in ("peak_mem_mib_max", "wall_s") else statistics.median(later)
    return out


def quality_target(finals: Sequence[dict[str, float]]) -> Optional[tuple[str, float, bool]]:
    """(metric, target, higher_is_better) for time to target, from each child's final
    ``val_*`` metrics: ``val_acc`` (the lowest final value) when every child has it,
    else ``val_loss`` (the highest); None when a child has neither."""
    for key, higher in (("val_acc", True), ("val_loss", False)):
        vals = [f[key] for f in finals if key in f]
        if vals and len(vals) == len(finals):
            return key, (min(vals) if higher else max(vals)), higher
    return None


def time_to_target(uri: str, run_id: str, key: str, target: float, higher: bool,
                   ) -> tuple[Optional[float], list[tuple[float, float]]]:
    """Seconds from the run's start to its first evaluation of ``key`` at or past
    ``target`` (None: never), and the (seconds since start, value) curve. The times are
    the values' MLflow timestamps, written when rank 0 sent them."""
    from elastic_ddp.tracking import client, metric_key

    c = client(uri)
    start = c.get_run(run_id).info.start_time
    hist = sorted(c.get_metric_history(run_id, metric_key(key)), key=lambda m: (m.timestamp, m.step))
    curve = [((m.timestamp - start) / 1000.0, m.value) for m in hist]
    hit = next((t for t, v in curve if (v >= target if higher else v <= target)), None)
    return hit, curve


def build_rows(children: Sequence[tuple[int, str, dict[str, float]]]) -> list[SweepRow]:
    """Rows from (world size, run id, steady metrics), sorted by world size. Efficiency is
    relative to the smallest world size N0: ``T_N x N0 / (N x T_N0)`` (1.0 = linear)."""
    children = sorted(children, key=lambda c: c[0])
    n0, _, m0 = children[0]
    rows = []
    for ws, run_id, m in children:
        nan = math.nan
        step = m.get("step_time_s_mean", nan)
        parts = step_breakdown(step, m.get("data_wait_s_mean", 0.0), m.get("fwd_bwd_s_mean", 0.0),
                               m.get("allreduce_exposed_s_mean", nan), m.get("optimizer_s_mean", 0.0))
        rows.append(SweepRow(
            world_size=ws, run_id=run_id, samples_per_s=m.get("samples_per_s", nan),
            tokens_per_s=m.get("tokens_per_s"),
            efficiency=scaling_efficiency(m.get("samples_per_s", nan) * n0,
                                          m0.get("samples_per_s", nan), ws),
            step_time_s=step, step_time_s_max=m.get("step_time_s_max", nan), breakdown=parts,
            allreduce_s=m.get("allreduce_s_min", nan),
            allreduce_bytes_per_step=m.get("allreduce_bytes_per_step", 0.0),
            busbw_GBps=m.get("allreduce_busbw_GBps", nan),
            peak_mem_mib_max=m.get("peak_mem_mib_max", nan), wall_s=m.get("wall_s", nan),
        ))
    return rows


def format_table(rows: Sequence[SweepRow], target: Optional[tuple[str, float]] = None) -> str:
    """A fixed-width text table, one line per world size: the final validation metric
    and the seconds to ``target`` (when given), then throughput and times in ms per step."""
    tok = any(r.tokens_per_s for r in rows)
    q = target[0] if target else None
    head = (f"{'N':>3}" + (f" {q:>9} {'to target':>9}" if q else "") + f" {'samples/s':>10}" +
            (f" {'tokens/s':>10}" if tok else "") +
            f" {'eff':>6} {'step ms':>8} {'max ms':>8} {'data':>6} {'compute':>8} {'ar_exp':>7}"
            f" {'optim':>6} {'other':>6} {'ar ms':>7} {'ar MB':>7} {'busbw GB/s':>10}"
            f" {'peak MiB':>9} {'wall s':>7}")
    lines = [head]
    for r in rows:
        b = {k: v * 1e3 for k, v in r.breakdown.items()}
        tt = f"{r.time_to_target_s:>8.1f}s" if r.time_to_target_s is not None else f"{'-':>9}"
        lines.append(
            f"{r.world_size:>3}" + (f" {r.quality.get(q, math.nan):>9.4f} {tt}" if q else "") +
            f" {r.samples_per_s:>10.1f}" +
            (f" {r.tokens_per_s or float('nan'):>10.0f}" if tok else "") +
            f" {r.efficiency:>6.1%} {r.step_time_s * 1e3:>8.2f} {r.step_time_s_max * 1e3:>8.2f}"
            f" {b['data_wait']:>6.2f} {b['compute']:>8.2f} {b['allreduce_exposed']:>7.2f}"
            f" {b['optimizer']:>6.2f} {b['other']:>6.2f} {r.allreduce_s * 1e3:>7.2f}"
            f" {r.allreduce_bytes_per_step / 1e6:>7.3f} {r.busbw_GBps:>10.3f}"
            f" {r.peak_mem_mib_max:>9.0f} {r.wall_s:>7.1f}")
    if q:
        lines.append(f"{q}: final, on the validation split; to target: seconds from the run's "
                     f"start to the first evaluation with {q} at or past {target[1]:.4f} (the "
                     "worst final value among the world sizes)")
    lines.append("N: world size; eff: samples/s vs linear from the smallest N; step ms: mean "
                 "over ranks (max: slowest rank); data/compute/ar_exp/optim/other: ms per "
                 "step (ar_exp = all-reduce not hidden by backward); ar ms: one whole "
                 "un-overlapped all-reduce (fastest rank); ar MB: 2(N-1)/N x gradient bytes "
                 "per rank per step; busbw = ar MB / ar ms.")
    return "\n".join(lines)


def _parent_metrics(r: SweepRow) -> dict[str, float]:
    """A row as parent-run metrics keyed by world size: ``<metric>/ws<N>``."""
    m = {"samples_per_s": r.samples_per_s, "scaling_efficiency": r.efficiency, **r.quality}
    if r.time_to_target_s is not None:
        m["time_to_target_s"] = r.time_to_target_s
    return {f"{k}/ws{r.world_size}": v for k, v in m.items() if v is not None and not math.isnan(v)}


def _table_row(r: SweepRow) -> dict:
    return {"world_size": r.world_size, **r.quality, "time_to_target_s": r.time_to_target_s,
            "samples_per_s": round(r.samples_per_s, 1), "scaling_efficiency": round(r.efficiency, 4),
            "step_ms": round(r.step_time_s * 1e3, 3), "wall_s": round(r.wall_s, 1),
            "run_id": r.run_id}


def sweep(cfg: Config, world_sizes: Sequence[int], progress: bool = False,
          out_dir: Optional[str] = None) -> SweepResult:
    """Run ``cfg`` at each world size (in increasing order) as child runs of one new
    parent MLflow run; log the table, the per-world-size metrics and the plots to the
    parent and return them.

    Raises:
        ConfigError: a world size the batch settings cannot carry, or a tracking server
            that does not answer (before anything runs).
        TrainingError: a child run failed; the parent run is closed as FAILED.
    """
    import ray

    from elastic_ddp import tracking
    from elastic_ddp.driver.launcher import train
    from elastic_ddp.driver.ray_start import init_ray

    sizes = sorted(set(world_sizes))
    tag = time.strftime("%Y%m%d-%H%M%S")
    children_cfg = {ws: child_config(cfg, ws, tag) for ws in sizes}   # validate all first
    uri = tracking.default_tracking_uri(cfg)
    from elastic_ddp.driver.preflight import check_tracking_store, tracking_uri_field

    check_tracking_store(uri, tracking_uri_field(cfg))  # before the parent run is opened
    # Few params: what the sweep compares and on what. The children carry the whole
    # config as params (and the parent has it as sweep/config.json); the MLflow UI prints
    # a run's params above each of its image charts, where fifty would hide the plots.
    # Three, one line above each plot: what varies, the task, the global batch.
    params = {"sweep.world_sizes": ",".join(map(str, sizes)),
              "task": cfg.task.path or cfg.model.name,
              "batch.global_batch_size": str(cfg.batch.global_batch_size)}
    no_resume = cfg.model_copy(deep=True)
    no_resume.run.resume = False
    parent_id, _ = tracking.open_run(no_resume, f"sweep-{tag}", uri, params=params,
                                     tags={"elastic_ddp.sweep": ",".join(map(str, sizes))},
                                     run_name=f"{cfg.run.name}-sweep-{tag}")
    print(f"elastic-ddp sweep: world sizes {sizes} -> parent MLflow run {parent_id} at {uri}",
          flush=True)

    started_ray = not ray.is_initialized()
    # One Ray cluster for the whole sweep, sized for the largest world size.
    init_ray(children_cfg[sizes[-1]])
    children: list[tuple[int, str, dict[str, float]]] = []
    finals: dict[int, dict[str, float]] = {}
    try:
        for ws in sizes:
            summary = train(children_cfg[ws], progress=progress, parent_run_id=parent_id)
            children.append((ws, summary.run_id, steady_metrics(uri, summary.run_id)))
            finals[ws] = dict(summary.metrics)
    except BaseException as e:  # a child's failure, Ctrl-C, SIGTERM (driver.stop.JobStopped)
        tracking.finish_run(uri, parent_id, ok=False, error=f"{type(e).__name__}: {e}",
                            status="FAILED" if isinstance(e, Exception) else "KILLED")
        raise
    finally:
        if started_ray:
            ray.shutdown()

    rows = build_rows(children)
    target = quality_target([finals[r.world_size] for r in rows])
    curves: dict[int, list[tuple[float, float]]] = {}
    for r in rows:
        r.quality = {k: v for k, v in finals[r.world_size].items() if k.startswith("val_")}
        if target is not None:
            r.time_to_target_s, curves[r.world_size] = time_to_target(uri, r.run_id, *target)
    table = format_table(rows, target[:2] if target else None)
    for r in rows:
        tracking.log_metrics(uri, parent_id, _parent_metrics(r), 0)
    with tempfile.TemporaryDirectory(prefix="elastic-ddp-sweep-") as tmp:
        d = Path(out_dir) if out_dir else Path(tmp)
        paths = plot_sweep(rows, d, title=f"{cfg.task.path or cfg.model.name}, global batch {cfg.batch.global_batch_size}")
        if target is not None:
            paths.insert(0, plot_quality(rows, curves, target[:2], d))
        (d / "sweep_table.txt").write_text(table + "\n")
        (d / "config.json").write_text(json.dumps(cfg.model_dump(mode="json"), indent=1))
        (d / "sweep.json").write_text(json.dumps([asdict(r) for r in rows], indent=1, default=str))
        for p in paths + [d / "sweep_table.txt", d / "sweep.json", d / "config.json"]:
            tracking.log_artifact(uri, parent_id, str(p), "sweep")
        tracking.log_table(uri, parent_id, [_table_row(r) for r in rows], "sweep/sweep_table.json")
        # As images, the parent's "Model metrics" tab shows the plots; under plots/ they
        # are its first section (sections sort in ASCII order, before samples_per_s/...).
        for p in paths:
            tracking.log_image(uri, parent_id, str(p), key=f"plots/{p.stem}")
        artifacts = ([f"sweep/{p.name}" for p in paths] +
                     ["sweep/sweep_table.txt", "sweep/sweep.json", "sweep/sweep_table.json",
                      "sweep/config.json"])
    tracking.finish_run(uri, parent_id, ok=True)
    return SweepResult(parent_run_id=parent_id, tracking_uri=uri, rows=rows, table=table,
                       artifacts=artifacts, target=target[:2] if target else None)
