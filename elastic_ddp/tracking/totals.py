"""The job's seconds outside its training steps' compute, summed by the tracker from the
metrics the lead sends (``report.goodput_parts`` splits the wall time with them):

- ``eval_s``: evaluation (the lead's ``eval_time_s``, one per evaluation);
- ``checkpoint_s``: the training loop blocked by checkpoint saves (the lead's
  ``checkpoint_block_s``: the whole write when synchronous, the snapshot and hand-off
  when asynchronous);
- ``data_wait_s``: data wait inside training steps (the window's per-step
  ``data_wait_s_max``, the slowest rank's, which sets a synchronous step's pace, times the
  window's steps), counted once per step number: the steps a restart recomputes are not
  counted again. Part of the steps' time, so part of the committed training time.
"""

from __future__ import annotations

from typing import Any

#: Metric -> the total it adds to (the metric's value in seconds, once per report).
SUMMED = {"eval_time_s": "eval_s", "checkpoint_block_s": "checkpoint_s"}


class SecondsTotals:
    """Totals over the tracker's lifetime (this submission); not thread-safe: the tracker
    calls :meth:`add` under its lock."""

    def __init__(self):
        self.totals: dict[str, float] = {"eval_s": 0.0, "checkpoint_s": 0.0, "data_wait_s": 0.0}
        self._window_step = 0  # the highest step a data-wait window was counted to

    def add(self, metrics: dict[str, Any], step: int) -> None:
        for k, total in SUMMED.items():
            if k in metrics:
                self.totals[total] += max(0.0, float(metrics[k]))
        if "data_wait_s_max" in metrics and step > self._window_step:
            self.totals["data_wait_s"] += max(0.0, float(metrics["data_wait_s_max"])) * (step - self._window_step)
            self._window_step = step

    def snapshot(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.totals.items()}
