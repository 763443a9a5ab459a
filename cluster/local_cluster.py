#!/usr/bin/env python3
"""A real multi-node Ray cluster on one machine: a head node plus K worker nodes,
each its own ``ray start`` with its own CPU count, so elastic training can be watched
growing (``add``) and shrinking (``remove``) without a cloud account.

    python cluster/local_cluster.py start 2 1        # head + 2 worker nodes of 1 CPU
    eval "$(python cluster/local_cluster.py env)"     # job API address + auth token path
    elastic-ddp submit experiments/configs/digits_cnn.yaml --wait
    python cluster/local_cluster.py add 1             # one more 1-CPU node
    python cluster/local_cluster.py remove            # kill the newest worker node
    python cluster/local_cluster.py status
    python cluster/local_cluster.py stop

Why not ``ray stop``: it kills *every* Ray process on the machine, including the
clusters of other people sharing it. Instead each node is started as
``ray start --block`` in a new session (``start_new_session``); ``ray start --block``
makes itself the process-group leader and its Ray processes (GCS, raylet, dashboard,
workers) stay in that group and carry kill-on-parent-death. Stopping a node signals
exactly that process group (SIGTERM, then SIGKILL after a grace period), and nothing
else. The pids live in ``state.json`` in the cluster directory.

Security defaults:

* every listener of every node is on 127.0.0.1. Ray binds its gRPC servers (GCS,
  raylet, workers), agents and metrics servers to loopback only when the node's IP is
  exactly 127.0.0.1, but ``ray start`` replaces 127.0.0.1 (as ``--node-ip-address``
  and in ``--address``) by the host's address, except in its single-machine mode
  (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``), which in turn refuses to start a worker
  node. So each node runs ``ray start`` through ``ray_start_on_loopback`` (this file's
  ``_ray_start`` command): its node processes get the single-machine mode (every
  process that connects, job drivers included, keeps 127.0.0.1), while the ``ray
  start`` process itself keeps the multi-node mode and leaves 127.0.0.1 as given.
  ``listeners_outside_loopback`` (and ``tests/e2e/cli/test_job_submit.py``) check the result;
* no fixed port: the GCS, dashboard, Ray client server, dashboard agent and the
  autoscaler/dashboard metrics ports are chosen free at start, the others are left to
  Ray (0: the OS picks one when binding), so several clusters can share a machine;
* token authentication is ON (``RAY_AUTH_MODE=token``) with a fresh random token per
  cluster in ``<dir>/auth_token`` (created with O_EXCL|O_NOFOLLOW, mode 0600), handed to
  every ``ray start`` through ``RAY_AUTH_TOKEN_PATH``; clients (``ray job submit``,
  ``elastic-ddp submit``) find it through the same variable (see ``env``);
* the cluster directory (default ``$TMPDIR/elastic-ddp-cluster-<uid>``, a predictable
  name in a shared directory) is created mode 0700 and refused (exit 2) when it is a
  symlink or belongs to another user. That is what keeps other users out of everything
  below it: Ray makes each directory it creates mode 777, the node temp dirs included;
  ``start``/``add`` put those back to 0700, but Ray opens them again whenever a driver
  or worker process starts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from elastic_ddp.driver.local_ray import (PrivateDirError, check_private_dir, free_port,  # noqa: E402
                                   listeners_outside_loopback, process_tree,
                                   ray_start_on_loopback, write_token)

HOST = "127.0.0.1"
DEFAULT_DIR = Path(tempfile.gettempdir()) / f"elastic-ddp-cluster-{os.getuid()}"
# ray's unix-socket paths live under the temp dir and must stay under ~107 bytes.
MAX_DIR_LEN = 60


class UsageError(ValueError):
    """A request this cluster cannot carry out as given; the message says what to do."""


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
            return True
        except OSError:
            return False


class LocalCluster:
    """Head + worker nodes of one local cluster; state in ``<dir>/state.json``."""

    def __init__(self, directory: str | os.PathLike = DEFAULT_DIR):
        # abspath, not resolve(): a symlinked cluster dir must be seen, not followed.
        self.dir = Path(os.path.abspath(directory))
        if len(str(self.dir)) > MAX_DIR_LEN:
            raise UsageError(f"cluster dir {self.dir} is too long for Ray's socket paths; "
                             f"use one under {MAX_DIR_LEN} characters (e.g. /tmp/edc-x)")
        check_private_dir(self.dir)
        self.state_file = self.dir / "state.json"
        self.token_file = self.dir / "auth_token"

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        if not self.state_file.exists():
            return {}
        return json.loads(self.state_file.read_text())

    def _save(self, st: dict[str, Any]) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(st, indent=1))
        os.replace(tmp, self.state_file)

    def env(self) -> dict[str, str]:
        """Environment a ``ray start`` or a client of this cluster needs: token auth on,
        the token by path (its value never appears on a command line or in a log)."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_file)}

    @property
    def dashboard_url(self) -> str:
        return f"http://{HOST}:{self.state()['dashboard_port']}"

    @property
    def gcs_address(self) -> str:
        return f"{HOST}:{self.state()['port']}"

    # ------------------------------------------------------------------ nodes
    def node_command(self, name: str, args: list[str]) -> list[str]:
        """The ``ray start`` command line of one node: its own temp dir, a free
        dashboard-agent port (Ray's fixed default 52365 would collide between nodes on
        one machine) and port 0 (the OS picks a free one at bind time) for the raylet's
        node and object managers, the metrics exporter and the agents' gRPC and runtime
        env ports. The node IP is set by ``head_args`` / ``node_env``."""
        return [sys.executable, str(Path(__file__).resolve()), "_ray_start", "--block",
                "--disable-usage-stats", "--node-ip-address", HOST,
                "--temp-dir", str(self.dir / name),
                "--dashboard-agent-listen-port", str(free_port()),
                "--dashboard-agent-grpc-port", "0", "--runtime-env-agent-port", "0",
                "--node-manager-port", "0", "--object-manager-port", "0",
                "--metrics-export-port", "0", *args]

    @staticmethod
    def head_args(port: int, dashboard_port: int, head_cpus: int, object_store_mb: int,
                  client_port: Optional[int] = None) -> list[str]:
        """Head-only flags: node IP 127.0.0.1, the dashboard / job API bound to 127.0.0.1
        only, the Ray client server on a free port (Ray's default 10001 is fixed)."""
        return ["--head", "--port", str(port),
                "--ray-client-server-port", str(client_port or free_port()),
                "--num-cpus", str(head_cpus),
                "--include-dashboard", "true", "--dashboard-host", HOST,
                "--dashboard-port", str(dashboard_port),
                "--object-store-memory", str(object_store_mb * 1024 * 1024)]

    @staticmethod
    def node_env(head: bool) -> dict[str, str]:
        """The head's autoscaler and dashboard metrics servers on free ports (fixed
        44217/44227 by default; they bind to 127.0.0.1 with the node IP)."""
        if not head:
            return {}
        return {"AUTOSCALER_METRIC_PORT": str(free_port()), "DASHBOARD_METRIC_PORT": str(free_port())}

    def _spawn(self, name: str, args: list[str], attempts: int = 3) -> dict[str, Any]:
        """Start one node, retrying: ``ray start`` gives a raylet a fixed 30 s to
        register with the GCS and exits when a loaded machine takes longer."""
        for attempt in range(1, attempts + 1):
            try:
                return self._spawn_once(name, args)
            except RuntimeError as e:
                if attempt == attempts:
                    raise
                print(f"local_cluster: node {name} failed to start (attempt {attempt}), "
                      f"retrying: {str(e).splitlines()[0]}", file=sys.stderr)
        raise AssertionError("unreachable")

    def _spawn_once(self, name: str, args: list[str]) -> dict[str, Any]:
        """Start one ``ray start --block`` in its own session; wait until it is up."""
        log = self.dir / f"{name}.log"
        env = {**os.environ, **self.env(), **self.node_env(name == "head")}
        # Job entrypoints run `python ...` through the head node's PATH: make that this
        # interpreter (the project's venv), as a cluster image's python would be.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        # Processes that find their cluster by address="auto" (Ray Train's placement
        # group cleaner uses the state API that way) pick the *latest* Ray instance on
        # the machine, which may be someone else's; pin them to this cluster's GCS.
        # (`ray start` itself never reads RAY_ADDRESS.)
        env["RAY_ADDRESS"] = self.gcs_address
        cmd = self.node_command(name, args)
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 180
        while time.time() < deadline:
            if proc.poll() is not None:
                _kill_group(proc.pid, grace_s=2)  # anything it left behind
                raise RuntimeError(f"node {name} exited with {proc.returncode} while starting; "
                                   f"log {log}:\n{log.read_text()[-3000:]}")
            # `ray start` prints this once every process of the node is up.
            if "Ray runtime started" in log.read_text(errors="replace"):
                self._narrow_temp_dir(self.dir / name)
                return {"name": name, "pid": proc.pid, "cpus": None, "log": str(log)}
            time.sleep(0.5)
        _kill_group(proc.pid)
        raise RuntimeError(f"node {name} did not start within 180 s; log {log}")

    def start(self, workers: int, cpus: float, head_cpus: int = 0, port: Optional[int] = None,
              dashboard_port: Optional[int] = None, object_store_mb: int = 256) -> dict:
        """Start the head (job API on ``dashboard_port``) and ``workers`` worker nodes of
        ``cpus`` CPUs each. The head gets ``head_cpus`` (default 0: like a real cluster,
        it only runs the job driver and the Train controller, which need no CPU)."""
        if self.state().get("nodes"):
            raise UsageError(f"a cluster is already recorded in {self.state_file}; "
                             "run `stop` first")
        if dashboard_port and not _port_free(dashboard_port):
            raise UsageError(f"port {dashboard_port} is taken (another Ray dashboard?); "
                             "pass --dashboard-port 0 for a free one")
        check_private_dir(self.dir, create=True)
        write_token(self.token_file)
        st = {"port": port or free_port(), "dashboard_port": dashboard_port or free_port(),
              "object_store_mb": object_store_mb, "nodes": [], "next_id": 1}
        self._save(st)
        head = self._spawn("head", self.head_args(st["port"], st["dashboard_port"], head_cpus,
                                                  object_store_mb))
        head["cpus"] = head_cpus
        st["nodes"].append(head)
        self._save(st)
        try:
            self._wait_job_api()
            for _ in range(workers):
                self.add(cpus)
        except BaseException:
            self.stop()  # never leave half a cluster behind
            raise
        return self.state()

    def add(self, cpus: float) -> dict:
        """Join one more worker node of ``cpus`` CPUs to the running cluster."""
        st = self.state()
        if not st.get("nodes"):
            raise UsageError("no cluster running here; `start` one first")
        name = f"worker{st['next_id']}"
        st["next_id"] += 1
        self._save(st)
        node = self._spawn(name, [
            "--address", self.gcs_address, "--num-cpus", str(int(cpus)),
            "--object-store-memory", str(st["object_store_mb"] * 1024 * 1024),
        ])
        node["cpus"] = cpus
        st = self.state()
        st["nodes"].append(node)
        self._save(st)
        return node

    def remove(self, name: Optional[str] = None, grace_s: float = 10.0) -> dict:
        """Kill one worker node (the newest unless ``name``): an abrupt node loss, as
        when a spot instance is reclaimed."""
        st = self.state()
        workers = [n for n in st.get("nodes", []) if n["name"] != "head"]
        if not workers:
            raise UsageError("no worker node to remove")
        node = next((n for n in workers if n["name"] == name), None) if name else workers[-1]
        if node is None:
            raise UsageError(f"no worker node named {name!r}; have {[n['name'] for n in workers]}")
        _kill_group(node["pid"], grace_s)
        st["nodes"] = [n for n in st["nodes"] if n["name"] != node["name"]]
        self._save(st)
        return node

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every node of this cluster (workers first), and only those processes."""
        st = self.state()
        for node in reversed(st.get("nodes", [])):
            _kill_group(node["pid"], grace_s)
        if st:
            st["nodes"] = []
            self._save(st)

    # ------------------------------------------------------------------ checks
    def _wait_job_api(self, timeout: float = 180) -> None:
        """Wait until the job API answers an authenticated request (with token auth on,
        even /api/version answers 401 without the token)."""
        req = urllib.request.Request(
            f"{self.dashboard_url}/api/version",
            headers={"Authorization": f"Bearer {self.token_file.read_text().strip()}"})
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"job API at {self.dashboard_url} did not answer in {timeout} s")

    def alive(self) -> list[str]:
        """Names of recorded nodes whose process group still exists."""
        return [n["name"] for n in self.state().get("nodes", []) if _group_alive(n["pid"])]

    def pids(self) -> list[int]:
        """Every process of this cluster's nodes (each ``ray start`` and its descendants)."""
        return [p for n in self.state().get("nodes", []) for p in process_tree(n["pid"])]

    def listeners_outside_loopback(self) -> list[str]:
        """TCP listeners of this cluster's processes on anything but 127.0.0.0/8 or ::1
        (``[]`` is what ``start`` promises)."""
        return listeners_outside_loopback(self.pids())

    @staticmethod
    def _narrow_temp_dir(node_dir: Path) -> None:
        """Ray makes every directory it creates mode 777 ("so others can use it"); put
        the node's temp dir and its session dirs back to 0700. Files below them stay out
        of reach anyway: the cluster dir above them is 0700."""
        for d in [node_dir, *node_dir.glob("session_*")]:
            if d.is_dir() and not d.is_symlink():
                os.chmod(d, 0o700)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):  # gone, or the id was reused
        return False


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _kill_group(pgid: int, grace_s: float = 10.0) -> None:
    """SIGTERM the node's process group and every descendant of its ``ray start``
    (Ray's processes exit cleanly on it), then SIGKILL whatever is left after
    ``grace_s``. Only processes started by this node are ever signalled: the pids are
    collected once, before any is signalled, so a reused pid is never hit later. (Ray's
    worker processes put themselves in process groups of their own, so signalling the
    node's group alone would leave them to exit on their own; the process tree finds
    exactly them.)"""
    procs = process_tree(pgid)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        for p in procs:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait
        while time.time() < deadline:
            try:  # reap it if it is our child, so it does not linger as a zombie
                os.waitpid(pgid, os.WNOHANG)
            except ChildProcessError:
                pass
            procs = [p for p in procs if _running(p)]
            if not procs and not _group_alive(pgid):
                return
            time.sleep(0.2)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_ray_start"]:  # a node's process, started by LocalCluster._spawn
        return ray_start_on_loopback(argv[1:])
    try:
        return _main(argv)
    except (UsageError, PrivateDirError) as e:  # bad input: exit 2, nothing started
        print(f"local_cluster: {e}", file=sys.stderr)
        return 2


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="local_cluster", description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=os.environ.get("ELASTIC_DDP_CLUSTER_DIR", str(DEFAULT_DIR)),
                   help="cluster state, token and node temp dirs (default %(default)s; "
                        "$ELASTIC_DDP_CLUSTER_DIR)")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="head + K worker nodes")
    s.add_argument("workers", type=int, help="worker nodes to start (K)")
    s.add_argument("cpus", type=int, help="CPUs per worker node")
    s.add_argument("--head-cpus", type=int, default=0)
    s.add_argument("--port", type=int, default=None, help="GCS port (default: a free one)")
    s.add_argument("--dashboard-port", type=int, default=8265, help="job API / dashboard port")
    s.add_argument("--object-store-mb", type=int, default=256)
    a = sub.add_parser("add", help="one more worker node")
    a.add_argument("cpus", type=int, nargs="?", default=1)
    r = sub.add_parser("remove", help="kill a worker node (the newest by default)")
    r.add_argument("name", nargs="?", default=None)
    sub.add_parser("stop", help="stop every node of this cluster (never `ray stop`)")
    sub.add_parser("status", help="nodes, addresses and liveness as JSON")
    sub.add_parser("env", help="shell exports for clients: eval \"$(... env)\"")
    args = p.parse_args(argv)
    c = LocalCluster(args.dir)
    if args.cmd == "start":
        c.start(args.workers, args.cpus, args.head_cpus, args.port, args.dashboard_port,
                args.object_store_mb)
        print(f"cluster up: job API {c.dashboard_url}, GCS {c.gcs_address}, nodes {c.alive()}")
        print(f'clients: eval "$(python {sys.argv[0]} --dir {c.dir} env)"')
    elif args.cmd == "add":
        print(json.dumps(c.add(args.cpus)))
    elif args.cmd == "remove":
        print(json.dumps(c.remove(args.name)))
    elif args.cmd == "stop":
        c.stop()
        print("stopped")
    elif args.cmd == "status":
        st = c.state()
        print(json.dumps({**st, "alive": c.alive(),
                          "job_api": c.dashboard_url if st else None}, indent=1))
    elif args.cmd == "env":
        if not c.state().get("nodes"):
            raise UsageError(f"no cluster in {c.dir}")
        for k, v in {**c.env(), "RAY_API_SERVER_ADDRESS": c.dashboard_url}.items():
            print(f"export {k}={v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
