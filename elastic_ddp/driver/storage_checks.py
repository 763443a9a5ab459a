"""Object-storage inputs checked before anything starts: ``data.train_path``,
``data.val_path`` and ``run.storage_path`` when they are ``s3://`` or ``gs://`` URIs.

    check_object_storage(cfg)      # ConfigError (exit 2), one line, or nothing

A mistyped bucket, a denied access, an endpoint where nothing (or no S3 API) answers, or
no credentials at all would otherwise surface as a pyarrow traceback in the middle of the
scan, or after Ray started and the MLflow run opened. Each check is a few requests
(``HeadBucket``, a one-key ``ListObjectsV2``; for the storage path a probe object written
and deleted), each bounded by :data:`CHECK_TIMEOUT_S` and at most :data:`CHECK_ATTEMPTS`
attempts, so a wrong endpoint costs seconds, never a hang. The endpoint, region and
credentials are those the job's own file system uses (:func:`elastic_ddp.paths.s3_settings`,
the AWS SDK's credential chain); credentials never appear in a message.
"""

from __future__ import annotations

import uuid

from elastic_ddp.config import Config, ConfigError
from elastic_ddp.paths import OBJECT_SCHEMES, bucket_and_key, is_uri, s3_settings

#: Seconds each check request may take (connect, and answer), at most: a check asks for
#: a few bytes, so the job's own longer request bound is not needed to tell a store that
#: answers from one that does not.
CHECK_TIMEOUT_S = 10.0
#: Attempts per check request (one retry of a dropped connection or a 5xx).
CHECK_ATTEMPTS = 2


class StorageError(ConfigError):
    """An object-storage input the job cannot use; the message names the field, the
    bucket or key, the store's answer and the fix."""


def check_object_storage(cfg: Config) -> None:
    """Check every object-store URI among the data paths and the storage path.

    Raises:
        StorageError: see :func:`check_s3`; the first failing field in the order
            ``data.train_path``, ``data.val_path``, ``run.storage_path``.
    """
    for field, uri, write in (("data.train_path", cfg.data.train_path, False),
                              ("data.val_path", cfg.data.val_path, False),
                              ("run.storage_path", cfg.run.storage_path, True)):
        if not uri or not is_uri(uri):
            continue
        scheme = uri.split("://", 1)[0].lower()
        if scheme == "s3":
            check_s3(uri, field, write)
        elif scheme in OBJECT_SCHEMES:
            check_gcs(uri, field)


def check_out_dir(uri, field: str = "prepare OUT_DIR") -> None:
    """An output URI written by a command other than a job (``elastic-ddp prepare``): an
    ``s3://`` one is checked for writing as ``run.storage_path`` is, a ``gs://`` one as
    :func:`check_gcs` does; a local path is not checked.

    Raises:
        StorageError: as :func:`check_s3` / :func:`check_gcs`.
    """
    uri = str(uri)
    if not is_uri(uri):
        return
    scheme = uri.split("://", 1)[0].lower()
    if scheme == "s3":
        check_s3(uri, field, write=True)
    elif scheme in OBJECT_SCHEMES:
        check_gcs(uri, field)


def _where(settings: dict) -> str:
    """The endpoint for messages, without any user info."""
    host = settings["endpoint_override"]
    if not host:
        return f"AWS S3 (region {settings['region'] or 'the SDK default'})"
    return f"{settings['scheme']}://{host.rsplit('@', 1)[-1]}"


def check_s3(uri: str, field: str, write: bool = False) -> None:
    """One ``s3://`` URI: the bucket exists and answers this process's credentials at the
    configured endpoint and region; the prefix can be listed; with ``write`` a probe
    object can be written (then deleted).

    Raises:
        StorageError: a malformed URI or endpoint variable; no credentials found; nothing
            answers at the endpoint (connection refused, or no answer within
            :data:`CHECK_TIMEOUT_S` s); an answer that is not the S3 API; the bucket does
            not exist; the bucket is in another region; access denied or invalid
            credentials.
    """
    import botocore.session
    from botocore.config import Config as BotoConfig
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        bucket, key = bucket_and_key(uri)
        settings = s3_settings(bucket)
    except ValueError as e:
        raise StorageError(f"{field}: {e}") from None
    where = _where(settings)
    session = botocore.session.get_session()
    try:
        creds = session.get_credentials()
    except BotoCoreError as e:
        raise StorageError(f"{field}={uri}: the AWS credentials cannot be loaded ({e}); fix the "
                           "profile (AWS_PROFILE, ~/.aws/config) or set AWS_ACCESS_KEY_ID and "
                           "AWS_SECRET_ACCESS_KEY") from None
    if creds is None:
        raise StorageError(
            f"{field}={uri}: no AWS credentials found (none in AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials, nor an instance or pod "
            "role); set them in the environment of the driver and of every node")
    endpoint = f"{settings['scheme']}://{settings['endpoint_override']}" if settings["endpoint_override"] else None
    timeout = CHECK_TIMEOUT_S
    client = session.create_client(
        "s3", endpoint_url=endpoint, region_name=settings["region"] or "us-east-1",
        config=BotoConfig(connect_timeout=min(settings["connect_timeout"], timeout),
                          read_timeout=min(settings["request_timeout"], timeout),
                          retries={"max_attempts": CHECK_ATTEMPTS, "mode": "standard"},
                          s3={"addressing_style": "path"} if endpoint else None))
    bound = (min(settings["connect_timeout"], timeout), min(settings["request_timeout"], timeout))
    step = "HeadBucket"
    try:
        client.head_bucket(Bucket=bucket)
        step = "ListObjectsV2"
        listed = client.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)
        if listed.get("Name") != bucket:
            raise StorageError(
                f"{field}={uri}: the server at {where} answered ListObjectsV2 for bucket "
                f"{bucket!r} with something that is not the S3 API; point AWS_ENDPOINT_URL "
                "(or AWS_ENDPOINT_URL_S3) at the S3 endpoint, or unset it for AWS")
        if write:
            step = "PutObject"
            probe = f"{key}/.elastic-ddp-write-check-{uuid.uuid4().hex}".lstrip("/")
            client.put_object(Bucket=bucket, Key=probe, Body=b"")
            step = "DeleteObject"
            client.delete_object(Bucket=bucket, Key=probe)
    except ClientError as e:
        raise StorageError(_client_error(e, uri, field, bucket, key, where, step, write)) from None
    except BotoCoreError as e:
        raise StorageError(_transport_error(e, uri, field, where, bound)) from None


def _client_error(e, uri: str, field: str, bucket: str, key: str, where: str, step: str,
                  write: bool) -> str:
    """The store's answer as one line with its fix."""
    err = e.response.get("Error", {})
    meta = e.response.get("ResponseMetadata", {})
    status = meta.get("HTTPStatusCode")
    code = err.get("Code") or str(status)
    answer = f"{step} answered HTTP {status}" + (f" {code}" if code != str(status) else "")
    region = (meta.get("HTTPHeaders") or {}).get("x-amz-bucket-region")
    if code in ("404", "NoSuchBucket"):
        return (f"{field}={uri}: the bucket {bucket!r} does not exist at {where} ({answer}); "
                f"check the bucket name in {field}, or create the bucket first "
                f"(aws s3 mb s3://{bucket})")
    if status == 301 or (code in ("PermanentRedirect", "AuthorizationHeaderMalformed") and region):
        return (f"{field}={uri}: the bucket {bucket!r} is in region {region or 'another region'}, "
                f"not the one configured ({answer}); set AWS_REGION={region or '<its region>'}")
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                "TokenRefreshRequired"):
        return (f"{field}={uri}: the store at {where} refused this process's AWS credentials "
                f"({answer}); set valid AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and "
                "AWS_SESSION_TOKEN for temporary ones) or AWS_PROFILE")
    if status == 403 and step == "HeadBucket":  # a HEAD answer has no body: no error code
        return (f"{field}={uri}: access denied to the bucket {bucket!r} at {where} ({answer}): "
                "these credentials are not valid for this store, or may not read the bucket; "
                "set valid AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or grant "
                f"them s3:ListBucket on it")
    if status == 403 or code == "AccessDenied":
        what = (f"write under s3://{bucket}/{key}" if write and step in ("PutObject", "DeleteObject")
                else f"read s3://{bucket}/{key}" if key else f"read the bucket {bucket!r}")
        return (f"{field}={uri}: access denied: these credentials may not {what} at {where} "
                f"({answer}); grant them s3:ListBucket{', s3:PutObject, s3:DeleteObject' if write else ', s3:GetObject'} "
                f"on the bucket, or use credentials that have them")
    return (f"{field}={uri}: the store at {where} refused {step} on bucket {bucket!r} ({answer}: "
            f"{err.get('Message') or 'no message'}); check {field} and the store's settings")


def _transport_error(e, uri: str, field: str, where: str, bound: tuple[float, float]) -> str:
    from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError
    from botocore.parsers import ResponseParserError

    if isinstance(e, ConnectTimeoutError):
        why = f"no connection within {bound[0]:g} s, {CHECK_ATTEMPTS} attempts"
    elif isinstance(e, EndpointConnectionError):
        why = "connection refused: nothing listens there"
    elif isinstance(e, ReadTimeoutError):
        why = f"it accepts connections but sent no answer within {bound[1]:g} s, {CHECK_ATTEMPTS} attempts"
    elif isinstance(e, ResponseParserError):
        return (f"{field}={uri}: the server at {where} does not answer as the S3 API (its answer "
                "cannot be parsed as S3's); point AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) at "
                "the S3 endpoint, or unset it for AWS")
    else:
        why = " ".join(str(e).split())
    return (f"{field}={uri}: the object store does not answer at {where} ({why}); check "
            "AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 (scheme, host and port) and that the store "
            "is running, or unset them for AWS")


def check_gcs(uri: str, field: str) -> None:
    """One ``gs://`` URI: its bucket can be read with this process's credentials.

    Raises:
        StorageError: the bucket does not exist, or the store refuses or does not answer
            (the store's answer in the message).
    """
    import pyarrow.fs

    from elastic_ddp.paths import uri_to_filesystem

    try:
        bucket, _ = bucket_and_key(uri)
        fs, _ = uri_to_filesystem(uri)
        info = fs.get_file_info(bucket)
    except ValueError as e:
        raise StorageError(f"{field}: {e}") from None
    except OSError as e:
        raise StorageError(f"{field}={uri}: the bucket {bucket!r} cannot be read ("
                           f"{' '.join(str(e).split())}); check the bucket name and the "
                           "credentials (GOOGLE_APPLICATION_CREDENTIALS)") from None
    if info.type == pyarrow.fs.FileType.NotFound:
        raise StorageError(f"{field}={uri}: the bucket {bucket!r} does not exist; check the "
                           f"bucket name in {field}, or create it (gcloud storage buckets create "
                           f"gs://{bucket})")

