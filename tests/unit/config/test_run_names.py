"""``run.name`` values that Ray Train or the file system cannot use are refused up front:
one exit-2 line naming the field and the longest name allowed, nothing started."""

from __future__ import annotations

import pytest

from helpers import nothing_started, run_cli, small_config, write_rows


@pytest.mark.parametrize("name,needle", [
    ("x" * 300, "is 300 bytes long, the longest allowed is 200"),
    ("é" * 101, "is 202 bytes long, the longest allowed is 200"),
    ("nightly/2024", "contains '/'"),
    ("a\tb", "contains '\\t'"),
    ("..", "names no directory of its own"),
])
def test_run_names_ray_or_the_file_system_refuse_exit_2(tmp_path, capsys, name, needle):
    """A run.name Ray Train's controller cannot create a directory for (over 200 bytes:
    the run directory is one file-name component, 255 bytes at most; '/', a control
    character, '..') is one exit-2 config error up front, naming the longest name
    allowed."""
    data = tmp_path / "data"
    write_rows(data / "train" / "part-0.parquet", range(32))
    write_rows(data / "val" / "part-0.parquet", range(100, 104))
    rc, out, err = run_cli(tmp_path, small_config(data, tmp_path), capsys, "--set", f"run.name={name}")
    assert rc == 2 and out == "", err
    assert "config error" in err and "run.name" in err and needle in err, err
    assert "200 bytes" in err
    nothing_started(tmp_path)
