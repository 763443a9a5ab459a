"""``elastic-ddp sweep``: a real two-size sweep (world sizes 1 and 2, a few steps of the
digits CNN on a real local Ray cluster) logged to a real sqlite MLflow store; the parent
run holds one child per world size with the timing metrics, and the plots."""

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
    from elastic_ddp.sweep import sweep

    # 6 steps, logs at 1, 3, 6; steps 3 and 6 are probe steps. No val set: one data set
    # to materialize per run. ws=1 runs 2 micro-steps (no_sync reference every step),
    # ws=2 one (the probe gives the reference).
    cfg = Config.from_dict(digits_config(digits_data, tmp_path, {
        "data": {"val_path": None},
        "train": {"epochs": 1, "max_steps": 6, "log_every_steps": 3},
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
        assert m["samples_per_s"] > 0
        for key in ("step_time_s", "data_wait_s", "fwd_bwd_s", "optimizer_s",
                    "allreduce_exposed_s", "peak_mem_mib"):
            assert m[f"{key}_max"] >= m[f"{key}_mean"] >= 0, (ws, key)
        assert m["peak_mem_mib_max"] > 50           # a torch process is > 50 MiB resident
        assert m["grad_bytes"] > 0
    # ring formula: N=1 moves nothing, N=2 moves 2(2-1)/2 = 1 x the gradient per rank
    assert by_ws[1].data.metrics["allreduce_bytes_per_step"] == 0
    m2 = by_ws[2].data.metrics
    assert m2["allreduce_bytes_per_step"] == m2["grad_bytes"]
    assert m2["allreduce_s_mean"] > 0 and m2["allreduce_busbw_GBps"] > 0

    arts = {a.path for a in client.list_artifacts(result.parent_run_id, "sweep")}
    for name in ("throughput.png", "scaling_efficiency.png", "step_breakdown.png",
                 "sweep_table.txt", "sweep.json"):
        assert f"sweep/{name}" in arts
        assert (out / name).stat().st_size > 0
    for name in ("throughput.png", "scaling_efficiency.png", "step_breakdown.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r.world_size for r in result.rows] == [1, 2]
    assert result.rows[0].efficiency == pytest.approx(1.0)
    assert "samples/s" in result.table.splitlines()[0]


def test_sweep_refuses_a_world_size_the_batch_cannot_carry(digits_data, tmp_path):
    from elastic_ddp.config import Config, ConfigError
    from elastic_ddp.sweep import child_config, parse_world_sizes

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
