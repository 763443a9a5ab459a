"""Rows whose per-sample loss was NaN or infinite: what the console and the MLflow run say.

A training step in which any row's loss is not finite has a non-finite gradient; every
rank skips that step (``worker.update.Update.apply``: the optimizer does not
step, none of the step's rows update the model). The rank that holds such rows reports
them (:func:`row_report`) to the tracker actor, which keeps them here:

- the console: one warning line per kind of value (``nan``, ``inf``), the first time a
  row of that kind is reported: the step, the rows' ids (file and row where the data
  set's statistics find them), what was done, and where the later ones are recorded;
- the MLflow run: the metric ``worker/nonfinite_loss_rows`` (rows reported so far, at
  the step), the tag :data:`NONFINITE_TAG` (how many, the first ids) and the artifact
  ``warnings/nonfinite_rows.json`` (one entry per row and skipped step).

A row is reported each time a step holding it is skipped (every epoch, and again when a
restart recomputes its step). Torch-free: the tracker actor runs it.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

#: The MLflow tag that sums the rows up (``warnings/nonfinite_rows.json`` lists each).
NONFINITE_TAG = "elastic_ddp.warning.nonfinite_loss"
#: The artifact that lists every reported row (``tracking.history.FILES``).
NONFINITE_FILE = "warnings/nonfinite_rows.json"
#: The metric of the rows reported so far (raw name; MLflow key ``worker/<name>``).
NONFINITE_METRIC = "nonfinite_loss_rows"
#: Ids a console line or the tag names before "and N more".
SHOWN = 8


def value_kind(loss: float) -> str:
    """``"nan"`` or ``"inf"`` (either sign)."""
    return "nan" if math.isnan(loss) else "inf"


def row_report(step: int, epoch: int, rank: int, step_rows: int, id_column: str,
               ids: Sequence, losses: Sequence[float], where: Optional[dict] = None) -> dict[str, Any]:
    """A rank's report of its rows with a non-finite loss in the skipped ``step`` (the
    step being computed, counted from 1; ``epoch`` 1-based): ``step_rows`` rows in the
    whole step, ``ids`` and their ``losses``, ``where``: ``{id: (file, row)}`` for the
    ids located (``data.scan.locate_ids``)."""
    where = where or {}
    rows = []
    for i, loss in zip(ids, losses):
        i = i.item() if hasattr(i, "item") else i
        row = {"step": int(step), "epoch": int(epoch), "rank": int(rank), id_column: i,
               "loss": "nan" if math.isnan(loss) else ("inf" if loss > 0 else "-inf")}
        if i in where:
            row["file"], row["row"] = where[i][0], int(where[i][1])
        rows.append(row)
    return {"step": int(step), "epoch": int(epoch), "rank": int(rank), "step_rows": int(step_rows),
            "id_column": id_column, "rows": rows}


def _named(rows: list[dict], col: str) -> str:
    """``sample_id 21 (a/part-0.parquet row 5), 40 and 3 more``."""
    names = [f"{r[col]}" + (f" ({r['file']} row {r['row']})" if "file" in r else "")
             for r in rows[:SHOWN]]
    more = f" and {len(rows) - SHOWN} more" if len(rows) > SHOWN else ""
    return f"{col} {', '.join(names)}{more}"


def warning_line(report: dict, kind: str) -> str:
    """The console line for the first rows of value ``kind`` in ``report``."""
    col = report["id_column"]
    rows = [r for r in report["rows"] if value_kind(float(r["loss"])) == kind]
    value = "a NaN" if kind == "nan" else "an infinite"
    return (f"step {report['step']} (epoch {report['epoch']}): {_named(rows, col)} had {value} "
            f"loss (rank {report['rank']}); the step was skipped on every rank, so none of its "
            f"{report['step_rows']} rows updated the model. Later rows with {value} loss are "
            f"not printed: the MLflow run counts them ({_metric_key()}) and lists each in "
            f"{NONFINITE_FILE}")


def _metric_key() -> str:
    from elastic_ddp.tracking.store import metric_key

    return metric_key(NONFINITE_METRIC)


class NonFiniteRows:
    """The job's reported rows (``rows``, the artifact's entries) and the kinds warned of."""

    def __init__(self):
        self.rows: list[dict[str, Any]] = []
        self.warned: set[str] = set()
        self.id_column = "sample_id"

    def add(self, report: dict) -> list[dict[str, Any]]:
        """Take one rank's report; returns the console notices it raises
        (``{"kind", "step", "message"}``, one per kind not warned of before)."""
        self.rows.extend(report["rows"])
        self.id_column = report["id_column"]
        notices = []
        for kind in ("nan", "inf"):
            if kind in self.warned or not any(value_kind(float(r["loss"])) == kind for r in report["rows"]):
                continue
            self.warned.add(kind)
            notices.append({"kind": f"nonfinite_loss_{kind}", "step": report["step"],
                            "message": warning_line(report, kind)})
        return notices

    def tag(self) -> str:
        """The run's tag: how many rows were reported, which (the first distinct ids)."""
        col = self.id_column
        distinct = list(dict.fromkeys(r[col] for r in self.rows))
        more = f" and {len(distinct) - SHOWN} more" if len(distinct) > SHOWN else ""
        return (f"{len(self.rows)} row(s) with a non-finite loss, their steps skipped: {col} "
                f"{', '.join(map(str, distinct[:SHOWN]))}{more}; each in {NONFINITE_FILE}")
