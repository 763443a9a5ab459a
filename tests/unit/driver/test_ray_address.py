"""A ``RAY_ADDRESS`` that nothing answers at: the CLI exits 2 at once with the fix, after
printing the config and what the scan did not read, and opens no MLflow run."""

from __future__ import annotations

import socket
import time

from helpers import nothing_started, run_cli, small_config, write_rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_ray_address_nothing_answers_at_exits_2_after_printing_what_the_scan_skipped(
        tmp_path, capsys, monkeypatch):
    """RAY_ADDRESS naming a cluster nothing answers at (where ray.init would wait for
    minutes) exits 2 at once, saying what to do. Before that, the CLI has printed the
    config and, once, what the scan did not read; no MLflow run exists."""
    data = tmp_path / "data"
    write_rows(data / "train" / "part-0.parquet", range(32))
    elsewhere = tmp_path / "elsewhere"
    write_rows(elsewhere / "part-1.parquet", range(32, 48))
    (data / "train" / "linked").symlink_to(elsewhere, target_is_directory=True)
    (data / "train" / "again").symlink_to(elsewhere, target_is_directory=True)
    write_rows(data / "train" / "_tmp" / "part-9.parquet", range(900, 908))
    (data / "train" / "README.txt").write_text("notes")
    write_rows(data / "val" / "part-0.parquet", range(100, 104))
    port = _free_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    t = time.time()
    rc, out, err = run_cli(tmp_path, small_config(data, tmp_path), capsys)
    assert rc == 2 and time.time() - t < 60, (rc, err)
    assert f"RAY_ADDRESS=127.0.0.1:{port}" in err and "ray start --head" in err, err
    assert "elastic-ddp config" in out
    assert out.count("entries not read") == 1, out
    for needle in ("2 Parquet file(s) read", "_tmp/: hidden", "README.txt: not *.parquet",
                   "same directory as another path (symlink)"):
        assert needle in out, (needle, out)
    nothing_started(tmp_path)
