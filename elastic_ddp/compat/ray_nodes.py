"""The Ray head node, found by a resource name Ray reserves for it.

- :func:`head_node_id`: the live node whose resources hold ``node:__internal_head__``
  (Ray gives that resource to the head node only; Ray has no public call that names the
  head). It buys the tracker actor's place on the head node, which no scale-down
  removes, while any worker node may go mid-job. Version guard: the
  ``head_node_resource`` override of :mod:`elastic_ddp.compat.versions`; on an untested
  Ray, and wherever no node holds the resource, this process's own node.
"""

from __future__ import annotations

HEAD_RESOURCE = "node:__internal_head__"


def head_node_id() -> str:
    """The Ray head node's id (hex), else this process's node (see the module's note).
    Needs a connected Ray (``ray.init``)."""
    import ray

    from elastic_ddp.compat.versions import ray_plan

    if ray_plan().applies("head_node_resource"):
        for n in ray.nodes():
            if n.get("Alive") and HEAD_RESOURCE in n.get("Resources", {}):
                return n["NodeID"]
    return ray.get_runtime_context().get_node_id()
