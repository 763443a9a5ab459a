"""The S3 fault proxy (tests/helpers/s3_fault_proxy.py) in front of the real S3 server, driven by
the clients the product uses: pyarrow's ``S3FileSystem`` (the AWS C++ SDK, with its
standard retry strategy and a request timeout) and boto3.

A throttled write (503 SlowDown for the first two PUTs) is retried and lands whole; a
stalled request is cut off by the client's request timeout and surfaces as an error
within its bound; bodies pass through unchanged both ways (a multipart upload of
streamed, aws-chunked parts; ranged reads)."""

from __future__ import annotations

import io
import os
import time

import pytest


def _fs(endpoint: str, timeout_s: float = 5.0, attempts: int = 3):
    from pyarrow import fs

    return fs.S3FileSystem(endpoint_override=endpoint, scheme="http", region="us-east-1",
                           access_key="testing", secret_key="testing",
                           request_timeout=timeout_s, connect_timeout=timeout_s,
                           retry_strategy=fs.AwsStandardS3RetryStrategy(max_attempts=attempts))


def test_slowdown_is_retried_and_the_write_lands(s3, s3_faults):
    key = "ckpt/step10/shard-0.distcp"
    s3_faults.add("PUT", r"shard-0\.distcp$", "slowdown", times=2)
    data = os.urandom(300_000)
    with _fs(s3_faults.endpoint).open_output_stream(f"{s3.name}/{key}") as f:
        f.write(data)
    assert s3.client.get_object(Bucket=s3.name, Key=key)["Body"].read() == data
    # Two answered 503 SlowDown, the third forwarded: three PUTs of the key in all.
    assert s3_faults.count("PUT", r"shard-0\.distcp$", "slowdown") == 2
    assert s3_faults.count("PUT", r"shard-0\.distcp$", "forward") == 1
    assert [s.status for s in s3_faults.seen if s.method == "PUT"] == [503, 503, 200]


def test_slowdown_past_the_retry_budget_is_an_error(s3, s3_faults):
    s3_faults.add("PUT", r"manifest\.json$", "slowdown", times=None)
    with pytest.raises(OSError, match="SLOW_DOWN|SlowDown|503"):
        with _fs(s3_faults.endpoint, attempts=2).open_output_stream(f"{s3.name}/ckpt/manifest.json") as f:
            f.write(b"{}")
    assert s3_faults.count("PUT", r"manifest\.json$") == 2  # max_attempts, no more
    assert s3.keys("ckpt/") == []


def test_a_stalled_request_is_cut_off_within_its_bound(s3, s3_faults):
    s3.client.put_object(Bucket=s3.name, Key="data/part-0.parquet", Body=b"x" * 1000)
    s3_faults.add("GET", r"part-0\.parquet$", "stall", times=None)
    fs = _fs(s3_faults.endpoint, timeout_s=1.0, attempts=2)
    t = time.monotonic()
    with pytest.raises(OSError):
        with fs.open_input_stream(f"{s3.name}/data/part-0.parquet") as f:
            f.read()
    elapsed = time.monotonic() - t
    # Two attempts of a 1 s request timeout and the SDK's backoff between them; never
    # the stall's 600 s.
    assert 1.0 <= elapsed < 10.0, elapsed
    assert s3_faults.count("GET", r"part-0\.parquet$", "stall") == 2


def test_bodies_stream_through_unchanged(s3, s3_faults):
    """boto3's multipart upload of a stream (aws-chunked parts with a trailing checksum)
    and pyarrow's ranged reads, through the proxy; the bytes match end to end."""
    import boto3
    from boto3.s3.transfer import TransferConfig

    data = os.urandom(11 * 2**20 + 123)
    client = boto3.client("s3", endpoint_url=s3_faults.endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    client.upload_fileobj(io.BytesIO(data), s3.name, "big.bin",
                          Config=TransferConfig(multipart_threshold=5 * 2**20,
                                                multipart_chunksize=5 * 2**20))
    assert s3_faults.count("PUT", r"big\.bin$") == 3  # three parts
    assert s3_faults.count("POST", r"big\.bin$") == 2  # create, complete
    # An aws-chunked body (streaming, a trailing checksum), itself sent with
    # Transfer-Encoding: chunked, as an SDK streams an object of unknown length over HTTPS.
    _put_aws_chunked(s3_faults.endpoint, s3.name, "chunked.bin", data[:300_000])
    assert s3.client.get_object(Bucket=s3.name, Key="chunked.bin")["Body"].read() == data[:300_000]
    (put,) = [s for s in s3_faults.seen if s.key == "chunked.bin"]
    assert put.headers["transfer-encoding"] == "chunked" and put.status == 200
    with _fs(s3_faults.endpoint).open_input_file(f"{s3.name}/big.bin") as f:
        assert f.read_at(1000, 7 * 2**20) == data[7 * 2**20:7 * 2**20 + 1000]
        assert f.size() == len(data)
    assert any(s.headers.get("range") for s in s3_faults.seen if s.method == "GET")
    got = client.get_object(Bucket=s3.name, Key="big.bin", Range="bytes=5-9")
    assert got["Body"].read() == data[5:10] and got["ResponseMetadata"]["HTTPStatusCode"] == 206


def _put_aws_chunked(endpoint: str, bucket: str, key: str, data: bytes, piece: int = 65536) -> None:
    """PUT ``data`` as an unsigned aws-chunked body with a trailing CRC32, sent with
    ``Transfer-Encoding: chunked`` in pieces of ``piece`` bytes."""
    import base64
    import http.client
    import zlib
    from urllib.parse import urlsplit

    crc = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()

    def body():
        for i in range(0, len(data), piece):
            chunk = data[i:i + piece]
            yield b"%x\r\n%s\r\n" % (len(chunk), chunk)
        yield f"0\r\nx-amz-checksum-crc32:{crc}\r\n\r\n".encode()

    u = urlsplit(endpoint)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("PUT", f"/{bucket}/{key}", body=body(), encode_chunked=True, headers={
        "Content-Encoding": "aws-chunked", "x-amz-decoded-content-length": str(len(data)),
        "x-amz-content-sha256": "STREAMING-UNSIGNED-PAYLOAD-TRAILER",
        "x-amz-trailer": "x-amz-checksum-crc32"})
    resp = conn.getresponse()
    assert resp.status == 200, (resp.status, resp.read())
    conn.close()
