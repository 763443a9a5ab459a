"""Pruning the checkpoints Ray Train never registers: those a partial quorum wrote
(per-step fault tolerance), whose manifest says ``reported: false``. Ray Train's
``CheckpointConfig(num_to_keep)`` removes only the checkpoints reported to it.
"""

from __future__ import annotations

from typing import Callable, Optional

from elastic_ddp.fencing import Fence, check as check_fence
from elastic_ddp.checkpoint.layout import (complete_checkpoints, read_manifest, rejected_paths,
                                           run_dir)


def prune_unreported(storage: str, run_name: str, keep: int, fence: Optional[Fence] = None,
                     log: Callable[[str], None] = print) -> list[str]:
    """Remove the run's unreported checkpoints (manifest ``reported: false``) that are
    not among its ``keep`` newest complete ones; returns their paths. Without this a run
    whose quorum stays partial would keep every one it wrote. Reported ones are left to
    Ray Train. A rejected checkpoint goes once ``keep`` good ones are newer. Costs a
    listing and a manifest read per checkpoint past the newest ``keep``.

    Raises:
        FencedError: another job holds the run's lease (``fence``); nothing removed.
    """
    fs, _ = run_dir(storage, run_name)
    check_fence(fence, "the pruning of unreported checkpoints")
    removed = []
    good = complete_checkpoints(storage, run_name)
    # A rejected one goes once `keep` good ones are newer (nothing else removes it).
    oldest_kept = good[keep - 1][0] if keep and len(good) >= keep else None
    rejected = [] if oldest_kept is None else [
        (k, p) for k, p in complete_checkpoints(storage, run_name, sizes=False, rejected=True)
        if k < oldest_kept and p in rejected_paths(fs, [p])]
    for _, path in good[keep:] + rejected:
        try:
            if read_manifest(fs, path).get("reported", True) is False:
                fs.delete_dir(path)
                removed.append(path)
        except (OSError, ValueError) as e:  # gone already, or unreadable: left as it is
            log(f"elastic-ddp: warning: could not remove the unreported checkpoint {path}: {e}")
    return removed
