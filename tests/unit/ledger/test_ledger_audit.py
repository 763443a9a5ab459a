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


def test_a_per_step_job_restarted_from_its_durable_checkpoint_recomputes_not_repeats(tmp_path):
    """Per-step ledgers (``LedgerWriter`` files): replicas 0 and 1 commit steps 1-3 in
    quorum 1, replica 1 dies, replica 0 commits 4-5 alone (quorum 2) and dies too; a
    replacement starts from the durable checkpoint at step 3 and commits 4-6 (quorum 3):
    steps 4 and 5 were recomputed, and every id counts once, from the later commits. The
    same second commit without that restart between is a problem."""
    import time

    import numpy as np

    from elastic_ddp.ledger import LedgerWriter

    def steps(w, rng, quorum, n):
        for s in rng:
            w.record(0, s, np.arange(2 * (s - 1), 2 * s) if n == 1 or w is not b
                     else np.array([], np.int64), quorum=quorum, n=n)
            w.commit(0, s, quorum=quorum, n=n)
            time.sleep(0.005)

    a = LedgerWriter(str(tmp_path), 0, 0, 2, mode="per_step")
    b = LedgerWriter(str(tmp_path), 1, 0, 2, mode="per_step")
    steps(a, range(1, 4), 1, 2)
    steps(b, range(1, 4), 1, 2)  # b's shares are empty: a holds every id
    b.close()
    steps(a, range(4, 6), 2, 1)
    a.close()
    time.sleep(0.02)
    c = LedgerWriter(str(tmp_path), 0, 3, 2, mode="per_step")
    steps(c, range(4, 7), 3, 1)
    c.close()
    r = audit(tmp_path, range(12), 1)
    assert r["ok"] and r["problems"] == [], (r["problems"], format_audit(r))
    assert r["recomputed_steps"] == 2 and r["epochs"][0]["steps"] == 6, r["recomputed_steps"]
    assert (r["epochs"][0]["repeated"], r["epochs"][0]["lost"]) == (0, 0)
    assert [x["recomputed_steps"] for x in r["attempts"]] == [2, 0, 0], r["attempts"]

    # A quorum that commits step 6 again with no restart of its own between: a problem,
    # even with another replica started in between from an earlier checkpoint (it took
    # no part in that commit).
    LedgerWriter(str(tmp_path), 1, 5, 2, mode="per_step").close()
    files = sorted(tmp_path.glob("attempt-*-rank*.jsonl"))
    c_file = next(f for f in files if json.loads(f.read_text().splitlines()[0])["resumed_from"] == 3)
    with open(c_file, "a") as f:  # c commits step 6 a second time, in quorum 4
        f.write(json.dumps({"epoch": 0, "step": 6, "ids": [10, 11], "quorum": 4, "n": 1}) + "\n")
        f.write(json.dumps({"commit": 6, "epoch": 0, "t": time.time(), "quorum": 4, "n": 1}) + "\n")
    bad = audit(tmp_path, range(12), 1)
    assert not bad["ok"] and bad["problems"] == ["step 6 committed by quorums [3, 4]"], bad["problems"]


def test_a_rank_killed_mid_step_differs_only_in_a_recomputed_step(tmp_path):
    """Rank 1 logs step 3 and rank 0 dies before it does; the next attempt resumes from
    step 2: the ranks agree on every committed step (ok). Had the next attempt resumed
    from step 3, the step rank 0 never logged would be committed: not ok."""
    _ledger(tmp_path, "a", 0, [{"epoch": 0, "step": 1, "ids": [0, 1]}, {"epoch": 0, "step": 2, "ids": [4, 5]}])
    _ledger(tmp_path, "a", 1, [{"epoch": 0, "step": 1, "ids": [2, 3]}, {"epoch": 0, "step": 2, "ids": [6, 7]},
                               {"epoch": 0, "step": 3, "ids": [10, 11]}])
    with open(tmp_path / "attempt-9-b-rank0.jsonl", "w") as f:
        f.write(json.dumps({"header": True, "attempt": "b", "rank": 0, "world_size": 1,
                            "resumed_from": 2, "t": 5.0}) + "\n")
        f.write(json.dumps({"epoch": 0, "step": 3, "ids": [8, 9, 10, 11]}) + "\n")
    r = audit(tmp_path, range(12), 1)
    assert r["ok"] and r["attempts"][0]["ranks_equal"], format_audit(r)
    assert r["attempts"][0]["recomputed_steps"] == 1 and r["attempts"][0]["committed_steps"] == 2
    with open(tmp_path / "attempt-9-b-rank0.jsonl", "w") as f:
        f.write(json.dumps({"header": True, "attempt": "b", "rank": 0, "world_size": 1,
                            "resumed_from": 3, "t": 5.0}) + "\n")
    bad = audit(tmp_path, range(12), 1)
    assert not bad["ok"] and not bad["attempts"][0]["ranks_equal"]
