"""Task metric names MLflow refuses: the CLI refuses them up front (exit 2 naming the
metric), and the tracker, behind that check, drops a refused value (counted, warned)
and writes every other one instead of retrying its buffer forever."""

from __future__ import annotations

from helpers import nothing_started, run_cli, small_config, write_rows


METRIC_TASK = """
import torch.nn.functional as F
from elastic_ddp.tasks.vision import CNNClassifier


class Topk(CNNClassifier):
    def loss(self, model, batch):
        logits = model(batch["x"])
        return (F.cross_entropy(logits, batch["y"], reduction="none"),
                {"acc@1": (logits.argmax(-1) == batch["y"]).float()})
"""


def test_a_metric_name_mlflow_refuses_exits_2_up_front(tmp_path, capsys):
    """A task metric named 'acc@1', a name MLflow refuses, is one exit-2 task error naming
    it and the fix, before anything starts."""
    data = tmp_path / "data"
    write_rows(data / "train" / "part-0.parquet", range(32))
    write_rows(data / "val" / "part-0.parquet", range(100, 104))
    task = tmp_path / "user" / "topk.py"
    task.parent.mkdir()
    task.write_text(METRIC_TASK)
    raw = small_config(data, tmp_path)
    raw["task"]["path"] = f"{task}:Topk"
    raw["model"] = {"kwargs": {"hidden": 8}}
    rc, out, err = run_cli(tmp_path, raw, capsys)
    assert rc == 2 and "task error" in err and "'acc@1'" in err and "rename it" in err, err
    nothing_started(tmp_path)


def test_the_tracker_drops_what_the_store_refuses_and_writes_the_rest(tmp_path, mlflow_store):
    """Safety net behind the up-front check: a value MLflow refuses is dropped (counted,
    warned) instead of blocking every later metric in a retry loop."""
    from mlflow.tracking import MlflowClient

    from elastic_ddp import tracking
    from elastic_ddp.tracking import JobTracker

    uri = mlflow_store
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("t", artifact_location=str(tmp_path / "a"))).info.run_id
    tracker = JobTracker(uri, run_id, flush_period_s=0.2)
    tracker.log_metrics({"train_loss": 0.5, "train_acc@1": 0.9}, 1)
    tracker.log_metrics({"train_loss": 0.4}, 2)
    assert tracker.flush(30)
    snap = tracker.snapshot()
    assert snap["dropped"] == 1 and "acc@1" in snap["last_error"], snap
    assert tracking.metric_history(uri, run_id, "train/loss") == [(1, 0.5), (2, 0.4)]
