"""MLflow system metrics of every Ray node that hosts training workers.

The driver's helper process (:mod:`elastic_ddp.tracking.opener`) samples the driver's
machine only (``system/<metric>``). A worker node may not reach the MLflow store (a
sqlite file on the driver's disk; a cluster with no shared disk), so each node is
sampled by one of its own training workers and the samples travel through the job's
tracker actor, as every other worker metric does:

- worker side, :class:`NodeSampler`: a daemon thread in every worker; the one that holds
  the node's lock file (:func:`node_lock`) collects MLflow's own monitors
  (``CPUMonitor``, ``DiskMonitor``, ``NetworkMonitor``, and ``GPUMonitor``/``ROCMMonitor``
  where NVML/ROCm answers) every :func:`interval_s` seconds and sends the averages to the
  tracker; the others retry the lock once an interval (one system call), so a node whose
  sampling worker dies is taken over by another of its workers (per-step mode replaces
  one replica alone). A lock rather than Ray Train's local rank: that rank counts workers
  per node IP (and per replica group in per-step mode), so nodes that share an IP (a
  local cluster, pods behind one host address) would have one sampler in all;
- tracker side, :class:`NodeSeries`: logs them as ``system/<node>/<metric>`` (MLflow's
  own naming for ``SystemMetricsMonitor(node_id=...)``) with a step counter per node
  that the tracker keeps across worker-group restarts and, after a resubmission,
  continues from the run's last step of that node.

``<node>`` is :func:`short_node_id`. The tracker also keeps one sender per node (the
first; another takes over when it has been silent for three intervals), should two
workers of one node both hold a lock (a lock file removed under them).

What it costs: the sampling worker imports MLflow (its package imports pandas and the
tracking client: about a second of one core on an idle machine, several on a loaded
one), once per worker-group start per node, in the sampler thread after its first
interval, so not during the worker's own start-up; then a few psutil calls and one actor
call per interval. The lock file (empty) stays in the node's temp directory.
Sampling never fails or slows training: any error stops that node's sampler after one
warning line in the worker's log.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Optional

# Senders silent for this many intervals lose their node to another sender.
STALE_INTERVALS = 3


def short_node_id(node_id: str) -> str:
    """The name of a Ray node in metric keys: the first 8 hex characters of its Ray node
    id (``ray list nodes`` and the events' ``node_ids`` show the full id, which starts
    with these). Not the IP: on a local cluster, or pods behind one host, several nodes
    share one; and a 56-character id would crowd every chart title."""
    return str(node_id)[:8]


def interval_s() -> float:
    """Seconds between samples: ``$MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` (MLflow's own
    knob, also read by the driver's monitor), else ``store.SYSTEM_METRICS_INTERVAL_S``."""
    from elastic_ddp.tracking.store import SYSTEM_METRICS_INTERVAL_S

    try:
        v = float(os.environ.get("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL") or SYSTEM_METRICS_INTERVAL_S)
        return v if v > 0 else SYSTEM_METRICS_INTERVAL_S
    except ValueError:
        return SYSTEM_METRICS_INTERVAL_S


def node_lock(node_id: str, key: str):
    """This node's sampler lock for job ``key`` (its run name), taken without waiting:
    the open file that holds it (the lock ends with the process), or None when another
    process of the node holds it. In the node's temp directory, which only its own
    processes see (a local cluster's nodes share it: the node id tells them apart)."""
    import fcntl
    import tempfile

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)[:80]
    f = open(os.path.join(tempfile.gettempdir(), f"elastic-ddp-sysmon-{safe}-{node_id[:16]}.lock"), "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return f
    except OSError:
        f.close()
        return None


def mlflow_monitors() -> list:
    """MLflow's monitor objects for this machine: CPU and memory, disk, network, and the
    GPU's where NVML (NVIDIA) or ROCm (AMD) is present."""
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

    monitors = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
    try:
        from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

        monitors.append(GPUMonitor())  # raises without nvidia-ml-py or without a GPU
    except Exception:  # noqa: BLE001 - no NVIDIA GPU here
        try:
            from mlflow.system_metrics.metrics.rocm_monitor import ROCMMonitor

            monitors.append(ROCMMonitor())
        except Exception:  # noqa: BLE001 - no GPU at all: CPU, disk and network only
            pass
    return monitors


def sample(monitors: list) -> dict[str, float]:
    """One sample of every monitor (``{metric: value}``, MLflow's names), their buffers
    cleared."""
    out: dict[str, float] = {}
    for m in monitors:
        m.collect_metrics()
        out.update({k: float(v) for k, v in m.aggregate_metrics().items()})
        m.clear_metrics()
    return out


class NodeSampler:
    """The daemon thread of one worker: once it holds the node's lock (:func:`node_lock`,
    job ``key``), it samples the node and sends to the tracker actor
    (``actor.node_metrics.remote``) every ``interval`` seconds until :meth:`stop` or the
    process ends. ``node_id``: this node's full Ray node id; ``ip``: its address."""

    def __init__(self, actor, node_id: str, ip: str = "", interval: Optional[float] = None,
                 key: str = "job"):
        self.actor, self.node_id, self.ip, self.key = actor, node_id, ip, key
        self.node = short_node_id(node_id)
        self.interval = interval or interval_s()
        self.sender = f"{ip}:{os.getpid()}"
        self.sent = 0
        self.lock = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="node-system-metrics", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        try:
            # The first wait: not during the worker's own start-up.
            while self.lock is None:
                if self._stop.wait(self.interval):
                    return
                self.lock = node_lock(self.node_id, self.key)
            monitors = mlflow_monitors()
            sample(monitors)  # the CPU % baseline: psutil measures since its last call
            while not self._stop.wait(self.interval):
                self.actor.node_metrics.remote(self.node, self.sender, sample(monitors), time.time(),
                                               self.interval, {"ip": self.ip, "node_id": self.node_id})
                self.sent += 1
        except Exception as e:  # noqa: BLE001 - monitoring never stops training
            sys.stdout.write(f"elastic-ddp: warning: system metrics of node {self.node} stopped "
                             f"({type(e).__name__}: {str(e)[:200]})\n")
            sys.stdout.flush()
        finally:
            if self.lock is not None:
                self.lock.close()  # another worker of the node may take over


def start_node_sampler(actor, key: str) -> Optional[NodeSampler]:
    """A :class:`NodeSampler` in this Ray worker for job ``key`` (its run name); None
    without a tracker, outside Ray, or when it cannot start."""
    try:
        if actor is None:
            return None
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        return NodeSampler(actor, node_id, ray.util.get_node_ip_address(), key=key)
    except Exception as e:  # noqa: BLE001 - monitoring never stops training
        sys.stdout.write(f"elastic-ddp: warning: no system metrics of this node ({type(e).__name__}: {e})\n")
        return None


class NodeSeries:
    """The tracker's side: which sender each node's samples are kept from, and each
    node's next step. Not thread-safe: the tracker calls it under its lock."""

    def __init__(self):
        self.owner: dict[str, tuple[str, float]] = {}  # node -> (sender, time of its last sample)
        self.steps: dict[str, int] = {}  # node -> samples logged by this tracker
        self.info: dict[str, dict[str, Any]] = {}  # node -> {"ip", "node_id"}
        self._base: dict[str, int] = {}  # node -> the run's next step before this tracker

    def add(self, node: str, sender: str, metrics: dict[str, float], t: float,
            interval: float, info: Optional[dict[str, Any]] = None) -> list[tuple[str, float, int, int]]:
        """The metric rows ``(key, value, timestamp ms, step)`` of one sample; [] when
        another sender holds the node (it sent within ``STALE_INTERVALS`` intervals).
        Steps here start at 0 per node: :meth:`shifted` adds the run's earlier ones."""
        own = self.owner.get(node)
        if own is not None and own[0] != sender and t - own[1] < STALE_INTERVALS * interval:
            return []
        self.owner[node] = (sender, t)
        if info:
            self.info[node] = dict(info)
        step = self.steps.get(node, 0)
        self.steps[node] = step + 1
        ts = int(t * 1000)
        return [(f"system/{node}/{k}", float(v), ts, step) for k, v in metrics.items()]

    def node_of(self, key: str) -> Optional[str]:
        parts = key.split("/")
        return parts[1] if len(parts) == 3 and parts[0] == "system" and parts[1] in self.steps else None

    def shifted(self, metrics: list[tuple], client, run_id: str) -> list[tuple]:
        """``metrics`` with each node's steps after the run's last step of that node
        (an earlier submission of the job sampled it too), read once per node from the
        store (``client``: an ``MlflowClient``). Raises what the store raises."""
        out = []
        for m in metrics:
            node = self.node_of(m[0])
            if node is None:
                out.append(m)
                continue
            if node not in self._base:
                # Read before this tracker's first write of the node, so it holds only
                # the earlier submissions' rows.
                hist = client.get_metric_history(run_id, m[0])
                self._base[node] = max((h.step for h in hist), default=-1) + 1
            out.append((m[0], m[1], m[2], m[3] + self._base[node]))
        return out
