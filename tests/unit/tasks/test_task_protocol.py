"""The task protocol without Ray: a user's task module from a file outside the repository
passes the dry run on real data, and every way a task can be wrong is an exit-2 error
that names the field or hook, before Ray or MLflow start."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import digits_config
from helpers import TASK, user_config, write_task
from elastic_ddp.driver.cli import main
from elastic_ddp.config import Config
from elastic_ddp.tasks.dry_run import preflight
from elastic_ddp.tasks.loading import TaskError, build_model, load_task
from elastic_ddp.tasks.protocol import TransformContext, default_collate, pad_sequences

def test_a_task_from_a_file_outside_the_repo_passes_the_dry_run(digits_data, tmp_path):
    cfg = Config.from_dict(user_config(digits_data, tmp_path, write_task(tmp_path)))
    task = load_task(cfg)
    from elastic_ddp.data.scan import scan_parquet

    info = scan_parquet(cfg.data.train_path, task.input_columns(), "sample_id")
    sample = preflight(cfg, task, info, None).sample
    assert sample["train"]["image"].shape == (1, 1, 8, 8) and sample["train"]["image"].dtype == np.float32
    assert type(build_model(cfg, task)).__name__ == "Net"
    # Shipped to Ray's workers by value: a pickle of the task needs no import path.
    from ray import cloudpickle

    clone = cloudpickle.loads(cloudpickle.dumps(task))
    assert type(clone).__name__ == "Digits" and clone.scale == 1.0


def test_augmentation_is_a_function_of_seed_epoch_and_sample_id():
    ids = np.array([5, 9, 2])
    a = TransformContext(0, 3, "train", ids).uniform(2)
    b = TransformContext(0, 3, "train", ids[::-1]).uniform(2)[::-1]  # other order / batch
    assert np.array_equal(a, b)
    assert not np.array_equal(a, TransformContext(0, 4, "train", ids).uniform(2))
    assert not np.array_equal(a, TransformContext(1, 3, "train", ids).uniform(2))


def test_pad_sequences_and_default_collate():
    x, mask = pad_sequences([np.array([1, 2, 3]), np.array([4])], pad_value=0)
    assert x.tolist() == [[1, 2, 3], [4, 0, 0]] and mask.tolist() == [[True] * 3, [True, False, False]]
    out = default_collate({"a": np.arange(6).reshape(3, 2), "b": np.array([np.ones(2)] * 3, dtype=object)})
    assert out["a"].shape == (3, 2) and out["b"].shape == (3, 2)
    with pytest.raises(TypeError, match="column 'v' has variable-length"):
        default_collate({"v": np.array([np.ones(2), np.ones(3)], dtype=object)})


# ------------------------------------------------------------------------- exit 2
def _cli(capsys, cfg_raw: dict, tmp: Path, *extra) -> tuple[int, str]:
    path = tmp / "c.yaml"
    path.write_text(yaml.safe_dump(cfg_raw))
    rc = main(["train", str(path), "--no-progress", *extra])
    out, err = capsys.readouterr()
    assert not (tmp / "mlflow.db").exists() and not (tmp / "ray_results").exists()
    assert out == ""  # no config print, no launcher line: nothing started
    return rc, err


@pytest.mark.parametrize("case,needles", [
    ("missing_file", ["task.path", "not found", "working directory"]),
    ("missing_module", ["task.path", "module 'no_such_pkg.tasks' not found"]),
    ("missing_attr", ["task.path", "has no attribute 'Digit'", "Digits"]),
    ("no_loss", ["does not define loss(model, batch)"]),
    ("scalar_loss", ["Task.loss must return the per-sample loss, shape [2]", "reduction='none'"]),
    ("task_kwargs", ["task.kwargs", "unexpected keyword argument 'colour'"]),
    ("model_kwargs", ["model.kwargs ['depth']", "unexpected keyword argument 'depth'", "width"]),
    ("transform_rows", ["Digits.transform", "returned 1 rows in column 'image' for 2 input rows"]),
    ("import_error", ["importing", "ZeroDivisionError"]),
    # The file is found; what it imports is not (README: a task file imports no sibling file).
    ("sibling_import", ["task.path=", "the task file ", "my_task.py was found, but its import of "
                        "'sibling_util' failed (No module named 'sibling_util'): sibling_util.py "
                        "lies beside it", "must not import sibling files", "copy what it uses "
                        "from sibling_util.py into my_task.py", "pip install -e"]),
    ("missing_dependency", ["my_task.py was found, but its import of 'no_such_dep_zz' failed",
                            "install no_such_dep_zz"]),
])
def test_task_errors_exit_2_naming_the_field(digits_data, tmp_path, capsys, case, needles):
    body, path_attr, kwargs, model_kwargs = TASK, "Digits", {}, {"width": 8}
    if case == "no_loss":
        body = TASK.replace("    def loss(self, model, batch):", "    def _loss(self, model, batch):")
    elif case == "scalar_loss":
        body = TASK.replace('reduction="none")', 'reduction="mean")')
    elif case == "transform_rows":
        body = TASK.replace('return {"image": img, "label": batch["y"]}',
                            'return {"image": img[:1], "label": batch["y"]}')
    elif case == "import_error":
        body = TASK + "\n1 / 0\n"
    elif case == "sibling_import":
        body = "from sibling_util import WIDTH\n" + TASK
        write_task(tmp_path, "WIDTH = 8\n", "sibling_util.py")
    elif case == "missing_dependency":
        body = "import no_such_dep_zz\n" + TASK
    elif case == "task_kwargs":
        kwargs = {"colour": "red"}
    elif case == "model_kwargs":
        model_kwargs = {"depth": 3}
    elif case == "missing_attr":
        path_attr = "Digit"
    task_file = write_task(tmp_path, body)
    raw = user_config(digits_data, tmp_path, task_file)
    raw["task"] = {"path": f"{task_file}:{path_attr}", "kwargs": kwargs}
    raw["model"]["kwargs"] = model_kwargs
    if case == "missing_file":
        raw["task"]["path"] = "nowhere/task.py:Digits"
    elif case == "missing_module":
        raw["task"]["path"] = "no_such_pkg.tasks:Digits"
    rc, err = _cli(capsys, raw, tmp_path)
    assert rc == 2, err
    assert err.startswith("elastic-ddp: task error: ") and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert "not found" not in err or case.startswith("missing_") and case != "missing_dependency", err


def test_builtin_model_kwargs_errors_exit_2(digits_data, pycode_data, tmp_path, capsys):
    raw = digits_config(pycode_data, tmp_path)
    raw["task"] = {"kwargs": {"column": "x", "block_size": 64}}
    raw["model"] = {"name": "gpt", "kwargs": {"n_embd": 100, "n_head": 3}}
    rc, err = _cli(capsys, raw, tmp_path)
    assert rc == 2 and "model.kwargs.n_embd (100) must be divisible by model.kwargs.n_head (3)" in err
    # The data does not fit the task: windows longer than block_size + 1.
    raw["model"]["kwargs"] = {"n_embd": 32, "n_head": 2}
    raw["task"]["kwargs"]["block_size"] = 16
    rc, err = _cli(capsys, raw, tmp_path)
    assert rc == 2 and "data error" in err and "more than 17" in err and "task.kwargs.block_size" in err


def test_python_api_takes_a_task_object(digits_data, tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("api_task", write_task(tmp_path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = Config.from_dict(user_config(digits_data, tmp_path, Path("unused.py")))
    task = load_task(cfg, mod.Digits(scale=0.5))
    assert task.scale == 0.5
    with pytest.raises(TaskError, match="is not an elastic_ddp.Task"):
        load_task(cfg, object())
    loss, extra = task.loss(build_model(cfg, task), {"image": torch.zeros(3, 1, 8, 8),
                                                     "label": torch.tensor([0, 1, 2])})
    assert loss.shape == (3,) and set(extra) == {"acc"}
