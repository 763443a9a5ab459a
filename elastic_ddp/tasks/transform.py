"""The task's transform applied to a batch of Parquet rows: the one-row-per-row contract
checked, the sample ids and the readers' bookkeeping column carried through. Run inside Ray
Data's ``map_batches`` on the workers and by the driver's dry run on a sample.
"""

from __future__ import annotations

import numpy as np

from elastic_ddp.tasks.protocol import Task, TransformContext
from elastic_ddp.errors import ElasticDDPError

SEQ = "_edp_seq"  # bookkeeping column: which read item a row came from


class TransformError(ElasticDDPError, ValueError):
    """The task's transform broke its contract (not a dict, or not one row per input row).
    Fatal: the same rows fail the same way on every attempt."""


class TaskTransform:
    """The task's transform as a Ray Data batch function: checks the one-row-per-row
    contract and carries the id and bookkeeping columns through."""

    def __init__(self, task: Task, seed: int, epoch: int, split: str, id_column: str):
        self.task, self.seed, self.epoch, self.split, self.id_column = task, seed, epoch, split, id_column

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = np.asarray(batch[self.id_column])
        seq = batch.pop(SEQ)
        out = self.task.transform(batch, TransformContext(self.seed, self.epoch, self.split, ids))
        if not isinstance(out, dict):
            raise TransformError(f"{type(self.task).__name__}.transform returned a "
                                 f"{type(out).__name__}, not a dict of column arrays")
        for k, v in out.items():
            if len(v) != len(ids):
                raise TransformError(
                    f"{type(self.task).__name__}.transform returned {len(v)} rows in column "
                    f"{k!r} for {len(ids)} input rows; it must return one row per input row, "
                    "in order (filter bad samples out of the Parquet files instead)")
        out = dict(out)
        out[self.id_column] = ids
        out[SEQ] = seq
        return out
