"""``elastic-ddp drain-node``: a Kubernetes pod eviction as a preemption notice.

    elastic-ddp drain-node --self --deadline 100     # a worker pod's preStop hook

Kubernetes ends a pod (a spot reclaim, ``kubectl drain``, a node upgrade, a
cluster-autoscaler scale-down) by running its ``preStop`` hook, then sending SIGTERM to
the container (``ray start --block``), then SIGKILL once ``terminationGracePeriodSeconds``
has passed since the hook started. Without a hook the SIGTERM takes the Ray node down at
once and the job sees a crash: the steps since the last checkpoint are recomputed and the
failure spends ``scaling.max_failures``.

This command, run as the hook inside the pod, drains the pod's own Ray node the way Ray's
autoscaler does before a preemption (``ray drain-node --reason
DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N``): Ray Train's preemption
path runs, every rank commits a checkpoint at the next step boundary and the group
restarts on the other nodes. The hook then waits until no training worker is left on the
node (or the deadline passes) and returns, so the SIGTERM that follows finds nothing to
lose. Give ``--deadline`` the grace period less a margin for Ray's own shutdown (the
shipped manifests: grace 120 s, deadline 100 s).

The node is found from the pod itself: the one raylet process in this container's mount
namespace; its command line carries the node id (``--node_id=``) and the GCS address
(``--gcs-address=``). A host with several Ray nodes in one mount namespace (a laptop's
local cluster) needs ``--node-id``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

from elastic_ddp.errors import EXIT_BAD_INPUT, ElasticDDPError

#: The process title of a Ray Train worker (Ray sets ``ray::<ActorClass>[.<method>]``).
TRAIN_WORKER_TITLE = "ray::RayTrainWorker"
#: Seconds ``ray drain-node`` may take to be accepted by the GCS.
DRAIN_REQUEST_TIMEOUT_S = 30.0
#: Seconds between looks at the node's processes while the hook waits.
POLL_S = 0.5


class DrainError(ElasticDDPError):
    """The node could not be found or its drain was not accepted (exit 2)."""

    exit_code = EXIT_BAD_INPUT
    kind = "drain-node"


@dataclass(frozen=True)
class RayNode:
    """A Ray node as its raylet process shows it."""

    node_id: str        # hex
    gcs_address: str    # host:port
    raylet_pid: int


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:  # gone, or not ours to read
        return []


def _mount_ns(pid: int | str) -> Optional[str]:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def _flag(argv: list[str], name: str) -> Optional[str]:
    prefix = f"{name}="
    return next((a[len(prefix):] for a in argv if a.startswith(prefix)), None)


def local_nodes() -> list[RayNode]:
    """The Ray nodes whose raylet runs in this process's mount namespace (a container's
    own: one in a pod), from ``/proc``. Costs one read of each process's command line."""
    mine = _mount_ns("self")
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        argv = _cmdline(int(entry))
        if not argv or not argv[0].endswith("/raylet") or _mount_ns(entry) != mine:
            continue
        node_id, gcs = _flag(argv, "--node_id"), _flag(argv, "--gcs-address")
        if node_id and gcs:
            out.append(RayNode(node_id, gcs, int(entry)))
    return sorted(out, key=lambda n: n.raylet_pid)


def find_node(node_id: Optional[str] = None) -> RayNode:
    """This container's Ray node, or the local node ``node_id`` (hex).

    Raises:
        DrainError: no raylet runs here, or several do and ``node_id`` names none of them.
    """
    nodes = local_nodes()
    if node_id is not None:
        hit = [n for n in nodes if n.node_id == node_id]
        if hit:
            return hit[0]
        raise DrainError(f"no Ray node {node_id} runs on this host (raylets here: "
                         f"{', '.join(n.node_id for n in nodes) or 'none'})")
    if not nodes:
        raise DrainError("no Ray node runs in this container (no raylet process in its mount "
                         "namespace): run the hook in the pod that runs `ray start`")
    if len(nodes) > 1:
        raise DrainError(f"{len(nodes)} Ray nodes run in this mount namespace "
                         f"({', '.join(n.node_id for n in nodes)}): name one with --node-id")
    return nodes[0]


def train_workers(node: RayNode) -> list[int]:
    """PIDs of the Ray Train workers the node's raylet started that are still alive."""
    from elastic_ddp.driver.local_ray import process_tree

    return [p for p in process_tree(node.raylet_pid)
            if (argv := _cmdline(p)) and argv[0].startswith(TRAIN_WORKER_TITLE)]


def request_drain(node: RayNode, deadline_at: float, reason: str) -> None:
    """Ask the GCS to drain ``node`` for a preemption at ``deadline_at`` (seconds since the
    epoch): the call of Ray's autoscaler and ``ray drain-node``, made from this process
    where the installed Ray is one it was tested on (``compat.ray_drain``), else through
    the ``ray drain-node`` command. Bounded by DRAIN_REQUEST_TIMEOUT_S.

    Raises:
        DrainError: the GCS refused the drain, did not answer in time, or ``ray`` is missing.
    """
    from elastic_ddp.compat.ray_drain import drain_in_process_supported, request_preemption_drain

    deadline_ms = int(deadline_at * 1000)
    if drain_in_process_supported():
        try:
            accepted, why = request_preemption_drain(node.gcs_address, node.node_id, reason,
                                                     deadline_ms, DRAIN_REQUEST_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - the GCS client's errors, named in the line
            raise DrainError(f"the GCS at {node.gcs_address} did not take the drain of node "
                             f"{node.node_id}: {type(e).__name__}: {e}") from None
        if not accepted:
            raise DrainError(f"the drain of node {node.node_id} was not accepted by the GCS at "
                             f"{node.gcs_address}: {why}")
        return
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    left_s = max(1, int(round(deadline_at - time.time())))
    cmd = [ray_cli if os.path.exists(ray_cli) else "ray", "drain-node", "--address", node.gcs_address,
           "--node-id", node.node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
           "--reason-message", reason, "--deadline-remaining-seconds", str(left_s)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=DRAIN_REQUEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise DrainError(f"the GCS at {node.gcs_address} did not answer the drain of node "
                         f"{node.node_id} in {DRAIN_REQUEST_TIMEOUT_S:.0f} s") from None
    except FileNotFoundError:
        raise DrainError("the `ray` command is not on PATH in this container") from None
    if out.returncode != 0:
        said = (out.stderr or out.stdout).strip().splitlines()
        raise DrainError(f"the drain of node {node.node_id} was not accepted by the GCS at "
                         f"{node.gcs_address}: {said[-1] if said else f'exit {out.returncode}'}")


def drain(deadline_s: int, node_id: Optional[str] = None, wait: bool = True,
          log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
          reason: str = "Kubernetes pod eviction (preStop hook)") -> dict:
    """Drain this container's Ray node (or ``node_id``) with a ``deadline_s`` notice and,
    with ``wait``, return once no Ray Train worker is left on it or the deadline passed.

    Returns:
        ``{"node_id", "drained_s", "workers_left"}``: seconds from the request to the
        node's last training worker's exit (or to the deadline), and how many remained.

    Raises:
        DrainError: see :func:`find_node` and :func:`request_drain`; ``deadline_s`` < 1.
    """
    if deadline_s < 1:
        raise DrainError(f"--deadline must be at least 1 second, got {deadline_s}")
    # The deadline counts from the hook's start, as the kubelet's grace period does: a slow
    # request takes from the notice, never past the SIGKILL.
    t0, deadline_at = time.monotonic(), time.time() + deadline_s
    node = find_node(node_id)
    request_drain(node, deadline_at, reason)
    log(f"elastic-ddp drain-node: node {node.node_id} draining (preemption in {deadline_s} s; "
        f"the GCS accepted it in {time.monotonic() - t0:.1f} s)")
    left = train_workers(node)
    while wait and left and time.monotonic() - t0 < deadline_s:
        time.sleep(POLL_S)
        left = train_workers(node)
    took = time.monotonic() - t0
    if left and wait:
        log(f"elastic-ddp drain-node: deadline reached with {len(left)} training worker(s) "
            f"still on node {node.node_id}")
    elif wait:
        log(f"elastic-ddp drain-node: no training worker left on node {node.node_id} "
            f"after {took:.1f} s")
    return {"node_id": node.node_id, "drained_s": round(took, 3), "workers_left": len(left)}
