"""Where a data set's files are: a local directory (symlinked directories followed once
each) or an object-store prefix (``s3://``, ``gs://``: the store's paged listing), in
sorted relative-path order, with their sizes and what was skipped (hidden entries, files
that are not ``*.parquet``). :mod:`elastic_ddp.data.scan` reads what is listed here."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa

from elastic_ddp.paths import is_uri, uri_to_filesystem
from elastic_ddp.errors import EXIT_BAD_INPUT, ElasticDDPError


class DataError(ElasticDDPError, ValueError):
    """A data set that cannot be trained on. The message names the file, the column and the fix."""

    exit_code = EXIT_BAD_INPUT
    kind = "data error"


#: What names a data set's path when the caller does not say which split it is.
DATA_PATH_FIELDS = "data.train_path / data.val_path"


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def shown(path: str | os.PathLike) -> str:
    """How a data path is named in messages: a URI as written, a local path as ``Path``."""
    text = os.fspath(path)
    return text if is_uri(text) else str(Path(text))


def is_remote(text: str) -> bool:
    return is_uri(text) and not text.lower().startswith("file:")


def listing(path: str | os.PathLike, field: str) -> tuple[str, list[str], list[int], list[str]]:
    """``(root, files, sizes, skipped)``: ``root`` the directory the files' relative names
    start from (a local path or URI, no trailing slash), ``files`` sorted by relative name."""
    text = os.fspath(path)
    if is_remote(text):
        return list_store(text, field)
    if is_uri(text):  # file://: its local path
        try:
            text = uri_to_filesystem(text)[1]
        except ValueError as e:
            raise DataError(f"{field}: {e}") from None
    root = Path(text)
    if not root.exists():
        raise DataError(f"{root}: path does not exist; check {field}, "
                        "or create the data set first (e.g. `elastic-ddp prepare digits data/digits`)")
    if root.is_file():
        f = os.path.abspath(root)
        return os.path.dirname(f), [f], [os.path.getsize(f)], []
    found: list[str] = []
    skipped: list[str] = []
    seen: set[str] = set()
    base = Path(os.path.abspath(root))
    for dirpath, dirnames, filenames in os.walk(base, followlinks=True):
        real = os.path.realpath(dirpath)
        rel_dir = Path(dirpath).relative_to(base)
        if real in seen:
            skipped.append(f"{rel_dir.as_posix()}/: same directory as another path (symlink), read once")
            dirnames[:] = []
            continue
        seen.add(real)
        for d in sorted(dirnames):
            if d.startswith((".", "_")):
                skipped.append(f"{(rel_dir / d).as_posix()}/: hidden (name starts with . or _)")
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "_")))
        for name in sorted(filenames):
            rel = (rel_dir / name).as_posix()
            if name.startswith((".", "_")):
                skipped.append(f"{rel}: hidden (name starts with . or _)")
            elif not name.endswith(".parquet"):
                skipped.append(f"{rel}: not *.parquet")
            elif os.path.isfile(base / rel):
                found.append(rel)
    if not found:
        raise DataError(_no_parquet(str(root), skipped, field))
    files = [str(base / rel) for rel in sorted(found)]
    return str(base), files, [os.path.getsize(f) for f in files], skipped


def _no_parquet(root: str, skipped: list[str], field: str) -> str:
    return (f"{root}: directory has no Parquet files (*.parquet, searched recursively"
            f"{'; skipped: ' + ', '.join(skipped[:5]) if skipped else ''}); point "
            f"{field} at the directory that holds them or prepare the data first")


def list_store(uri: str, field: str) -> tuple[str, list[str], list[int], list[str]]:
    """The object-store listing: one ``get_file_info`` of the path, then every object
    under it (``FileSelector(recursive=True)``: the store's paged listing)."""
    import pyarrow.fs

    try:
        fs, base = uri_to_filesystem(uri)
    except (ValueError, pa.ArrowException) as e:
        raise DataError(f"{field}={uri}: {one_line(e)}") from None
    scheme = uri.split("://", 1)[0]
    try:
        top = fs.get_file_info(base)
        if top.type == pyarrow.fs.FileType.NotFound:
            raise DataError(f"{uri}: path does not exist (no object and no prefix of that name); "
                            f"check {field}, or upload the data set first")
        if top.type == pyarrow.fs.FileType.File:
            parent = uri.rstrip("/").rsplit("/", 1)[0]
            return parent, [f"{scheme}://{base}"], [int(top.size)], []
        listed = fs.get_file_info(pyarrow.fs.FileSelector(base, recursive=True))
    except OSError as e:
        raise DataError(f"{field}={uri}: the store cannot be listed ({one_line(e)}); check the "
                        "bucket name, the endpoint (AWS_ENDPOINT_URL) and the credentials") from None
    found: dict[str, int] = {}
    skipped: set[str] = set()
    for info in listed:
        if info.type != pyarrow.fs.FileType.File:
            continue
        rel = info.path[len(base):].lstrip("/")
        parts = rel.split("/")
        hidden = next((i for i, p in enumerate(parts) if p.startswith((".", "_"))), None)
        if hidden is not None and hidden < len(parts) - 1:
            skipped.add(f"{'/'.join(parts[:hidden + 1])}/: hidden (name starts with . or _)")
        elif hidden is not None:
            skipped.add(f"{rel}: hidden (name starts with . or _)")
        elif not rel.endswith(".parquet"):
            skipped.add(f"{rel}: not *.parquet")
        else:
            found[rel] = int(info.size)
    root = uri.rstrip("/")
    if not found:
        raise DataError(_no_parquet(root, sorted(skipped), field))
    rels = sorted(found)
    return root, [f"{root}/{r}" for r in rels], [found[r] for r in rels], sorted(skipped)


def relative_name(root: str, f: str) -> str:
    if f.startswith(root.rstrip("/") + "/"):
        return f[len(root.rstrip("/")) + 1:]
    return f.rsplit("/", 1)[-1]
