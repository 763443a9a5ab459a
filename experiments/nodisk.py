"""Ray worker nodes that share no disk with the driver, on one machine.

A real cluster's nodes (KubeRay pods, cloud VMs) see the container image and nothing of
the driver's disk: a path only the driver has (its data, its run storage, its ``/tmp``)
is not there. Each node here is ``ray start --address=<head> --block`` run inside a
mount namespace of its own (``unshare --mount --propagation private``, root only), in
which a fresh, empty tmpfs is mounted over every directory a driver-local path could
live in: ``/tmp`` (which also gives the node its own Ray session dir), the temp dir the
driver sees (``$TMPDIR``), ``/var/tmp``, ``/dev/shm`` (each node its own shared memory,
as on separate machines), ``$HOME`` and whatever the caller adds (a test's basetemp).
The code, the virtualenv and the interpreter's installation stay visible: they are the
node's "image" (kept the same way as ``keep`` where they lie under a hidden directory).

``keep``: directories the nodes see anyway although they lie under a hidden one: the
tests' diagnostics only (a sample ledger, a fault marker), never a job's data or storage.
They are bind-mounted aside before the tmpfs goes over their parent and moved back
after, so a node sees exactly those and nothing beside them.

The head stays in the driver's namespace (it runs the driver's Ray processes, Ray
Train's controller and the job's tracker, which Ray and elastic-ddp pin to the driver's
node). Processes of the nodes share the machine's pid and network namespaces: the
driver signals a node's workers by pid and reaches them on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Optional

HOST = "127.0.0.1"
# `ray start` for a node whose processes listen on 127.0.0.1 only (see
# elastic_ddp.driver.local_ray.ray_start_on_loopback); run by the node's own interpreter,
# the project's virtualenv, which every node sees.
_RAY_START = ("import sys; from elastic_ddp.driver.local_ray import ray_start_on_loopback; "
              "sys.exit(ray_start_on_loopback(sys.argv[1:]))")
# Where kept directories wait (bind-mounted) while their parents are hidden: a tmpfs of
# the node's own over /mnt, in its private namespace.
_HOLD = "/mnt"


def namespaces_unavailable() -> Optional[str]:
    """``None`` when this process can start a node in a mount namespace of its own with a
    tmpfs over ``/tmp``; otherwise why not, in one line (for a test's skip reason)."""
    if os.geteuid() != 0:
        return f"no-shared-disk nodes need root for unshare --mount (uid {os.geteuid()})"
    try:
        p = subprocess.run(["unshare", "--mount", "--propagation", "private", "--",
                            "/bin/sh", "-c", "mount -t tmpfs nodisk-probe /tmp"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare --mount could not run: {e}"
    if p.returncode != 0:
        return f"unshare --mount failed (rc {p.returncode}): {p.stderr.strip().splitlines()[-1:]}"
    return None


def _under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def image_dirs() -> list[Path]:
    """What a node runs, its "image": the code, the virtualenv and the interpreter's
    installation (a virtualenv's python is a link into it)."""
    return [Path(__file__).resolve().parents[1], Path(sys.prefix).resolve(),
            Path(sys.base_prefix).resolve()]


def hidden_dirs(extra: Iterable[str | os.PathLike] = ()) -> list[str]:
    """The directories a node hides (absolute, resolved, outermost only, sorted): the
    default set above plus ``extra``. One that holds part of the image is hidden all the
    same: :func:`kept_image_dirs` names the parts to keep visible in it."""
    wanted = ["/tmp", tempfile.gettempdir(), "/var/tmp", "/dev/shm", str(Path.home()), *extra]
    out: list[Path] = []
    for d in sorted({Path(os.path.realpath(p)) for p in wanted}, key=lambda p: len(p.parts)):
        if not d.is_dir() or d == Path("/") or d in image_dirs():
            continue
        if not any(_under(d, o) for o in out):
            out.append(d)
    return sorted(map(str, out))


def kept_image_dirs(hidden: list[str]) -> list[str]:
    """The parts of the image that lie under a hidden directory (e.g. a pyenv or uv
    Python under ``$HOME``): kept visible, as the image's files are on a real node."""
    return sorted({str(i) for i in image_dirs() for h in hidden if _under(i, Path(h)) and i != Path(h)})


def namespace_script(hide: list[str], keep: list[str]) -> str:
    """The ``sh`` program a node runs in its new namespace before exec'ing ``ray start``:
    hold each kept dir aside, a tmpfs over each hidden dir, the kept dirs moved back."""
    lines = ["set -e", f"mount -t tmpfs nodisk-hold {_HOLD}"]
    for i, k in enumerate(keep):
        lines += [f"mkdir -p {_HOLD}/{i}", f"mount --bind {shlex.quote(k)} {_HOLD}/{i}"]
    for d in hide:
        # 1777 like /tmp: Ray and the job's processes create their own dirs in it.
        lines.append(f"mount -t tmpfs -o mode=1777 nodisk {shlex.quote(d)}")
    for i, k in enumerate(keep):
        lines += [f"mkdir -p {shlex.quote(k)}", f"mount --move {_HOLD}/{i} {shlex.quote(k)}"]
    lines.append('exec "$@"')
    return "\n".join(lines)


def free_port() -> int:
    from elastic_ddp.driver.local_ray import free_port as fp

    return fp(HOST)


def cluster_auth_token() -> Optional[str]:
    """The Ray token-authentication token this process would use, if any: from
    ``RAY_AUTH_TOKEN``, the file at ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token`` (the
    places Ray reads it from, in its order). Ray 2.60 turns token authentication on for a
    new local cluster and writes the token under ``$HOME``, which a no-disk node does not
    see."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"]
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


class NoDiskNode:
    """One worker node in its own mount namespace: ``ray start --block`` under
    ``unshare``, its own session (process group), its output in ``log`` (a file the
    driver opened: the node writes to it through the inherited descriptor)."""

    def __init__(self, address: str, cpus: int, hide: list[str], keep: list[str], log: Path,
                 env: Optional[dict[str, str]] = None, object_store_bytes: int = 100 * 2**20,
                 resources: Optional[dict[str, float]] = None):
        self.log = Path(log)
        ray_cmd = [sys.executable, "-c", _RAY_START, "--address", address, "--block",
                   "--disable-usage-stats", "--node-ip-address", HOST, "--num-cpus", str(cpus),
                   "--object-store-memory", str(object_store_bytes),
                   # Ray's fixed default 52365 would collide between nodes; 0: the OS picks.
                   "--dashboard-agent-listen-port", str(free_port()),
                   "--dashboard-agent-grpc-port", "0", "--runtime-env-agent-port", "0",
                   "--node-manager-port", "0", "--object-manager-port", "0",
                   "--metrics-export-port", "0"]
        if resources:
            ray_cmd += ["--resources", json.dumps(resources)]
        cmd = ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
               namespace_script(hide, keep), "nodisk-node", *ray_cmd]
        full_env = {**os.environ, **(env or {})}
        token = cluster_auth_token()
        if token and "RAY_AUTH_TOKEN" not in full_env:
            # The node's $HOME is hidden, so it cannot read ~/.ray/auth_token: it gets the
            # cluster's token in its environment, as a KubeRay pod gets it from a Secret.
            full_env["RAY_AUTH_TOKEN"] = token
        # Processes that find their cluster by address="auto" pick the newest Ray
        # instance on the machine, perhaps another's: pin them to this one's GCS.
        full_env["RAY_ADDRESS"] = address
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_started(self, timeout: float = 180) -> None:
        """Until ``ray start`` says the node is up. Raises RuntimeError with the log's tail
        when it exits or does not start in ``timeout`` seconds."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            text = self.log.read_text(errors="replace")
            if "Ray runtime started" in text:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"no-disk node exited with {self.proc.returncode} while "
                                   f"starting; {self.log}:\n{text[-3000:]}")
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"no-disk node did not start in {timeout} s; log {self.log}")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the node's process group and every descendant of its ``ray start``
        (collected once, before any signal, so a reused pid is never hit), SIGKILL what is
        left after ``grace_s``. Its namespace and tmpfs go with its last process."""
        from elastic_ddp.driver.local_ray import process_tree

        procs = process_tree(self.proc.pid)
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            for p in procs:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            deadline = time.time() + wait
            while time.time() < deadline:
                self.proc.poll()
                procs = [p for p in procs if _running(p)]
                if not procs:
                    return
                time.sleep(0.2)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_alive_nodes(n: int, timeout: float = 120) -> list[dict]:
    """Until the connected cluster has ``n`` alive nodes; returns them (``ray.nodes()``)."""
    import ray

    deadline = time.time() + timeout
    while True:
        alive = [x for x in ray.nodes() if x["Alive"]]
        if len(alive) >= n:
            return alive
        if time.time() > deadline:
            raise RuntimeError(f"{len(alive)} of {n} nodes alive after {timeout} s")
        time.sleep(0.3)


def start_nodes(cluster, n: int, cpus: int, hide: Iterable[str | os.PathLike] = (),
                keep: Iterable[str | os.PathLike] = (), env: Optional[dict[str, str]] = None,
                log_dir: Optional[Path] = None) -> list[NoDiskNode]:
    """``n`` no-disk worker nodes of ``cpus`` CPUs joined to ``cluster`` (a
    ``ray.cluster_utils.Cluster`` this process is connected to), appended to
    ``cluster.nodisk_nodes`` as they start (so the caller stops them on any failure).
    Started one after another and each waited for: on a loaded machine a raylet has a
    fixed 30 s to register with the GCS."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="nodisk-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    hidden = hidden_dirs(hide)
    kept = [str(Path(os.path.realpath(k))) for k in keep] + kept_image_dirs(hidden)
    for k in kept:
        Path(k).mkdir(parents=True, exist_ok=True)
    cluster.nodisk_hidden, cluster.nodisk_kept = hidden, kept
    before = len([x for x in __import__("ray").nodes() if x["Alive"]])
    for i in range(n):
        node = NoDiskNode(cluster.address, cpus, hidden, kept, log_dir / f"nodisk-{i}.log", env)
        cluster.nodisk_nodes.append(node)
        node.wait_started()
    wait_alive_nodes(before + n)
    return cluster.nodisk_nodes
