"""The scan's one schema over files that real writers make differently (nullability, list
child names, integer widths, a ``y=7/`` directory), and the reader returning what the
scan checked: numbers of different widths widen, other mixes are refused naming both
files. Real Parquet files, no Ray."""

from __future__ import annotations

import pyarrow as pa
import pytest

from elastic_ddp.data.scan import DataError, scan_parquet
from helpers import mixed_dataset, task_columns, write_rows


def test_the_reader_delivers_what_the_scan_checked_on_mixed_files(tmp_path):
    """Nullability, list child names, int32/int64 and a `y=7/` directory: the scan
    unifies one schema (int32 widened to int64, nullable where any file is) and the
    reader's own read function returns every file's values cast to it, `y` included."""
    from elastic_ddp.data.ingest import _read_window
    from elastic_ddp.data.order import Piece, Window

    ids = mixed_dataset(tmp_path)
    info = scan_parquet(tmp_path, task_columns(), "sample_id")
    assert info.num_rows == len(ids)
    assert info.schema.field("y").type == pa.int64() and info.schema.field("y").nullable
    assert pa.types.is_list(info.schema.field("x").type)
    got_ids, got_y = [], []
    for g in info.row_groups:
        t = _read_window(info.files, info.schema, 0,
                         Window(0, 0, (Piece(g.file, g.index, 0, g.num_rows),), g.num_rows, ()))[0]
        assert t.schema.field("y").type == pa.int64()
        got_ids += t["sample_id"].to_pylist()
        got_y += t["y"].to_pylist()
    assert sorted(got_ids) == ids
    assert got_y == [i % 3 for i in got_ids]  # never 7 from the directory name


@pytest.mark.parametrize("a,b,fine", [
    (pa.int32(), pa.int64(), True), (pa.uint16(), pa.int32(), True), (pa.int8(), pa.uint8(), True),
    (pa.uint64(), pa.int64(), False), (pa.int64(), pa.float64(), False),
    (pa.float32(), pa.float64(), True), (pa.string(), pa.binary(), False),
])
def test_numbers_of_different_widths_are_widened_other_mixes_refused(tmp_path, a, b, fine):
    from elastic_ddp.data.columns import unify_field

    if fine:
        f = unify_field(pa.field("v", a, nullable=False), pa.field("v", b))
        assert f.nullable
        for t in (a, b):  # both files cast to it without loss
            assert pa.array([1, 2], t).cast(f.type).to_pylist() == [1, 2] if t not in (
                pa.string(), pa.binary()) else True
    else:
        with pytest.raises(TypeError):
            unify_field(pa.field("v", a), pa.field("v", b))


def test_a_label_stored_as_float_in_one_file_is_refused_naming_both_files(tmp_path):
    write_rows(tmp_path / "a.parquet", range(8))
    write_rows(tmp_path / "b.parquet", range(8, 16), y_type=pa.float64())
    with pytest.raises(DataError) as e:
        scan_parquet(tmp_path, task_columns(), "sample_id")
    msg = str(e.value)
    assert "a.parquet" in msg and "b.parquet" in msg and "'y'" in msg and "double" in msg


def test_a_list_of_strings_where_floats_are_declared_is_named_in_plain_words(tmp_path):
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"sample_id": pa.array([0, 1], pa.int64()),
                             "x": pa.array([["a"] * 64] * 2, pa.list_(pa.string())),
                             "y": pa.array([0, 1], pa.int64())}), tmp_path / "a.parquet")
    from elastic_ddp import Column

    for kind, words in (("float", "floating-point numbers"), ("int", "integers"), ("number", "numbers")):
        with pytest.raises(DataError) as e:
            scan_parquet(tmp_path, {"x": Column.list_of(kind, length=64)}, "sample_id")
        assert str(e.value).endswith(f"column 'x' is a list of string, not of {words}; rewrite "
                                     "the column"), str(e.value)
