"""The sample ledger's audit on hand-written ledgers: a clean history across a restart
at another world size passes; a lost id, a replayed committed step, or a skipped step
that not every rank skipped is reported (so the audits of the fault tests are not
vacuous)."""

from __future__ import annotations

import json
from pathlib import Path

from elastic_ddp.ledger import audit, format_audit


def test_audit_flags_repeats_losses_and_uncommitted_steps(tmp_path):
    """The audit is not vacuous: hand-written ledgers of two attempts (world size 2, then
    1 resuming from step 1) where attempt 0's step 2 was recomputed are clean; dropping
    an id or replaying a committed step is reported."""
    def write(name, header, rows):
        with open(tmp_path / name, "w") as f:
            f.write(json.dumps({"header": True, **header}) + "\n")
            for r in rows:
                f.write(json.dumps(r) + "\n")

    write("attempt-1-a-rank0.jsonl", {"attempt": "a", "rank": 0, "world_size": 2,
                                      "resumed_from": 0, "t": 1.0},
          [{"epoch": 0, "step": 1, "ids": [0, 1]}, {"epoch": 0, "step": 2, "ids": [4]}])
    write("attempt-1-a-rank1.jsonl", {"attempt": "a", "rank": 1, "world_size": 2,
                                      "resumed_from": 0, "t": 1.1},
          [{"epoch": 0, "step": 1, "ids": [2, 3]}, {"epoch": 0, "step": 2, "ids": [5]}])
    # torn last line of a killed rank: ignored
    with open(tmp_path / "attempt-1-a-rank1.jsonl", "a") as f:
        f.write('{"epoch": 0, "st')
    write("attempt-2-b-rank0.jsonl", {"attempt": "b", "rank": 0, "world_size": 1,
                                      "resumed_from": 1, "t": 5.0},
          [{"epoch": 0, "step": 2, "ids": [4, 5]}])
    r = audit(tmp_path, range(6), 1)
    assert r["ok"], format_audit(r)
    assert r["world_sizes"] == [2, 1]
    assert r["attempts"][0]["recomputed_steps"] == 1 and r["attempts"][1]["committed_steps"] == 1

    bad = audit(tmp_path, range(7), 1)  # id 6 never trained on
    assert bad["epochs"][0]["lost"] == 1 and not bad["ok"]
    write("attempt-3-c-rank0.jsonl", {"attempt": "c", "rank": 0, "world_size": 1,
                                      "resumed_from": 2, "t": 9.0},
          [{"epoch": 0, "step": 3, "ids": [0, 1]}])  # replays ids of committed step 1
    bad = audit(tmp_path, range(6), 1)
    assert bad["epochs"][0]["repeated"] == 2 and not bad["ok"]


def _ledger(d: Path, attempt: str, rank: int, rows: list[dict], ws: int = 2, resumed: int = 0):
    with open(d / f"attempt-{1 + rank}-{attempt}-rank{rank}.jsonl", "w") as f:
        f.write(json.dumps({"header": True, "attempt": attempt, "rank": rank, "world_size": ws,
                            "resumed_from": resumed, "t": 1.0}) + "\n")
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_the_audit_counts_skipped_samples_as_skipped_and_checks_every_rank_agrees(tmp_path):
    _ledger(tmp_path, "a", 0, [{"epoch": 0, "step": 1, "ids": [0, 1]},
                               {"epoch": 0, "step": 2, "ids": [4], "skipped": True}])
    _ledger(tmp_path, "a", 1, [{"epoch": 0, "step": 1, "ids": [2, 3]},
                               {"epoch": 0, "step": 2, "ids": [5], "skipped": True}])
    r = audit(tmp_path, range(6), 1)
    e = r["epochs"][0]
    assert r["ok"] and e["lost"] == 0 and e["repeated"] == 0
    assert e["skipped"] == 2 and e["skipped_ids"] == [4, 5] and e["skipped_steps"] == [2]
    # One rank skipping alone is the defect the one decision prevents: not ok.
    _ledger(tmp_path, "a", 1, [{"epoch": 0, "step": 1, "ids": [2, 3]},
                               {"epoch": 0, "step": 2, "ids": [5]}])
    bad = audit(tmp_path, range(6), 1)
    assert not bad["ok"] and not bad["attempts"][0]["skips_agree"]
