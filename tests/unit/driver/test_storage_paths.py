"""``run.storage_path`` as Ray Train receives it: a directory whose name holds URI
characters (' ', '#', '?', '%', '@') is handed over as a file system and a path, never
as a string to parse; a storage path that cannot be written, or a ``file://`` URI with a
raw '#', is one exit-2 line before anything starts."""

from __future__ import annotations

import pytest

from conftest import digits_config
from helpers import nothing_started, run_cli, small_config, write_rows


@pytest.mark.parametrize("name", ["ray results", "run #3", "what?", "100% done", "a@b"])
def test_ray_train_gets_a_file_system_and_a_path_never_a_uri_to_parse(tmp_path, name):
    """The storage path reaches Ray Train as (file system, path): Ray's StorageContext
    writes its marker into the directory named, whatever characters it has. The string
    form Ray would parse itself breaks on a relative path with a space, and a
    ``file://`` + path URI on '#'/'?'/' '."""
    import pyarrow.fs as pafs
    from ray.train.v2._internal.execution.storage import StorageContext

    from elastic_ddp.config import Config
    from elastic_ddp.driver.launcher import build_trainer

    storage = tmp_path / name / "ckpt #1 ?x"
    raw = digits_config(tmp_path, tmp_path, {"run": {"name": "sweep #2", "storage_path": str(storage)}})
    trainer = build_trainer(Config.from_dict(raw), job=None, tracker=None)
    rc = trainer.run_config
    assert isinstance(rc.storage_filesystem, pafs.LocalFileSystem)
    assert rc.storage_path == str(storage)
    ctx = StorageContext(rc.storage_path, rc.name, storage_filesystem=rc.storage_filesystem)
    assert (storage / "sweep #2").is_dir() and any((storage / "sweep #2").iterdir())
    assert ctx.experiment_fs_path == f"{storage}/sweep #2"
    # The same directory named by its percent-encoded file:// URI reaches Ray Train as
    # the same (file system, path).
    raw["run"]["storage_path"] = storage.as_uri()
    by_uri = build_trainer(Config.from_dict(raw), job=None, tracker=None).run_config
    assert isinstance(by_uri.storage_filesystem, pafs.LocalFileSystem)
    assert by_uri.storage_path == str(storage)


def test_a_storage_path_that_cannot_be_written_exits_2(tmp_path, capsys):
    """A storage path under a regular file (which would kill Ray Train's controller after
    the MLflow run opened) is one exit-2 line, and nothing is created."""
    data = tmp_path / "data"
    write_rows(data / "train" / "part-0.parquet", range(32))
    write_rows(data / "val" / "part-0.parquet", range(100, 104))
    (tmp_path / "notes.txt").write_text("a file")
    raw = small_config(data, tmp_path, {"run": {"storage_path": str(tmp_path / "notes.txt" / "runs")}})
    rc, out, err = run_cli(tmp_path, raw, capsys)
    assert rc == 2 and "run.storage_path" in err and "is not a directory" in err, err
    assert not (tmp_path / "notes.txt").is_dir()
    # Sibling: a file:// URI built by pasting a path with '#' into it.
    raw["run"]["storage_path"] = f"file://{tmp_path}/runs #3"
    rc, out, err = run_cli(tmp_path, raw, capsys)
    assert rc == 2 and "run.storage_path" in err and "%23" in err, err
    nothing_started(tmp_path)
