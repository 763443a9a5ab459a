"""Ray on this machine that listens on 127.0.0.1 only, and the checks that prove it.

    from elastic_ddp.driver.local_ray import init_local_ray, listeners_outside_loopback
    init_local_ray(num_cpus=4)
    assert listeners_outside_loopback() == []   # this process and its descendants

``ray.init(address="local")`` on Linux starts a GCS, a raylet, agents and workers that
listen on every interface (gRPC on ``*``/``::``, metrics on 0.0.0.0) or on the host's
address, some on fixed ports (autoscaler/dashboard metrics 44217/44227, dashboard agent
52365, Ray client 10001) that collide when two instances share a machine. Ray binds all
of them to loopback only when the node's IP is exactly ``127.0.0.1``, and keeps that IP
only in its single-machine mode (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, the default on
macOS and Windows); otherwise it swaps in the host's address. Here:

* ``init_local_ray``: an in-process instance (``elastic-ddp train`` on a laptop, the
  test fixtures) in that mode, with free metrics ports;
* ``ray_start_on_loopback``: ``ray start`` for the nodes of a multi-node cluster on one
  machine (``cluster/local_cluster.py``);
* ``check_private_dir`` / ``write_token``: the cluster directory and token file no other
  user can read or plant;
* ``listeners_outside_loopback``: TCP listeners of given processes outside 127.0.0.0/8
  and ::1, from ``/proc`` (Linux);
* ``RayDriverLog``: Ray's own driver-side log lines (e.g. its token-authentication
  warning) into the Ray session's log folder instead of the console, unless
  ``ELASTIC_DDP_RAY_LOGS=1`` (``elastic-ddp train --ray-logs``).
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import secrets
import socket
import stat
from pathlib import Path
from typing import Any, Iterable, Optional

from elastic_ddp.compat.ray_local import RAY_INIT_LOGGER
from elastic_ddp.errors import ElasticDDPError

LOOPBACK = "127.0.0.1"
# Ray's single-machine mode: with it off (the default on Linux) ray.init and `ray start`
# replace a node IP of 127.0.0.1 by the host's address.
_SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Metrics servers of the head's autoscaler monitor and dashboard, fixed ports by default;
# read by those processes at start (they inherit the environment of ray.init's caller).
_METRIC_PORT_VARS = ("AUTOSCALER_METRIC_PORT", "DASHBOARD_METRIC_PORT")
# Ray's fixed default ports (GCS, dashboard, Ray client, autoscaler and dashboard metrics,
# dashboard agent): a port chosen here is never one of them, or a second instance started
# with Ray's defaults would collide with it.
RAY_DEFAULT_PORTS = frozenset({6379, 8265, 10001, 44217, 44227, 52365})


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on ``host`` right now (bound and released), never one of
    ``RAY_DEFAULT_PORTS``."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in RAY_DEFAULT_PORTS:
            return port


def loopback_env() -> dict[str, str]:
    """Environment for the processes of a single-machine Ray instance: Ray's
    single-machine mode (node IP 127.0.0.1 kept) and fresh metrics ports."""
    return {_SINGLE_MACHINE: "0", **{v: str(free_port()) for v in _METRIC_PORT_VARS}}


def init_local_ray(num_cpus: int, **kw: Any) -> None:
    """``ray.init`` of a fresh, private single-machine Ray instance with every listener
    on 127.0.0.1 and no fixed port.

    ``address="local"`` (never attach to someone else's instance on this machine), node
    IP 127.0.0.1, no dashboard unless asked (then on 127.0.0.1 and a free port), and,
    while Ray starts its processes, Ray's single-machine mode and free metrics ports in
    the environment they inherit. This process's own environment and Ray's mode flag are
    restored afterwards, so a later ``ray.init`` of a remote cluster is unaffected. Other
    keyword arguments go to ``ray.init`` (``configure_logging``, ``runtime_env``...).
    """
    import ray

    from elastic_ddp.compat.ray_local import cluster_mode

    env = loopback_env()
    saved_env = {k: os.environ.get(k) for k in env}
    kw.setdefault("include_dashboard", False)
    if kw.get("include_dashboard"):
        kw.setdefault("dashboard_host", LOOPBACK)
        kw.setdefault("dashboard_port", free_port())
    os.environ.update(env)
    # Ray may have been imported (and its mode flag computed from the environment)
    # before this call: the flag is set for the call itself.
    try:
        with cluster_mode(False):
            ray.init(address="local", num_cpus=num_cpus, _node_ip_address=LOOPBACK, **kw)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --------------------------------------------------------------------------- Ray's log lines
RAY_LOGS_ENV = "ELASTIC_DDP_RAY_LOGS"
DRIVER_LOG = "elastic-ddp-driver.log"


def ray_logs_on_console() -> bool:
    """True when Ray's own log lines should reach the console: ``ELASTIC_DDP_RAY_LOGS``
    set to 1/true/yes (``elastic-ddp train --ray-logs`` sets it)."""
    return os.environ.get(RAY_LOGS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class RayDriverLog:
    """Ray's driver-side log records (the ``ray`` logger and its children: Ray's start,
    its token-authentication warning, Ray Train's driver messages) kept off the console.

    ``start()`` before ``ray.init``: the ``ray`` logger's console handler is replaced by
    a buffer. ``attach()`` after it: the buffer goes to ``<session>/logs/``
    :data:`DRIVER_LOG` (beside Ray's own logs, where the workers' and the controller's
    output already goes with ``log_to_driver=False``), and later records follow.
    Returns that file's path. Errors (level ERROR and above) still reach stderr: they are
    what a person must see."""

    def __init__(self):
        self._buffer = logging.handlers.MemoryHandler(capacity=1_000_000,
                                                      flushLevel=logging.CRITICAL + 10)
        self._errors = logging.StreamHandler()
        self._errors.setLevel(logging.ERROR)
        self._errors.setFormatter(logging.Formatter("ray: %(levelname)s %(message)s"))
        self.path: Optional[Path] = None

    def start(self) -> None:
        ray_logger = logging.getLogger("ray")
        ray_logger.handlers = [self._buffer, self._errors]
        ray_logger.propagate = False
        ray_logger.setLevel(logging.INFO)
        # ray.init(configure_logging=False) clears the "ray" logger's handlers (and with
        # none left, Python prints WARNING records on stderr itself): what ray.init
        # logs (RAY_INIT_LOGGER, e.g. the token-authentication warning) stops one level
        # below it until attach().
        inner = logging.getLogger(RAY_INIT_LOGGER)
        inner.handlers = [self._buffer, self._errors]
        inner.propagate = False

    def attach(self) -> Optional[Path]:
        import tempfile

        from elastic_ddp.compat.ray_local import session_logs_dir

        logs = session_logs_dir() or Path(tempfile.gettempdir())  # None: client mode
        self.path = logs / DRIVER_LOG
        try:
            handler: logging.Handler = logging.FileHandler(self.path)
        except OSError:
            handler, self.path = logging.NullHandler(), None
        handler.setFormatter(logging.Formatter(
            "%(asctime)s\t%(levelname)s %(filename)s:%(lineno)d -- %(message)s"))
        self._buffer.setTarget(handler)
        self._buffer.flush()
        logging.getLogger("ray").handlers = [handler, self._errors]
        inner = logging.getLogger(RAY_INIT_LOGGER)
        inner.handlers = []
        inner.propagate = True
        return self.path


# --------------------------------------------------------------------------- ray start
def ray_start_on_loopback(argv: list[str]) -> int:
    """``ray start ARGV`` for a node that must listen on 127.0.0.1 only (Ray 2.60).

    The node's processes (raylet, agents, workers, job drivers) inherit Ray's
    single-machine mode, in which Ray keeps 127.0.0.1 as a node or GCS address instead
    of swapping in the host's. This process stays in multi-node mode (single-machine
    mode refuses to join a worker node to a head) and keeps 127.0.0.1 where given: Ray's
    ``resolve_ip_for_localhost`` would turn it into the host's address.
    """
    os.environ[_SINGLE_MACHINE] = "0"  # inherited by every process of the node
    from ray.scripts.scripts import cli

    from elastic_ddp.compat.ray_local import cluster_mode, keep_loopback_addresses

    keep_loopback_addresses(LOOPBACK)
    with cluster_mode(True):  # this process only: allow a worker node
        cli.main(args=["start", *argv], prog_name="ray")  # exits like the `ray` command
    return 0


# --------------------------------------------------------------------------- private state
class PrivateDirError(ElasticDDPError, ValueError):
    """A directory for a cluster's token and state that another user could control."""


def check_private_dir(path: Path, create: bool = False) -> None:
    """Refuse a cluster directory another user could control: a symlink, a non-directory
    or one owned by someone else (PrivateDirError naming it and the fix). With ``create``,
    make it (mode 0700) when missing; an own directory open to others is narrowed to 0700.
    Only the last component is checked: in a sticky shared directory such as /tmp, nobody
    else can replace a directory of ours once it exists."""
    if create:
        try:
            path.mkdir(mode=0o700, parents=False)
        except FileExistsError:
            pass
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir(mode=0o700)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    fix = "remove it, or pass --dir (or ELASTIC_DDP_CLUSTER_DIR) naming a directory of your own"
    if stat.S_ISLNK(st.st_mode):
        raise PrivateDirError(f"cluster dir {path} is a symlink (to {os.readlink(path)}); "
                              f"refusing to follow it: {fix}")
    if not stat.S_ISDIR(st.st_mode):
        raise PrivateDirError(f"cluster dir {path} exists and is not a directory: {fix}")
    if st.st_uid != os.getuid():
        raise PrivateDirError(f"cluster dir {path} belongs to uid {st.st_uid}, not to you "
                              f"(uid {os.getuid()}); whoever owns it can read the cluster's "
                              f"token and replace its files: {fix}")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


def write_token(path: Path) -> None:
    """A fresh random token, readable only by its owner. O_CREAT|O_EXCL|O_NOFOLLOW with
    mode 0600: never written through a file or symlink someone else put there, never
    readable by others even for a moment. The token of an earlier cluster (a file in
    this private directory) is removed first; a symlink is removed, not followed."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


# --------------------------------------------------------------------------- checks
def _children() -> dict[int, list[int]]:
    """ppid -> child pids, read from /proc."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Fields after the ")" that closes the command name: state, ppid, ...
        ppid = int(fields.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(entry))
    return out


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants (``[]`` when ``pid`` is gone)."""
    children = _children()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p not in out and Path(f"/proc/{p}").exists():
            out.append(p)
            todo.extend(children.get(p, []))
    return out


def ray_session_pids() -> list[int]:
    """This process and its descendants: the driver and the GCS, raylet, agents and
    workers that ``ray.init(address="local")`` started (other users' Ray instances on
    the machine are not among them)."""
    return process_tree(os.getpid())


def _addr(hex_addr: str) -> str:
    """A /proc/net/tcp{,6} address (little-endian 32-bit words) as text."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(words) == 4 else socket.AF_INET6, words)


def tcp_listeners() -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket (IPv4 and IPv6)."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A":  # TCP_LISTEN
                continue
            host, port = f[1].split(":")
            out[int(f[9])] = (_addr(host), int(port, 16))
    return out


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1 and IPv4-mapped ::ffff:127.x.y.z."""
    import ipaddress

    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def listeners(pids: Iterable[int]) -> list[tuple[int, str, str, int]]:
    """(pid, process name, address, port) of every TCP socket these processes listen on,
    found by matching the socket inodes of /proc/<pid>/fd against /proc/net/tcp{,6}."""
    table = tcp_listeners()
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:  # exited, or not ours to inspect
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inode = int(link[8:-1])
                if inode in table:
                    out.append((pid, name, *table[inode]))
    return sorted(set(out))


def listeners_outside_loopback(pids: Optional[Iterable[int]] = None) -> list[str]:
    """``"pid 123 (raylet) on 0.0.0.0:44217"`` for every TCP listener of ``pids`` (default
    ``ray_session_pids()``) that is not on 127.0.0.0/8 or ::1; ``[]`` is the goal."""
    pids = ray_session_pids() if pids is None else pids
    return [f"pid {pid} ({name}) on {addr}:{port}" for pid, name, addr, port in listeners(pids)
            if not is_loopback(addr)]
