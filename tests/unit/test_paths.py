"""Local storage paths with characters a URI reserves (space, #, ?, %, @, non-ASCII)
become file:// URIs that pyarrow reads back as the same directory, and are never parsed
as URIs themselves (elastic_ddp/paths.py). No Ray: pyarrow's file systems only."""

from __future__ import annotations

import os

import pyarrow.fs
import pytest

from elastic_ddp.paths import is_uri, local_path, path_to_uri, uri_to_filesystem

# Each name breaks "file://" + path concatenation: the space is refused by pyarrow's URI
# parser, '#'/'?' start a fragment/query (a shorter path is checked), '%20' is decoded
# to a space, '@' is taken for user info before a host in some positions.
AWKWARD = ["ray results", "a#b", "what?x=1", "pct%20y", "100%", "user@host", "ünï ☃ δ",
           "mix a#b?c%d@e", "#lead", "trail?"]


@pytest.mark.parametrize("name", AWKWARD)
def test_path_to_uri_round_trips_through_pyarrow(tmp_path, name):
    d = tmp_path / "storage" / name
    d.mkdir(parents=True)
    (d / "marker").write_text("x")
    uri = path_to_uri(str(d))
    assert uri.startswith("file:///")
    assert not any(c in uri for c in " #?"), uri  # reserved characters are encoded

    # What Ray Train does with a storage URI, and what the launcher's run-dir check does.
    fs, path = pyarrow.fs.FileSystem.from_uri(uri)
    assert isinstance(fs, pyarrow.fs.LocalFileSystem)
    assert path == str(d.resolve())
    assert fs.get_file_info(f"{path}/marker").type == pyarrow.fs.FileType.File

    for where in (str(d), uri):  # the plain path and the URI name the same directory
        fs, path = uri_to_filesystem(where)
        assert isinstance(fs, pyarrow.fs.LocalFileSystem)
        assert path == str(d.resolve())
        assert fs.get_file_info(path).type == pyarrow.fs.FileType.Directory
        # The launcher's "does storage/<run name> exist" check: a sibling name is absent.
        assert fs.get_file_info(f"{path}/nope").type == pyarrow.fs.FileType.NotFound


def test_a_shorter_path_is_not_mistaken_for_the_real_one(tmp_path):
    """'a#b' must not be checked as 'a' (what a fragment-stripping parse would do): with
    only 'a' on disk, 'a#b' does not exist."""
    (tmp_path / "a").mkdir()
    for where in (str(tmp_path / "a#b"), path_to_uri(str(tmp_path / "a#b"))):
        fs, path = uri_to_filesystem(where)
        assert path.endswith("/a#b")
        assert fs.get_file_info(path).type == pyarrow.fs.FileType.NotFound


def test_relative_and_home_paths_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert path_to_uri("ray results") == (tmp_path.resolve() / "ray results").as_uri()
    assert uri_to_filesystem("ray results")[1] == str(tmp_path.resolve() / "ray results")
    monkeypatch.setenv("HOME", str(tmp_path / "home dir"))
    assert local_path("~/runs") == str(tmp_path / "home dir" / "runs")
    assert path_to_uri("~/runs").endswith("/home%20dir/runs")


@pytest.mark.parametrize("uri", ["s3://bucket/runs", "gs://bucket/a b", "file:///tmp/x%20y",
                                 "hdfs://namenode:8020/runs", "abfss://c@acct.dfs.core.windows.net/p"])
def test_uris_pass_through_unchanged(uri):
    assert is_uri(uri)
    assert path_to_uri(uri) == uri


@pytest.mark.parametrize("path", ["/data/a://b", "C:\\runs", "relative/dir", "1http://x"])
def test_paths_that_only_look_like_uris_are_local(path):
    assert not is_uri(path)
    assert path_to_uri(path).startswith("file:///")


def test_other_schemes_go_to_pyarrow():
    fs, path = uri_to_filesystem("mock:///bucket/runs")  # pyarrow's in-memory test scheme
    assert not isinstance(fs, pyarrow.fs.LocalFileSystem) and path == "bucket/runs"


@pytest.mark.parametrize("uri,needle", [
    ("file:///tmp/a#b", "%23"),              # a raw fragment: refused, not dropped
    ("file:///tmp/what?x=1", "%3F"),
    ("file:///tmp/trail?", "%3F"),
    ("file://otherhost/tmp/x", "host 'otherhost'"),
    ("", "empty storage path"),
])
def test_file_uris_that_name_no_local_path_are_refused(uri, needle):
    with pytest.raises(ValueError, match=needle.replace("?", r"\?")):
        uri_to_filesystem(uri)

