"""torchft internals elastic-ddp reads (``scaling.fault_tolerance: per_step``).

``Manager._quorum_id`` is the lighthouse's id of the quorum this replica is in, the same
on every participant of that quorum: the per-step ledger (``elastic_ddp.ledger``) keys
each replica's share of a step by it, so that the audit joins the shares of the attempt
that committed. torchft has no public accessor for it. Tested on torchft 0.2.0; on
another version the replica's own count of the quorums it joined at the current step
stands in (one warning line): equal across the participants of a quorum unless a
replica with a share joins a step the others are already retrying, which the audit then
reports as a step committed by two quorums.
"""

from __future__ import annotations

import functools
import logging
from importlib import metadata

TESTED_TORCHFT = "0.2.0"

_log = logging.getLogger(__name__)
_warned: list[bool] = []


@functools.lru_cache(maxsize=1)
def _version() -> str:
    try:
        return metadata.version("torchft")
    except metadata.PackageNotFoundError:
        return "unknown"


def quorum_id(manager, fallback: int) -> int:
    """The id of the quorum ``manager`` (a ``torchft.Manager``) is in.

    Args:
        manager: this replica's torchft Manager, after ``start_quorum``.
        fallback: this replica's own quorum count at the current step, returned on a
            torchft version other than ``TESTED_TORCHFT``.
    """
    if _version() == TESTED_TORCHFT:
        return int(manager._quorum_id)
    if not _warned:
        _warned.append(True)
        _log.warning("torchft %s is not %s (tested): the per-step ledger keys shares by this "
                     "replica's own quorum count", _version(), TESTED_TORCHFT)
    return int(fallback)


def quorum_id_is_exact() -> bool:
    """Whether :func:`quorum_id` is the lighthouse's id on this torchft (a new id: the
    members changed), not the fallback count."""
    return _version() == TESTED_TORCHFT
