"""``elastic-ddp sweep``: a real two-size sweep (world sizes 1 and 2, a few steps of the
digits CNN on a real local Ray cluster) logged to a real sqlite MLflow store; the parent
run holds one child per world size with the timing metrics, the final quality and time
to target per world size (metrics keyed ``<metric>/ws<N>``, a table), and the plots (as
artifacts and as MLflow images)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import digits_config


# Two full Ray Train jobs back to back: ~2 x 40 s of start-up on an idle 2-core machine
# (338 s measured under a load average of ~30), over the ~90 s budget of `make test`.
@pytest.mark.slow
def test_sweep_world_sizes_1_2_logs_children_and_plots(ray_cluster, digits_data, tmp_path):
    from mlflow.tracking import MlflowClient

    from elastic_ddp.config import Config
    from elastic_ddp.driver.sweep import sweep

    # 6 steps, logs at 1, 3, 6; steps 3 and 6 are probe steps; a validation at step 6
    # (two batches per rank) gives each world size its final quality. ws=1 runs 2
    # micro-steps (no_sync reference every step), ws=2 one (the probe gives the reference).
    cfg = Config.from_dict(digits_config(digits_data, tmp_path, {
        "train": {"epochs": 1, "max_steps": 6, "log_every_steps": 3, "eval_max_batches": 2},
        "run": {"name": "sweep-test"},
    }))
    out = tmp_path / "sweep_out"
    result = sweep(cfg, [2, 1], out_dir=str(out))

    client = MlflowClient(result.tracking_uri)
    parent = client.get_run(result.parent_run_id)
    assert parent.info.status == "FINISHED"
    children = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{result.parent_run_id}'")
    assert len(children) == 2
    by_ws = {int(c.data.params["scaling.max_workers"]): c for c in children}
    assert set(by_ws) == {1, 2}
    for ws, child in by_ws.items():
        m = child.data.metrics
        assert child.info.status == "FINISHED"
        assert m["samples_per_s"] > 0 and "val/acc" in m
        for key in ("step_time_s", "data_wait_s", "fwd_bwd_s", "optimizer_s",
                    "allreduce_exposed_s", "peak_mem_mib"):
            assert m[f"worker/{key}_max"] >= m[f"worker/{key}_mean"] >= 0, (ws, key)
        assert m["worker/peak_mem_mib_max"] > 50     # a torch process is > 50 MiB resident
        assert m["worker/grad_bytes"] > 0
    # ring formula: N=1 moves nothing, N=2 moves 2(2-1)/2 = 1 x the gradient per rank
    assert by_ws[1].data.metrics["worker/allreduce_bytes_per_step"] == 0
    m2 = by_ws[2].data.metrics
    assert m2["worker/allreduce_bytes_per_step"] == m2["worker/grad_bytes"]
    assert m2["worker/allreduce_s_mean"] > 0 and m2["worker/allreduce_busbw_GBps"] > 0

    # The parent: per world size, keyed by it (never a world size used as a step).
    pm = parent.data.metrics
    for ws in (1, 2):
        child_m = by_ws[ws].data.metrics
        assert pm[f"val_acc/ws{ws}"] == pytest.approx(child_m["val/acc"])
        assert pm[f"val_loss/ws{ws}"] == pytest.approx(child_m["val/loss"])
        assert pm[f"samples_per_s/ws{ws}"] > 0 and f"scaling_efficiency/ws{ws}" in pm
        assert 0 < pm[f"time_to_target_s/ws{ws}"] <= child_m["wall_s"] + 1
    for key in pm:
        assert {h.step for h in client.get_metric_history(result.parent_run_id, key)} == {0}, key
    assert not [k for k in pm if "/" not in k], sorted(pm)
    key, target = result.target
    assert key == "val_acc" and target == pytest.approx(min(pm["val_acc/ws1"], pm["val_acc/ws2"]))
    assert [r.world_size for r in result.rows] == [1, 2]
    assert all(r.time_to_target_s is not None for r in result.rows)
    assert "val_acc" in result.table.splitlines()[0] and "to target" in result.table.splitlines()[0]

    arts = {a.path for a in client.list_artifacts(result.parent_run_id, "sweep")}
    assert parent.data.params["sweep.world_sizes"] == "1,2" and len(parent.data.params) <= 3
    for name in ("quality.png", "throughput.png", "scaling_efficiency.png", "step_breakdown.png",
                 "sweep_table.txt", "sweep.json", "sweep_table.json", "config.json"):
        assert f"sweep/{name}" in arts, arts
    for name in ("quality.png", "throughput.png", "scaling_efficiency.png", "step_breakdown.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import json

    table = json.loads(Path(client.download_artifacts(result.parent_run_id, "sweep/sweep_table.json",
                                                      str(tmp_path / "dl"))).read_text())
    assert {"world_size", "val_acc", "time_to_target_s", "samples_per_s"} <= set(table["columns"])
    assert [row[table["columns"].index("world_size")] for row in table["data"]] == [1, 2]
    # The plots as MLflow images: the parent's "Model metrics" tab shows them.
    images = {a.path for a in client.list_artifacts(result.parent_run_id, "images")}
    assert len(images) >= 4, images
    assert parent.data.tags.get("mlflow.loggedImages") == "True"  # what the UI's image charts read
    assert result.rows[0].efficiency == pytest.approx(1.0)
    assert all(r.wall_s > 0 and r.peak_mem_mib_max > 50 for r in result.rows), result.rows
    assert "samples/s" in result.table.splitlines()[0]
    assert not [ln for ln in result.table.splitlines()[1:3] if ln.rstrip().endswith("nan")]  # wall s


def test_sweep_refuses_a_world_size_the_batch_cannot_carry(digits_data, tmp_path):
    from elastic_ddp.config import Config, ConfigError
    from elastic_ddp.driver.sweep import child_config, parse_world_sizes

    cfg = Config.from_dict(digits_config(digits_data, tmp_path))
    perm = Config.from_dict(digits_config(digits_data, tmp_path, {"data": {"order": "permutation"}}))
    cfg8 = Config.from_dict(digits_config(digits_data, tmp_path, {"data": {"partitions": 8}}))
    assert parse_world_sizes("2, 1,2") == [1, 2]
    with pytest.raises(ConfigError, match="world-sizes"):
        parse_world_sizes("1,x")
    with pytest.raises(ConfigError, match="global_batch_size"):
        child_config(perm, 3, "t")           # permutation: 64 does not divide over 3
    with pytest.raises(ConfigError, match="data.partitions=8"):
        child_config(cfg8, 3, "t")           # windowed: 8 partitions do not divide over 3
    assert child_config(cfg, 3, "t").scaling.max_workers == 3  # 60 partitions do
    assert child_config(cfg, 1, "t").scaling.max_workers == 1
