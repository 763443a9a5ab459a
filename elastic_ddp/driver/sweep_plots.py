"""The scaling sweep's plots (matplotlib, PNG files logged to the parent MLflow run):
where the time goes per world size, and quality against wall time. ``rows`` are
:class:`elastic_ddp.driver.sweep.SweepRow` objects."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

# The parts of a step's time, bottom to top in the stacked bars (SweepRow.breakdown's keys).
BREAKDOWN_PARTS = ("data_wait", "compute", "allreduce_exposed", "optimizer", "other")


def plot_sweep(rows: Sequence[Any], out_dir: Path, title: str = "") -> list[Path]:
    """Write throughput.png, scaling_efficiency.png, step_breakdown.png into ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    ws = [r.world_size for r in rows]
    tput = [r.samples_per_s for r in rows]
    paths = []

    fig, ax = plt.subplots(figsize=(5.5, 4))
    ideal = [tput[0] * n / ws[0] for n in ws]
    ax.plot(ws, ideal, "--", color="grey", label="linear ideal")
    ax.plot(ws, tput, "o-", color="C0", label="measured")
    for n, t in zip(ws, tput):
        ax.annotate(f"{t:.0f}", (n, t), textcoords="offset points", xytext=(0, 6), ha="center")
    ax.set_xlabel("world size (workers)")
    ax.set_ylabel("samples / s (steady state)")
    ax.set_xticks(ws)
    ax.set_ylim(bottom=0)
    ax.set_title(f"Throughput vs world size{': ' + title if title else ''}", fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out_dir / "throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 4))
    eff = [r.efficiency * 100 for r in rows]
    ax.bar([str(n) for n in ws], eff, color="C2")
    ax.axhline(100, ls="--", color="grey", label="linear scaling")
    for i, e in enumerate(eff):
        ax.annotate(f"{e:.0f}%", (i, e), textcoords="offset points", xytext=(0, 3), ha="center")
    ax.set_xlabel("world size (workers)")
    ax.set_ylabel(f"scaling efficiency, % of linear from N={ws[0]}")
    ax.set_ylim(0, max(110, max(eff) * 1.1 if eff else 110))
    ax.set_title("Scaling efficiency", fontsize=10)
    ax.legend(loc="lower right")
    fig.tight_layout()
    paths.append(out_dir / "scaling_efficiency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4))
    bottom = [0.0] * len(rows)
    labels = {"data_wait": "data wait", "compute": "forward+backward (hidden all-reduce inside)",
              "allreduce_exposed": "exposed all-reduce", "optimizer": "optimizer",
              "other": "other"}
    for i, part in enumerate(BREAKDOWN_PARTS):
        vals = [r.breakdown[part] * 1e3 for r in rows]
        ax.bar([str(n) for n in ws], vals, bottom=bottom, label=labels[part], color=f"C{i}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("world size (workers)")
    ax.set_ylabel("ms per optimizer step (mean over ranks)")
    ax.set_title("Step-time breakdown", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    paths.append(out_dir / "step_breakdown.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def plot_quality(rows: Sequence[Any], curves: dict[int, list[tuple[float, float]]],
                 target: tuple[str, float], out_dir: Path) -> Path:
    """quality.png: the validation metric against seconds since each child's start (one
    line per world size), the target as a dashed line and each world size's time to
    reach it marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, value = target
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, r in enumerate(rows):
        pts = curves.get(r.world_size, [])
        if pts:
            ax.plot([t for t, _ in pts], [v for _, v in pts], "o-", color=f"C{i}", ms=3,
                    label=f"N={r.world_size}" + (f": {r.time_to_target_s:.0f} s to target"
                                                 if r.time_to_target_s is not None else ""))
        if r.time_to_target_s is not None:
            ax.axvline(r.time_to_target_s, color=f"C{i}", ls=":", lw=1)
    ax.axhline(value, ls="--", color="grey", label=f"target {key} = {value:.4f}")
    ax.set_xlabel("seconds since the run started (start-up included)")
    ax.set_ylabel(key)
    ax.set_title(f"Time to target {key} by world size", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / "quality.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
