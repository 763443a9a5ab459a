"""Faults on a local multi-node Ray cluster, shared by the experiments that inject them
(``chaos.py``, ``bench_recovery.py``, ``soak.py``): the cluster itself, this cluster's
training worker processes, and the faults a cloud or Kubernetes delivers (a node drained
with a deadline, a node lost, a process killed).

Everything here acts on this machine's processes and this cluster's GCS only; Linux
(``/proc``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator, Optional

NODE_MEMORY = 100 * 2**20  # object store of each node: the jobs pass no large objects


def children(pid: int, recursive: bool = True) -> list[int]:
    """The child pids of ``pid`` (``recursive``: all its descendants), from /proc."""
    kids: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(p.name))
    if not recursive:
        return kids.get(pid, [])
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    """The command line of ``pid`` ('' when it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def train_workers() -> list[dict]:
    """The live Ray Train worker processes of the cluster this driver is connected to:
    ``[{"pid", "node_id"}]``, from the GCS actor table (no dashboard needed), each pid
    checked to still be a Ray worker process (its title starts with ``ray::``)."""
    import ray._private.state as state

    out = []
    for info in state.actors(actor_state_name="ALIVE").values():
        if info["ActorClassName"] == "RayTrainWorker" and info["Pid"]:
            if cmdline(int(info["Pid"])).startswith("ray::"):
                out.append({"pid": int(info["Pid"]), "node_id": info["Address"]["NodeID"]})
    return out


def train_worker_pids(cluster) -> list[int]:
    """PIDs of ``ray::RayTrainWorker`` processes under ``cluster``'s worker raylets (never
    another cluster's, even without a driver connected)."""
    from ray._private import ray_constants

    pids = []
    for node in list(cluster.worker_nodes):
        for info in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, []):
            pids += [c for c in children(info.process.pid)
                     if cmdline(c).startswith("ray::RayTrainWorker")]
    return pids


def add_node(cluster, tries: int = 3, **kw):
    """``cluster.add_node`` with retries: Ray gives a raylet 30 s to register with the
    GCS, which a machine shared by several Ray clusters does not always meet. Call it
    from the main thread (Ray's ``Node`` installs a SIGTERM handler)."""
    kw.setdefault("object_store_memory", NODE_MEMORY)
    for i in range(tries):
        try:
            return cluster.add_node(**kw)
        except Exception:  # noqa: BLE001 - "timed out during startup"; retried
            if i == tries - 1:
                raise
            time.sleep(2)


@contextlib.contextmanager
def local_cluster(nodes: int, node_cpus: int, head_cpus: int = 1, ray_metrics: bool = False,
                  shared_disk: bool = True, hide: Iterable[str | Path] = (),
                  keep: Iterable[str | Path] = (), node_env: Optional[dict[str, str]] = None,
                  log_dir: Optional[Path] = None, **init) -> Iterator:
    """A ``ray.cluster_utils.Cluster``: a head with ``head_cpus`` logical CPUs (the
    driver's tasks, the Ray Train controller) and ``nodes`` worker nodes of ``node_cpus``,
    this driver connected to it (``init``: more ``ray.init`` arguments); shut down on
    exit. Logical CPUs: what Ray schedules by, not cores the processes are bound to.

    ``shared_disk=False``: the worker nodes share no disk with the driver
    (``experiments/nodisk.py``: each in a mount namespace of its own, a tmpfs over
    ``/tmp``, the temp dirs, ``$HOME`` and ``hide``; ``keep``: diagnostics dirs they see
    anyway). Root only. They are listed in ``cluster.nodisk_nodes`` (not in
    ``cluster.worker_nodes``); ``node_env`` is added to their environment and the
    head's (the object store's endpoint and credentials: Ray Train's controller on the
    head opens the run's storage too), their logs go to ``log_dir`` (default: a temp
    dir). Give the head ``head_cpus=0`` so that no training worker lands on it.

    ``ray_metrics``: Ray's own metrics collection (off by default). Why off: while a
    placement-group bundle of a removed node cannot be placed again (a per-step job that
    lost a node and has no spare one), Ray's GCS retries it without backoff, a busy loop
    of one core until a node joins (ray-project/ray#18651, #65007), and with metrics on
    the head's metrics agent ingests the loop's scheduling metrics on a second core. On
    a real cluster both run on the head; here every node shares the same cores with the
    training workers, which Ray runs at niceness 15 (below the GCS and the agent), and a
    replacement worker's start took minutes instead of seconds."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster()
    cluster.nodisk_nodes = []
    try:
        with _environ(node_env or {}):  # the head's processes inherit it
            add_node(cluster, num_cpus=head_cpus, include_dashboard=False,
                     **({} if ray_metrics else {"_system_config": {"enable_metrics_collection": False}}))
        if shared_disk:
            for _ in range(nodes):
                add_node(cluster, num_cpus=node_cpus)
            cluster.wait_for_nodes()
        ray.init(address=cluster.address, **{"logging_level": "WARNING", **init})
        if not shared_disk:
            _nodisk().start_nodes(cluster, nodes, node_cpus, hide, keep, node_env, log_dir)
        yield cluster
    finally:
        end_running_jobs()
        ray.shutdown()
        for node in getattr(cluster, "nodisk_nodes", []):
            node.stop()
        cluster.shutdown()


def _in_train(frame) -> bool:
    """Whether ``frame``'s stack runs ``elastic_ddp.train`` (the driver's job)."""
    end = os.path.join("elastic_ddp", "driver", "launcher.py")
    while frame is not None:
        if frame.f_code.co_name == "train" and frame.f_code.co_filename.endswith(end):
            return True
        frame = frame.f_back
    return False


def end_running_jobs(timeout_s: float = 120.0) -> list[str]:
    """Before this driver disconnects from its cluster (``ray.shutdown()``): a job still
    running in another thread of this process (``elastic_ddp.train`` on its stack: a test
    that failed while its job ran on, an experiment stopped by Ctrl-C) is ended by
    SIGKILL to the processes of the cluster's live actors (its controller, workers and
    tracker: the job's ``fit`` then fails and ``train`` returns), and waited for up to
    ``timeout_s`` in all. Returns the names of the job threads still alive after that.

    Why: Ray can end the whole process, exit status 1, when a thread reaches it after
    ``ray.shutdown()`` ("The core worker has already been shutdown ... The process will
    exit"; whether it does depends on where the thread is inside Ray): one failed test
    with its job thread left running stopped a test session there, without its summary.
    Costs nothing when no job runs."""
    import threading

    frames = sys._current_frames()
    me = threading.current_thread()
    jobs = [t for t in threading.enumerate() if t is not me and _in_train(frames.get(t.ident))]
    if not jobs:
        return []
    try:
        import ray._private.state as state

        actors = state.actors(actor_state_name="ALIVE").values()
    except Exception:  # noqa: BLE001 - no GCS to ask: the jobs end with it anyway
        actors = []
    _kill([int(a["Pid"]) for a in actors if a.get("Pid") and cmdline(int(a["Pid"])).startswith("ray::")])
    deadline = time.time() + timeout_s
    for t in jobs:
        t.join(max(0.0, deadline - time.time()))
    left = [t.name for t in jobs if t.is_alive()]
    print(f"[cluster_faults] {len(jobs)} job thread(s) still running at the cluster's shutdown: their "
          f"actors killed; {len(left)} still alive after that", file=sys.stderr, flush=True)
    return left


@contextlib.contextmanager
def _environ(extra: dict[str, str]):
    """``extra`` in ``os.environ`` for the block (what a process started in it inherits),
    the previous values back afterwards."""
    import os

    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _nodisk():
    """``nodisk.py`` beside this file (the experiments directory is not a package)."""
    import importlib.util
    import sys

    if "nodisk" not in sys.modules:
        spec = importlib.util.spec_from_file_location("nodisk", Path(__file__).with_name("nodisk.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["nodisk"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["nodisk"]


class Pod:
    """A worker node as a Kubernetes pod's container runs it: ``ray start --block`` in a
    mount namespace of its own (root only; ``nodisk.NoDiskNode`` with nothing hidden, so
    the disk stays shared), so that the preStop hook run inside it finds this node's
    raylet and no other. :meth:`evict` ends it as the kubelet ends a deleted pod.

    ``grace_s``: the pod's ``terminationGracePeriodSeconds``; ``deadline_s``: the hook's
    ``--deadline`` (the grace less a margin for Ray's own shutdown; the shipped
    manifests: 120 and 100). Ray's own drain on SIGTERM
    (``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S``) gets ``deadline_s`` too, as the manifests
    set it. ``node_id``: the raylet's (hex), read from its command line.

    Raises (from the constructor):
        RuntimeError: the node did not start (its log's tail).
    """

    def __init__(self, address: str, cpus: int, log: Path, grace_s: float = 45.0,
                 deadline_s: float = 35.0, env: Optional[dict[str, str]] = None):
        self.grace_s, self.deadline_s = grace_s, deadline_s
        env = {**(env or {}), "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": str(int(deadline_s))}
        self.node = _nodisk().NoDiskNode(address, cpus, [], [], Path(log), env)
        try:
            self.node.wait_started()
            self.node_id = self._raylet_node_id(timeout=60)
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int:
        """The container's main process: ``ray start`` (``unshare`` and ``sh`` exec it)."""
        return self.node.pid

    def _raylet_node_id(self, timeout: float) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for p in children(self.pid):
                argv = cmdline(p).split(" ")
                if argv and argv[0].endswith("/raylet"):
                    ids = [a[len("--node_id="):] for a in argv if a.startswith("--node_id=")]
                    if ids:
                        return ids[0]
            time.sleep(0.3)
        raise RuntimeError(f"no raylet under the pod's ray start (pid {self.pid}) in {timeout} s; "
                           f"log {self.node.log}")

    def evict(self, hook: bool = True) -> dict:
        """The kubelet's deletion of this pod: the preStop hook ``elastic-ddp drain-node
        --self --deadline <deadline_s>`` run inside the pod (``nsenter --mount``; skipped
        with ``hook=False``), then SIGTERM to ``ray start``, then SIGKILL to every process
        of the pod still there when ``grace_s`` have passed since the hook started (the
        container's cgroup is killed as a whole). Returns ``{"hook_rc", "hook_out",
        "hook_s", "exited_s"}`` (seconds from the start of the eviction; ``exited_s``:
        when ``ray start`` had exited, None when the SIGKILL ended it)."""
        t0 = time.monotonic()
        out: dict = {"hook_rc": None, "hook_out": "", "hook_s": None, "exited_s": None}
        if hook:
            try:
                r = subprocess.run(["nsenter", f"--target={self.pid}", "--mount", "--",
                                    str(Path(sys.executable).parent / "elastic-ddp"), "drain-node",
                                    "--self", "--deadline", str(int(self.deadline_s))],
                                   capture_output=True, text=True, timeout=self.grace_s)
                out.update(hook_rc=r.returncode, hook_out=(r.stdout + r.stderr)[-2000:])
            except subprocess.TimeoutExpired:
                out.update(hook_rc="timeout")
            out["hook_s"] = time.monotonic() - t0
        tree = [self.pid, *children(self.pid)]  # collected before any signal: no reused pid
        try:
            os.kill(self.pid, signal.SIGTERM)
            self.node.proc.wait(timeout=max(0.0, self.grace_s - (time.monotonic() - t0)))
            out["exited_s"] = time.monotonic() - t0
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        _kill(tree)
        self.node.proc.wait(timeout=30)
        return out

    def kill(self) -> None:
        """SIGKILL every process of the pod at once: a node lost without notice."""
        _kill([self.pid, *children(self.pid)])
        self.node.proc.wait(timeout=30)


def _kill(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def drain_node(address: str, node_id: str, deadline_s: float,
               message: str = "spot reclaim (experiment)") -> None:
    """Drain ``node_id`` as a preemption with ``deadline_s`` seconds of notice: the GCS
    call ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
    --deadline-remaining-seconds N`` makes (and the autoscaler, and KubeRay), from this
    process. The node stays up; removing it when the deadline passes is the caller's.

    Raises:
        RuntimeError: the GCS refused the drain."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=address)
    accepted, why = gcs.drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"), message,
        int(time.time() * 1000 + deadline_s * 1000))
    if not accepted:
        raise RuntimeError(f"the drain of node {node_id} was refused: {why}")
