"""One Parquet column against the task's ``Column`` declaration, from the footer (types,
null counts, min/max statistics) and, for list lengths, the first and last row group.
Used by :func:`elastic_ddp.data.scan.scan_parquet`."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from elastic_ddp.tasks.protocol import Column

_KIND_TEST = {
    "int": pa.types.is_integer,
    "float": pa.types.is_floating,
    "number": lambda t: pa.types.is_integer(t) or pa.types.is_floating(t),
    "binary": lambda t: pa.types.is_binary(t) or pa.types.is_large_binary(t)
    or pa.types.is_fixed_size_binary(t),
    "string": lambda t: pa.types.is_string(t) or pa.types.is_large_string(t),
    "list": lambda t: pa.types.is_list(t) or pa.types.is_large_list(t)
    or pa.types.is_fixed_size_list(t),
    "any": lambda t: True,
}
_KIND_WORDS = {"int": "an integer", "float": "a floating-point number", "number": "a number",
               "binary": "binary (bytes)", "string": "a string", "list": "a list"}
_KIND_PLURAL = {"int": "integers", "float": "floating-point numbers", "number": "numbers",
                "binary": "binary values (bytes)", "string": "strings", "list": "lists"}


def type_key(t: pa.DataType) -> tuple:
    """A type's identity for cross-file comparison, ignoring list child field names and
    nullability (writers disagree on ``item`` vs ``element``; a column declared ``not
    null`` in one file holds the same values as a nullable one)."""
    if pa.types.is_fixed_size_list(t):
        return ("fixed_size_list", t.list_size, type_key(t.value_type))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return (str(t).split("<", 1)[0], type_key(t.value_type))
    return (str(t),)


def unify_field(a: pa.Field, b: pa.Field) -> pa.Field:
    """The field both files can be cast to without loss: the same type (list child names
    ignored), nullable if either is. Numbers of different widths are widened, also inside
    lists: integers to the wider integer that holds both (int32 + int64 -> int64, uint16 +
    int32 -> int32; uint64 with a signed type has none), floats to the wider float.
    Integers and floats are never mixed: ids and labels must not silently become floats.

    Raises:
        TypeError: the types differ otherwise.
    """
    t = a.type if type_key(a.type) == type_key(b.type) else widen(a.type, b.type)
    if t is None:
        raise TypeError(f"{a.type} vs {b.type}")
    return a.with_type(t).with_nullable(a.nullable or b.nullable)


_SIGNED = [pa.int8(), pa.int16(), pa.int32(), pa.int64()]
_UNSIGNED = [pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64()]
_FLOATS = [pa.float16(), pa.float32(), pa.float64()]


def widen(a: pa.DataType, b: pa.DataType):
    """The narrowest type both ``a`` and ``b`` cast to without loss (see
    :func:`unify_field`), keeping ``a``'s list kind and child name; None if there is none."""
    if type_key(a) == type_key(b):
        return a
    if (pa.types.is_list(a) and pa.types.is_list(b)) or (
            pa.types.is_large_list(a) and pa.types.is_large_list(b)):
        inner = widen(a.value_type, b.value_type)
        if inner is None:
            return None
        fld = a.value_field.with_type(inner).with_nullable(a.value_field.nullable or b.value_field.nullable)
        return pa.list_(fld) if pa.types.is_list(a) else pa.large_list(fld)
    if pa.types.is_fixed_size_list(a) and pa.types.is_fixed_size_list(b) and a.list_size == b.list_size:
        inner = widen(a.value_type, b.value_type)
        return None if inner is None else pa.list_(a.value_field.with_type(inner), a.list_size)
    if pa.types.is_floating(a) and pa.types.is_floating(b):
        return max(a, b, key=_FLOATS.index)
    if pa.types.is_integer(a) and pa.types.is_integer(b):
        sa, sb = pa.types.is_signed_integer(a), pa.types.is_signed_integer(b)
        if sa == sb:
            order = _SIGNED if sa else _UNSIGNED
            return max(a, b, key=order.index)
        u, signed = (b, a) if sa else (a, b)
        need = _SIGNED[min(3, _UNSIGNED.index(u) + 1)] if u != pa.uint64() else None
        if need is None:
            return None
        return max(need, signed, key=_SIGNED.index)
    return None


def check_column(pf: pq.ParquetFile, f: Path, name: str, spec: Column, error) -> None:
    """Raise ``error`` (a DataError class) naming ``f``, ``name`` and the fix when the
    column does not fit ``spec``."""
    t = pf.schema_arrow.field(name).type
    fix = f" ({spec.hint})" if spec.hint else ""
    if not _KIND_TEST[spec.kind](t):
        raise error(f"{f}: column {name!r} has type {t}, not {_KIND_WORDS[spec.kind]}; rewrite the "
                    f"column or point the task at another one{fix}")
    if spec.kind == "list" and spec.inner and not _KIND_TEST[spec.inner](t.value_type):
        raise error(f"{f}: column {name!r} is a list of {t.value_type}, not of "
                    f"{_KIND_PLURAL[spec.inner]}; rewrite the column{fix}")
    md = pf.metadata
    leaves = [i for i in range(md.num_columns)
              if md.schema.column(i).path == name or md.schema.column(i).path.startswith(name + ".")]
    for g in range(md.num_row_groups):
        for i in leaves:
            st = md.row_group(g).column(i).statistics
            if st is None:
                continue
            if not spec.nullable and st.null_count:
                inner = " (nulls inside lists included)" if spec.kind == "list" else ""
                raise error(f"{f}: column {name!r} has {st.null_count} null(s) in row group {g}"
                            f"{inner}; drop those rows or fill the values before training")
            if st.has_min_max and (spec.min is not None or spec.max is not None):
                _check_range(f, name, g, st.min, st.max, spec, error)
    if spec.kind == "list" and (spec.length is not None or spec.max_length is not None):
        _check_lengths(pf, f, name, t, spec, error)


def _check_range(f, name, g, lo, hi, spec: Column, error) -> None:
    if isinstance(lo, (bytes, str)):
        return
    if spec.min is not None and lo < spec.min:
        raise error(f"{f}: column {name!r} has value {lo} in row group {g}, below the smallest "
                    f"allowed {spec.min}" + (f"; {spec.hint}" if spec.hint else ""))
    if spec.max is not None and hi > spec.max:
        raise error(f"{f}: column {name!r} has value {hi} in row group {g}, above the largest "
                    f"allowed {spec.max}" + (f"; {spec.hint}" if spec.hint else ""))


def _check_lengths(pf: pq.ParquetFile, f: Path, name: str, t: pa.DataType, spec: Column,
                   error) -> None:
    if pa.types.is_fixed_size_list(t):
        lengths = {t.list_size}
    else:
        lengths = set()
        for g in sorted({0, pf.metadata.num_row_groups - 1}):
            column = pf.read_row_group(g, columns=[name]).column(name)
            if len(column) == 0:
                continue
            bounds = pc.min_max(pc.list_value_length(column))
            lengths.update(v for v in (bounds["min"].as_py(), bounds["max"].as_py()) if v is not None)
    fix = f"; {spec.hint}" if spec.hint else ""
    if spec.length is not None and lengths - {spec.length}:
        raise error(f"{f}: column {name!r} has lists of length "
                    f"{', '.join(str(n) for n in sorted(lengths))}, expected exactly {spec.length}{fix}")
    if spec.max_length is not None and lengths and max(lengths) > spec.max_length:
        raise error(f"{f}: column {name!r} has lists of {max(lengths)} values, more than "
                    f"{spec.max_length}{fix}")
