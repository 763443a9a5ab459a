"""When the training step waits for its data: a watch over the logged step windows that
raises one warning per MLflow run (a resumed run whose tag says it was given gets none),
with the fix: one short console line (the numbers, the first fix, where the others are),
and the full text in the run's tag and ``warnings/data_wait.txt``.

Input: each logged window's ``data_wait_frac`` and ``step_time_s`` (``elastic_ddp.metrics``,
``StepWindow.reduce``): the slowest rank's data wait over the slowest rank's step time,
both seconds per optimizer step over the window. The watch fires when the median of
``data_wait_frac`` over the last ``window`` logged windows exceeds ``threshold``. The
median, not the mean: every epoch start and every restart pays the data pipeline's start
in one window's data wait; a median over five windows ignores such a window and still
fires when the data path is slower than the step for most of the last five.

Torch-free: the tracker actor runs it on every metrics record it receives.
"""

from __future__ import annotations

from collections import deque
from typing import Mapping, Optional

#: Share of step time above which the step is said to wait for data.
THRESHOLD = 0.10
#: Logged windows the median is taken over (also the fewest before it can fire).
WINDOW = 5
#: The MLflow tag that holds the warning (also written as ``warnings/data_wait.txt``).
DATA_WAIT_TAG = "elastic_ddp.warning.data_wait"


#: Where the fixes are explained (the console line points there).
DOC = "docs/troubleshooting.md#the-training-step-waits-for-its-data"


def data_wait_line(frac: float, first_step: int, last_step: int, threshold: float = THRESHOLD,
                   window: int = WINDOW) -> str:
    """The console line: the numbers, the first fix, and where the others are."""
    return (f"the training step waits for its data: data_wait is {frac:.0%} of step time "
            f"(median of the last {window} logged windows, steps {first_step}-{last_step}; "
            f"threshold {threshold:.0%}). First fix: more read and transform processes per "
            f"rank (data.read_tasks) where the nodes have idle cores; more fixes: {DOC}")


def data_wait_message(frac: float, first_step: int, last_step: int, threshold: float = THRESHOLD,
                      window: int = WINDOW) -> str:
    """The warning in full for a median data-wait share ``frac`` over logged steps
    ``first_step..last_step`` (one paragraph, no newline): the run's tag and artifact."""
    return (f"the training step waits for its data: data_wait is {frac:.0%} of step time "
            f"(median of the last {window} logged windows, logged at steps {first_step}-{last_step}; "
            f"the threshold is {threshold:.0%}), so the accelerator idles while the data path "
            "catches up. Fixes: give the data path more CPUs: more read and transform "
            "processes per rank with data.read_tasks where the training nodes have idle cores, "
            "or data.reader: ray_data with data.task_cpus: 1 and a CPU-only node added to the "
            "cluster (the dataloader reader runs on the training workers' nodes only); with "
            "ray_data, let each rank read further ahead with data.read_ahead_mib; cut row "
            "groups into smaller, parallel transform items with data.block_rows; or make "
            "Task.transform cheaper (vectorised decoding, work moved to collate or the model).")


class DataWaitWatch:
    """Fires once per object (one per job: the tracker's) when the step waits for data;
    never after :meth:`given` (an earlier submission of the run gave the warning).

    ``threshold``: share of step time, in (0, 1). ``window``: logged windows in the
    median, >= 1.
    """

    def __init__(self, threshold: float = THRESHOLD, window: int = WINDOW):
        if not 0 < threshold < 1 or window < 1:
            raise ValueError(f"need 0 < threshold < 1 and window >= 1, got {threshold}, {window}")
        self.threshold, self.window = float(threshold), int(window)
        self._recent: deque[tuple[int, float]] = deque(maxlen=self.window)
        self._prev_step: Optional[int] = None
        self.fired: Optional[dict] = None

    def given(self) -> None:
        """The run has had this warning (a resumed run's tag): it does not fire again."""
        self.fired = {"kind": "data_wait", "given": True}

    def add(self, metrics: Mapping[str, float], step: int) -> Optional[str]:
        """One metrics record as the trainer logs it at ``step``. Records without
        ``data_wait_frac`` (validation, events) are ignored. Returns the warning in full
        the first time the median exceeds the threshold, else None (also every time
        after); ``fired["message"]`` is then its console line (:func:`data_wait_line`)."""
        if self.fired is not None or "data_wait_frac" not in metrics:
            return None
        frac = float(metrics["data_wait_frac"])
        if frac != frac:                       # NaN: a window with no step time
            return None
        step = int(step)
        if self._prev_step is not None and step <= self._prev_step:
            # A restart re-logs steps from its checkpoint: the windows before it describe
            # steps that no longer count, and the pipeline's start is in the next one.
            self._recent.clear()
        self._prev_step = step
        self._recent.append((step, frac))
        if len(self._recent) < self.window:
            return None
        fracs = sorted(f for _, f in self._recent)
        mid = len(fracs) // 2
        median = fracs[mid] if len(fracs) % 2 else (fracs[mid - 1] + fracs[mid]) / 2
        if median <= self.threshold:
            return None
        first, last = self._recent[0][0], self._recent[-1][0]
        msg = data_wait_message(median, first, last, self.threshold, self.window)
        self.fired = {"kind": "data_wait", "step": last, "data_wait_frac": median,
                      "message": data_wait_line(median, first, last, self.threshold, self.window)}
        return msg
