"""Checkpoints: sharded (``torch.distributed.checkpoint``), verified by checksums,
resharded on load; the schema's one owner is ``checkpoint.manager.CheckpointManager``
(its save; the restore in ``checkpoint.restore``, the pruning in ``checkpoint.prune``).

This package imports no torch at import time: the Ray Train controller uses
``checkpoint_step`` and ``newest_complete`` between a failure and the restart. The torch
parts are the submodules ``manager`` (write and commit), ``restore`` (verify and load),
``state`` (the model's and optimizer's state, a healing replica's live state), ``shares``
(replicated state split among the ranks), ``export`` (the model alone, as one file) and
``legacy`` (format ``elastic-ddp/2``'s ``state.pt``).
The layout of a checkpoint directory: ``checkpoint.layout``; for users:
docs/checkpoints.md.
"""

from elastic_ddp.checkpoint.layout import (  # noqa: F401
    CONFIG, FORMAT, LEGACY_FORMAT, LEGACY_STATE_FILE, MANIFEST, RUN_STATE, CheckpointCorruptError,
    CheckpointError, checkpoint_name, checkpoint_step, complete_checkpoints, newest_complete,
    read_manifest)
from elastic_ddp.checkpoint.legacy import load_state  # noqa: F401  (torch imported on call)
