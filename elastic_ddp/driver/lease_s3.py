"""The run lease's record on S3, written only by conditional requests (boto3).

S3 (since 2024) and the S3 servers that follow it answer a ``PutObject`` with
``If-None-Match: *`` by ``412 PreconditionFailed`` when the key exists, and one with
``If-Match: <etag>`` by the same when the object is no longer that version. So:

* create: ``If-None-Match: *``: of jobs racing for a free lease exactly one succeeds;
* take over a stale lease, heartbeat: ``If-Match`` the ETag read (or last written): a
  job whose record was replaced meanwhile fails instead of overwriting the new holder;
* release: ``DeleteObject`` with ``If-Match`` (a store that refuses the condition on a
  delete: the ETag read back first, then a plain delete).

Endpoint, region and credentials come from the environment as boto3 reads them
(``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``, profiles, instance roles),
or from the storage URI's ``endpoint_override``/``region``/``scheme`` options as pyarrow
takes them. Every request has a connect and a read timeout and a bounded number of
retries with backoff (botocore's "standard" mode: throttling and transient errors).
"""

from __future__ import annotations

import os
import threading
from typing import Optional
from urllib.parse import parse_qs, urlsplit

from elastic_ddp.errors import ElasticDDPError

#: Seconds to connect / to wait for an answer, per attempt; attempts per request.
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 10.0
MAX_ATTEMPTS = 4


class LeaseStoreError(ElasticDDPError, OSError):
    """A request to the object store failed (not a failed condition): one line naming the
    bucket, the key and the store's error."""


def is_s3(storage: str) -> bool:
    return urlsplit(str(storage)).scheme.lower() == "s3"


_clients: dict = {}
_clients_lock = threading.Lock()
#: What boto3 builds a client from, besides the arguments: a change makes a new client.
_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION",
        "AWS_ACCESS_KEY_ID", "AWS_PROFILE")


def _client(endpoint: Optional[str], region: Optional[str]):
    """A boto3 S3 client with time bounds and bounded retries, one per endpoint, region
    and credentials' environment (a client costs about 0.3 s of CPU to build; it is
    thread-safe, so the heartbeat and every lease of the process share it)."""
    import boto3
    from botocore.config import Config

    key = (endpoint, region, *(os.environ.get(k) for k in _ENV))
    with _clients_lock:
        if key not in _clients:
            config = Config(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                            retries={"max_attempts": MAX_ATTEMPTS, "mode": "standard"})
            _clients[key] = boto3.session.Session().client(
                "s3", endpoint_url=endpoint, region_name=region, config=config)
        return _clients[key]


class S3Object:
    """One object ``s3://bucket/key`` written by conditional requests.

    Args:
        storage: the storage URI the key lives under (its query options: pyarrow's
            ``endpoint_override``, ``region``, ``scheme``).
        key_path: ``bucket/key`` (pyarrow's path of the object)."""

    def __init__(self, storage: str, key_path: str):
        self.bucket, _, self.key = key_path.lstrip("/").partition("/")
        opts = {k: v[-1] for k, v in parse_qs(urlsplit(str(storage)).query).items()}
        endpoint = opts.get("endpoint_override")
        if endpoint and "://" not in endpoint:
            endpoint = f"{opts.get('scheme', 'https')}://{endpoint}"
        self.client = _client(endpoint or None, opts.get("region") or None)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def _fail(self, what: str, e: Exception) -> LeaseStoreError:
        err = getattr(e, "response", {}).get("Error", {})
        text = f"{err.get('Code')}: {err.get('Message')}" if err else f"{type(e).__name__}: {e}"
        return LeaseStoreError(f"{what} {self.uri} failed ({text})")

    @staticmethod
    def _code(e: Exception) -> str:
        return str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))

    def create(self, data: bytes) -> Optional[str]:
        """Write ``data`` where no object is: its ETag, or None when the key exists.

        Raises:
            LeaseStoreError: any other failure (no such bucket, access denied, no answer).
        """
        return self._put(data, IfNoneMatch="*")

    def replace(self, data: bytes, etag: str) -> Optional[str]:
        """Write ``data`` over the version ``etag``: the new ETag, or None when the object
        is another version now (or gone)."""
        return self._put(data, IfMatch=etag)

    def _put(self, data: bytes, **cond) -> Optional[str]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return self.client.put_object(Bucket=self.bucket, Key=self.key, Body=data,
                                          ContentType="application/json", **cond)["ETag"]
        except ClientError as e:
            # 412: the condition failed. 409 ConditionalRequestConflict: another
            # conditional write to the key is in flight (S3 lets one of them win).
            # NoSuchKey: an If-Match on a key deleted meanwhile.
            if self._code(e) in ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "412", "409"):
                return None
            raise self._fail("writing", e) from e
        except BotoCoreError as e:
            raise self._fail("writing", e) from e

    def read(self) -> tuple[Optional[bytes], Optional[str]]:
        """(content, ETag), or (None, None) when there is no object."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self.key)
            return r["Body"].read(), r["ETag"]
        except ClientError as e:
            if self._code(e) in ("NoSuchKey", "404"):
                return None, None
            raise self._fail("reading", e) from e
        except BotoCoreError as e:
            raise self._fail("reading", e) from e

    def delete(self, etag: str) -> bool:
        """Delete the object if it is still version ``etag``; whether it was deleted."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=etag)
            return True
        except ClientError as e:
            code = self._code(e)
            if code in ("PreconditionFailed", "NoSuchKey", "412", "404"):
                return False
            if code not in ("NotImplemented", "InvalidArgument", "InvalidRequest", "501"):
                raise self._fail("deleting", e) from e
        except BotoCoreError as e:
            raise self._fail("deleting", e) from e
        # A store without conditional deletes: compare, then delete (a takeover between
        # the two is lost with the record: its holder's next heartbeat finds it gone).
        _, now = self.read()
        if now != etag:
            return False
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key)
        except (ClientError, BotoCoreError) as e:
            raise self._fail("deleting", e) from e
        return True
