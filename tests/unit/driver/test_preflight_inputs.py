"""Every job input is pickled on the driver before anything starts (the task, its
kwargs, the model factory, the transform through the task): a task holding a lock, an
open file, or a transform using a module-level lock exits 2 with one line that names the
object path, its type and the fix; no MLflow store, no run, no Ray. The CLI runs as a
user runs it, on a task file written outside the repository."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import digits_config

HEAD = '''
import threading

import numpy as np
import torch.nn as nn
import torch.nn.functional as F

import elastic_ddp

GLOBAL_LOCK = threading.Lock()


class Digits(elastic_ddp.Task):
    columns = {"x": elastic_ddp.Column.list_of("float", length=64),
               "y": elastic_ddp.Column.integer(min=0, max=9)}

    def __init__(self, **kw):
        self.cache = {"sizes": [1, 2]}
        %(init)s

    def transform(self, batch, ctx):
        %(transform)s
        return {"image": np.stack(list(batch["x"])).astype(np.float32), "label": batch["y"]}

    def build_model(self):
        return nn.Linear(64, 10)

    def loss(self, model, batch):
        return F.cross_entropy(model(batch["image"]), batch["label"], reduction="none")


def locked_factory():
    lock = threading.Lock()

    def build():
        with lock:
            return nn.Linear(64, 10)
    return build


factory = locked_factory()
'''

CASES = {
    "lock": ({"init": "self.lock = threading.Lock()"},
             "task.lock: threading.Lock cannot be pickled (TypeError: cannot pickle"),
    # A file open for writing (cloudpickle ships one open for reading by its content).
    "nested": ({"init": "self.cache['log'] = open(__file__ + '.log', 'a')"},
               "task.cache.log: an open file (io.TextIOWrapper) cannot be pickled "
               "(PicklingError: Cannot pickle files that are not opened for reading"),
    "global": ({"transform": "with GLOBAL_LOCK: pass"},
               "task.transform.<global GLOBAL_LOCK>: threading.Lock cannot be pickled (TypeError: "),
    "factory": ({}, "model.factory.<closure lock>: threading.Lock cannot be pickled (TypeError: "),
}


def _job(tmp_path: Path, data: Path, case: str) -> Path:
    fill = {"init": "pass", "transform": "pass", **CASES[case][0]}
    task = tmp_path / "user_code" / "locked_task.py"
    task.parent.mkdir(parents=True, exist_ok=True)
    task.write_text(textwrap.dedent(HEAD % fill))
    raw = digits_config(data, tmp_path)
    raw["task"] = {"path": f"{task}:Digits", "kwargs": {}}
    raw["model"] = {"kwargs": {}, **({"factory": f"{task}:factory"} if case == "factory" else {})}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_input_that_cannot_be_pickled_exits_2_naming_its_path(tmp_path, digits_data, capsys, case):
    from elastic_ddp.driver.cli import main

    rc = main(["train", str(_job(tmp_path, digits_data, case)), "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"elastic-ddp: task error: {CASES[case][1]}"), err
    assert "create it where it is used" in err and "__getstate__" in err
    assert "elastic-ddp config" not in out  # refused before the config print
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "ray_results").exists()
    if "ray" in sys.modules:
        assert not sys.modules["ray"].is_initialized()


def test_a_task_given_to_train_is_checked_too(tmp_path, digits_data):
    """The Python API: a task object holding a lock, refused with the same path."""
    import threading

    from elastic_ddp.config import Config
    from elastic_ddp import train
    from elastic_ddp.tasks.loading import TaskError
    from elastic_ddp.tasks.vision import CNNClassifier

    raw = digits_config(digits_data, tmp_path)
    task = CNNClassifier(**raw["task"]["kwargs"])
    task.state = [1, {"guard": threading.RLock()}]
    with pytest.raises(TaskError, match=r"^task\.state\[1\]\.guard: threading\.RLock cannot be pickled"):
        train(Config.from_dict(raw), task=task, progress=False)
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "ray_results").exists()


def test_inputs_that_pickle_pass(tmp_path):
    from elastic_ddp.tasks.pickling import find_unpicklable

    assert find_unpicklable({"a": [1, 2.0, "x"], "f": lambda v: v + 1}, "task") is None
