"""The data layer on real Parquet files: prepare digits/pycode, and scan's checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elastic_ddp.data import DataError, DatasetInfo, prepare_digits, prepare_pycode, scan_parquet
from elastic_ddp.data.scan import read_sample_ids
from elastic_ddp.tasks.protocol import Column

X = {"x": Column.list_of("number")}
XY = {**X, "y": Column.integer(min=0)}


def _read_split(split_dir: Path) -> pa.Table:
    files = sorted(split_dir.glob("*.parquet"))
    assert files, f"no files in {split_dir}"
    return pa.concat_tables(pq.read_table(f) for f in files)


# --------------------------------------------------------------------------- digits


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("digits")
    prepare_digits(out, num_files=4, val_fraction=0.2, seed=0)
    return out


def test_digits_rows_ids_values(digits_dir):
    from sklearn.datasets import load_digits

    train, val = _read_split(digits_dir / "train"), _read_split(digits_dir / "val")
    assert len(list((digits_dir / "train").glob("*.parquet"))) == 4
    assert train.num_rows + val.num_rows == 1797
    assert val.num_rows == round(1797 * 0.2)

    ids = np.concatenate([train["sample_id"].to_numpy(), val["sample_id"].to_numpy()])
    assert np.array_equal(np.sort(ids), np.arange(1797))
    assert train.schema.field("sample_id").type == pa.int64()
    assert train.schema.field("y").type == pa.int64()
    assert train.schema.field("x").type.value_type == pa.float32()

    x = np.stack(train["x"].to_numpy(zero_copy_only=False))
    assert x.shape == (train.num_rows, 64) and x.dtype == np.float32
    assert x.min() == 0.0 and x.max() == 1.0
    assert set(train["y"].to_numpy()) == set(range(10))

    # Stable ids: the row with id i is image i of load_digits, pixels and label.
    ref = load_digits()
    tid = train["sample_id"].to_numpy()
    np.testing.assert_allclose(x, ref.data[tid] / 16.0, rtol=0, atol=1e-7)
    assert np.array_equal(train["y"].to_numpy(), ref.target[tid])


def test_digits_deterministic_and_overwrites(digits_dir, tmp_path):
    other = tmp_path / "again"
    prepare_digits(other, num_files=4, val_fraction=0.2, seed=0)
    for split in ("train", "val"):
        assert _read_split(digits_dir / split).equals(_read_split(other / split))
    # A different seed gives a different split; re-preparing fewer files into the same
    # directory leaves no stale part files and no staging directories behind.
    summary = prepare_digits(other, num_files=2, val_fraction=0.1, seed=1)
    assert sorted(p.name for p in (other / "train").iterdir()) == [
        "part-00000.parquet",
        "part-00001.parquet",
    ]
    assert sorted(p.name for p in other.iterdir()) == ["train", "val"]
    assert summary["train"]["num_rows"] + summary["val"]["num_rows"] == 1797
    assert not _read_split(other / "val").equals(_read_split(digits_dir / "val"))
    prepare_digits(other, num_files=2, val_fraction=0.0)
    assert not (other / "val").exists()


def test_scan_prepared_digits(digits_dir):
    cols = {"x": Column.list_of("number", length=64), "y": Column.integer(min=0, max=9)}
    info = scan_parquet(digits_dir / "train", cols)
    assert isinstance(info, DatasetInfo)
    assert info.num_rows == sum(info.rows_per_file) == sum(g.num_rows for g in info.row_groups)
    assert len(info.files) == 4 and [Path(f).name for f in info.files] == [
        f"part-{i:05d}.parquet" for i in range(4)
    ]
    assert info.schema.names == ["sample_id", "x", "y"]
    assert all(g.nbytes > 0 for g in info.row_groups)
    ids = read_sample_ids(digits_dir / "train")
    assert ids.dtype == np.int64 and np.all(np.diff(ids) > 0) and len(ids) == info.num_rows
    val = scan_parquet(digits_dir / "val", cols)
    assert np.intersect1d(ids, read_sample_ids(digits_dir / "val")).size == 0
    assert info.num_rows + val.num_rows == 1797
    # A single file is a data set too.
    one = scan_parquet(info.files[0], X)
    assert one.num_rows == info.rows_per_file[0] and one.schema.names == ["sample_id", "x"]
    # The fingerprint follows the rows, not the location.
    assert scan_parquet(digits_dir / "train", cols).fingerprint == info.fingerprint != val.fingerprint


# --------------------------------------------------------------------------- pycode


def test_pycode_windows(tmp_path):
    summary = prepare_pycode(tmp_path, block_size=64, num_files=3, val_fraction=0.05, max_bytes=300_000)
    train, val = _read_split(tmp_path / "train"), _read_split(tmp_path / "val")
    assert train.num_rows > 0 and val.num_rows > 0
    assert summary["train"]["num_rows"] == train.num_rows
    assert train.num_rows * 65 <= summary["train"]["bytes"] < (train.num_rows + 1) * 65
    assert train.schema.field("x").type.value_type == pa.uint8()
    for t in (train, val):
        assert np.array_equal(t["sample_id"].to_numpy(), np.arange(t.num_rows))
        lengths = pa.compute.list_value_length(t["x"]).to_numpy()
        assert np.all(lengths == 65)

    # Windows are consecutive slices of the byte stream: rejoined, they read as Python.
    text = np.concatenate(train["x"].to_numpy(zero_copy_only=False)).tobytes().decode("utf-8", "replace")
    assert "def " in text and "import " in text and "return" in text
    val_text = np.concatenate(val["x"].to_numpy(zero_copy_only=False)).tobytes().decode("utf-8", "replace")
    assert val_text not in text  # split by file, so val text is not a piece of train

    info = scan_parquet(tmp_path / "train", {"x": Column.list_of("int", length=65, min=0, max=255)})
    assert info.num_rows == train.num_rows


def test_pycode_tiny_cap_still_gives_one_window_per_split(tmp_path):
    summary = prepare_pycode(tmp_path, block_size=1000, num_files=2, max_bytes=500)
    assert summary["train"]["num_rows"] == 1 and summary["val"]["num_rows"] == 1
    assert summary["train"]["files"] == [str(tmp_path / "train" / "part-00000.parquet")]
    with pytest.raises(ValueError, match="block_size"):
        prepare_pycode(tmp_path, block_size=0)


# --------------------------------------------------------------------------- scan errors


def _write(path: Path, **columns) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


def _ok(path: Path, ids=(0, 1, 2), width=4, feature_type=pa.float32()) -> Path:
    ids = list(ids)
    return _write(
        path,
        sample_id=pa.array(ids, pa.int64()),
        x=pa.array([[0.5] * width for _ in ids], pa.list_(feature_type)),
        y=pa.array([i % 3 for i in ids], pa.int64()),
    )


def _raises(path, *needles, columns=X) -> str:
    with pytest.raises(DataError) as exc:
        scan_parquet(path, columns)
    msg = str(exc.value)
    for needle in needles:
        assert str(needle) in msg, f"{needle!r} not in: {msg}"
    return msg


def test_scan_ok_and_skips_hidden(tmp_path):
    _ok(tmp_path / "b" / "part-1.parquet", ids=[10, 11])
    _ok(tmp_path / "a.parquet", ids=[5, 1])
    _write(tmp_path / ".staging-x" / "junk.parquet", other=pa.array([1]))
    (tmp_path / "_SUCCESS.parquet").write_text("not parquet")
    (tmp_path / "notes.txt").write_text("hi")
    info = scan_parquet(tmp_path, XY)
    assert [Path(f).name for f in info.files] == ["a.parquet", "part-1.parquet"]
    assert info.rows_per_file == [2, 2]
    assert read_sample_ids(tmp_path).tolist() == [1, 5, 10, 11]
    # What was not read is reported, with the reason.
    assert any(".staging-x" in s and "hidden" in s for s in info.skipped), info.skipped
    assert any("_SUCCESS.parquet" in s for s in info.skipped)
    assert any("notes.txt" in s and "not *.parquet" in s for s in info.skipped)


def test_scan_follows_symlinked_directories_once(tmp_path):
    """Half the files in a symlinked sub-directory are read (they were silently dropped),
    and a link loop or a second link to the same directory is read once, reported."""
    root, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    _ok(root / "local" / "part-0.parquet", ids=range(0, 8))
    _ok(elsewhere / "part-1.parquet", ids=range(8, 16))
    (root / "linked").symlink_to(elsewhere, target_is_directory=True)
    (root / "again").symlink_to(elsewhere, target_is_directory=True)
    (elsewhere / "loop").symlink_to(root, target_is_directory=True)
    info = scan_parquet(root, XY)
    assert info.num_rows == 16 and len(info.files) == 2, info.files
    assert read_sample_ids(root).tolist() == list(range(16))
    assert sum("symlink" in s for s in info.skipped) >= 2, info.skipped


def test_scan_unifies_nullability_across_files(tmp_path):
    """Two files identical but for `not null` on a column: the scan unifies the schemas
    (nullable wins) instead of passing files the reader then fails to concatenate."""
    strict = pa.schema([pa.field("sample_id", pa.int64(), nullable=False),
                        pa.field("x", pa.list_(pa.float32()), nullable=False),
                        pa.field("y", pa.int64(), nullable=False)])
    pq.write_table(pa.table({"sample_id": [0, 1], "x": [[0.5] * 4] * 2, "y": [0, 1]},
                            schema=strict), tmp_path / "a.parquet")
    _ok(tmp_path / "b.parquet", ids=[2, 3])
    info = scan_parquet(tmp_path, XY)
    assert all(f.nullable for f in info.schema)
    # Every file casts to it (what the reader does for each row group).
    for f in info.files:
        t = pq.read_table(f, columns=info.schema.names).select(info.schema.names).cast(info.schema)
        assert t.schema.equals(info.schema)


def test_scan_reads_the_file_not_a_hive_partition_key(tmp_path):
    """A directory named like a partition key of an existing column (`y=7/`): the value
    in the file counts (Ray Data's partition inference would replace it with 7)."""
    _ok(tmp_path / "y=7" / "part-0.parquet", ids=[0, 1, 2])
    info = scan_parquet(tmp_path, {**X, "y": Column.integer(min=0, max=2)})
    from elastic_ddp.data.ingest import _read_window
    from elastic_ddp.data.order import Piece, Window

    g = info.row_groups[0]
    t = _read_window(info.files, info.schema, 0, Window(0, 0, (Piece(g.file, g.index, 0, 3),), 3, ()))[0]
    assert t["y"].to_pylist() == [0, 1, 2]


def test_scan_checks_value_ranges_and_nulls_from_statistics(tmp_path):
    # A label above num_classes - 1, in any split, names the file, row group and fix.
    _ok(tmp_path / "val" / "part-0.parquet", ids=[0, 1, 2, 3, 4, 5])  # y = i % 3 -> up to 2
    msg = _raises(tmp_path / "val", "part-0.parquet", "'y'", "value 2", "row group 0",
                  "raise task.kwargs.num_classes",
                  columns={**X, "y": Column.integer(min=0, max=1, hint="raise task.kwargs.num_classes")})
    assert "largest allowed 1" in msg
    # A null inside a list<float> (the reader would turn it into NaN) is refused.
    _write(tmp_path / "n" / "a.parquet", sample_id=pa.array([0, 1]),
           x=pa.array([[1.0, None], [2.0, 3.0]], pa.list_(pa.float32())))
    _raises(tmp_path / "n", "a.parquet", "'x'", "1 null(s)", "nulls inside lists")
    scan_parquet(tmp_path / "n", {"x": Column.list_of("number", nullable=True)})  # allowed


def test_scan_missing_path(tmp_path):
    _raises(tmp_path / "nope", "nope", "does not exist")


def test_scan_no_parquet_files(tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    _raises(tmp_path, str(tmp_path), "no Parquet files")


def test_scan_not_parquet(tmp_path):
    _ok(tmp_path / "a.parquet")
    (tmp_path / "b.parquet").write_bytes(b"this is not parquet at all")
    _raises(tmp_path, "b.parquet", "not a valid Parquet")


def test_scan_empty(tmp_path):
    _ok(tmp_path / "a.parquet", ids=[])
    _raises(tmp_path, "empty", "0 rows in 1 file")


def test_scan_missing_column(tmp_path):
    _ok(tmp_path / "a.parquet")
    _write(tmp_path / "b.parquet", sample_id=pa.array([7], pa.int64()), pixels=pa.array([[1.0]]))
    msg = _raises(tmp_path, "b.parquet", "'x'", "'pixels'", "'sample_id'")
    assert "a.parquet" not in msg
    _raises(tmp_path / "a.parquet", "a.parquet", "'label'", columns={**X, "label": Column.integer()})


def test_scan_type_mismatch_between_files(tmp_path):
    """Integers of different widths are widened (int32 + int64 -> int64, what the reader
    casts to); an integer and a float column are refused, naming both files and types."""
    _ok(tmp_path / "a.parquet", ids=[0, 1])
    _write(
        tmp_path / "b.parquet",
        sample_id=pa.array([2, 3], pa.int32()),
        x=pa.array([[0.5] * 4] * 2, pa.list_(pa.float32())),
    )
    assert scan_parquet(tmp_path, X).schema.field("sample_id").type == pa.int64()
    _write(
        tmp_path / "c.parquet",
        sample_id=pa.array([4.0, 5.0], pa.float64()),
        x=pa.array([[0.5] * 4] * 2, pa.list_(pa.float32())),
    )
    _raises(tmp_path, "a.parquet", "c.parquet", "'sample_id'", "double", "int64")


def test_scan_feature_type_mismatch_between_files(tmp_path):
    _ok(tmp_path / "a.parquet", ids=[0, 1])
    _ok(tmp_path / "b.parquet", ids=[2, 3], feature_type=pa.float64())
    assert scan_parquet(tmp_path, X).schema.field("x").type.value_type == pa.float64()
    _ok(tmp_path / "c.parquet", ids=[4, 5], feature_type=pa.int32())
    _raises(tmp_path, "a.parquet", "c.parquet", "'x'", "int32", "float")


def test_scan_id_not_integer(tmp_path):
    _write(
        tmp_path / "a.parquet",
        sample_id=pa.array(["a", "b"]),
        x=pa.array([[1.0], [2.0]], pa.list_(pa.float32())),
    )
    _raises(tmp_path, "a.parquet", "'sample_id'", "not an integer")


def test_scan_duplicate_ids_within_file(tmp_path):
    _ok(tmp_path / "a.parquet", ids=[0, 1])
    _ok(tmp_path / "b.parquet", ids=[5, 9, 5])
    msg = _raises(tmp_path, "b.parquet", "'sample_id'", "duplicate sample id 5")
    assert "a.parquet" not in msg


def test_scan_duplicate_ids_across_files(tmp_path):
    _ok(tmp_path / "a.parquet", ids=[0, 1, 42])
    _ok(tmp_path / "b.parquet", ids=[42, 43])
    _raises(tmp_path, "a.parquet", "b.parquet", "'sample_id'", "duplicate sample id 42")


def test_scan_feature_not_list(tmp_path):
    _write(tmp_path / "a.parquet", sample_id=pa.array([0, 1]), x=pa.array([1.0, 2.0]))
    _raises(tmp_path, "a.parquet", "'x'", "not a list")


def test_scan_feature_lengths_checked_against_the_declared_length(tmp_path):
    _write(
        tmp_path / "a.parquet",
        sample_id=pa.array([0, 1]),
        x=pa.array([[1.0, 2.0], [1.0]], pa.list_(pa.float32())),
    )
    fixed = {"x": Column.list_of("number", length=2, hint="fix task.kwargs.input_shape")}
    _raises(tmp_path, "a.parquet", "'x'", "length 1, 2", "expected exactly 2", "input_shape",
            columns=fixed)
    scan_parquet(tmp_path, X)  # variable length is fine when the task allows it
    _raises(tmp_path, "a.parquet", "'x'", "2 values, more than 1",
            columns={"x": Column.list_of("number", max_length=1)})


def test_scan_feature_lengths_differ_across_files(tmp_path):
    _ok(tmp_path / "a.parquet", ids=[0, 1], width=4)
    _ok(tmp_path / "b.parquet", ids=[2, 3], width=5)
    _raises(tmp_path, "b.parquet", "'x'", "length 5", "expected exactly 4",
            columns={"x": Column.list_of("number", length=4)})


def test_scan_feature_length_checked_in_last_row_group(tmp_path):
    path = tmp_path / "a.parquet"
    table = pa.table(
        {
            "sample_id": pa.array(range(6), pa.int64()),
            "x": pa.array([[0.0] * 3] * 5 + [[0.0] * 2], pa.list_(pa.float32())),
        }
    )
    pq.write_table(table, path, row_group_size=2)
    _raises(path, "a.parquet", "'x'", "length 2, 3", columns={"x": Column.list_of("number", length=3)})


def test_scan_label_not_integer(tmp_path):
    _write(
        tmp_path / "a.parquet",
        sample_id=pa.array([0, 1]),
        x=pa.array([[1.0], [2.0]], pa.list_(pa.float32())),
        y=pa.array([0.0, 1.0]),
    )
    _raises(tmp_path, "a.parquet", "'y'", "not an integer", columns=XY)


def test_scan_on_100k_rows_keeps_nothing_per_row(tmp_path):
    """The scan result carries row groups, not rows: its size does not grow with the
    number of rows (what goes to every worker)."""
    import pickle

    n = 100_000
    for i, part in enumerate(np.array_split(np.arange(n), 4)):
        pq.write_table(
            pa.table(
                {
                    "sample_id": pa.array(part, pa.int64()),
                    "x": pa.FixedSizeListArray.from_arrays(
                        pa.array(np.zeros(len(part) * 8, np.float32)), 8
                    ),
                    "y": pa.array(part % 10, pa.int64()),
                }
            ),
            tmp_path / f"part-{i}.parquet", row_group_size=25_000,
        )
    info = scan_parquet(tmp_path, {"x": Column.list_of("number", length=8), "y": Column.integer(max=9)})
    assert info.num_rows == n and len(info.row_groups) == 4
    assert len(pickle.dumps(info)) < 10_000
    assert np.array_equal(read_sample_ids(tmp_path), np.arange(n))
