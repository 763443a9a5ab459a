"""The driver's Ray: connected (a running cluster or a private local one), and the
job's two actors started on it (the Ray Train controller's process and the tracker).

    init_ray(cfg)
    host, tracker = connect_and_start(cfg, tracking_uri)
"""

from __future__ import annotations

import os

from elastic_ddp import tracking
from elastic_ddp.compat.versions import ray_plan
from elastic_ddp.config import Config
from elastic_ddp.driver.preflight import check_ray_address


def init_ray(cfg: Config) -> None:
    """Connect to Ray: the cluster ``RAY_ADDRESS`` names, else a private local one.

    Ray's own log lines stay off the console (``local_ray.RayDriverLog``: the driver's
    into the session's ``logs/elastic-ddp-driver.log``; the workers', the controller's
    and Ray Data's stay in their files there, ``log_to_driver=False``) unless
    ``ELASTIC_DDP_RAY_LOGS=1`` (``elastic-ddp train --ray-logs``)."""
    import ray

    from elastic_ddp.driver import network_checks
    from elastic_ddp.driver.local_ray import RayDriverLog, init_local_ray, ray_logs_on_console

    if ray.is_initialized():
        return
    verbose = ray_logs_on_console()
    routing = None if verbose else RayDriverLog()
    if routing is not None:
        routing.start()
    # configure_logging=False: ray.init would put its console handler back.
    log_kw = ({"configure_logging": True, "logging_level": "INFO", "log_to_driver": True}
              if verbose else {"configure_logging": False, "log_to_driver": False})
    if os.environ.get("RAY_ADDRESS"):
        network_checks.connect_ray(log_kw)  # bounded; a loopback-only cluster on 127.0.0.1
    else:
        # A laptop/CI run: a local cluster with enough logical CPUs for max_workers plus
        # Ray Data's read and transform tasks; the workers set their own torch thread
        # counts. address="local": without it ray.init auto-attaches to any Ray instance
        # running on this machine (another user's `ray start`) and then refuses num_cpus.
        # Every listener on 127.0.0.1 (elastic_ddp.driver.local_ray).
        need = int(cfg.scaling.max_workers * cfg.scaling.cpus_per_worker) + 2
        init_local_ray(num_cpus=max(need, os.cpu_count() or 1), **log_kw)
    if routing is not None:
        routing.attach()


def cluster_running() -> bool:
    """This driver joins a Ray that is already up: ``RAY_ADDRESS`` names a cluster (as
    ``ray job submit`` sets it), or this process is connected already."""
    import ray

    return ray.is_initialized() or os.environ.get("RAY_ADDRESS", "").strip() not in ("", "local")


def ray_address_answers() -> bool:
    """``RAY_ADDRESS`` answers (``check_ray_address``); when it does not, that error is
    raised after the input checks, which print what the scan skipped first."""
    from elastic_ddp.config import ConfigError

    try:
        check_ray_address()
    except ConfigError:
        return False
    return True


def connect_and_start(cfg: Config, uri: str) -> tuple:
    """Connect to Ray, then start the Ray Train controller's process
    (``compat.ray_controller_host.ControllerHost``, where the installed Ray is one it was
    tested on; else None: Ray Train starts its own controller in ``fit``) and the tracker
    actor; both boot from now on. Returns ``(host, tracker)``."""
    init_ray(cfg)
    host = None
    if ray_plan().applies("controller_host"):
        from elastic_ddp.compat.ray_controller_host import start_controller_host

        host = start_controller_host()
    return host, tracking.start_tracker(uri)


def kill_actors(*actors) -> None:
    """``ray.kill`` each of ``actors`` that is not None. Ray is not imported when there is
    none: a job stopped before Ray started (its checks, a signal in the user's code)
    exits without paying Ray's import (seconds of CPU) in its clean-up."""
    if all(a is None for a in actors):
        return
    import ray

    for a in actors:
        if a is not None:
            ray.kill(a)


def import_ray_train() -> None:
    """Import Ray Train (run beside ``ray.init``, which mostly waits)."""
    import ray.train.torch  # noqa: F401 - the import cost, paid while Ray starts
