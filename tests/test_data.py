"""The data layer on real Parquet files: prepare digits/pycode, and scan's checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elastic_ddp.data import DataError, DatasetInfo, prepare_digits, prepare_pycode, scan_parquet


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
    info = scan_parquet(digits_dir / "train", feature_column="x", label_column="y")
    assert isinstance(info, DatasetInfo)
    assert info.num_rows == sum(info.rows_per_file) == len(info.sample_ids)
    assert len(info.files) == 4 and [Path(f).name for f in info.files] == [
        f"part-{i:05d}.parquet" for i in range(4)
    ]
    assert info.sample_ids.dtype == np.int64
    assert np.all(np.diff(info.sample_ids) > 0)
    assert info.feature_len == 64 and info.num_classes_seen == 10
    val = scan_parquet(digits_dir / "val", feature_column="x", label_column="y")
    assert np.intersect1d(info.sample_ids, val.sample_ids).size == 0
    assert info.num_rows + val.num_rows == 1797
    # A single file is a data set too.
    one = scan_parquet(info.files[0], feature_column="x")
    assert one.num_rows == info.rows_per_file[0] and one.num_classes_seen is None


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

    info = scan_parquet(tmp_path / "train", feature_column="x")
    assert info.feature_len == 65 and info.num_rows == train.num_rows


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


def _raises(path, *needles, **kwargs) -> str:
    kwargs.setdefault("feature_column", "x")
    with pytest.raises(DataError) as exc:
        scan_parquet(path, **kwargs)
    msg = str(exc.value)
    for needle in needles:
        assert str(needle) in msg, f"{needle!r} not in: {msg}"
    return msg


def test_scan_ok_and_skips_hidden(tmp_path):
    _ok(tmp_path / "b" / "part-1.parquet", ids=[10, 11])
    _ok(tmp_path / "a.parquet", ids=[5, 1])
    _write(tmp_path / ".staging-x" / "junk.parquet", other=pa.array([1]))
    (tmp_path / "_SUCCESS.parquet").write_text("not parquet")
    info = scan_parquet(tmp_path, feature_column="x", label_column="y")
    assert [Path(f).name for f in info.files] == ["a.parquet", "part-1.parquet"]
    assert info.rows_per_file == [2, 2]
    assert info.sample_ids.tolist() == [1, 5, 10, 11]
    assert info.feature_len == 4 and info.num_classes_seen == 3


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
    _raises(tmp_path, "empty", "sample_id")


def test_scan_missing_column(tmp_path):
    _ok(tmp_path / "a.parquet")
    _write(tmp_path / "b.parquet", sample_id=pa.array([7], pa.int64()), pixels=pa.array([[1.0]]))
    msg = _raises(tmp_path, "b.parquet", "'x'", "'pixels'", "'sample_id'")
    assert "a.parquet" not in msg
    _raises(tmp_path / "a.parquet", "a.parquet", "'label'", label_column="label")


def test_scan_type_mismatch_between_files(tmp_path):
    _ok(tmp_path / "a.parquet", ids=[0, 1])
    _write(
        tmp_path / "b.parquet",
        sample_id=pa.array([2, 3], pa.int32()),
        x=pa.array([[0.5] * 4] * 2, pa.list_(pa.float32())),
    )
    _raises(tmp_path, "a.parquet", "b.parquet", "'sample_id'", "int32", "int64")


def test_scan_feature_type_mismatch_between_files(tmp_path):
    _ok(tmp_path / "a.parquet", ids=[0, 1])
    _ok(tmp_path / "b.parquet", ids=[2, 3], feature_type=pa.float64())
    _raises(tmp_path, "a.parquet", "b.parquet", "'x'", "double", "float")


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


def test_scan_feature_lengths_differ_within_file(tmp_path):
    _write(
        tmp_path / "a.parquet",
        sample_id=pa.array([0, 1]),
        x=pa.array([[1.0, 2.0], [1.0]], pa.list_(pa.float32())),
    )
    _raises(tmp_path, "a.parquet", "'x'", "different lengths")


def test_scan_feature_lengths_differ_across_files(tmp_path):
    _ok(tmp_path / "a.parquet", ids=[0, 1], width=4)
    _ok(tmp_path / "b.parquet", ids=[2, 3], width=5)
    _raises(tmp_path, "a.parquet", "b.parquet", "'x'", "length 5", "length 4")


def test_scan_feature_length_checked_in_last_row_group(tmp_path):
    path = tmp_path / "a.parquet"
    table = pa.table(
        {
            "sample_id": pa.array(range(6), pa.int64()),
            "x": pa.array([[0.0] * 3] * 5 + [[0.0] * 2], pa.list_(pa.float32())),
        }
    )
    pq.write_table(table, path, row_group_size=2)
    _raises(path, "a.parquet", "'x'", "different lengths")


def test_scan_label_not_integer(tmp_path):
    _write(
        tmp_path / "a.parquet",
        sample_id=pa.array([0, 1]),
        x=pa.array([[1.0], [2.0]], pa.list_(pa.float32())),
        y=pa.array([0.0, 1.0]),
    )
    _raises(tmp_path, "a.parquet", "'y'", "not an integer", label_column="y")


def test_scan_fast_on_100k_rows(tmp_path):
    import time

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
            tmp_path / f"part-{i}.parquet",
        )
    start = time.perf_counter()
    info = scan_parquet(tmp_path, feature_column="x", label_column="y")
    assert time.perf_counter() - start < 2.0
    assert info.num_rows == n and info.feature_len == 8 and info.num_classes_seen == 10
    assert np.array_equal(info.sample_ids, np.arange(n))
