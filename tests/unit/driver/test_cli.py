"""The command line as a user meets it: --version, help on every argument, the exit
codes (0, 1, 2, 130), a short config print only after the config validated, the
optional scikit-learn extra, and what the package declares. No Ray cluster is started:
every train here fails its config or data check first."""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from conftest import digits_config, mlflow_runs
from elastic_ddp.driver.cli import _parser, main
from elastic_ddp.config import Config

REPO = Path(__file__).resolve().parents[3]
PRESET = REPO / "experiments/configs/digits_cnn.yaml"


def _cli_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("elastic-ddp")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "elastic_ddp"]


def _config_file(tmp_path: Path, extra=None) -> Path:
    # data/ under tmp_path does not exist: a train that gets past the config fails its
    # data scan (exit 2) before Ray or MLflow start.
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(digits_config(tmp_path / "data", tmp_path, extra)))
    return path


def _nothing_started(tmp_path: Path) -> None:
    assert mlflow_runs(tmp_path) == [] and not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "ray_results").exists()
    if "ray" in sys.modules:
        assert not sys.modules["ray"].is_initialized()


# ------------------------------------------------------------------ --version, help
def test_version_is_the_installed_package_version():
    p = subprocess.run(_cli_cmd() + ["--version"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"elastic-ddp {metadata.version('elastic-ddp')}"


def test_every_argument_of_every_command_has_help():
    def actions(parser: argparse.ArgumentParser, path: str):
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    yield from actions(sub, f"{path} {name}")
            elif not isinstance(a, (argparse._HelpAction,)):
                yield path, a

    seen = list(actions(_parser(), "elastic-ddp"))
    assert len(seen) > 20  # the walk did reach the subcommands
    missing = [f"{path} {a.dest}" for path, a in seen
               if not a.help or a.help == argparse.SUPPRESS]
    assert missing == []


def test_top_level_help_lists_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for code, words in (("0", "ok"), ("1", "training failed"), ("2", "bad config, data or arguments"),
                        ("130", "interrupted")):
        assert re.search(rf"^\s+{code}\s+{words}", out, re.M), (code, out)
    assert "--set KEY=VALUE is typed by the field" in out


@pytest.mark.parametrize("argv", [["train"], ["train", "c.yaml", "--bogus"], ["frobnicate"],
                                  ["prepare", "mnist", "out"]])
def test_argument_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "usage: elastic-ddp" in capsys.readouterr().err


# ------------------------------------------------------------------ train: exit 2, short print
@pytest.mark.parametrize("item,needle", [
    ("scaling.use_gpu=yes", "scaling.use_gpu must be one of auto, true, false; got 'yes'"),
    ("optim.betas=[0.9,0.9", "optim.betas must be a list"),
    ("scaling.max_wrokers=3", "scaling.max_wrokers: unknown key; did you mean scaling.max_workers?"),
    ("run.name=", "run.name is empty"),
])
def test_train_bad_set_exits_2_before_printing_or_starting(tmp_path, capsys, item, needle):
    path = _config_file(tmp_path)
    rc = main(["train", str(path), "--no-progress", "--set", item])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""  # no config print, no launcher line
    assert err == f"elastic-ddp: config error: {err.split('config error: ', 1)[1]}"
    assert needle in err and len(err.strip().splitlines()) == 1, err
    _nothing_started(tmp_path)


def test_train_config_error_exits_2_without_config_print(tmp_path, capsys):
    path = _config_file(tmp_path, {"scaling": {"min_workers": 3, "max_workers": 2}})
    rc = main(["train", str(path), "--verbose"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert "scaling.min_workers" in err
    _nothing_started(tmp_path)


def test_train_prints_only_the_changed_fields_unless_verbose(tmp_path, capsys):
    from elastic_ddp.driver.cli import config_lines

    path = _config_file(tmp_path)
    rc = main(["train", str(path), "--no-progress", "--set", "optim.lr=0.02"])
    out, err = capsys.readouterr()
    # tmp_path/data does not exist: the data error comes before any config print.
    assert rc == 2 and "data error" in err and out == ""
    _nothing_started(tmp_path)

    lines = config_lines(Config.load(path, ["optim.lr=0.02"]))
    assert lines[0].startswith("elastic-ddp config (fields that differ from the defaults")
    assert "  optim.lr=0.02" in lines and '  model.kwargs={"hidden": 32}' in lines, lines
    assert not any("momentum" in line or "bucket_cap_mb" in line for line in lines)  # defaults
    assert len(lines) < 30  # the full dump was ~90 lines
    dump = json.loads("\n".join(config_lines(Config.load(path), verbose=True)[1:]))
    assert dump["parallel"]["bucket_cap_mb"] == 25.0 and dump["optim"]["momentum"] == 0.9


def test_changed_fields_of_the_digits_preset():
    cfg = Config.load(PRESET)
    assert cfg.changed_fields() == {
        "data.train_path": "data/digits/train",   # required: always listed
        "data.val_path": "data/digits/val",
        "task.kwargs": {"feature_column": "x", "label_column": "y", "num_classes": 10,
                        "input_shape": [1, 8, 8]},
        "model.name": "cnn", "model.kwargs": {"hidden": 64},
        "optim.lr": 0.01, "optim.weight_decay": 0.01, "optim.warmup_steps": 10,
        "optim.min_lr_ratio": 0.05,
        "batch.micro_batch_size": 32,
        "train.epochs": 15, "train.checkpoint_every_steps": 50,
        "run.name": "digits-cnn",
    }
    # A field set to its default is not a change; a tuple is listed as JSON (a list).
    cfg = Config.load(PRESET, ["seed=0", "model.kwargs.hidden=128", "optim.betas=[0.8,0.95]"])
    changed = cfg.changed_fields()
    assert "seed" not in changed and changed["model.kwargs"] == {"hidden": 128}
    assert changed["optim.betas"] == [0.8, 0.95]


def test_short_config_lines_are_set_arguments_that_rebuild_the_config(tmp_path):
    """Each printed line is a valid --set: applied to nothing but the defaults they
    rebuild the same config (so the short print leaves out nothing that matters)."""
    from elastic_ddp.driver.cli import config_lines

    cfg = Config.load(PRESET, ["run.name=sweep #2", "data.val_path=null", "scaling.use_gpu=false",
                               "model.kwargs.hidden=8", "optim.betas=[0.8,0.95]"])
    lines = config_lines(cfg)
    items = [line.strip() for line in lines[1:]]
    assert "run.name=sweep #2" in items and "scaling.use_gpu=false" in items
    assert Config.load(None, items) == cfg


# ------------------------------------------------------------------ 130, extras, packaging
def test_ctrl_c_exits_130(tmp_path):
    """A real SIGINT while the command waits on the network: `submit` to a job API that
    accepts the connection and never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(120)
    port = srv.getsockname()[1]
    p = subprocess.Popen(_cli_cmd() + ["submit", "experiments/configs/digits_cnn.yaml",
                                       "--address", f"http://127.0.0.1:{port}"],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        conn, _ = srv.accept()  # the client is now blocked on its request
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
        srv.close()
    assert p.returncode == 130, err
    assert err.strip().endswith("elastic-ddp: interrupted")
    assert "Traceback" not in err


def test_prepare_digits_without_scikit_learn_names_the_extra(tmp_path, capsys, monkeypatch):
    # As if scikit-learn were not installed: a first meta path finder raises what the
    # import system raises for a missing top-level package.
    class NoSklearn:
        @staticmethod
        def find_spec(fullname, path=None, target=None):
            if fullname == "sklearn":
                raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
            return None

    for mod in [m for m in sys.modules if m == "sklearn" or m.startswith("sklearn.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(sys, "meta_path", [NoSklearn(), *sys.meta_path])
    rc = main(["prepare", "digits", str(tmp_path / "digits")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "pip install 'elastic-ddp[examples]'" in err and "scikit-learn" in err
    assert not (tmp_path / "digits").exists()


# Distribution name -> the module elastic_ddp imports.
_MODULE = {"scikit-learn": "sklearn", "pyyaml": "yaml", "pytorch-optimizer": "pytorch_optimizer",
           "nvidia-ml-py": "pynvml"}


def _requirements(extra=None) -> list[str]:
    out = []
    for req in metadata.requires("elastic-ddp") or []:
        name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0).lower()
        marker = re.search(r'extra\s*==\s*"([^"]+)"', req)
        if (marker.group(1) if marker else None) == extra:
            out.append(name)
    return out


def test_playwright_is_only_in_the_ui_extra():
    """The MLflow UI screenshots' driver is the ``ui`` extra's alone: not ``ft`` (what a
    GPU cluster installs for torchft), and not ``dev`` (no test of the default suite
    drives a browser; ``make test-all`` installs ``ui`` for the slow one)."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    holding = sorted(name for name, reqs in extras.items()
                     if any(re.match(r"playwright\b", r) for r in reqs))
    assert holding == ["ui"], holding
    assert extras["ft"] == ["torchft==0.2.0"]
    assert re.search(r'test-all: \$\(UI_STAMP\)', (REPO / "Makefile").read_text())
    assert 'pip install -qq -e ".[ui]"' in (REPO / "Makefile").read_text()


def test_every_runtime_dependency_is_imported_and_sklearn_is_an_extra():
    sources = "\n".join(p.read_text() for p in (REPO / "elastic_ddp").rglob("*.py"))
    unused = [dist for dist in _requirements()
              if not re.search(rf"^\s*(import|from)\s+{_MODULE.get(dist, dist.replace('-', '_'))}\b",
                               sources, re.M)]
    assert unused == []  # pandas was declared and never imported
    assert "scikit-learn" not in _requirements()
    assert "scikit-learn" in _requirements("examples")
    # make setup (and so make train / make test) installs the extra prepare digits needs,
    # and the hf extra of the Hugging Face example (tests/e2e/examples/test_example_hf.py).
    assert re.search(r'pip install .*-e "\.\[dev,examples,hf\]"', (REPO / "Makefile").read_text())
    assert metadata.metadata("elastic-ddp")["License-Expression"] == "Apache-2.0"
