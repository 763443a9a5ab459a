"""Ray core internals that keep a local Ray instance on 127.0.0.1 (used by
:mod:`elastic_ddp.driver.local_ray`). Ray has no public switch for either:

- :func:`cluster_mode`: ``ray_constants.ENABLE_RAY_CLUSTER``, the flag Ray computes from
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when it is imported. Off: single-machine mode, in
  which Ray keeps 127.0.0.1 as the node address instead of the host's; on: a process that
  may join a worker node to a head. Set for the duration of one call and restored.
- :func:`keep_loopback_addresses`: ``services.resolve_ip_for_localhost`` swaps 127.0.0.1
  for the host's address when a worker node joins; patched in the ``ray start`` process
  only (it exits with the command).
- :func:`init_on_loopback`: ``ray.init``'s private ``_node_ip_address`` set to 127.0.0.1
  and single-machine mode for the call, so a driver joins a cluster whose nodes listen
  on loopback only (``cluster/local_cluster.py``) at 127.0.0.1, instead of at the host's
  address, where Ray waits for its GCS forever. Only on the Ray releases it was tested
  on (:data:`LOOPBACK_DRIVER_RAY`).
- :func:`host_address`: the address Ray puts in place of 127.0.0.1 (``ray._raylet
  .node_ip_address_from_perspective``); without it, the same UDP-route lookup.
- :func:`exit_during_init`: ``os._exit`` for a watchdog whose ``ray.init`` hangs in Ray's
  C++ core (``driver.network_checks.connect_ray``).
- :func:`session_logs_dir`: the connected node's log directory (``ray._private.worker
  ._global_node``), so the driver's Ray log lines go beside Ray's own. None in client
  mode or when the attribute is gone.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator, Optional


@contextlib.contextmanager
def cluster_mode(enabled: bool) -> Iterator[None]:
    """Ray's multi-node flag set to ``enabled`` inside the block (this process only)."""
    from ray._private import ray_constants

    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):  # a Ray without the flag: as it ships
        yield
        return
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = enabled
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def keep_loopback_addresses(loopback: str) -> None:
    """From now on in this process, ``loopback`` given as a node or GCS address stays as
    it is instead of becoming the host's address."""
    from ray._private import services

    resolve = services.resolve_ip_for_localhost
    services.resolve_ip_for_localhost = lambda host: host if host == loopback else resolve(host)


#: Ray releases on which a driver joined a loopback-only cluster with
#: :func:`init_on_loopback` (tests/unit/driver/test_network_bounds.py). What it relies on: ray.init
#: resolves the GCS and node address through ``services.resolve_ip_for_localhost``, which
#: keeps 127.0.0.1 in single-machine mode; elsewhere a loopback-only cluster is refused
#: with the fix (driver.network_checks).
LOOPBACK_DRIVER_RAY = ("2.60.0",)


def init_on_loopback(init: Callable[..., Any], kw: dict[str, Any],
                     loopback: str = "127.0.0.1") -> bool:
    """``init(**kw)`` (``ray.init``) with node IP ``loopback`` and Ray's single-machine
    mode for the call: the GCS address stays ``loopback`` and this driver registers on the
    node with that IP. False, without calling, on a Ray release not in
    :data:`LOOPBACK_DRIVER_RAY` (the caller says what to do instead)."""
    import ray

    if ray.__version__ not in LOOPBACK_DRIVER_RAY:
        return False
    with cluster_mode(False):
        init(_node_ip_address=loopback, **kw)
    return True


def exit_during_init(code: int) -> None:
    """End this process at once with ``code`` (``os._exit``, documented in Python's
    ``os``), from a thread other than the one in ``ray.init``: ray.init waits for a GCS
    inside Ray's C++ core, which neither an exception nor a signal handler interrupts
    until it returns. What it costs: no atexit handlers and no ``finally`` blocks run
    (the caller has printed its line and flushed; the MLflow helper exits when its stdin
    closes)."""
    import os

    os._exit(code)


def host_address() -> Optional[str]:
    """This host's address as Ray picks it for a node (the interface of the route to the
    internet), or None when there is no such route."""
    try:
        from ray._raylet import node_ip_address_from_perspective

        return node_ip_address_from_perspective(None)
    except Exception:  # noqa: BLE001 - renamed or moved: do what it does
        import socket

        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect(("8.8.8.8", 53))  # no packet is sent: it picks the route
                return s.getsockname()[0]
        except OSError:
            return None


def session_logs_dir() -> Optional[Path]:
    """The log directory of the Ray node this process started or joined, or None."""
    try:
        import ray

        return Path(ray._private.worker._global_node.get_logs_dir_path())
    except Exception:  # noqa: BLE001 - client mode, or not connected
        return None


#: The logger of what ``ray.init`` itself logs (the token-authentication warning, the
#: start): a private module's name, which ``RayDriverLog`` routes with the ``ray`` logger's
#: records. If Ray renames it, those few lines reach the console again; nothing breaks.
RAY_INIT_LOGGER = "ray._private"
