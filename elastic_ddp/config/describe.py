"""The config reference, generated from the schema: every field's dotted key, type, default
and description, as read from the pydantic models of :mod:`~elastic_ddp.config.sections`.

    elastic-ddp config --describe              # plain text, for a terminal
    elastic-ddp config --describe --markdown   # docs/config.md

``docs/config.md`` is this module's :func:`markdown` output; a fast test regenerates it and
compares, so the reference cannot drift from the schema.
"""

from __future__ import annotations

import json
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from elastic_ddp.config.schema import Config

# The command that writes docs/config.md, named by its header and by the test's failure.
REGENERATE = "elastic-ddp config --describe --markdown > docs/config.md"


@dataclass(frozen=True)
class FieldDoc:
    """One leaf field: ``key`` dotted (``data.train_path``), ``type`` as a YAML user
    writes it (``int >= 1``, ``"refuse" | "restart_epoch"``, ``str | null``), ``default``
    as YAML/JSON text or ``required``, ``description`` the schema's text."""

    key: str
    type: str
    default: str
    description: str


@dataclass(frozen=True)
class SectionDoc:
    """A section (``data``; ``""`` for the top-level fields), its docstring and fields."""

    name: str
    doc: str
    fields: tuple[FieldDoc, ...]


def sections(model: type[BaseModel] = Config) -> list[SectionDoc]:
    """The top-level fields, then one :class:`SectionDoc` per section field, in the
    schema's declaration order."""
    top: list[FieldDoc] = []
    out: list[SectionDoc] = []
    for name, info in model.model_fields.items():
        sub = _model_of(info.annotation)
        if sub is not None:
            out.append(SectionDoc(name, _doc(sub), tuple(
                _field(f"{name}.{k}", i) for k, i in sub.model_fields.items())))
        else:
            top.append(_field(name, info))
    return [SectionDoc("", "Top-level fields.", tuple(top)), *out]


def fields(model: type[BaseModel] = Config) -> list[FieldDoc]:
    """Every leaf field of ``model``, dotted, in declaration order."""
    return [f for s in sections(model) for f in s.fields]


def text(width: int = 88) -> str:
    """The reference for a terminal: one block per field, its description indented."""
    lines = ["elastic-ddp config fields (key: type = default). Set them in the YAML file or "
             "with --set KEY=VALUE.", ""]
    for s in sections():
        lines.append(f"[{s.name or 'top level'}] {s.doc}")
        for f in s.fields:
            lines.append(f"  {f.key}: {f.type} = {f.default}")
            lines += textwrap.wrap(f.description, width, initial_indent="      ",
                                   subsequent_indent="      ")
        lines.append("")
    return "\n".join(lines)


def markdown() -> str:
    """``docs/config.md``: a table per section (key, type, default, description)."""
    out = ["# Configuration reference", "",
           f"Generated from the schema (`elastic_ddp/config/sections.py`) by `{REGENERATE}`;",
           "edit the fields' descriptions there, not this file. A YAML preset sets any of these",
           "fields (every field not named keeps its default); `--set KEY=VALUE` sets one on the",
           "command line, typed by the field (`elastic-ddp train -h`). Unknown keys are refused.",
           ""]
    for s in sections():
        out += [f"## {'Top level' if not s.name else '`' + s.name + '`'}", "", s.doc, "",
                "| key | type | default | description |", "| --- | --- | --- | --- |"]
        out += [f"| `{f.key}` | {_cell(f.type)} | {_cell(f.default)} | {_text_cell(f.description)} |"
                for f in s.fields]
        out.append("")
    return "\n".join(out)


def _cell(value: str) -> str:
    return "`" + value.replace("|", "\\|") + "`"


def _text_cell(text: str) -> str:
    # A table cell of prose: '|' would end the cell, '<' could open an HTML tag.
    return text.replace("|", "\\|").replace("<", "&lt;")


def _doc(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split())


def _model_of(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _field(key: str, info: FieldInfo) -> FieldDoc:
    if info.is_required():
        default = "required"
    else:
        value = info.get_default(call_default_factory=True)
        default = json.dumps(value.model_dump(mode="json") if isinstance(value, BaseModel) else value)
    kind, bounds = _type(info.annotation), _bounds(info)
    if bounds and kind.endswith(" | null"):  # the bound is the number's: int >= 1 | null
        kind = kind.removesuffix(" | null") + bounds + " | null"
    else:
        kind += bounds
    return FieldDoc(key, kind, default,
                    " ".join((info.description or "").split()))


def _bounds(info: FieldInfo) -> str:
    ops = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    parts = [f"{ops[k]} {getattr(m, k)}" for m in info.metadata for k in ops
             if getattr(m, k, None) is not None]
    return (" " + ", ".join(parts)) if parts else ""


def _type(t: Any) -> str:
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type(a) for a in args)
    if origin is dict:
        return "mapping"
    if origin in (tuple, list):
        return "[" + ", ".join(_type(a) for a in args) + "]"
    if t is Any:
        return "any"
    return {str: "str", int: "int", float: "float", bool: "bool"}.get(t, getattr(t, "__name__", str(t)))
