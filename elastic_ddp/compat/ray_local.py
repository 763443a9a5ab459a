"""Ray core internals that keep a local Ray instance on 127.0.0.1 (used by
:mod:`elastic_ddp.driver.local_ray`). Ray has no public switch for either:

- :func:`cluster_mode`: ``ray_constants.ENABLE_RAY_CLUSTER``, the flag Ray computes from
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when it is imported. Off: single-machine mode, in
  which Ray keeps 127.0.0.1 as the node address instead of the host's; on: a process that
  may join a worker node to a head. Set for the duration of one call and restored.
- :func:`keep_loopback_addresses`: ``services.resolve_ip_for_localhost`` swaps 127.0.0.1
  for the host's address when a worker node joins; patched in the ``ray start`` process
  only (it exits with the command).
- :func:`session_logs_dir`: the connected node's log directory (``ray._private.worker
  ._global_node``), so the driver's Ray log lines go beside Ray's own. None in client
  mode or when the attribute is gone.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Optional


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
