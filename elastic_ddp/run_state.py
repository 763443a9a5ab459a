"""The state one run carries through checkpoints and restarts (:class:`Progress`,
:class:`Counters`), what the driver hands every worker (:class:`JobSpec`), and the
errors a rank raises. The checkpoint schema itself is ``Trainer.state_dict``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from elastic_ddp.checkpoint import CheckpointError
from elastic_ddp.errors import ElasticDDPError

if TYPE_CHECKING:
    from elastic_ddp.config import Config


class StepError(ElasticDDPError, RuntimeError):
    """An exception raised inside a training step, tagged with the step so the controller
    can tell a deterministic error (same step, same message, every attempt) from a
    failure worth a restart."""


class NonFiniteError(ElasticDDPError, RuntimeError):
    """``train.max_nonfinite_steps`` consecutive steps had a non-finite gradient."""


class DataChangedError(CheckpointError):
    """The checkpoint was written on other data than the job now reads."""


#: What each key of :func:`data_identity` comes from, for messages.
DATA_FIELDS = {"fingerprint": "the training data's rows (data.train_path)", "order": "data.order",
               "partitions": "data.partitions", "window": "data.shuffle_window_rows",
               "block_rows": "data.block_rows", "seed": "seed"}


def data_identity(cfg: "Config", fingerprint: str) -> dict[str, Any]:
    """What a checkpoint's cursor is a position in (its run state's ``data``): the
    training set's fingerprint and every setting of the epoch order."""
    return {"fingerprint": fingerprint, "order": cfg.data.order, "partitions": cfg.partitions,
            "window": cfg.data.shuffle_window_rows, "block_rows": cfg.data.block_rows,
            "seed": cfg.seed}


@dataclass
class Progress:
    """Where the run is: optimizer steps done, the epoch, the global position in it
    (``cursor``, samples) and samples consumed over the run."""

    step: int = 0
    epoch: int = 0
    cursor: int = 0
    samples_seen: int = 0


@dataclass
class Counters:
    """Run-wide counters that travel in the checkpoint (seconds are wall-clock)."""

    committed_train_s: float = 0.0    # step time of steps covered by a checkpoint
    uncommitted_train_s: float = 0.0  # step time since the last checkpoint (lost on failure)
    restarts: int = 0
    world_sizes_seen: list[int] = field(default_factory=list)
    skipped_steps: int = 0            # steps whose gradient was not finite
    skipped_samples: int = 0


@dataclass(frozen=True)
class Diagnostics:
    """What a test, a benchmark or a chaos run adds to a job; a production job needs none
    of it (``train(cfg, diagnostics=Diagnostics(...))``).

    Args:
        ledger_dir: every rank writes the sample ids of each committed step there (one
            JSON line per step and rank), for :func:`elastic_ddp.ledger.audit`.
        fault: fault injection in the real worker processes
            (:class:`elastic_ddp.worker.faults.Fault`): a rank SIGKILLs itself, dies inside
            a checkpoint write, or raises, at a chosen step.
    """

    ledger_dir: Optional[str] = None
    fault: Optional[dict] = None


@dataclass
class JobSpec:
    """What the driver hands every worker (``train_loop_config``): small and picklable.

    ``config``: the job's :class:`~elastic_ddp.config.Config` as the driver validated it
    (pydantic models pickle; the workers use it as it is, without validating it again).
    ``sample``: ``{"train": row, "val": row}``, one transformed row of each split from
    the driver's dry run (``tasks.dry_run.preflight``): the shape of an empty batch for a
    rank whose share is empty. ``diagnostics``: what a test or an experiment adds
    (:class:`Diagnostics`). ``preemption``: this Ray turns a notice into a checkpoint
    (``restart`` mode) or a replica leaving its quorum (``per_step`` mode)
    (``compat.versions.preemption_supported``; ``elastic_ddp.worker.notice``).
    """

    config: Config
    task: Any
    train: Any
    val: Any
    tracker: Any
    t0: float
    sample: dict
    storage: str = ""
    diagnostics: Diagnostics = field(default_factory=lambda: Diagnostics())
    preemption: bool = False
    #: The job's lease token (``elastic_ddp.fencing.Fence``), checked before every
    #: checkpoint commit, report and removal; None: not checked.
    fence: Any = None

    @property
    def ledger_dir(self) -> Optional[str]:
        return self.diagnostics.ledger_dir

    @property
    def fault(self) -> Optional[dict]:
        return self.diagnostics.fault
