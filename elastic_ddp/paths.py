"""Local paths and storage URIs, kept apart.

``run.storage_path`` is either a local path (``ray_results``, ``/mnt/nfs/ray results``)
or a URI (``s3://bucket/runs``). Building a URI as ``"file://" + path`` breaks on the
characters a URI reserves: a space makes pyarrow raise ``ArrowInvalid: Cannot parse
URI``, and ``#`` or ``?`` start a fragment or query, so the file system silently looks at
a shorter path. Here a local path becomes a URI only through percent-encoding
(``Path.as_uri``), and a local path is never handed to a URI parser at all.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
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
    * other schemes (``s3://``, ``gs://``, ``hdfs://``, ...):
      ``pyarrow.fs.FileSystem.from_uri``.

    Returns:
        ``(filesystem, path)``: pass the path to that file system's methods
        (``get_file_info``, ``open_input_file``).

    Raises:
        ValueError: an empty path, a ``file://`` URI with a remote host, or a raw ``?`` or
            ``#`` in a ``file://`` URI (a query or fragment, which names no part of a file
            path: percent-encode them as ``%3F`` / ``%23``, or pass the plain path), or
            a percent-escape that does not decode as UTF-8 (pyarrow paths are UTF-8).
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
    if parts.scheme.lower() != "file":
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
