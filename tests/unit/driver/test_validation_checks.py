"""The validation split gets the training split's input checks: a label out of range,
rows of the wrong length or a null label in a validation file is one exit-2 line naming
the file, the column and the fix, before Ray or MLflow start."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import nothing_started, run_cli, small_config, write_rows


@pytest.mark.parametrize("case,needles", [
    ("label_5", ["val", "part-0.parquet", "'y'", "value 5", "largest allowed 2",
                 "task.kwargs.num_classes"]),
    ("short_rows", ["val", "part-0.parquet", "'x'", "length 63", "expected exactly 64"]),
    ("null_label", ["val", "part-0.parquet", "'y'", "null"]),
])
def test_validation_data_gets_the_training_checks_exit_2(tmp_path, capsys, case, needles):
    """A validation label 5 with num_classes 3 (and siblings: rows of the wrong length, a
    null label) is one exit-2 line naming the val file, the column and the fix, before
    Ray or MLflow start."""
    data = tmp_path / "data"
    write_rows(data / "train" / "part-0.parquet", range(32))
    if case == "label_5":
        write_rows(data / "val" / "part-0.parquet", range(100, 104), labels=[0, 1, 5, 2])
    elif case == "short_rows":
        p = data / "val" / "part-0.parquet"
        p.parent.mkdir(parents=True)
        pq.write_table(pa.table({"sample_id": [100, 101], "x": [[0.5] * 63, [0.5] * 63],
                                 "y": [0, 1]}), p)
    else:
        p = data / "val" / "part-0.parquet"
        p.parent.mkdir(parents=True)
        pq.write_table(pa.table({"sample_id": [100, 101], "x": [[0.5] * 64] * 2,
                                 "y": pa.array([0, None], pa.int64())}), p)
    rc, out, err = run_cli(tmp_path, small_config(data, tmp_path), capsys)
    assert rc == 2 and out == "", (rc, out, err)
    assert err.startswith("elastic-ddp: data error: ") and len(err.strip().splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)
    nothing_started(tmp_path)
