"""Local paths and storage URIs, kept apart.

``run.storage_path`` is either a local path (``ray_results``, ``/mnt/nfs/ray results``)
or a URI (``s3://bucket/runs``). Building a URI as ``"file://" + path`` breaks on the
characters a URI reserves: a space makes pyarrow raise ``ArrowInvalid: Cannot parse
URI``, and ``#`` or ``?`` start a fragment or query, so the file system silently looks at
a shorter path. Here a local path becomes a URI only through percent-encoding
(``Path.as_uri``), and a local path is never handed to a URI parser at all.

An object-store URI (``s3://``, ``gs://``) becomes a pyarrow file system here and nowhere
else (:func:`uri_to_filesystem`): its endpoint, region, time bounds and retries come from
the environment (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``AWS_REGION`` /
``AWS_DEFAULT_REGION``, ``ELASTIC_DDP_S3_CONNECT_TIMEOUT_S``,
``ELASTIC_DDP_S3_REQUEST_TIMEOUT_S``, ``ELASTIC_DDP_S3_MAX_ATTEMPTS``,
``ELASTIC_DDP_GCS_RETRY_S``), its credentials from the SDK's own chain.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Optional
from urllib.parse import unquote, urlsplit

# scheme "://": a scheme is a letter then letters, digits, + - . (RFC 3986). Two
# characters at least, so a Windows drive ("C:\\") is never taken for one; a local
# path that merely contains "://" further on ("/data/a://b") is not a URI either.
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+://")


def is_uri(path: str | os.PathLike) -> bool:
    """True when ``path`` starts with ``scheme://`` (``s3://``, ``gs://``, ``file://``)."""
    return bool(_URI.match(os.fspath(path)))


def local_path(path: str | os.PathLike) -> str:
    """``path`` absolute: ``~`` expanded, then resolved against the current directory
    (symlinks resolved, as the launcher's storage path always was). It need not exist."""
    return str(Path(os.fspath(path)).expanduser().resolve())


def path_to_uri(path: str | os.PathLike) -> str:
    """A storage location as a URI.

    A URI (``scheme://...``) is returned unchanged. A local path is made absolute
    (``local_path``) and turned into a ``file://`` URI by ``pathlib.Path.as_uri``: every
    byte outside the unreserved set is percent-encoded (space -> ``%20``, ``#`` -> ``%23``,
    ``?`` -> ``%3F``, ``%`` -> ``%25``, non-ASCII as UTF-8), so any URI parser, pyarrow's
    included, reads back exactly this path.

    Raises:
        ValueError: an empty path.
    """
    text = os.fspath(path)
    if not text:
        raise ValueError("empty storage path; give a directory or a URI such as s3://bucket/runs")
    if is_uri(text):
        return text
    return Path(local_path(text)).as_uri()


def uri_to_filesystem(uri: str | os.PathLike):
    """The pyarrow file system and the path on it for a local path or a URI.

    * a local path: ``pyarrow.fs.LocalFileSystem`` and the absolute path (``local_path``),
      without any URI parsing, so spaces, ``#``, ``?``, ``%`` and ``@`` are plain characters;
    * ``file://`` URIs: ``LocalFileSystem`` and the percent-decoded path (``file:///a%20b``
      -> ``/a b``); only an empty host or ``localhost``;
    * ``s3://bucket/key``: ``pyarrow.fs.S3FileSystem`` built by :func:`s3_filesystem`
      (endpoint, region, time bounds and retries from the environment) and ``bucket/key``;
    * ``gs://`` / ``gcs://``: ``pyarrow.fs.GcsFileSystem`` (:func:`gcs_filesystem`);
    * other schemes (``hdfs://``, ...): ``pyarrow.fs.FileSystem.from_uri``.

    The object-store file systems are built once per process and settings and shared
    (``pyarrow`` file systems are thread-safe): a reader that opens one file per row group
    costs no client set-up per file.

    Returns:
        ``(filesystem, path)``: pass the path to that file system's methods
        (``get_file_info``, ``open_input_file``).

    Raises:
        ValueError: an empty path, a ``file://`` URI with a remote host, or a raw ``?`` or
            ``#`` in a ``file://`` URI (a query or fragment, which names no part of a file
            path: percent-encode them as ``%3F`` / ``%23``, or pass the plain path), or
            a percent-escape that does not decode as UTF-8 (pyarrow paths are UTF-8); an
            ``s3://``/``gs://`` URI without a bucket or with ``?`` options (the settings
            come from the environment), or a malformed endpoint or time-bound variable.
        pyarrow.ArrowInvalid / ArrowNotImplementedError: a URI pyarrow cannot parse, or a
            scheme this pyarrow build lacks.
    """
    import pyarrow.fs

    text = os.fspath(uri)
    if not text:
        raise ValueError("empty storage path; give a directory or a URI such as s3://bucket/runs")
    if not is_uri(text):
        return pyarrow.fs.LocalFileSystem(), local_path(text)
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme in OBJECT_SCHEMES:
        bucket, key = bucket_and_key(text)
        fs = s3_filesystem(bucket) if scheme == "s3" else gcs_filesystem()
        return fs, f"{bucket}/{key}".rstrip("/")
    if scheme != "file":
        return pyarrow.fs.FileSystem.from_uri(text)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"{text}: a file:// URI with host {parts.netloc!r}; use file:///path "
                         "for this machine, or a shared file system's own URI scheme")
    if parts.query or parts.fragment or text.endswith(("?", "#")):
        raise ValueError(f"{text}: '?' or '#' in a file:// URI starts a query or fragment, not "
                         "part of the path; percent-encode them (%3F, %23) or pass the plain "
                         "path")
    # strict: pyarrow takes UTF-8 paths only, so an invalid escape fails here, by name.
    return pyarrow.fs.LocalFileSystem(), unquote(parts.path, errors="strict")


def filesystem_uri(fs, path: str) -> str:
    """The inverse of :func:`uri_to_filesystem` for what it returns: ``s3://bucket/key``
    for an S3 path, ``gs://...`` for GCS, the local path itself for a local one (a path
    every node of a shared-disk cluster reads the same). What a file's identity is when it
    is handed to another process or node."""
    kind = getattr(fs, "type_name", "")
    if kind == "s3":
        return f"s3://{path}"
    if kind == "gcs":
        return f"gs://{path}"
    return path


# ------------------------------------------------------------------ object stores
#: URI schemes whose file systems :func:`uri_to_filesystem` builds itself.
OBJECT_SCHEMES = ("s3", "gs", "gcs")

#: Seconds to open a TCP connection to the object store (``ELASTIC_DDP_S3_CONNECT_TIMEOUT_S``).
S3_CONNECT_TIMEOUT_S = 10.0
#: Seconds one request may go without an answer (``ELASTIC_DDP_S3_REQUEST_TIMEOUT_S``): a
#: store that accepts the connection and never answers fails the request after this.
S3_REQUEST_TIMEOUT_S = 60.0
#: Attempts per request (``ELASTIC_DDP_S3_MAX_ATTEMPTS``), with the AWS SDK's standard
#: retry strategy: exponential backoff with jitter on throttling (503 SlowDown, 429),
#: 5xx answers and dropped connections; other 4xx answers are not retried.
S3_MAX_ATTEMPTS = 5
#: Seconds GCS retries a failing request before giving up (``ELASTIC_DDP_GCS_RETRY_S``).
GCS_RETRY_TIME_LIMIT_S = 60.0

_ENV_CONNECT = "ELASTIC_DDP_S3_CONNECT_TIMEOUT_S"
_ENV_REQUEST = "ELASTIC_DDP_S3_REQUEST_TIMEOUT_S"
_ENV_ATTEMPTS = "ELASTIC_DDP_S3_MAX_ATTEMPTS"
_ENV_GCS_RETRY = "ELASTIC_DDP_GCS_RETRY_S"
# The variables the AWS SDK's credential chain reads from the environment: a change of any
# of them (a test, a refreshed session token) gets a fresh client. Only a hash of them is
# kept, never the values.
_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                   "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE",
                   "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE")

_FS_CACHE: dict = {}
_FS_LOCK = threading.Lock()
_BUCKET_REGIONS: dict[str, Optional[str]] = {}


def bucket_and_key(uri: str) -> tuple[str, str]:
    """``("bucket", "key/with/slashes")`` of an ``s3://`` / ``gs://`` URI (key "" for the
    bucket itself; percent-escapes are not decoded: an object key is the text as written).

    Raises:
        ValueError: no bucket, or a ``?`` / ``#`` (URI options are not read: endpoint,
            region and credentials come from the environment).
    """
    scheme, _, rest = os.fspath(uri).partition("://")
    if "?" in rest or "#" in rest:
        raise ValueError(f"{uri}: '?' or '#' in an object-store URI; options are not read from "
                         "the URI: set the endpoint, region and credentials in the environment "
                         "(AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID ...)")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"{uri}: no bucket; write {scheme}://BUCKET/PREFIX")
    return bucket, key.strip("/")


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment variable ``name``, else
    ``default``.

    Raises:
        ValueError: set but not a positive number, naming the variable.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{name}={raw!r}: give a positive number of seconds (default {default:g})")
    return value


def s3_endpoint() -> tuple[Optional[str], Optional[str]]:
    """``(scheme, host[:port])`` of the S3 endpoint the AWS SDKs would use:
    ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL`` (``http://`` or ``https://``; no
    scheme means https); ``(None, None)`` for AWS itself.

    Raises:
        ValueError: a scheme other than http/https, or no host.
    """
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        raw = os.environ.get(name, "").strip()
        if not raw:
            continue
        parts = urlsplit(raw if "://" in raw else f"https://{raw}")
        if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
            raise ValueError(f"{name}={raw!r}: give the endpoint as http://HOST:PORT or "
                             "https://HOST[:PORT]")
        return parts.scheme.lower(), parts.netloc
    return None, None


def s3_region(bucket: Optional[str] = None) -> Optional[str]:
    """``AWS_REGION``, else ``AWS_DEFAULT_REGION``, else (AWS itself, no endpoint set)
    the bucket's own region as AWS reports it (one request, remembered per process);
    None: the SDK's default."""
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        if os.environ.get(name, "").strip():
            return os.environ[name].strip()
    if bucket is None or s3_endpoint()[1] is not None:
        return None
    if bucket not in _BUCKET_REGIONS:
        import pyarrow.fs

        try:
            _BUCKET_REGIONS[bucket] = pyarrow.fs.resolve_s3_region(bucket)
        except (OSError, ValueError):  # no such bucket, no network: the request says why
            _BUCKET_REGIONS[bucket] = None
    return _BUCKET_REGIONS[bucket]


def s3_settings(bucket: Optional[str] = None) -> dict:
    """The keyword arguments :func:`s3_filesystem` gives ``pyarrow.fs.S3FileSystem``
    (no credentials: the SDK's chain finds them), for messages and checks: ``scheme``,
    ``endpoint_override``, ``region``, ``connect_timeout``, ``request_timeout`` (s),
    ``max_attempts``."""
    scheme, host = s3_endpoint()
    return {"scheme": scheme, "endpoint_override": host, "region": s3_region(bucket),
            "connect_timeout": env_seconds(_ENV_CONNECT, S3_CONNECT_TIMEOUT_S),
            "request_timeout": env_seconds(_ENV_REQUEST, S3_REQUEST_TIMEOUT_S),
            "max_attempts": int(env_seconds(_ENV_ATTEMPTS, S3_MAX_ATTEMPTS))}


def _credentials_key() -> str:
    import hashlib

    seen = "\0".join(f"{k}={os.environ.get(k, '')}" for k in _CREDENTIAL_ENV)
    return hashlib.sha256(seen.encode()).hexdigest()


def s3_filesystem(bucket: Optional[str] = None):
    """This process's ``pyarrow.fs.S3FileSystem`` for :func:`s3_settings` (one per
    distinct settings and credential variables).

    Credentials are the AWS SDK's default chain (``AWS_ACCESS_KEY_ID`` / ``..._SECRET_...``
    / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and ``~/.aws``, web identity, the instance's
    role); they are never passed, stored or printed here. Buckets are never created."""
    import pyarrow.fs

    kw = s3_settings(bucket)
    key = ("s3", tuple(sorted(kw.items())), _credentials_key())
    with _FS_LOCK:
        fs = _FS_CACHE.get(key)
        if fs is None:
            attempts = kw.pop("max_attempts")
            fs = pyarrow.fs.S3FileSystem(
                **{k: v for k, v in kw.items() if v is not None},
                retry_strategy=pyarrow.fs.AwsStandardS3RetryStrategy(max_attempts=attempts))
            _FS_CACHE[key] = fs
    return fs


def gcs_filesystem():
    """This process's ``pyarrow.fs.GcsFileSystem``: credentials from Google's default chain
    (``GOOGLE_APPLICATION_CREDENTIALS``, the metadata server), requests retried for at
    most ``GCS_RETRY_TIME_LIMIT_S`` seconds (``ELASTIC_DDP_GCS_RETRY_S``)."""
    from datetime import timedelta

    import pyarrow.fs

    limit = env_seconds(_ENV_GCS_RETRY, GCS_RETRY_TIME_LIMIT_S)
    key = ("gs", limit, os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", ""))
    with _FS_LOCK:
        fs = _FS_CACHE.get(key)
        if fs is None:
            fs = _FS_CACHE[key] = pyarrow.fs.GcsFileSystem(retry_time_limit=timedelta(seconds=limit))
    return fs
