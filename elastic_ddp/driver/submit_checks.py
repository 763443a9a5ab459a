"""What may leave this machine with a job: checks ``elastic-ddp submit`` runs before it
contacts a cluster. Credentials in URIs, settings only this machine can use (relative or
local paths, a local MLflow store), a bearer token over plain http, and ``--set`` values
that YAML reads back unchanged. No Ray import: these run in the fast unit tier.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Mapping, Optional
from urllib.parse import parse_qsl, urlparse

import yaml

from elastic_ddp.config import Config, ConfigError

# Variables whose value is a credential whatever it looks like.
SECRET_NAME = re.compile(r"TOKEN|PASSWORD|PASSWD|SECRET|CREDENTIAL|API_?KEY|ACCESS_KEY|PRIVATE_KEY",
                          re.I)
_SECRET_QUERY = re.compile(r"token|password|passwd|secret|key|sig|signature|credential", re.I)
PATH_FIELDS = ("data.train_path", "data.val_path", "run.storage_path")
CLUSTER_MLFLOW_FIX = (
    "the job then uses the MLFLOW_TRACKING_URI of the cluster's nodes: on KubeRay the "
    "Secret elastic-ddp-mlflow (cluster/kuberay/raycluster.yaml), on a local cluster the "
    "environment `cluster/local_cluster.py start` ran in; or send a URI without "
    "credentials and give the nodes MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD "
    "(or MLFLOW_TRACKING_TOKEN)")


def is_local_address(address: str) -> bool:
    """True for a job API on this machine (loopback): the cluster then shares this
    machine's file system, so relative paths can be made absolute for it."""
    host = urlparse(address if "://" in address else f"http://{address}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cleartext_token_warning(address: str, headers: Mapping[str, str]) -> Optional[str]:
    """A warning when a bearer token would cross the network unencrypted (``http://`` to
    a non-loopback host), else None."""
    scheme = urlparse(address if "://" in address else f"http://{address}").scheme
    if not headers.get("Authorization") or scheme != "http" or is_local_address(address):
        return None
    return (f"sending the Ray auth token in clear text over http:// to {address}: anyone "
            "on the path can read it and run code on the cluster. Use https://, or a "
            "tunnel (`ray dashboard CLUSTER.yaml`, `ssh -L 8265:127.0.0.1:8265 HEAD`, "
            "`kubectl port-forward svc/elastic-ddp-head-svc 8265:8265`) and "
            "--address http://127.0.0.1:8265")


def has_credentials(value: str) -> bool:
    """Whether a URI carries a credential: ``user[:password]@`` in it (any scheme, e.g.
    ``https://u:p@host``, ``postgresql://u:p@db/x``), or a token-like query parameter."""
    if "://" not in value:
        return False
    try:
        u = urlparse(value)
    except ValueError:
        return True  # unparsable: do not guess that it is harmless
    if u.username or u.password or "@" in u.netloc:
        return True
    return any(_SECRET_QUERY.search(k) for k, _ in parse_qsl(u.query, keep_blank_values=True))


def is_uri(value: str) -> bool:
    """A URI (``s3://``, ``http://``, ...), not a file system path."""
    return "://" in value


def _local_store(uri: str) -> bool:
    """An MLflow store that only this machine can reach: sqlite, file or a plain path."""
    scheme = urlparse(uri).scheme if is_uri(uri) or uri.startswith("sqlite:") else ""
    return scheme in ("", "sqlite", "file")


def yaml_value(s: str) -> str:
    """``s`` written as a ``--set`` value that YAML reads back as the same string: as is
    when it already does (most paths), else as a YAML double-quoted scalar (JSON string
    syntax). Raises ConfigError for a string no YAML scalar can carry."""
    try:
        if yaml.safe_load(s) == s:
            return s
    except yaml.YAMLError:
        pass
    quoted = json.dumps(s, ensure_ascii=False)
    try:
        if yaml.safe_load(quoted) == s:
            return quoted
    except yaml.YAMLError:
        pass
    raise ConfigError(f"{s!r} cannot be passed as a --set value (unprintable characters); "
                      "rename the directory or pass the value in the config file")


def effective_tracking_uri(cfg: Config, environ: Mapping[str, str]) -> str:
    """The MLflow store the submitter means: the config's, else its MLFLOW_TRACKING_URI."""
    return cfg.run.tracking_uri or environ.get("MLFLOW_TRACKING_URI") or ""


def _on_this_machine(p: Path, root: Path) -> Optional[str]:
    """Why an absolute path is this machine's, or None: it lies in the checkout, the
    home or temp directory, or exists here."""
    p = Path(os.path.normpath(p))
    for base, what in ((root, "this checkout"), (Path.home(), "your home directory"),
                       (Path(tempfile.gettempdir()), "the temp directory")):
        if p == base or base in p.parents:
            return f"in {what}"
    return "exists on this machine" if p.exists() else None


def local_only_settings(cfg: Config, root: Path, environ: Mapping[str, str]) -> list[str]:
    """Settings a cluster on another machine cannot use, each naming the field and the
    fix: relative or this machine's data/storage paths, a local MLflow store."""
    out = []
    for key in PATH_FIELDS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if not value or is_uri(value):
            continue
        if not Path(value).is_absolute():
            out.append(f"{key}={value!r} is relative: on the cluster it resolves inside the "
                       "job's uploaded copy of the checkout, which has no data and is new at "
                       f"every submission; use an object-store URI (--set {key}=s3://BUCKET/...)"
                       " or a path every node mounts (/mnt/shared/...)")
        elif (why := _on_this_machine(Path(value), root)) is not None:
            out.append(f"{key}={value!r} is this machine's ({why}): the cluster's nodes do not "
                       "see it; use a path every node mounts or an object-store URI (if "
                       "every node does mount it at this path, pass --allow-local-paths)")
    uri = effective_tracking_uri(cfg, environ)
    if uri and _local_store(uri):
        where = "run.tracking_uri" if cfg.run.tracking_uri else "MLFLOW_TRACKING_URI"
        out.append(f"{where}={uri!r} is a local MLflow store: the job would write its run "
                   "on the head node; use a tracking server every node reaches "
                   "(--set run.tracking_uri=http://mlflow.internal:5000, see "
                   "cluster/mlflow_server.sh), or unset both to use the cluster's own "
                   "MLFLOW_TRACKING_URI")
    return out
