"""A planned grow recomputes no step, end to end, on a real multi-node local Ray cluster.

One ``ray.cluster_utils.Cluster``: a head (1 CPU) and one 2-CPU worker node; a worker asks
for 2 CPUs, so the elastic job (1 to 2 workers) starts at world size 1. A second node is
added mid-epoch; Ray Train's elastic policy decides to restart the group at world size 2.
With ``scaling.grow_checkpoint_timeout_s`` (the default) the workers first commit a
checkpoint at a grow notice (``compat.ray_grow``) and the larger group resumes at that step:
the ledger shows every sample once, the ``resize`` event 0 steps recomputed and the grow's
cost from the decision to the first step at the new size. With it off (0) the same grow
restarts from the epoch's checkpoint (no periodic one inside an epoch) and recomputes the
steps since it: what the notice saves.

Slow tier (``-m slow``): each job waits for Ray's view of the cluster (its autoscaling
coordinator's 20 s tick) to see the added node.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import _deep_update, digits_config
from elastic_ddp import train
from elastic_ddp.ledger import audit, format_audit
from elastic_ddp.run_state import Diagnostics
from helpers import add_node, local_cluster, max_step, train_ids, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.slow]

EPOCHS = 3
# Slower steps (sleep only: the arithmetic is unchanged), so that the job still runs at
# world size 1 when Ray sees the added node (up to ~20 s after it joins).
SLOW = {"rank": -1, "at_step": 0, "where": "none", "step_s": 0.8}


@pytest.fixture(scope="module")
def cluster():
    """A head (1 CPU) and one 2-CPU worker node (``helpers.local_cluster``); the
    test adds the second node."""
    with local_cluster(1, 2, head_cpus=1) as c:
        yield c


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from elastic_ddp.data.prepare import prepare_digits

    out = tmp_path_factory.mktemp("digits-grow")
    prepare_digits(out, num_files=1, val_fraction=0.2, seed=0)
    return out


def _job(data: Path, tmp: Path, name: str, grow_timeout_s: float):
    from elastic_ddp.config import Config

    return Config.from_dict(_deep_update(digits_config(data, tmp, {}), {
        "model": {"kwargs": {"hidden": 32}},
        "batch": {"global_batch_size": 64, "micro_batch_size": 32, "policy": "uneven"},
        # No periodic checkpoint inside an epoch: without the one at the grow notice, a
        # grow mid-epoch recomputes every step since the epoch's start.
        "train": {"epochs": EPOCHS, "checkpoint_every_steps": 1000, "log_every_steps": 2,
                  "keep_checkpoints": 3},
        "scaling": {"min_workers": 1, "max_workers": 2, "cpus_per_worker": 2, "torch_threads": 1,
                    "max_failures": 0, "use_gpu": False, "collective_timeout_s": 30,
                    "resize_monitor_interval_s": 2, "grow_checkpoint_timeout_s": grow_timeout_s},
        "run": {"name": name},
    }))


def _artifact(summary, path: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(summary.tracking_uri)
    with tempfile.TemporaryDirectory() as d:
        return json.loads(Path(client.download_artifacts(summary.run_id, path, d)).read_text())


@pytest.mark.parametrize("checkpoint_first", [True, False], ids=["grow-notice", "no-notice"])
def test_a_grow_onto_an_added_node(cluster, data, tmp_path, checkpoint_first):
    ledger = tmp_path / "ledger"
    cfg = _job(data, tmp_path, f"grow-{checkpoint_first}", 60.0 if checkpoint_first else 0.0)
    result: dict = {}

    def run():
        try:
            result["summary"] = train(cfg, diagnostics=Diagnostics(ledger_dir=str(ledger), fault=SLOW),
                                      progress=False)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            result["error"] = e

    # Training in a thread, the cluster changed here: Ray's Node registers a SIGTERM
    # handler, which only the main thread may do.
    th = threading.Thread(target=run, daemon=True)
    th.start()
    node = None
    try:
        wait_until(lambda: not th.is_alive() or max_step(ledger) >= 2, 300)
        assert th.is_alive(), result
        t_add = time.time()
        node = add_node(cluster, num_cpus=2)
        th.join(timeout=600)
        assert not th.is_alive(), "training did not finish in 10 minutes"
    finally:
        if node is not None:  # the module's next job starts at world size 1 again
            cluster.remove_node(node)
    if "error" in result:
        raise result["error"]
    s = result["summary"]
    report = audit(ledger, train_ids(data), EPOCHS)
    print(format_audit(report))
    for ep, e in report["epochs"].items():
        assert (e["repeated"], e["lost"], e["unknown"]) == (0, 0, 0), (ep, e)
    assert report["ok"] and s.steps == 23 * EPOCHS
    assert report["world_sizes"][0] == 1 and report["world_sizes"][-1] == 2, report["world_sizes"]
    assert not [e for e in s.events if e["type"] in ("failure", "preemption")], s.events
    (ev,) = [e for e in s.events if e["type"] == "resize"]
    print(json.dumps(ev, indent=1, default=str))
    assert ev["world_size_before"] == 1 and ev["world_size_after"] == 2, ev
    assert ev["recovery_s"] is not None and ev["t"] > t_add, ev
    print(f"grow (checkpoint first: {checkpoint_first}): added node -> decision "
          f"{ev['t'] - t_add:.1f} s, decision -> first step at world size 2 {ev['recovery_s']} s, "
          f"steps recomputed {ev['steps_recomputed']}")
    # The MLflow run's summary.json holds the same event, with its cost.
    (stored,) = [e for e in _artifact(s, "summary.json")["events"] if e["type"] == "resize"]
    assert stored["recovery_s"] == ev["recovery_s"], stored
    if checkpoint_first:
        # The checkpoint at the grow notice, then the resize: the larger group resumed at
        # the step the smaller one stopped at.
        assert ev["checkpoint_first"] is True and ev["steps_recomputed"] == 0, ev
        assert ev["resumed_at_step"] == ev["last_checkpoint_step"] == ev["last_step_seen"], ev
        assert ev["resumed_at_step"] % 23 != 0, ev  # mid-epoch: not an epoch's checkpoint
        assert 0 < ev["decision_to_checkpoint_s"] < ev["recovery_s"], ev
        assert stored["checkpoint_first"] is True and stored["steps_recomputed"] == 0, stored
    else:
        assert "checkpoint_first" not in ev and ev["steps_recomputed"] > 0, ev
