"""The training data's fingerprint (what a checkpoint records to refuse a resume on other
data): the same rows copied elsewhere keep it; rows added, removed or renumbered change
it. Real Parquet files."""

from __future__ import annotations

from elastic_ddp.data.scan import scan_parquet
from helpers import task_columns, write_rows


def test_the_fingerprint_changes_with_the_rows_not_with_a_copy(tmp_path):
    cols = task_columns()
    write_rows(tmp_path / "d" / "a.parquet", range(16))
    base = scan_parquet(tmp_path / "d", cols).fingerprint
    import shutil

    shutil.copytree(tmp_path / "d", tmp_path / "copy")
    assert scan_parquet(tmp_path / "copy", cols).fingerprint == base       # moved: same data
    write_rows(tmp_path / "d" / "b.parquet", range(16, 24))                 # 8 rows added
    added = scan_parquet(tmp_path / "d", cols).fingerprint
    (tmp_path / "d" / "b.parquet").unlink()
    write_rows(tmp_path / "d" / "a.parquet", range(12))                     # rows removed
    removed = scan_parquet(tmp_path / "d", cols).fingerprint
    write_rows(tmp_path / "d" / "a.parquet", range(100, 116))               # ids renumbered
    renumbered = scan_parquet(tmp_path / "d", cols).fingerprint
    assert len({base, added, removed, renumbered}) == 4
