"""When a checkpoint is due: one object decides, at fixed moments of the run; the
trainer commits what it says (``Trainer._commit``: the checkpoint, then the due's
``then``).

Reasons, in the order they are asked at a committed step's boundary:

- ``notice``/``grow`` (``restart`` mode; ``worker.notice.NoticeListener.due``): a notice
  agreed by the ranks (a SIGTERM, a node drain, the driver's stop, the controller's
  planned grow): the attempt's last checkpoint, then ``notice.Preempted`` (a grow's
  rank waits for the group's teardown first);
- ``stop`` (``per_step`` mode; ``PerStepFaultTolerance.stop_due``): the driver's stop,
  agreed in a committed step's all-reduce: the last checkpoint, then ``Preempted``;
- ``cadence``: every ``train.checkpoint_every_steps`` steps inside an epoch;
- ``epoch``: an epoch's end (the state moves to the next epoch's start; with the
  epoch's validation metrics; the run's last where the run ends there);
- ``leave`` (``per_step`` mode, ``ft.leaving_alone``): a noticed replica whose last step
  was a quorum of itself alone: the live state leaves with it, so it commits that step
  first (also after a step its quorum did not commit).

At the run's start, a checkpoint written at an epoch's last row (a notice there) is that
epoch's end; at the run's end, a run stopped by ``train.max_steps`` inside an epoch
gets its last checkpoint with validation metrics (``end``).

    policy = CheckpointPolicy(cfg, n_train, progress, sources=[...], leaving_alone=...)
    for due in policy.due("step"):      # "start" | "step" | "redo" | "end"
        trainer.checkpoint(...)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional


@dataclass(frozen=True)
class Due:
    """A checkpoint the policy says is due.

    Attributes:
        reason: ``notice``, ``grow``, ``stop``, ``cadence``, ``epoch``, ``leave`` or ``end``.
        line: logged (lead) before it is written; None: nothing.
        metrics: extra values in its report (``notice.GROW_METRIC`` at a grow).
        evaluate: validation metrics join them (an epoch's end, the run's end).
        final: the run's (or this attempt's) last: written synchronously.
        then: called once it is committed (raises ``notice.Preempted``); None: training
            goes on.
    """

    reason: str
    line: Optional[str] = None
    metrics: dict = field(default_factory=dict)
    evaluate: bool = False
    final: bool = False
    then: Optional[Callable[[], None]] = None


class CheckpointPolicy:
    """See the module docstring.

    Args:
        cfg: the job's config (``train.epochs``, ``max_steps``, ``checkpoint_every_steps``).
        n_train: rows of the training split (an epoch's end).
        progress: the trainer's ``run_state.Progress`` (read; moved to the next epoch at
            an epoch's end).
        sources: called with the step after each committed step while the run goes on:
            a notice's or a stop's :class:`Due`, or None (the listener's, the mode's).
        leaving_alone: whether this replica's last step was a quorum of itself alone
            (``ft.leaving_alone``).
    """

    def __init__(self, cfg, n_train: int, progress, sources: list[Callable[[int], Optional[Due]]],
                 leaving_alone: Callable[[], bool] = lambda: False):
        self.train, self.n_train, self.progress = cfg.train, n_train, progress
        self.sources, self.leaving_alone = sources, leaving_alone
        #: The step of the last checkpoint committed (or restored); None: none yet.
        self.checkpointed_step: Optional[int] = None

    @property
    def done(self) -> bool:
        """The run is over: ``train.epochs`` epochs, or ``train.max_steps`` steps."""
        p, c = self.progress, self.train
        return p.epoch >= c.epochs or (c.max_steps is not None and p.step >= c.max_steps)

    def due(self, moment: str) -> Iterator[Due]:
        """The checkpoints due at ``moment``, in the order to commit them: ``"start"``
        (before the first step of this attempt), ``"step"`` (after a committed step),
        ``"redo"`` (after a step its quorum did not commit) or ``"end"`` (the loop is
        over). A due whose ``then`` raises ends the iteration there."""
        p = self.progress
        if moment == "step":
            if not self.done:
                for source in self.sources:
                    got = source(p.step)
                    if got is not None:
                        yield got
                        return
            every = self.train.checkpoint_every_steps
            if not self.done and p.step % every == 0 and p.cursor < self.n_train:
                yield Due("cadence")
        if moment in ("start", "step") and p.cursor >= self.n_train and (moment == "step" or not self.done):
            p.epoch, p.cursor = p.epoch + 1, 0
            yield Due("epoch", evaluate=True, final=self.done)
        if moment in ("step", "redo") and not self.done and self.leaving_alone() \
                and self.checkpointed_step != p.step:
            yield Due("leave", line=f"leaving alone in its quorum at step {p.step}: committing a checkpoint")
        if moment == "end" and p.cursor != 0:  # stopped by train.max_steps inside an epoch
            yield Due("end", evaluate=True, final=True)
