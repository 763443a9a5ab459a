"""``--set key.sub=value`` overrides, typed by the config field they set.

The text after ``=`` is converted according to the pydantic annotation of the target
field, found by walking the model's fields along the dotted key, so a value means the
same whatever it looks like:

* ``str`` fields (``run.name``, ``data.train_path``): the raw text, untouched. No YAML
  parsing, so ``2024`` stays a string, ``@nightly`` is allowed and ``sweep #2`` keeps
  its ``#2`` (YAML would read it as a comment). Empty is refused (an unset shell
  variable, most likely). One exception: text in double quotes is a YAML double-quoted
  string (``"a\tb"``), the form ``submit`` uses for values plain text cannot carry.
* ``bool``: ``true`` or ``false``, case-insensitive; anything else (``yes``, ``1``) is
  refused rather than guessed.
* ``int`` / ``float``: Python number syntax (``4``, ``2e-3``); anything else is refused.
* ``Literal[...]``: one of the listed values (booleans in it as ``true`` / ``false``).
* ``Optional[X]``: empty, ``null`` or ``~`` gives None; otherwise as for ``X``.
* lists, tuples, dicts, sections: a YAML/JSON flow value, e.g. ``[1, 8, 8]``; pydantic
  validates the items.
* free-form (``Any``, the values of ``dict[str, Any]``, their sub-keys): YAML-typed, as
  the same text would be in the YAML file (``64`` is an int, ``true`` a bool, ``[1, 2]``
  a list), except that a plain string is kept verbatim: ``#`` starts no comment and
  text YAML cannot parse (``@x``) is a string. Quote to force a string: ``'64'``.

Every refusal is one line that names the dotted field and what it accepts; the CLI
turns it into exit code 2.
"""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel

from elastic_ddp.config.errors import ConfigError
from elastic_ddp.errors import ElasticDDPError

_NULL_TEXT = ("", "null", "~")  # compared lower-cased and stripped
_SEQUENCES = (list, tuple, set, frozenset)
# A YAML comment starts at a '#' at the start of the text or after whitespace.
_COMMENT = re.compile(r"(^|\s)#")


class _BadValue(ElasticDDPError, ValueError):
    """The text does not fit the field's type; the message says what would."""


def parse_override(model: type[BaseModel], item: str) -> tuple[str, Any]:
    """Split ``key.sub=value`` and convert the value for the field ``key.sub`` of ``model``.

    Args:
        model: The root config class (``Config``); its field annotations decide the type.
        item: One override as typed after ``--set``. Only the first ``=`` splits, so a
            value may contain ``=``.

    Returns:
        ``(dotted key, value)``, the value of the type the field expects (pydantic still
        validates ranges and cross-field rules afterwards).

    Raises:
        ConfigError: no ``=`` or an empty key; a key that names no field; a sub-key
            under a plain value; a value that does not fit the field's type (bad number,
            a bool other than true/false, a value outside a Literal, unparsable YAML for
            a list/dict). The message is one line and names the dotted field.
    """
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {item!r}: expected key.sub=value, e.g. "
                          "--set scaling.max_workers=4")
    annotation = field_annotation(model, key)
    try:
        return key, coerce_text(annotation, text)
    except _BadValue as e:
        raise ConfigError(f"--set {item}: {key} {e}") from None


def field_annotation(model: type[BaseModel], key: str) -> Any:
    """The type annotation of the field at dotted ``key`` inside ``model``.

    Walks pydantic sub-models by their fields, ``dict[K, V]`` by any key (to ``V``), and
    ``Any`` by any key (to ``Any``); ``Optional[...]`` around a section is looked through.

    Raises:
        ConfigError: a part names no field (with the closest field names as a hint), or
            a part goes below a plain value such as ``run.name.x``.
    """
    parts = key.split(".")
    tp: Any = model
    for i, part in enumerate(parts):
        here = ".".join(parts[: i + 1])
        parent = ".".join(parts[:i])
        inner = _strip_optional(_unannotate(tp))
        origin = get_origin(inner)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            field = inner.model_fields.get(part)
            if field is None:
                raise ConfigError(f"--set {key}: {here}: unknown key; "
                                  f"{unknown_key_hint(inner, parts[:i], part)}")
            tp = field.annotation
        elif inner is Any or inner is object:
            tp = Any
        elif origin is dict or (isinstance(origin, type) and issubclass(origin, Mapping)) \
                or inner is dict:
            args = get_args(inner)
            tp = args[1] if len(args) == 2 else Any
        else:
            raise ConfigError(f"--set {key}: {parent} is a value ({_type_name(inner)}), not a "
                              f"section; set it whole: --set {parent}=...")
    return tp


def unknown_key_hint(section: type[BaseModel], path: list[str], part: str) -> str:
    """What to say of ``part``, a key the ``section`` at dotted ``path`` does not have:
    the closest field (``did you mean scaling.max_workers?``), else the section's fields."""
    names = list(section.model_fields)
    close = difflib.get_close_matches(part, names, n=1)
    if close:
        return f"did you mean {'.'.join([*path, *close])}?"
    return f"{'.'.join(path) or 'the config'} has: {', '.join(names)}"


def section_at(model: type[BaseModel], path: list[str]) -> type[BaseModel] | None:
    """The section (a pydantic model) at dotted ``path`` inside ``model``; None where the
    path does not lead to one."""
    tp: Any = model
    for part in path:
        inner = _strip_optional(_unannotate(tp))
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)) or part not in inner.model_fields:
            return None
        tp = inner.model_fields[part].annotation
    inner = _strip_optional(_unannotate(tp))
    return inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None


def coerce_text(annotation: Any, text: str) -> Any:
    """Convert ``--set`` text to a value for a field annotated ``annotation``.

    The rules are in this module's docstring. Raises ``_BadValue`` (a ValueError) whose
    message completes "<field> ..." (e.g. "must be true or false; got 'yes'").
    """
    tp = _unannotate(annotation)
    if tp is Any or tp is object:
        return _free_form(text)
    origin = get_origin(tp)
    if origin is Union or origin is types.UnionType:
        args = get_args(tp)
        members = [a for a in args if a is not type(None)]
        if len(members) < len(args) and text.strip().lower() in _NULL_TEXT:
            return None
        if len(members) == 1:
            return coerce_text(members[0], text)
        # A real union (int | str): the first member that takes the text, in declared order.
        problems = []
        for m in members:
            try:
                return coerce_text(m, text)
            except _BadValue as e:
                problems.append(str(e))
        raise _BadValue(" or ".join(problems))
    if origin is Literal:
        return _literal(get_args(tp), text)
    if tp is bool:
        return _bool(text)
    if tp is int:
        try:
            return int(text.strip())
        except ValueError:
            raise _BadValue(f"must be an integer, e.g. 4; got {text!r}") from None
    if tp is float:
        try:
            return float(text.strip())
        except ValueError:
            raise _BadValue(f"must be a number, e.g. 0.5 or 1e-3; got {text!r}") from None
    container = origin if origin is not None else tp
    if isinstance(container, type) and issubclass(container, _SEQUENCES):
        value = _yaml_flow(text, "a list in brackets, [a, b, ...]")
        if not isinstance(value, list):
            raise _BadValue(f"must be a list in brackets, [a, b, ...]; got {text!r}")
        return value
    if isinstance(container, type) and (issubclass(container, (dict, Mapping, BaseModel))):
        value = _yaml_flow(text, "a mapping in braces, {key: value, ...}")
        if not isinstance(value, dict):
            raise _BadValue(f"must be a mapping in braces, {{key: value, ...}}; got {text!r}")
        return value
    if text == "" and isinstance(tp, type) and issubclass(tp, str):
        # Most often an unset shell variable (--set run.name=$NAME); only Optional
        # fields take empty as null, and an empty name or path is never meant.
        raise _BadValue("is empty; give it a value (empty means null only for fields "
                        "that may be null)")
    if len(text) >= 2 and text[0] == text[-1] == '"' and isinstance(tp, type) and issubclass(tp, str):
        # A YAML double-quoted string: what `elastic-ddp submit` writes for values that
        # would not survive as plain text (a tab, a leading space); escapes apply.
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = None
        if isinstance(value, str):
            return value
    # str and every other scalar type pydantic parses from a string (Path, Enum, ...):
    # the raw text, so nothing in it is lost to YAML (comments, quotes, '@', leading 0s).
    return text


def _unannotate(tp: Any) -> Any:
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    return tp


def _strip_optional(tp: Any) -> Any:
    if get_origin(tp) in (Union, types.UnionType):
        members = [a for a in get_args(tp) if a is not type(None)]
        if len(members) == 1:
            return _unannotate(members[0])
    return tp


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _show(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else "null" if v is None else str(v)


def _bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("true", "false"):
        return t == "true"
    raise _BadValue(f"must be true or false; got {text!r}")


def _literal(allowed: tuple, text: str) -> Any:
    t = text.strip()
    for v in allowed:
        if isinstance(v, bool):
            if t.lower() == _show(v):
                return v
        elif v is None:
            if t.lower() in _NULL_TEXT:
                return None
        elif isinstance(v, int):
            if re.fullmatch(r"[+-]?\d+", t) and int(t) == v:
                return v
        elif t == str(v):
            return v
    raise _BadValue(f"must be one of {', '.join(_show(v) for v in allowed)}; got {text!r}")


def _yaml_flow(text: str, what: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        # PyYAML's message spans several lines with a caret; keep its one-line core.
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        mark = getattr(e, "problem_mark", None)
        where = f" at character {mark.column + 1}" if mark is not None else ""
        raise _BadValue(f"must be {what}; {text!r} is not valid YAML: "
                        f"{problem}{where}") from None


def _free_form(text: str) -> Any:
    s = text.strip()
    if s[:1] in ("[", "{"):  # meant as a flow list/mapping: must parse
        return _yaml_flow(text, "a YAML flow value")
    if s[:1] in ("'", '"'):  # quoted: the user asked for YAML's string
        return _yaml_flow(text, "a quoted YAML string")
    if _COMMENT.search(text):  # YAML would drop the rest as a comment; keep it
        return text
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text  # '@nightly', 'a: b: c': a plain string to a person
    if value is None:
        return None if s.lower() in _NULL_TEXT else text
    if isinstance(value, (bool, int, float)):
        return value
    # A str (kept verbatim rather than YAML's folding of it), and what a one-line value
    # rarely means: dates (2024-01-01 -> datetime.date), block mappings ('a: b').
    return text
