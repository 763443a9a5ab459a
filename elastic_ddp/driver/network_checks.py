"""Time bounds on the driver's network dependencies: the Ray cluster ``RAY_ADDRESS``
names and the MLflow tracking server. Each must answer within
:func:`connect_timeout_s` seconds (``ELASTIC_DDP_CONNECT_TIMEOUT_S``, default 15), or
the job exits 2 with one line naming the address, what did not answer and the fix.

    from elastic_ddp.driver.network_checks import check_ray_gcs, connect_ray

    check_ray_gcs("127.0.0.1:6379", "RAY_ADDRESS")   # ConfigError if it does not answer
    connect_ray({"log_to_driver": False})             # ray.init(**kw), bounded

A refused connection is only one way a server fails: one that accepts the TCP
connection and never answers (a frozen head node, a proxy in front of a dead backend, a
server at the wrong port that waits for something else) makes ``ray.init`` retry its
GCS for minutes and MLflow's client wait ``MLFLOW_HTTP_REQUEST_TIMEOUT`` (120 s) on each
of ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` (7) tries. Here:

* a Ray GCS (gRPC over HTTP/2) must send its HTTP/2 SETTINGS frame, which every HTTP/2
  server sends first, after the client's connection preface (no Ray protocol involved);
* ``RAY_ADDRESS`` on 127.0.0.1 whose cluster listens on loopback only (the project's
  ``cluster/local_cluster.py``): Ray replaces 127.0.0.1 by the host's address, where
  such a cluster does not listen, and waits forever; the driver joins it on 127.0.0.1
  instead (:func:`elastic_ddp.compat.ray_local.init_on_loopback`);
* ``ray.init`` itself runs under a watchdog (:data:`RAY_INIT_FACTOR` times the bound);
* MLflow's own request knobs get bounded defaults for the job's requests
  (:func:`bound_mlflow_requests`).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Any, Optional
from urllib.parse import urlsplit

from elastic_ddp.config import ConfigError

TIMEOUT_ENV = "ELASTIC_DDP_CONNECT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 15.0
# ray.init does more than one round trip (the GCS, the node table, the driver's
# registration with a raylet, the job's config): it gets this many bounds.
RAY_INIT_FACTOR = 4
# MLflow's knobs for each of its HTTP requests, set for the job (driver, its MLflow
# helper, local Ray's workers) unless a person set them: MLflow ships 120 s and 7 retries
# with exponential backoff, about 17 minutes of waiting per request on a server that has
# stopped answering. 30 s x 4 tries still rides out a server's restart.
MLFLOW_KNOBS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "30", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3"}

_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_H2_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty SETTINGS frame
_RAY_FIX = ("start the cluster first (ray start --head, or cluster/local_cluster.py start), "
            "point RAY_ADDRESS at its GCS address, or unset RAY_ADDRESS to train on a local Ray")


def connect_timeout_s() -> float:
    """Seconds a network dependency has to answer: ``ELASTIC_DDP_CONNECT_TIMEOUT_S``
    (a positive number), default :data:`DEFAULT_TIMEOUT_S`.

    Raises:
        ConfigError: the variable is set but not a positive number.
    """
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        raise ConfigError(f"{TIMEOUT_ENV}={raw!r}: not a positive number of seconds; set it "
                          f"to e.g. {DEFAULT_TIMEOUT_S:.0f}, or unset it")
    return value


def _s(seconds: float) -> str:
    return f"{seconds:g} s"


def tcp_unanswered(host: str, port: int, timeout_s: float) -> Optional[str]:
    """None when ``host:port`` accepts a TCP connection within ``timeout_s``; else what
    happened ("refused the connection", "did not accept a connection within 15 s")."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except socket.timeout:
        return f"did not accept a connection within {_s(timeout_s)}"
    except OSError as e:
        return f"refused the connection ({e.strerror or e})" if isinstance(
            e, ConnectionRefusedError) else f"could not be reached ({e.strerror or e})"
    return None


def http2_unanswered(host: str, port: int, timeout_s: float) -> Optional[str]:
    """None when ``host:port`` answers an HTTP/2 connection preface within ``timeout_s``
    (any bytes, or a closed connection: something is serving there; what it is, is for
    the client to say); else what did not answer. A TCP connection that is accepted but
    gets no byte back (a frozen process, whose kernel still completes the handshake)
    is the case this finds."""
    why = None
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            s.sendall(_H2_PREFACE + _H2_SETTINGS)
            s.recv(9)
    except socket.timeout:
        why = f"accepted the connection but sent no answer within {_s(timeout_s)}"
    except ConnectionRefusedError as e:
        why = f"refused the connection ({e.strerror or e})"
    except OSError:  # reset, TLS-only servers closing on plain text: it answered
        pass
    return why


def _host_port(addr: str) -> tuple[Optional[str], Optional[int]]:
    parts = urlsplit(addr if "://" in addr else f"tcp://{addr}")
    try:
        return parts.hostname, parts.port
    except ValueError:
        return None, None


def check_ray_gcs(addr: str, field: str = "RAY_ADDRESS") -> None:
    """Refuse a Ray address (``host:port`` or ``ray://host:port``) that does not answer
    within :func:`connect_timeout_s`: refused, silent after accepting, unreachable.
    Addresses without a port (``auto``, ``local``) are Ray's to resolve.

    Raises:
        ConfigError: ``"RAY_ADDRESS=127.0.0.1:6379: the Ray cluster at 127.0.0.1:6379
            accepted the connection but sent no answer within 15 s; ..."`` with the fix.
    """
    host, port = _host_port(addr)
    if not host or not port:
        return
    seen = _failed.get(addr)
    if seen and time.monotonic() - seen[0] < _FAILED_KEEP_S:
        raise seen[1]  # the driver checks twice (before and after the scan): wait once
    timeout = connect_timeout_s()
    tls = os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")
    why = tcp_unanswered(host, port, timeout) if tls else http2_unanswered(host, port, timeout)
    if why:
        err = ConfigError(
            f"{field}={addr}: the Ray cluster at {host}:{port} {why}; {_RAY_FIX} (a slow "
            f"network: raise {TIMEOUT_ENV}, now {_s(timeout)})")
        _failed[addr] = (time.monotonic(), err)
        raise err
    _failed.pop(addr, None)


# address -> (when, the error) of a check that failed in this process, kept this long.
_failed: dict[str, tuple[float, ConfigError]] = {}
_FAILED_KEEP_S = 120.0


def _host_address() -> Optional[str]:
    """The address Ray substitutes for 127.0.0.1 (:func:`compat.ray_local.host_address`)."""
    from elastic_ddp.compat.ray_local import host_address

    return host_address()


def loopback_only(addr: str) -> bool:
    """``addr`` is a 127.x address whose cluster does not answer at the host's own address
    on the same port (it listens on loopback only, as ``cluster/local_cluster.py``'s does):
    a driver that lets Ray swap in the host's address would wait for it forever."""
    from elastic_ddp.driver.local_ray import is_loopback

    host, port = _host_port(addr)
    if not host or not port or addr.startswith("ray://"):
        return False
    try:
        if not is_loopback(host if host != "localhost" else "127.0.0.1"):
            return False
    except ValueError:
        return False
    outside = _host_address()
    if outside is None or is_loopback(outside):
        return False  # Ray keeps 127.0.0.1 itself
    return tcp_unanswered(outside, port, min(2.0, connect_timeout_s())) is not None


def connect_ray(init_kw: dict[str, Any]) -> None:
    """``ray.init(**init_kw)`` of the cluster ``RAY_ADDRESS`` names, bounded: the address
    must answer (:func:`check_ray_gcs`), a loopback-only cluster is joined on 127.0.0.1,
    and ``ray.init`` gets :data:`RAY_INIT_FACTOR` bounds. When it has not returned by then,
    one line naming the address and the fix goes to stderr and the process exits 2 at
    once: ``ray.init`` waits inside Ray's C++ core, where nothing in this process can
    interrupt it.

    Raises:
        ConfigError: see :func:`check_ray_gcs`; a loopback-only cluster on a Ray release
            :func:`~elastic_ddp.compat.ray_local.init_on_loopback` was not tested on.
    """
    import ray

    from elastic_ddp.compat.ray_local import exit_during_init, init_on_loopback

    addr = os.environ.get("RAY_ADDRESS", "").strip()
    check_ray_gcs(addr)
    bound = RAY_INIT_FACTOR * connect_timeout_s()
    host, port = _host_port(addr)
    where = f"{host}:{port}" if host and port else addr
    done = threading.Event()

    def watchdog() -> None:
        if done.wait(bound):
            return
        print(f"elastic-ddp: RAY_ADDRESS={addr}: the Ray cluster at {where} accepted the "
              f"connection but the driver did not join it within {_s(bound)} (its GCS or a "
              f"node's raylet does not answer; Ray's log lines above say which); check the "
              f"cluster (ray status --address {where}), {_RAY_FIX} (a slow network: raise "
              f"{TIMEOUT_ENV}, now {_s(bound / RAY_INIT_FACTOR)})", file=sys.stderr, flush=True)
        sys.stdout.flush()
        exit_during_init(2)

    threading.Thread(target=watchdog, name="ray-init-watchdog", daemon=True).start()
    try:
        if loopback_only(addr):
            if not init_on_loopback(ray.init, init_kw):
                raise ConfigError(
                    f"RAY_ADDRESS={addr}: the Ray cluster at {where} listens on loopback only "
                    f"and Ray {ray.__version__} would connect at this host's address instead; "
                    "start the cluster with --node-ip-address set to this host's address, or "
                    "install a Ray release elastic-ddp was tested on")
        else:
            ray.init(**init_kw)
    finally:
        done.set()


def http_unanswered(url: str, timeout_s: Optional[float] = None) -> Optional[str]:
    """What did not answer when a GET of ``url`` gets no answer (or answers slower than
    ``timeout_s``, default :func:`connect_timeout_s`): "accepted the connection but did
    not answer GET URL within 15 s". None for any answer, and for a refused or failed
    connection (the caller's client says those itself, at once)."""
    import urllib.request

    timeout = connect_timeout_s() if timeout_s is None else timeout_s
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            r.read(1)
    except (OSError, ValueError) as e:
        if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
            return (f"accepted the connection but did not answer GET {url} within "
                    f"{_s(timeout)} (raise {TIMEOUT_ENV} on a slow network)")
    return None


def bound_mlflow_requests() -> None:
    """MLflow's per-request timeout and retry count for this process and the ones it
    starts (:data:`MLFLOW_KNOBS`), unless already set: a tracking server that stops
    answering mid-job fails the request (which the job's tracker retries and reports)
    instead of holding it for a quarter of an hour."""
    for k, v in MLFLOW_KNOBS.items():
        os.environ.setdefault(k, v)
