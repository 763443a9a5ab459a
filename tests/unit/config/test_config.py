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
from elastic_ddp.driver.cli import main
from elastic_ddp.config import Config, ConfigError

REPO = Path(__file__).resolve().parents[3]


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


def test_a_misspelt_key_in_the_yaml_file_gets_the_closest_field(tmp_path):
    """As ``--set`` does: the file's unknown keys, each with the field it is closest to
    (or the section's fields when none is close), every one in one message."""
    raw = _cfg(tmp_path, {"scaling": {"max_worker": 3}, "optimiser": {"lr": 0.1},
                          "train": {"zzzz": 1}})
    path = _write_yaml(tmp_path / "c.yaml", raw)
    from elastic_ddp.config.schema import TrainConfig

    with pytest.raises(ConfigError) as e:
        Config.load(path)
    lines = str(e.value).splitlines()
    assert lines[0] == f"{path}: invalid config", lines
    assert set(lines[1:]) == {
        "  scaling.max_worker: unknown key; did you mean scaling.max_workers? "
        "(every field: elastic-ddp config --describe)",
        "  optimiser: unknown key; did you mean optim? (every field: elastic-ddp config --describe)",
        f"  train.zzzz: unknown key; train has: {', '.join(TrainConfig.model_fields)} "
        "(every field: elastic-ddp config --describe)"}, lines
    assert "epochs, max_steps" in lines[1] + lines[2] + lines[3]


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


def test_no_task_or_two_tasks_refused(tmp_path):
    raw = _cfg(tmp_path)
    raw["model"] = {"kwargs": {}}
    with pytest.raises(ConfigError, match=r"no task: set task\.path .* or model\.name"):
        Config.from_dict(raw)
    raw = _cfg(tmp_path, {"task": {"path": "mlp"}})
    with pytest.raises(ConfigError, match=r"task\.path='mlp' and model\.name='cnn' name two tasks"):
        Config.from_dict(raw)


def test_fixed_global_indivisible_batch_suggests_the_nearest_values(tmp_path):
    # permutation order: ranks split each step by position, so the global batch must
    # divide over every world size. 64 does not divide over 3 (nor 5, 6); the values
    # 2..6 all divide are multiples of lcm(2..6) = 60: 60 and 120 are the nearest.
    perm = {"data": {"order": "permutation"}, "scaling": {"min_workers": 2, "max_workers": 6}}
    with pytest.raises(ConfigError) as e:
        Config.from_dict(_cfg(tmp_path, perm))
    msg = str(e.value)
    assert "batch.global_batch_size=64 does not divide over world size(s) [3, 5, 6]" in msg, msg
    assert ("set batch.global_batch_size to 60 or 120 (the nearest values divisible by every "
            "world size in 2..6)") in msg, msg
    assert "narrow scaling.min_workers..max_workers to 2..2 or 4..4" in msg, msg
    assert "batch.policy=uneven" in msg
    # The suggestions really are valid, and so is the same batch under policy uneven.
    for fix in ({"batch": {"global_batch_size": 60}}, {"batch": {"global_batch_size": 120}},
                {"batch": {"policy": "uneven"}}):
        Config.from_dict(_cfg(tmp_path, {**perm, **fix}))
    Config.from_dict(_cfg(tmp_path, {**perm, "scaling": {"min_workers": 4, "max_workers": 4}}))


def test_a_wide_worker_range_is_told_the_narrower_ranges_not_a_huge_multiple(tmp_path):
    """1..7 workers: every value all of 1..7 divide is a multiple of 420, no fix for a
    batch of 64 (nor for the default 60 partitions); the message names the ranges that
    work with the value as it is instead, and the file."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_cfg(tmp_path, {"scaling": {"min_workers": 1, "max_workers": 7}})))
    with pytest.raises(ConfigError) as e:
        Config.load(path, ["data.order=permutation"])
    msg = str(e.value)
    assert msg.startswith(f"{path} with --set data.order=permutation: "), msg
    assert ("batch.global_batch_size=64 does not divide over world size(s) [3, 5, 6, 7] allowed "
            "by scaling.min_workers..max_workers=1..7; narrow scaling.min_workers..max_workers "
            "to 1..2 or 4..4 (world sizes that divide 64), or set batch.policy=uneven") in msg, msg
    assert "420" not in msg
    with pytest.raises(ConfigError) as e:
        Config.load(path)  # windowed: the default 60 partitions do not divide over 7
    msg = str(e.value)
    assert ("data.partitions=60 does not divide over world size(s) [7] allowed by "
            "scaling.min_workers..max_workers=1..7; narrow scaling.min_workers..max_workers to "
            "1..6 (world sizes that divide 60), or set batch.policy=uneven") in msg, msg
    assert "420" not in msg
    Config.load(path, ["scaling.max_workers=6"])
    Config.load(path, ["data.order=permutation", "scaling.max_workers=2"])


def test_fixed_global_windowed_needs_world_sizes_dividing_partitions(tmp_path):
    # windowed order: a rank owns whole partitions, so fixed_global (equal shares) needs
    # every world size to divide data.partitions; the default partitions do.
    ws = {"scaling": {"min_workers": 2, "max_workers": 6}}
    cfg = Config.from_dict(_cfg(tmp_path, ws))
    assert cfg.partitions == 60 and all(cfg.partitions % n == 0 for n in range(2, 7))
    with pytest.raises(ConfigError) as e:
        Config.from_dict(_cfg(tmp_path, {**ws, "data": {"partitions": 8}}))
    msg = str(e.value)
    assert "data.partitions=8" in msg and "[3, 5, 6]" in msg, msg
    assert "set data.partitions to 60 (the nearest value divisible by every world size" in msg, msg
    Config.from_dict(_cfg(tmp_path, {**ws, "data": {"partitions": 8}, "batch": {"policy": "uneven"}}))
    with pytest.raises(ConfigError, match=r"scaling\.max_workers=6 exceeds data\.partitions=4: .*; "
                                          r"raise data\.partitions to at least 6 \(or leave it "
                                          r"unset: its default here is 60\), or lower "
                                          r"scaling\.max_workers to 4$"):
        Config.from_dict(_cfg(tmp_path, {**ws, "data": {"partitions": 4},
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
        "model.kwargs.batch_norm=true",     # YAML bool in a free-form dict
        "data.val_path=null",               # YAML null
        "run.name=my run",                  # plain string with a space
        "train.max_steps=",                 # empty -> None
    ])
    assert cfg.scaling.max_workers == 4 and isinstance(cfg.scaling.max_workers, int)
    assert cfg.batch.global_batch_size == 96
    assert cfg.optim.lr == pytest.approx(2e-3)
    assert tuple(cfg.optim.betas) == (0.8, 0.95)
    assert cfg.model.kwargs["batch_norm"] is True
    assert cfg.data.val_path is None
    assert cfg.run.name == "my run"
    assert cfg.train.max_steps is None
    # The file's other values survive the overrides.
    assert cfg.model.kwargs["hidden"] == 32


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


# ------------------------------------------------------------------ --set typed by the field
# What a --set value means depends on the field it sets (elastic_ddp/config/overrides.py), not on
# how YAML would read the text.
@pytest.mark.parametrize("item,field,expected", [
    ("run.name=2024", ("run", "name"), "2024"),              # YAML: int -> was refused
    ("run.name=@nightly", ("run", "name"), "@nightly"),      # YAML: ScannerError traceback
    ("run.name=sweep #2", ("run", "name"), "sweep #2"),      # YAML: comment -> was 'sweep'
    ("data.train_path=/x/run #3/train", ("data", "train_path"), "/x/run #3/train"),
    ("run.name=  padded ", ("run", "name"), "  padded "),    # verbatim, not stripped
    ("run.name='q'", ("run", "name"), "'q'"),                # quotes are part of the text
    ("run.experiment_name=a=b", ("run", "experiment_name"), "a=b"),  # first '=' splits
    ("data.val_path=0123", ("data", "val_path"), "0123"),    # YAML: int 123 (leading 0 lost)
    ("run.tracking_uri=true", ("run", "tracking_uri"), "true"),  # Optional[str]: still text
])
def test_set_string_fields_take_the_text_verbatim(tmp_path, item, field, expected):
    path = _write_yaml(tmp_path / "c.yaml", _cfg(tmp_path))
    cfg = Config.load(path, [item])
    value = getattr(getattr(cfg, field[0]), field[1])
    assert value == expected and isinstance(value, str)


@pytest.mark.parametrize("item,field,expected", [
    ("scaling.use_gpu=true", ("scaling", "use_gpu"), True),
    ("scaling.use_gpu=FALSE", ("scaling", "use_gpu"), False),
    ("scaling.use_gpu=auto", ("scaling", "use_gpu"), "auto"),
    ("parallel.bf16=True", ("parallel", "bf16"), True),
    ("scaling.max_workers=4", ("scaling", "max_workers"), 4),
    ("optim.lr=2e-3", ("optim", "lr"), 2e-3),
    ("optim.lr=1", ("optim", "lr"), 1.0),
    ("task.kwargs.input_shape=[1,8,8]", ("task", "kwargs"), {"feature_column": "x", "label_column": "y", "num_classes": 10, "input_shape": [1, 8, 8]}),
    ("optim.betas=[0.9,0.95]", ("optim", "betas"), (0.9, 0.95)),
    ("data.val_path=null", ("data", "val_path"), None),
    ("data.partitions=~", ("data", "partitions"), None),
    ("train.max_steps=", ("train", "max_steps"), None),
    ("train.max_steps=NULL", ("train", "max_steps"), None),
])
def test_set_typed_fields(tmp_path, item, field, expected):
    raw = _cfg(tmp_path, {"scaling": {"max_workers": 4}, "batch": {"global_batch_size": 96}})
    path = _write_yaml(tmp_path / "c.yaml", raw)
    value = getattr(getattr(Config.load(path, [item]), field[0]), field[1])
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("item,needle", [
    # YAML would read 'yes' as True: a bool field takes exactly true or false.
    ("scaling.use_gpu=yes", "scaling.use_gpu must be one of auto, true, false; got 'yes'"),
    ("parallel.bf16=1", "parallel.bf16 must be true or false; got '1'"),
    ("parallel.bf16=on", "parallel.bf16 must be true or false"),
    ("train.epochs=zero", "train.epochs must be an integer"),
    ("train.epochs=2.5", "train.epochs must be an integer"),       # pydantic: 'fractional'
    ("train.epochs=", "train.epochs must be an integer"),          # not Optional: no null
    ("optim.lr=fast", "optim.lr must be a number"),
    ("model.name=CNN", "model.name must be one of mlp, cnn, gpt; got 'CNN'"),
    ("optim.betas=0.9,0.95", "optim.betas must be a list in brackets"),
    ("run.name=", "run.name is empty"),                            # e.g. an unset $VAR
    ("run.name.sub=x", "run.name is a value (str), not a section"),
])
def test_set_refuses_values_that_do_not_fit_the_field(tmp_path, item, needle):
    path = _write_yaml(tmp_path / "c.yaml", _cfg(tmp_path))
    with pytest.raises(ConfigError) as e:
        Config.load(path, [item])
    assert needle in str(e.value)
    assert "\n" not in str(e.value)  # one line, starting with the override itself
    assert str(e.value).startswith(f"--set {item.split('=')[0]}")


def test_set_bad_yaml_in_a_list_is_one_line(tmp_path):
    path = _write_yaml(tmp_path / "c.yaml", _cfg(tmp_path))
    with pytest.raises(ConfigError) as e:  # was a yaml ParserError traceback
        Config.load(path, ["optim.betas=[0.9,0.9"])
    msg = str(e.value)
    assert msg.startswith("--set optim.betas=[0.9,0.9: optim.betas must be a list")
    assert "not valid YAML" in msg and "\n" not in msg


def test_set_unknown_key_names_the_dotted_field_and_the_closest(tmp_path):
    path = _write_yaml(tmp_path / "c.yaml", _cfg(tmp_path))
    with pytest.raises(ConfigError, match=r"scaling\.max_wrokers: unknown key; "
                                          r"did you mean scaling\.max_workers\?"):
        Config.load(path, ["scaling.max_wrokers=3"])
    with pytest.raises(ConfigError, match=r"zzz: unknown key; the config has: seed, data"):
        Config.load(path, ["zzz=1"])


def test_set_free_form_fields_are_yaml_typed():
    """A field annotated Any / dict[str, Any] (such as a model.kwargs) has no type to go
    by: its values and sub-keys are read as YAML scalars, but a plain string is still kept
    whole. The walk follows annotations, so this holds for sections added later."""
    from typing import Any, Optional

    from pydantic import BaseModel, Field

    from elastic_ddp.config.overrides import parse_override

    class Model(BaseModel):
        factory: str = "pkg.mod:build"
        kwargs: dict[str, Any] = Field(default_factory=dict)
        widths: Optional[dict[str, int]] = None

    class Root(BaseModel):
        model: Model = Field(default_factory=Model)

    cases = {
        "model.kwargs.hidden=64": 64,
        "model.kwargs.p=0.1": 0.1,
        "model.kwargs.bias=false": False,
        "model.kwargs.norm=null": None,
        "model.kwargs.act=gelu": "gelu",
        "model.kwargs.tag='2024'": "2024",          # quoted: YAML's string
        "model.kwargs.note=sweep #2": "sweep #2",   # no comment stripping
        "model.kwargs.who=@me": "@me",              # not valid YAML: the text
        "model.kwargs.day=2024-01-01": "2024-01-01",  # not a datetime.date
        "model.kwargs.deep.er=3": 3,                # sub-keys of Any: still typed
        "model.kwargs.dims=[1, 2]": [1, 2],
        "model.kwargs={a: 1}": {"a": 1},
        "model.widths.fc=8": 8,                     # dict[str, int] values are ints
        "model.factory=64": "64",                   # str field: never YAML
    }
    for item, expected in cases.items():
        key, value = parse_override(Root, item)
        assert key == item.split("=")[0]
        assert value == expected and type(value) is type(expected), (item, value)
    with pytest.raises(ConfigError, match=r"model\.widths\.fc must be an integer"):
        parse_override(Root, "model.widths.fc=wide")
    with pytest.raises(ConfigError, match=r"model\.kwargs\.dims must be a YAML flow value; "
                                          r"'\[1, 2' is not valid YAML"):
        parse_override(Root, "model.kwargs.dims=[1, 2")
    with pytest.raises(ConfigError, match=r"model\.factroy: unknown key; did you mean model\.factory"):
        parse_override(Root, "model.factroy=x")


# ------------------------------------------------------------------ CLI exit codes
def _run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_bad_config_exits_2_and_starts_nothing(tmp_path, capsys):
    path = _write_yaml(tmp_path / "c.yaml", _cfg(tmp_path, {"scaling": {"max_workers": 3},
                                                           "data": {"order": "permutation"}}))
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


def test_cli_plan_fits_the_partitions_to_the_data_as_train_does(tmp_path, capsys):
    """One row group of 40 rows: the job gets fewer partitions than the default, so plan
    must show the world sizes of the count train will use, not of the default."""
    from elastic_ddp.data.ingest import epoch_partitions
    from elastic_ddp.data.scan import scan_parquet

    _digits_like(tmp_path / "data" / "train" / "part-0.parquet", range(40))
    raw = _cfg(tmp_path, {"batch": {"global_batch_size": 8, "micro_batch_size": 8},
                          "scaling": {"min_workers": 1, "max_workers": 4}})
    cfg = Config.from_dict(raw)
    fitted = epoch_partitions(scan_parquet(cfg.data.train_path, {}, "sample_id"), cfg)
    assert cfg.data.partitions is None and fitted < cfg.partitions, (fitted, cfg.partitions)
    rc, out, _ = _run_cli(capsys, "plan", str(_write_yaml(tmp_path / "c.yaml", raw)))
    assert rc == 0, out
    assert f"{fitted} partitions fitted to" in out and "40 rows" in out, out
    assert f"windowed with {fitted} canonical partitions" in out, out


def test_cli_subprocess_exit_code(tmp_path):
    """The installed console script, as a user runs it: exit 2 and the field on stderr."""
    exe = Path(sys.executable).with_name("elastic-ddp")
    path = _write_yaml(tmp_path / "c.yaml", _cfg(tmp_path, {"scaling": {"min_workers": 3}}))
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "elastic_ddp"]
    p = subprocess.run(cmd + ["plan", str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "scaling.min_workers" in p.stderr and "scaling.max_workers" in p.stderr


def test_a_missing_column_is_not_told_the_hint_about_its_values(tmp_path):
    # The digits task's label hint ("labels must be 0..9; raise num_classes") answered a
    # missing label column, which has no values to remap.
    import pyarrow as pa
    import pyarrow.parquet as pq

    from elastic_ddp.data.scan import DataError, scan_parquet
    from elastic_ddp.tasks.vision import CNNClassifier

    (tmp_path / "train").mkdir()
    pq.write_table(pa.table({"sample_id": [0, 1], "x": [[0.0] * 64] * 2, "y": [0, 1]}),
                   tmp_path / "train" / "part-0.parquet")
    task = CNNClassifier(feature_column="x", label_column="nolabel")
    with pytest.raises(DataError, match="missing column 'nolabel'") as e:
        scan_parquet(tmp_path / "train", task.input_columns(), "sample_id")
    assert "labels must be" not in str(e.value) and "'y'" in str(e.value), str(e.value)


def test_a_missing_id_column_names_data_id_column_as_the_fix(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from elastic_ddp.data.scan import DataError, scan_parquet
    from elastic_ddp.tasks.vision import CNNClassifier

    pq.write_table(pa.table({"sample_id": [0, 1], "x": [[0.0] * 64] * 2, "y": [0, 1]}),
                   tmp_path / "part-0.parquet")
    task = CNNClassifier(feature_column="x", label_column="y")
    with pytest.raises(DataError) as e:
        scan_parquet(tmp_path, task.input_columns(), "id")
    assert str(e.value).endswith("missing column 'id'; the file has columns: 'sample_id', 'x', "
                                 "'y'. Set data.id_column to the column that holds each row's "
                                 "unique id, or write one (int64) named 'id'"), str(e.value)
    with pytest.raises(DataError, match=r"Point the task at existing columns \(Task.columns\)"):
        scan_parquet(tmp_path, CNNClassifier(feature_column="x", label_column="z").input_columns())


@pytest.mark.parametrize("missing", ["train", "val"])
def test_a_missing_data_path_names_its_field(tmp_path, capsys, missing):
    data = tmp_path / "data"
    other = "val" if missing == "train" else "train"
    _digits_like(data / other / "part-0.parquet", range(20))
    path = _write_yaml(tmp_path / "c.yaml", _cfg(tmp_path))
    rc, _, err = _run_cli(capsys, "train", str(path), "--no-progress")
    assert rc == 2, err
    assert err.strip() == (f"elastic-ddp: data error: {data / missing}: path does not exist; check "
                           f"data.{missing}_path, or create the data set first (e.g. `elastic-ddp "
                           "prepare digits data/digits`)"), err
    assert mlflow_runs(tmp_path) == []


def test_with_run_name_validates_the_new_name_and_leaves_the_config_as_it_was(tmp_path):
    from pydantic import ValidationError

    cfg = Config.from_dict({"data": {"train_path": str(tmp_path)}, "model": {"name": "mlp"},
                            "run": {"name": "job"}})
    assert cfg.with_run_name("job") is cfg
    renamed = cfg.with_run_name("job-0123abcd")
    assert renamed.run.name == "job-0123abcd" and cfg.run.name == "job"
    assert renamed.model_dump() == {**cfg.model_dump(), "run": {**cfg.model_dump()["run"], "name": "job-0123abcd"}}
    with pytest.raises(ValidationError, match="run name"):
        cfg.with_run_name("a/b")
    assert cfg.run.name == "job"
