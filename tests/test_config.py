"""Config validation and the CLI's exit code 2: every refusal names the dotted field
(or the file and column) and nothing is started: no Ray, no MLflow run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import digits_config, mlflow_runs
from elastic_ddp.cli import main
from elastic_ddp.config import Config, ConfigError

REPO = Path(__file__).resolve().parents[1]


def _cfg(tmp_path, extra=None) -> dict:
    # The data paths need not exist: Config validation never touches the files.
    return digits_config(tmp_path / "data", tmp_path, extra)


def _write_yaml(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


# ------------------------------------------------------------------ Config validation
def test_valid_config_loads_and_flattens(tmp_path):
    cfg = Config.from_dict(_cfg(tmp_path))
    flat = cfg.to_flat_dict()
    assert flat["batch.global_batch_size"] == 64
    assert flat["scaling.min_workers"] == 2
    assert flat["model.name"] == "cnn"


@pytest.mark.parametrize("preset,model", [("digits_cnn.yaml", "cnn"), ("pycode_gpt.yaml", "gpt")])
def test_repo_presets_are_valid(preset, model):
    cfg = Config.load(REPO / "experiments/configs" / preset)
    assert cfg.model.name == model
    assert cfg.batch.global_batch_size % cfg.scaling.max_workers == 0


def test_unknown_key_names_dotted_field(tmp_path):
    raw = _cfg(tmp_path, {"optim": {"learning_rate": 0.1}})
    with pytest.raises(ConfigError) as e:
        Config.from_dict(raw)
    assert "optim.learning_rate" in str(e.value) and "unknown key" in str(e.value)

    raw = _cfg(tmp_path, {"trian": {"epochs": 2}})
    with pytest.raises(ConfigError, match=r"trian: unknown key"):
        Config.from_dict(raw)


def test_min_workers_above_max_names_both(tmp_path):
    raw = _cfg(tmp_path, {"scaling": {"min_workers": 3, "max_workers": 2}})
    with pytest.raises(ConfigError) as e:
        Config.from_dict(raw)
    msg = str(e.value)
    assert "scaling.min_workers" in msg and "scaling.max_workers" in msg


def test_unknown_model_name(tmp_path):
    raw = _cfg(tmp_path, {"model": {"name": "resnet"}})
    with pytest.raises(ConfigError) as e:
        Config.from_dict(raw)
    msg = str(e.value)
    assert "model.name" in msg
    assert all(n in msg for n in ("mlp", "cnn", "gpt")), msg


def test_gpt_heads_must_divide_width(tmp_path):
    raw = _cfg(tmp_path, {"model": {"name": "gpt", "n_embd": 100, "n_head": 3}})
    with pytest.raises(ConfigError, match=r"model\.n_embd .*model\.n_head"):
        Config.from_dict(raw)


def test_fixed_global_indivisible_batch_suggests_multiple(tmp_path):
    # 64 does not divide over world size 3 (nor 5, 6); lcm(2..6) = 60 -> suggest 120.
    raw = _cfg(tmp_path, {"scaling": {"min_workers": 2, "max_workers": 6}})
    with pytest.raises(ConfigError) as e:
        Config.from_dict(raw)
    msg = str(e.value)
    assert "batch.global_batch_size" in msg
    assert "[3, 5, 6]" in msg
    assert "multiple of 60" in msg and "120" in msg
    assert "batch.policy=uneven" in msg
    # The suggestion really is valid, and so is the same batch under policy uneven.
    Config.from_dict(_cfg(tmp_path, {"scaling": {"min_workers": 2, "max_workers": 6},
                                     "batch": {"global_batch_size": 120}}))
    Config.from_dict(_cfg(tmp_path, {"scaling": {"min_workers": 2, "max_workers": 6},
                                     "batch": {"policy": "uneven"}}))


def test_batch_smaller_than_world_refused(tmp_path):
    raw = _cfg(tmp_path, {"batch": {"global_batch_size": 3, "policy": "uneven"},
                          "scaling": {"min_workers": 2, "max_workers": 4}})
    with pytest.raises(ConfigError, match=r"batch\.global_batch_size=3 .*scaling\.max_workers=4"):
        Config.from_dict(raw)


def test_set_overrides_parse_yaml_values(tmp_path):
    path = _write_yaml(tmp_path / "c.yaml", _cfg(tmp_path))
    cfg = Config.load(path, [
        "scaling.max_workers=4",            # int
        "batch.global_batch_size=96",       # keeps 2..4 divisible (lcm 12)
        "optim.lr=2e-3",                    # float in exponent form
        "optim.betas=[0.8, 0.95]",          # YAML flow list
        "model.batch_norm=true",            # YAML bool
        "data.val_path=null",               # YAML null
        "run.name=my run",                  # plain string with a space
        "train.max_steps=",                 # empty -> None
    ])
    assert cfg.scaling.max_workers == 4 and isinstance(cfg.scaling.max_workers, int)
    assert cfg.batch.global_batch_size == 96
    assert cfg.optim.lr == pytest.approx(2e-3)
    assert tuple(cfg.optim.betas) == (0.8, 0.95)
    assert cfg.model.batch_norm is True
    assert cfg.data.val_path is None
    assert cfg.run.name == "my run"
    assert cfg.train.max_steps is None
    # The file's other values survive the overrides.
    assert cfg.model.hidden == 32


def test_set_override_errors(tmp_path):
    path = _write_yaml(tmp_path / "c.yaml", _cfg(tmp_path))
    with pytest.raises(ConfigError, match="expected key.sub=value"):
        Config.load(path, ["scaling.max_workers"])
    with pytest.raises(ConfigError, match="scaling.max_wrokers: unknown key"):
        Config.load(path, ["scaling.max_wrokers=3"])
    with pytest.raises(ConfigError, match=r"train\.epochs"):
        Config.load(path, ["train.epochs=zero"])
    with pytest.raises(ConfigError, match="not found"):
        Config.load(tmp_path / "missing.yaml")


# ------------------------------------------------------------------ CLI exit codes
def _run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_bad_config_exits_2_and_starts_nothing(tmp_path, capsys):
    path = _write_yaml(tmp_path / "c.yaml", _cfg(tmp_path, {"scaling": {"max_workers": 3}}))
    rc, out, err = _run_cli(capsys, "train", str(path), "--no-progress")
    assert rc == 2
    assert "batch.global_batch_size" in err and "config error" in err
    assert not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "ray_results").exists()

    rc, _, err = _run_cli(capsys, "train", str(path), "--set", "scaling.max_workers=2",
                          "--set", "train.epochz=3")
    assert rc == 2 and "train.epochz" in err
    assert not (tmp_path / "mlflow.db").exists()


def _digits_like(path: Path, ids, with_label=True) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    cols = {"sample_id": pa.array(list(ids), pa.int64()),
            "x": pa.array([[0.5] * 64 for _ in ids], pa.list_(pa.float32()))}
    if with_label:
        cols["y"] = pa.array([i % 10 for i in ids], pa.int64())
    pq.write_table(pa.table(cols), path)


def test_cli_missing_label_column_exits_2_no_run(tmp_path, capsys):
    data = tmp_path / "data"
    _digits_like(data / "train" / "part-0.parquet", range(20), with_label=False)
    _digits_like(data / "val" / "part-0.parquet", range(20, 30))
    path = _write_yaml(tmp_path / "c.yaml", _cfg(tmp_path))
    rc, _, err = _run_cli(capsys, "train", str(path), "--no-progress")
    assert rc == 2
    assert "data error" in err and "part-0.parquet" in err and "missing column 'y'" in err
    assert mlflow_runs(tmp_path) == []
    assert not (tmp_path / "ray_results").exists()


def test_cli_duplicate_sample_id_exits_2_no_run(tmp_path, capsys):
    data = tmp_path / "data"
    _digits_like(data / "train" / "part-0.parquet", range(20))
    _digits_like(data / "train" / "part-1.parquet", [19, 20, 21])
    _digits_like(data / "val" / "part-0.parquet", range(100, 110))
    path = _write_yaml(tmp_path / "c.yaml", _cfg(tmp_path))
    rc, _, err = _run_cli(capsys, "train", str(path), "--no-progress")
    assert rc == 2
    assert "duplicate sample id 19" in err and "'sample_id'" in err
    assert mlflow_runs(tmp_path) == []


def test_cli_model_data_mismatch_exits_2(tmp_path, capsys):
    data = tmp_path / "data"
    _digits_like(data / "train" / "part-0.parquet", range(20))
    _digits_like(data / "val" / "part-0.parquet", range(20, 30))
    path = _write_yaml(tmp_path / "c.yaml", _cfg(tmp_path, {"model": {"input_shape": [1, 4, 4]}}))
    rc, _, err = _run_cli(capsys, "train", str(path), "--no-progress")
    assert rc == 2 and "model.input_shape" in err
    assert mlflow_runs(tmp_path) == []


def test_cli_plan_prints_world_sizes(tmp_path, capsys):
    path = _write_yaml(tmp_path / "c.yaml", _cfg(tmp_path, {
        "batch": {"global_batch_size": 64, "micro_batch_size": 16, "policy": "uneven"},
        "scaling": {"min_workers": 2, "max_workers": 5}}))
    rc, out, _ = _run_cli(capsys, "plan", str(path))
    assert rc == 0
    rows = {int(line.split()[0]): line.split() for line in out.splitlines()
            if line.strip() and line.split()[0].isdigit()}
    assert sorted(rows) == [2, 3, 4, 5]
    # world_size global rows/rank grad_accum lr_x
    assert rows[2][1:4] == ["64", "32", "2"]
    assert rows[3][1:4] == ["64", "21-22", "2"]
    assert rows[4][1:4] == ["64", "16", "1"]
    assert rows[5][1:4] == ["64", "12-13", "1"]


def test_cli_subprocess_exit_code(tmp_path):
    """The installed console script, as a user runs it: exit 2 and the field on stderr."""
    exe = Path(sys.executable).with_name("elastic-ddp")
    path = _write_yaml(tmp_path / "c.yaml", _cfg(tmp_path, {"scaling": {"min_workers": 3}}))
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "elastic_ddp.cli"]
    p = subprocess.run(cmd + ["plan", str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "scaling.min_workers" in p.stderr and "scaling.max_workers" in p.stderr
