"""Screenshots of the MLflow UI as a person sees it, for a finished job's run.

    .venv/bin/python experiments/mlflow_screenshots.py --store mlflow.db --out shots/
    .venv/bin/python experiments/mlflow_screenshots.py --store mlflow.db --run RUN_ID --out shots/

Starts ``mlflow ui`` on 127.0.0.1 (a free port) against the sqlite store, opens the
run's pages in a headless Chromium and writes one PNG per page into ``--out``:
``overview.png``, ``model-metrics.png`` (and ``model-metrics-sections.json``: its chart
sections top to bottom), ``system-metrics.png``, ``artifacts.png``, and
for a sweep parent run (tag ``elastic_ddp.driver.sweep``) also ``sweep-parent.png`` and
``sweep-children.png`` (the experiment's runs table, children nested).

Needs the ``ui`` extra (``pip install -e '.[ui]'``: playwright, the Python driver
only) and a Chromium on the machine (Debian: ``apt-get install chromium``); playwright's
own browser download is not used. ``--chromium`` names the browser binary (default:
``$CHROMIUM``, else ``chromium`` or ``chromium-browser`` on PATH).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PAGES = {  # file name -> the run page's tab (the part of the URL after the run id)
    "overview": "",
    "model-metrics": "/model-metrics",
    "system-metrics": "/system-metrics",
    "artifacts": "/artifacts",
}


def find_chromium(explicit: str | None = None) -> str | None:
    """The Chromium binary: ``explicit``, ``$CHROMIUM``, or chromium/chromium-browser on
    PATH; None when there is none (the caller skips)."""
    for cand in (explicit, os.environ.get("CHROMIUM"), "chromium", "chromium-browser"):
        if cand and (path := shutil.which(cand) or (cand if Path(cand).is_file() else None)):
            return path
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowUI:
    """``mlflow ui`` on 127.0.0.1 for the store, as a context manager; ``url`` is its root.
    The server's own log goes to ``log_path`` (it is not what we look at)."""

    def __init__(self, store_uri: str, log_path: Path, timeout_s: float = 120.0):
        self.store_uri, self.log_path, self.timeout_s = store_uri, log_path, timeout_s
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "MlflowUI":
        exe = Path(sys.executable).with_name("mlflow")
        cmd = [str(exe) if exe.exists() else "mlflow", "ui", "--backend-store-uri", self.store_uri,
               "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + self.timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow ui exited ({self.proc.returncode}); see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"mlflow ui did not answer in {self.timeout_s:.0f} s; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # Its own session: the gunicorn/uvicorn workers it started go with it.
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
        self._log.close()


def capture(store: Path, out: Path, run_id: str | None = None, chromium: str | None = None,
            width: int = 1400, height: int = 1000, settle_s: float = 4.0,
            artifact: str | None = "startup.json") -> list[Path]:
    """Write the run's pages as PNGs into ``out``; returns their paths.

    ``run_id``: default the newest finished run that is not a sweep child. ``settle_s``:
    seconds to wait after the page's network is idle (charts animate in). ``artifact``:
    the file opened in the artifacts tab's preview."""
    from mlflow.tracking import MlflowClient
    from playwright.sync_api import sync_playwright

    browser_exe = find_chromium(chromium)
    if browser_exe is None:
        raise SystemExit("no Chromium found: apt-get install chromium, or pass --chromium PATH")
    uri = f"sqlite:///{store.resolve()}"
    client = MlflowClient(uri)
    run = client.get_run(run_id) if run_id else _newest_run(client)
    exp = run.info.experiment_id
    out.mkdir(parents=True, exist_ok=True)
    shots = []
    with MlflowUI(uri, out / "mlflow-ui.log") as ui, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_exe, headless=True,
                                     args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": width, "height": height})
        base = f"{ui.url}/#/experiments/{exp}/runs/{run.info.run_id}"
        _as_a_person_sets_it(page, base, settle_s)
        pages = dict(PAGES)
        is_sweep = "elastic_ddp.sweep" in run.data.tags
        for name, tab in pages.items():
            click = artifact if name == "artifacts" else None
            shots.append(_shot(page, base + tab, out / f"{name}.png", settle_s, click))
            if name == "model-metrics":
                # The charts tab's sections, top to bottom, beside the picture of it.
                (out / "model-metrics-sections.json").write_text(json.dumps(_sections(page)))
        if is_sweep:
            shots.append(_shot(page, base + "/model-metrics", out / "sweep-parent.png", settle_s))
            # The runs table with the parent's row expanded: its children nested under it.
            shots.append(_shot(page, f"{ui.url}/#/experiments/{exp}", out / "sweep-children.png",
                               settle_s, expand=True))
        browser.close()
    return shots


def _as_a_person_sets_it(page, url: str, settle_s: float) -> None:
    """The UI as someone training models sees it: the "Model training" side of MLflow 3's
    GenAI / Model training switch, and the assistant panel (opened on a first visit)
    closed. Both are remembered by the browser (local storage) for the later pages."""
    page.goto(url, wait_until="load", timeout=60_000)
    time.sleep(settle_s)
    for how in (lambda: page.get_by_text("Model training", exact=True).first.click(timeout=5000),
                lambda: page.get_by_role("button", name="Close").first.click(timeout=5000)):
        try:
            how()
            time.sleep(1)
        except Exception:  # noqa: BLE001 - an older or newer UI without it
            pass


def _shot(page, url: str, path: Path, settle_s: float, click: str | None = None,
          expand: bool = False) -> Path:
    # Not "networkidle": the metric pages poll the server while open.
    page.goto(url, wait_until="load", timeout=60_000)
    try:
        page.wait_for_load_state("networkidle", timeout=int(settle_s * 1000))
    except Exception:  # noqa: BLE001 - a polling page never idles; the settle time below covers it
        pass
    time.sleep(settle_s)
    if click:
        try:
            page.get_by_text(click, exact=True).first.click(timeout=5000)
            time.sleep(settle_s / 2)
        except Exception:  # noqa: BLE001 - not in this run: the tree as it is
            pass
    if expand:
        try:
            page.locator("[aria-label*='xpand'], [data-testid*='expand']").first.click(timeout=5000)
            time.sleep(settle_s / 2)
        except Exception:  # noqa: BLE001 - nothing to expand
            pass
    page.screenshot(path=str(path), full_page=True)
    print(f"{path}  <- {url}", flush=True)
    return path


def _sections(page, timeout_s: float = 30.0) -> list[str]:
    # Charts load after the page: wait for the last section ("Model metrics") to show.
    deadline, found = time.time() + timeout_s, []
    while time.time() < deadline:
        found = chart_sections(page)
        if "Model metrics" in found:
            break
        time.sleep(0.5)
    return found


def chart_sections(page) -> list[str]:
    """The section titles of a metrics tab, top to bottom (``"train"``, ``"val"``, ...,
    ``"Model metrics"``), as the UI shows them: each title is followed by its chart
    count, e.g. ``"train (2)"``."""
    import re

    texts = page.locator("h3, h4, [role=button]").all_inner_texts()
    out = []
    for t in texts:
        m = re.match(r"^\s*(.+?)\s*\n?\s*\((\d+)\)", t)
        if m and "Add chart" in t:
            out.append(m.group(1).strip())
    return out


def _newest_run(client):
    runs = []
    for exp in client.search_experiments():
        runs += client.search_runs([exp.experiment_id], filter_string="attributes.status = 'FINISHED'",
                                   order_by=["attributes.start_time DESC"], max_results=20)
    runs = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    if not runs:
        raise SystemExit("no finished run in the store")
    return max(runs, key=lambda r: r.info.start_time)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", default="mlflow.db", help="the sqlite MLflow store (default mlflow.db)")
    p.add_argument("--run", default=None, help="run id (default: the newest finished top-level run)")
    p.add_argument("--out", default="shots", help="directory for the PNGs (default shots/)")
    p.add_argument("--chromium", default=None, help="Chromium binary (default: $CHROMIUM or PATH)")
    p.add_argument("--width", type=int, default=1400, help="viewport width in px (default 1400)")
    p.add_argument("--height", type=int, default=1000, help="viewport height in px (default 1000)")
    p.add_argument("--artifact", default="startup.json",
                   help="artifact opened in the artifacts tab (default startup.json)")
    a = p.parse_args(argv)
    capture(Path(a.store), Path(a.out), a.run, a.chromium, a.width, a.height, artifact=a.artifact)
    return 0


if __name__ == "__main__":
    sys.exit(main())
