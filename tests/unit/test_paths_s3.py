"""``paths.uri_to_filesystem`` for object stores: the S3 file system built from the
environment as the AWS SDKs read it (endpoint, region, time bounds, retries), one per
process and settings, reaching the real S3 server; malformed URIs and variables refused
by name."""

from __future__ import annotations

import pyarrow.fs
import pytest

from elastic_ddp import paths
from elastic_ddp.paths import bucket_and_key, s3_endpoint, s3_settings, uri_to_filesystem


def test_an_s3_uri_reaches_the_server_named_by_the_environment(s3):
    s3.client.put_object(Bucket=s3.name, Key="d/a.bin", Body=b"12345")
    fs, path = uri_to_filesystem(s3.uri("d/a.bin"))
    assert isinstance(fs, pyarrow.fs.S3FileSystem) and path == f"{s3.name}/d/a.bin"
    assert fs.get_file_info(path).size == 5
    assert uri_to_filesystem(s3.uri("d/"))[1] == f"{s3.name}/d"
    assert uri_to_filesystem(f"s3://{s3.name}")[1] == s3.name
    again, _ = uri_to_filesystem(s3.uri("other"))
    assert again is fs  # one client per process and settings


def test_settings_come_from_the_environment(monkeypatch):
    for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION",
              "ELASTIC_DDP_S3_CONNECT_TIMEOUT_S", "ELASTIC_DDP_S3_REQUEST_TIMEOUT_S",
              "ELASTIC_DDP_S3_MAX_ATTEMPTS"):
        monkeypatch.delenv(k, raising=False)
    assert s3_endpoint() == (None, None)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    assert s3_endpoint() == ("http", "127.0.0.1:9000")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "https://s3.example:8443")  # the service's own wins
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    monkeypatch.setenv("ELASTIC_DDP_S3_REQUEST_TIMEOUT_S", "2.5")
    got = s3_settings("b")
    assert got == {"scheme": "https", "endpoint_override": "s3.example:8443", "region": "eu-west-1",
                   "connect_timeout": paths.S3_CONNECT_TIMEOUT_S, "request_timeout": 2.5,
                   "max_attempts": paths.S3_MAX_ATTEMPTS}
    monkeypatch.setenv("AWS_REGION", "us-west-2")
    assert s3_settings("b")["region"] == "us-west-2"
    a = paths.s3_filesystem("b")
    monkeypatch.setenv("ELASTIC_DDP_S3_REQUEST_TIMEOUT_S", "3")
    assert paths.s3_filesystem("b") is not a  # other settings: another client


@pytest.mark.parametrize("name,value", [("ELASTIC_DDP_S3_REQUEST_TIMEOUT_S", "soon"),
                                        ("ELASTIC_DDP_S3_CONNECT_TIMEOUT_S", "0"),
                                        ("AWS_ENDPOINT_URL", "ftp://host:21")])
def test_a_malformed_variable_is_refused_by_name(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    with pytest.raises(ValueError, match=rf"^{name}="):
        uri_to_filesystem("s3://bucket/key")


def test_object_uris_need_a_bucket_and_take_no_options():
    assert bucket_and_key("s3://b/x/y/") == ("b", "x/y")
    assert bucket_and_key("gs://b") == ("b", "")
    with pytest.raises(ValueError, match="no bucket"):
        bucket_and_key("s3:///x")
    with pytest.raises(ValueError, match="options are not read"):
        bucket_and_key("s3://b/x?endpoint_override=h:1")
