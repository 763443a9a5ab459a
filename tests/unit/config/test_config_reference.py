"""The config reference is the schema's: ``elastic-ddp config --describe`` lists every field
with its true type and default, ``docs/config.md`` is its Markdown output unchanged, every
field and section carries a description, and every config key the docs name exists."""

from __future__ import annotations

import json
import re
from pathlib import Path

from elastic_ddp.config import Config
from elastic_ddp.config import describe
from elastic_ddp.driver.cli import main

REPO = Path(__file__).resolve().parents[3]
DOCS = [REPO / "README.md", REPO / "cluster" / "README.md", *sorted((REPO / "docs").glob("*.md")),
        REPO / "experiments" / "examples" / "README.md"]


def test_docs_config_md_is_the_generated_reference():
    on_disk = (REPO / "docs" / "config.md").read_text()
    assert on_disk == describe.markdown(), (
        f"docs/config.md differs from the schema's descriptions: regenerate it with "
        f"`.venv/bin/{describe.REGENERATE}` and commit it")


def test_every_field_and_section_has_a_description():
    for section in describe.sections():
        assert len(section.doc) > 10, section.name
        for f in section.fields:
            assert len(f.description) > 10, f"{f.key} has no description in config/sections.py"


def test_describe_prints_every_field_with_its_type_and_default(capsys):
    assert main(["config", "--describe"]) == 0
    out = capsys.readouterr().out
    cfg = Config.from_dict({"data": {"train_path": "d"}, "model": {"name": "mlp"}})
    flat = cfg.to_flat_dict()  # an independent walk of a config's values
    described = {f.key: f for f in describe.fields()}
    # Every value a config holds is described; only the empty free-form dicts have no value.
    assert set(described) - set(flat) == {"task.kwargs", "model.kwargs"}
    assert set(flat) <= set(described)
    for key, f in described.items():
        assert f"  {key}: {f.type} = {f.default}\n" in out, key
        if key == "data.train_path":
            assert f.default == "required"
        elif key not in ("model.name",):  # set above to make the config valid
            want = flat.get(key, {})
            assert json.loads(f.default) == want, (key, f.default, want)
    assert described["data.order"].type == '"windowed" | "permutation"'
    assert described["data.partitions"].type == "int >= 1 | null"
    assert described["optim.betas"].type == "[float, float]"


def test_describe_markdown_is_the_files_content(capsys):
    assert main(["config", "--describe", "--markdown"]) == 0
    assert capsys.readouterr().out == describe.markdown()


# Dotted names in the docs that look like config keys and are not: MLflow params the run
# logs beside the config's, and attribute paths inside a pickling error's message.
NOT_CONFIG_KEYS = {"model.parameters", "data.train_rows", "task.lock", "task.cache.log",
                   "task.transform"}


def test_every_config_key_the_docs_name_exists():
    fields = describe.fields()
    keys = {f.key for f in fields}
    free_form = tuple(f.key + "." for f in fields if f.type == "mapping")
    sections = "|".join(s.name for s in describe.sections() if s.name)
    # A name not inside a longer dotted or slashed path (ray.train.report, model/model.pt),
    # not a call (task.input_columns()), not a file name.
    pattern = re.compile(rf"(?<![\w./{{])((?:{sections})\.[a-z_][\w.]*\w)(?![\w(])")
    unknown = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for m in pattern.finditer(line):
                key = m.group(1)
                if re.search(r"\.(py|pt|png|safetensors|json|yaml)$", key):
                    continue
                if key in keys or key.startswith(free_form) or key in NOT_CONFIG_KEYS:
                    continue
                unknown.append(f"{doc.relative_to(REPO)}:{n}: {key}")
    assert not unknown, "config keys named in the docs that the schema lacks:\n" + "\n".join(unknown)
