"""A node drain requested from this process: the GCS call ``ray drain-node`` makes
(``ray._raylet.GcsClient.drain_node``; Ray has no public Python API for it).

What it buys: ``elastic-ddp drain-node`` (a pod's preStop hook) asks for the drain
without starting the ``ray`` command, a second interpreter that imports Ray's whole CLI:
2-7 s on a loaded 2-core machine, seconds taken from the notice. On a Ray release outside
:data:`GCS_DRAIN_RAY` the hook runs ``ray drain-node`` instead (the same request).
"""

from __future__ import annotations

from typing import Optional

#: The releases on which the in-process call was tested (its signature, with ``timeout``,
#: is Ray 2.60's; ``ray._private.node`` makes the same call on SIGTERM).
GCS_DRAIN_RAY = ("2.60.0",)


def drain_in_process_supported(version: Optional[str] = None) -> bool:
    """Whether :func:`request_preemption_drain` may be used on Ray ``version`` (default:
    the installed one)."""
    if version is None:
        import ray

        version = ray.__version__
    return version in GCS_DRAIN_RAY


def request_preemption_drain(gcs_address: str, node_id: str, message: str, deadline_ms: int,
                             timeout_s: float) -> tuple[bool, str]:
    """Ask the GCS at ``gcs_address`` to drain node ``node_id`` (hex) for a preemption at
    ``deadline_ms`` (milliseconds since the epoch); ``timeout_s`` bounds the call.

    Returns:
        ``(accepted, why_not)``.

    Raises:
        what the GCS client raises (no answer within ``timeout_s``, a refused connection)."""
    import ray._raylet
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=gcs_address)
    accepted, why = gcs.drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"), message,
        int(deadline_ms), timeout=timeout_s)
    return bool(accepted), str(why or "")
