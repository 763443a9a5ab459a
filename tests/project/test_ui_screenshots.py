"""The MLflow UI as a person sees it (tests/e2e/tracking/test_train_e2e.py checks the logged content;
this checks how the real UI shows it): a real sqlite store written through the real
tracker writer (``tracking.JobTracker``, in-process, raw trainer metric names), the real
``mlflow ui`` on 127.0.0.1, a real headless Chromium driven by playwright
(experiments/mlflow_screenshots.py). The charts tab lists the train/ and val/ sections
first, and the four run pages render to PNGs.

Skipped when no Chromium is installed (``apt-get install chromium``; playwright's own
browser download is not used) or without playwright, the Python driver (the ``ui``
extra, which ``make test-all`` installs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import digits_config

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "experiments"))
import mlflow_screenshots as shots  # noqa: E402

pytestmark = pytest.mark.skipif(shots.find_chromium() is None,
                                reason="no Chromium on this machine (apt-get install chromium)")


def _finished_run(tmp: Path) -> tuple[str, str]:
    from elastic_ddp import tracking
    from elastic_ddp.config import Config

    cfg = Config.from_dict(digits_config(tmp / "d", tmp))
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    run_id, _ = tracking.open_run(cfg, "storage", uri)
    w = tracking.JobTracker(uri, run_id, flush_period_s=0.2)
    for step in range(1, 41, 5):  # what rank 0 sends, under the trainer's raw names
        w.log_metrics({"step": step, "epoch": 1 + step // 20, "train_loss": 2.0 / step,
                       "train_acc": 1 - 1.0 / (step + 1), "lr": 0.01, "samples_per_s": 900.0,
                       "world_size": 2, "step_time_s_mean": 0.01, "step_time_s_max": 0.012,
                       "allreduce_s_min": 0.002, "peak_mem_mib_max": 600.0}, step)
        if step % 20 == 1:
            w.log_metrics({"val_loss": 1.0 / step, "val_acc": 1 - 0.5 / step}, step)
    assert w.flush(30)
    tracking.log_metrics(uri, run_id, {"goodput": 0.5, "wall_s": 60.0, "startup_s": 30.0}, 40)
    tracking.log_table(uri, run_id, [{"phase": "scan", "seconds": 1.5}], "startup.json")
    tracking.finish_run(uri, run_id, ok=True)
    return uri, run_id


# slow: 30 s of a real browser; the run's content is checked in test_tracking/test_train_e2e.
@pytest.mark.slow
def test_run_pages_show_loss_and_accuracy_first(tmp_path):
    pytest.importorskip("playwright.sync_api", reason="no playwright: pip install -e '.[ui]'")
    uri, run_id = _finished_run(tmp_path)
    out = tmp_path / "shots"
    paths = shots.capture(tmp_path / "mlflow.db", out, run_id, settle_s=1.5)
    assert {p.name for p in paths} == {"overview.png", "model-metrics.png", "system-metrics.png",
                                       "artifacts.png"}
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000

    sections = json.loads((out / "model-metrics-sections.json").read_text())
    # As a person scrolls the charts tab: loss and accuracy, then the rest.
    assert sections[:2] == ["train", "val"], sections
    assert sections.index("worker") > 1 and sections[-1] == "Model metrics", sections
