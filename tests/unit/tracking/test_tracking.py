"""What a job writes into MLflow, without Ray: metric names for the UI's chart sections,
the params a job logs, source tags, dataset inputs, an MLflow model that loads, and a
sqlite store that keeps working after it is moved with its ``mlruns/`` (real sqlite
stores under tmp_path, real MLflow clients). The e2e test (tests/e2e/tracking/test_train_e2e.py)
checks the same on a real job's run."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import digits_config
from elastic_ddp import tracking
from elastic_ddp.config import Config


def test_metric_keys_sort_quality_first_in_the_ui():
    k = tracking.metric_key
    assert k("train_loss") == "train/loss" and k("val_acc") == "val/acc" and k("val_bpb") == "val/bpb"
    assert k("step") is None
    assert k("lr") == "lr" and k("epoch") == "epoch" and k("samples_per_s") == "samples_per_s"
    assert k("wall_s") == "wall_s" and k("goodput") == "goodput"  # what sweep reads back
    assert k("step_time_s_mean") == "worker/step_time_s_mean"
    assert k("allreduce_busbw_GBps") == "worker/allreduce_busbw_GBps"
    assert k("system/cpu_utilization_percentage") == "system/cpu_utilization_percentage"
    # The MLflow 3 UI lists prefixed sections in ASCII order (unprefixed last): the two
    # quality sections come before every other section the trainer's metrics make.
    raw = ["train_loss", "train_acc", "val_loss", "val_acc", "step_time_s_mean", "data_wait_s_max",
           "allreduce_s_min", "peak_mem_mib_max", "grad_bytes", "data_wait_frac", "lr", "epoch"]
    sections = sorted({k(r).split("/")[0] for r in raw if "/" in k(r)})
    assert sections[:2] == ["train", "val"], sections


def test_job_params_only_what_the_job_uses(tmp_path):
    base = digits_config(tmp_path / "d", tmp_path)
    p = tracking.job_params(Config.from_dict(base))
    assert "None" not in p.values() and "null" not in p.values()
    assert not [k for k in p if k.startswith("parallel.powersgd")]
    assert "parallel.fsdp_keep_params_between_fwd_bwd" not in p and "batch.lr_scaling" not in p
    assert "optim.momentum" not in p and p["optim.betas"] == "[0.9, 0.999]"  # adamw
    assert "run.tracking_uri" not in p  # may carry credentials
    assert p["world_size"] == "2" and p["parallel.strategy"] == "ddp"
    # JSON-typed text: what --set takes back
    assert p["model.kwargs.hidden"] == "32" and p["parallel.bf16"] == "false"
    assert json.loads(p["task.kwargs.input_shape"]) == [1, 8, 8]
    assert [k for k in p if k.startswith("model.kwargs.")] == ["model.kwargs.hidden"]

    hook = Config.from_dict({**base, "parallel": {"comm_hook": "powersgd"}, "optim": {"name": "sgd"},
                             "scaling": {**base["scaling"], "min_workers": 1, "max_workers": 4},
                             "batch": {**base["batch"], "policy": "uneven"}})
    ph = tracking.job_params(hook)
    assert ph["parallel.powersgd_rank"] == "8" and "parallel.powersgd_start_iter" not in ph  # null
    assert ph["optim.momentum"] == "0.9" and "optim.betas" not in ph
    assert ph["world_size"] == "1-4" and "scaling.resize_monitor_interval_s" in ph
    fsdp = tracking.job_params(Config.from_dict({**base, "parallel": {"strategy": "fsdp"}}))
    assert "parallel.bucket_cap_mb" not in fsdp and "parallel.comm_hook" not in fsdp
    assert fsdp["parallel.fsdp_keep_params_between_fwd_bwd"] == "false"


def test_source_tags_name_the_user_and_this_checkout():
    tags = tracking.source_tags()
    assert tags["mlflow.user"] and tags["mlflow.source.type"] in ("LOCAL", "JOB")
    assert tags["mlflow.source.name"]
    repo = Path(tracking.__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout (an exported tree): no commit to record")
    assert tags["mlflow.source.git.commit"] == head.stdout.strip()
    assert tags["elastic_ddp.git_dirty"] in ("true", "false")


def test_git_remote_credentials_never_reach_a_tag(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t",
                    "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "remote", "add", "origin",
                    "https://user:s3cret@git.example.com/team/repo.git"], check=True)
    info = tracking.git_info(tmp_path)
    assert info["repo_url"] == "https://git.example.com/team/repo.git"
    assert len(info["commit"]) == 40 and info["dirty"] == "false"


def test_dataset_input_and_table_in_a_real_store(digits_data, tmp_path, mlflow_store):
    from elastic_ddp.data.scan import scan_parquet
    from elastic_ddp.tasks.dry_run import count_params
    from elastic_ddp.tasks.loading import load_task

    cfg = Config.from_dict(digits_config(digits_data, tmp_path))
    uri = mlflow_store
    run_id, resumed = tracking.open_run(cfg, "storage", uri)
    task = load_task(cfg)
    info = scan_parquet(cfg.data.train_path, task.input_columns(), "sample_id")
    val = scan_parquet(cfg.data.val_path, task.input_columns(), "sample_id")
    tracking.log_job_inputs(uri, run_id, cfg, tracking.task_params(task, count_params(cfg, task)), info, val, resumed)
    tracking.log_table(uri, run_id, [{"phase": "scan", "seconds": 1.5}], "startup.json")
    run = tracking.run_info(uri, run_id)
    by_ctx = {i.tags[0].value: i.dataset for i in run.inputs.dataset_inputs}
    assert set(by_ctx) == {"training", "validation"}
    tr = by_ctx["training"]
    assert tr.digest == info.fingerprint[:16] and tr.name == f"{digits_data.name}/train"
    assert json.loads(tr.profile)["num_rows"] == info.num_rows > 1000
    assert json.loads(tr.source)["uri"] == (digits_data / "train").resolve().as_uri()
    assert {c["name"] for c in json.loads(tr.schema)["mlflow_colspec"]} == {"sample_id", "x", "y"}
    p = run.data.params
    assert p["data.train_rows"] == str(info.num_rows) and p["task"].endswith("CNNClassifier")
    assert int(p["model.parameters"]) > 1000
    table = json.loads(Path(tracking.download_artifact(uri, run_id, "startup.json", str(tmp_path))).read_text())
    assert table["columns"] == ["phase", "seconds"] and table["data"] == [["scan", 1.5]]


def test_logged_model_loads_with_mlflow_pytorch(tmp_path, mlflow_store):
    import mlflow.pytorch
    import torch

    cfg = Config.from_dict(digits_config(tmp_path / "d", tmp_path))
    uri = mlflow_store
    run_id, _ = tracking.open_run(cfg, "storage", uri)
    from elastic_ddp.tasks.loading import build_model, load_task

    torch.manual_seed(0)
    model = build_model(cfg, load_task(cfg)).eval()
    x = torch.randn(5, 64)
    model_id = tracking.log_model(uri, run_id, model, (x, model(x)), step=7)
    run = tracking.run_info(uri, run_id)
    assert [m.model_id for m in run.outputs.model_outputs] == [model_id]
    mlflow.set_tracking_uri(uri)
    loaded = mlflow.pytorch.load_model(f"models:/{model_id}")
    assert torch.allclose(loaded(x), model(x))
    logged = tracking.client(uri).get_logged_model(model_id)
    # In the run's experiment (not "Default"), beside the run's artifacts.
    assert logged.experiment_id == run.info.experiment_id
    assert logged.artifact_location.startswith(str(tmp_path / "mlruns"))


def test_the_final_model_of_a_large_job_holds_the_checkpoints_tensors(tmp_path):
    """Without the dry run's CPU module (a model over CPU_DRY_RUN_PARAMS) the driver's
    logged model takes the exported weights as its own tensors: one copy in memory, not
    a second build's, and it loads with mlflow.pytorch to the same outputs."""
    import mlflow.pytorch
    import torch

    from elastic_ddp.driver.finish import _log_mlflow_model, _module_holding
    from elastic_ddp.tasks.loading import build_model, load_task

    cfg = Config.from_dict(digits_config(tmp_path / "d", tmp_path))
    task = load_task(cfg)
    torch.manual_seed(1)
    trained = build_model(cfg, task).eval()
    weights = trained.state_dict()
    held = _module_holding(cfg, task, weights)
    sd = held.state_dict()
    assert sd.keys() == weights.keys()
    assert all(sd[k].data_ptr() == weights[k].data_ptr() for k in weights), "weights were copied"
    assert not any(t.is_meta for t in held.parameters())
    x = torch.randn(5, 64)
    assert torch.equal(held.eval()(x), trained(x))

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id, _ = tracking.open_run(cfg, "storage", uri)
    model_id = _log_mlflow_model(cfg, uri, run_id, task, weights, None, 3, model=None)
    assert model_id is not None
    mlflow.set_tracking_uri(uri)
    assert torch.allclose(mlflow.pytorch.load_model(f"models:/{model_id}")(x), trained(x))


def test_a_moved_store_keeps_its_artifacts(tmp_path):
    """The default layout (mlflow.db beside mlruns/) moved to another folder: the next
    job that opens it re-anchors the experiment, its runs and logged models, so nothing
    is written to (or read from) the old folder."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    cfg = Config.from_dict(digits_config(a / "d", a))
    uri_a = f"sqlite:///{a / 'mlflow.db'}"
    run_id, _ = tracking.open_run(cfg, "storage", uri_a)
    tracking.log_text(uri_a, run_id, "hello", "notes/hello.txt")
    assert tracking.run_info(uri_a, run_id).info.artifact_uri.startswith(str(a / "mlruns"))
    assert (a / "mlruns").is_dir() and not (Path.cwd() / "mlruns" / "1" / run_id).exists()

    shutil.move(str(a), str(b))
    uri_b = f"sqlite:///{b / 'mlflow.db'}"
    exp = tracking.client(uri_b).get_experiment_by_name("tests")
    assert exp.artifact_location.startswith(str(a))  # MLflow stored the absolute old path
    assert tracking.experiment_id(uri_b, "tests") == exp.experiment_id
    run = tracking.run_info(uri_b, run_id)
    assert run.info.artifact_uri == str(b / "mlruns" / exp.experiment_id / run_id / "artifacts")
    got = tracking.download_artifact(uri_b, run_id, "notes/hello.txt", str(tmp_path / "dl"))
    assert Path(got).read_text() == "hello"
    tracking.log_text(uri_b, run_id, "again", "notes/again.txt")
    assert (b / "mlruns" / exp.experiment_id / run_id / "artifacts/notes/again.txt").exists()
    assert not a.exists()  # nothing recreated the old folder


def test_restart_event_rows_carry_times_as_text():
    from elastic_ddp.driver.finish import _event_row

    ev = {"index": 0, "type": "failure", "t": 1_796_000_000.5, "cause": "step 9: boom",
          "world_size_before": 2, "world_size_after": 1, "resumed_at_step": 8,
          "recovery_s": 12.3, "steps_recomputed": 1, "failed_ranks": [1]}
    row = _event_row(ev)
    assert "t" not in row and row["time"].startswith("2026-") and "T" in row["time"]
    assert row["recovery_s"] == 12.3 and row["failed_ranks"] == [1]
    assert list(row)[:4] == ["index", "type", "time", "cause"]


def test_the_tracker_counts_restarts_across_submissions(tmp_path, mlflow_store):
    """A resubmission's tracker continues the earlier submissions' count: two attempts at
    world sizes 2 and 1 before, this start makes three, and the run's tag says so."""
    from mlflow.tracking import MlflowClient

    from elastic_ddp.tracking import JobTracker

    uri = mlflow_store
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("t", artifact_location=str(tmp_path / "a"))).info.run_id
    t = JobTracker(uri, run_id, attempts_before=2, world_sizes_before=[2, 1])
    assert t.start_attempt(2) == {"attempts": 3, "world_sizes": [2, 1, 2]}
    assert t.flush(30)
    tags = client.get_run(run_id).data.tags
    assert tags["elastic_ddp.attempts"] == "3"
    assert json.loads(tags["elastic_ddp.world_sizes_seen"]) == [2, 1, 2]


def test_per_step_attempts_are_per_replica_and_a_failure_joins_its_own_ranks_replacement(tmp_path, mlflow_store):
    """Per-step mode: every replica records its own attempt (rank named), and a
    failure's recovery is the failed rank's replacement, resumed at the step before its
    first commit: one that healed from a live survivor recomputes nothing, even though it
    restored an older checkpoint first; one with no survivor left recomputes the steps
    since the checkpoint it restored."""
    from mlflow.tracking import MlflowClient

    from elastic_ddp.driver.report import recovery_events
    from elastic_ddp.tracking import JobTracker

    client = MlflowClient(mlflow_store)
    run_id = client.create_run(client.create_experiment("t", artifact_location=str(tmp_path / "a"))).info.run_id
    tr = JobTracker(mlflow_store, run_id)
    t = 1_796_000_000.0
    tr.attempt(enter=t, ready=t + 1, world_size=2, resumed_from=0, rank=0)
    tr.attempt(enter=t, ready=t + 1, world_size=2, resumed_from=0, rank=1)
    tr.attempt(first_step=t + 2, step=1, rank=1)  # a first step updates its own rank's attempt
    tr.attempt(first_step=t + 3, step=1, rank=0)
    assert [(a["rank"], a["first_step"]) for a in tr.attempts] == [(0, t + 3), (1, t + 2)]
    # Rank 1 dies at step 500 (the survivor, rank 0, goes on); its replacement restores
    # the checkpoint of step 400 and heals from rank 0 to step 530 at its first commit.
    tr.attempt(enter=t + 101, ready=t + 102, world_size=2, resumed_from=400, rank=1)
    tr.attempt(first_step=t + 110, step=531, rank=1)
    # Then rank 0 dies at step 900 with rank 1 gone too: its replacement restores step 880.
    tr.attempt(enter=t + 201, ready=t + 202, world_size=2, resumed_from=880, rank=0)
    tr.attempt(first_step=t + 210, step=881, rank=0)
    events = [{"type": "failure", "t": t + 100, "failed_ranks": [1], "last_step_seen": 500},
              {"type": "failure", "t": t + 200, "failed_ranks": [0], "last_step_seen": 900}]
    healed, restarted = recovery_events({"events": events, "attempts": tr.attempts})
    assert (healed["resumed_at_step"], healed["steps_recomputed"], healed["recovery_s"]) == (530, 0, 10.0), healed
    assert (restarted["resumed_at_step"], restarted["steps_recomputed"]) == (880, 20), restarted
