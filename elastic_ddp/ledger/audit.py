"""The audit: each epoch's samples once in committed steps (the rule is in
:mod:`elastic_ddp.ledger`), for ``restart`` and ``per_step`` ledgers."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from elastic_ddp.ledger.files import _mode, _records, read_attempts


def audit(ledger_dir: str | Path, all_ids: Iterable[int], epochs: int | Iterable[int],
          finished: bool = True) -> dict:
    """Check that each epoch consumed every sample id exactly once in committed steps.

    Args:
        ledger_dir: the directory given to ``train(..., diagnostics=Diagnostics(ledger_dir=...))``.
        all_ids: the training set's sample ids (shape [N]).
        epochs: the number of epochs to audit (0..epochs-1) or an iterable of epochs.
        finished: the job ended with a final checkpoint (its last attempt is committed
            in full); False treats the last attempt's steps as uncommitted.

    Returns:
        ``{"attempts": [{"key", "t", "world_size", "resumed_from", "steps_per_rank":
        {epoch: {rank: n}}, "ranks_equal": bool, "skips_agree": bool, "committed_steps",
        "recomputed_steps"}], "epochs": {epoch: {"committed_ids": sorted list, "steps": n,
        "repeated": n, "lost": n, "unknown": n, "skipped": n, "skipped_steps": [steps],
        "skipped_ids": sorted list}}, "world_sizes": [ws per attempt], "ok": bool}``.
        ``repeated`` counts id uses beyond the first in committed steps of the epoch,
        ``lost`` the data set's ids no committed step used, ``unknown`` ids not in the
        data set, ``skipped`` the ids of committed steps that were skipped (consumed, not
        learned from: neither lost nor repeated); ``ok`` is repeated, lost and unknown
        zero for every epoch, equal committed step counts across ranks in every attempt, and the same
        skipped steps on every rank of an attempt.

    Raises:
        LedgerError: see ``read_attempts``.
    """
    if _mode(ledger_dir) == "per_step":
        return audit_per_step(ledger_dir, all_ids, epochs)
    attempts = read_attempts(ledger_dir)
    universe = np.unique(np.asarray(list(all_ids), dtype=np.int64))
    epoch_list = list(range(epochs)) if isinstance(epochs, int) else sorted(epochs)
    used: dict[int, Counter] = defaultdict(Counter)
    committed_steps: dict[int, set[int]] = defaultdict(set)
    skipped_ids: dict[int, set[int]] = defaultdict(set)
    skipped_steps: dict[int, set[int]] = defaultdict(set)
    out_attempts = []
    for i, a in enumerate(attempts):
        last = i == len(attempts) - 1
        limit: Optional[int]
        if last:
            limit = None if finished else a.resumed_from
        else:
            limit = attempts[i + 1].resumed_from
        per_epoch: dict[int, dict[int, int]] = defaultdict(dict)
        n_committed = 0
        recomputed: set[int] = set()  # steps any rank logged past the commit point
        for rank, rows in sorted(a.steps.items()):
            # Committed steps only: a rank killed mid-step (its node removed) may miss
            # the last step its peers logged, which the next attempt recomputes.
            counts: Counter = Counter(ep for ep, step, _ in rows if limit is None or step <= limit)
            for ep, n in counts.items():
                per_epoch[ep][rank] = n
            for ep, step, ids in rows:
                if limit is None or step <= limit:
                    used[ep].update(ids.tolist())
                    if step in a.skipped.get(rank, ()):
                        skipped_ids[ep].update(ids.tolist())
                        skipped_steps[ep].add(step)
                    if rank == min(a.steps):
                        n_committed += 1
                    committed_steps[ep].add(step)
                else:
                    recomputed.add(step)
        n_recomputed = len(recomputed)
        ranks_equal = (len(a.steps) == a.world_size and all(
            len(set(r.values())) == 1 and len(r) == a.world_size for r in per_epoch.values()))
        # A rank may die mid-step: compare the skips over the steps every rank recorded.
        common = set.intersection(*({s for _, s, _ in rows} for rows in a.steps.values())) \
            if a.steps else set()
        skips_agree = len({frozenset(sk & common) for sk in a.skipped.values()}) <= 1
        out_attempts.append({
            "key": a.key, "t": a.t, "world_size": a.world_size,
            "resumed_from": a.resumed_from, "ranks_seen": sorted(a.steps),
            "steps_per_rank": {ep: dict(r) for ep, r in sorted(per_epoch.items())},
            "ranks_equal": ranks_equal, "skips_agree": skips_agree, "committed_steps": n_committed,
            "recomputed_steps": n_recomputed,
        })
    out_epochs = {}
    for ep in epoch_list:
        c = used.get(ep, Counter())
        ids = np.fromiter(c.keys(), dtype=np.int64, count=len(c))
        out_epochs[ep] = {
            "committed_ids": sorted(int(x) for x in ids),
            "steps": len(committed_steps.get(ep, ())),
            "repeated": int(sum(n - 1 for n in c.values() if n > 1)),
            "lost": int(len(np.setdiff1d(universe, ids))),
            "unknown": int(len(np.setdiff1d(ids, universe))),
            "skipped": len(skipped_ids.get(ep, ())),
            "skipped_steps": sorted(skipped_steps.get(ep, ())),
            "skipped_ids": sorted(skipped_ids.get(ep, ())),
        }
    ok = (all(e["repeated"] == 0 and e["lost"] == 0 and e["unknown"] == 0
              for e in out_epochs.values())
          and all(a["ranks_equal"] and a["skips_agree"] for a in out_attempts))
    return {"attempts": out_attempts, "epochs": out_epochs,
            "world_sizes": [a.world_size for a in attempts], "ok": ok}


def audit_per_step(ledger_dir: str | Path, all_ids: Iterable[int], epochs: int | Iterable[int]) -> dict:
    """The audit of a per-step fault-tolerant job (``scaling.fault_tolerance: per_step``):
    every replica logs the ids of its share of step k under the quorum id before the
    all-reduce, and a commit line once the step is applied. A step counts once, with the
    ids of the quorum that committed it (all participants' shares); an attempt whose
    quorum did not commit (a replica died in it) is redone and not counted.

    A step committed again by a later quorum is recomputed, not repeated, when a replica
    of that later quorum started between the two commits from a durable checkpoint before
    that step (every replica holding the live state was gone, as in ``restart`` mode): the
    later commit counts, like the next attempt's in :func:`audit`. Two commits of a step
    without such a restart between them are a problem.

    Returns the same shape as :func:`audit` (``attempts``: one row per replica process,
    ``recomputed_steps``: its commits a later restart recomputed), plus
    ``uncommitted_attempts``, ``recomputed_steps`` (the steps committed again after a
    restart from a durable checkpoint) and ``problems`` (a step committed by two quorums
    with no such restart between them).
    """
    files = sorted(Path(ledger_dir).glob("attempt-*-rank*.jsonl"))
    shares: dict[tuple[int, int], list[np.ndarray]] = defaultdict(list)
    epoch_of: dict[int, int] = {}
    commits: dict[int, set[int]] = defaultdict(set)
    commit_t: dict[tuple[int, int], float] = {}  # (step, quorum) -> first commit time
    committed_by: dict[tuple[int, int], list[int]] = defaultdict(list)  # -> attempt rows
    out_attempts = []
    for f in files:
        lines = f.read_text().splitlines()
        head = json.loads(lines[0])
        n_commit = 0
        for rec in _records(lines[1:]):
            if "commit" in rec:
                key = (int(rec["commit"]), int(rec["quorum"]))
                commits[key[0]].add(key[1])
                t = float(rec.get("t", 0.0))
                commit_t[key] = min(commit_t.get(key, t), t)
                committed_by[key].append(len(out_attempts))
                n_commit += 1
            else:
                shares[(int(rec["step"]), int(rec["quorum"]))].append(np.asarray(rec["ids"], np.int64))
                epoch_of[int(rec["step"])] = int(rec["epoch"])
        out_attempts.append({"key": f.name, "t": float(head["t"]), "world_size": int(head["world_size"]),
                             "resumed_from": int(head["resumed_from"]), "rank": int(head["rank"]),
                             "committed_steps": n_commit, "ranks_equal": True,
                             "recomputed_steps": 0, "ranks_seen": [int(head["rank"])]})
    universe = np.unique(np.asarray(list(all_ids), dtype=np.int64))
    epoch_list = list(range(epochs)) if isinstance(epochs, int) else sorted(epochs)
    used: dict[int, Counter] = defaultdict(Counter)
    steps_per_epoch: dict[int, int] = defaultdict(int)
    problems = []
    recomputed = 0
    for step, quorums in sorted(commits.items()):
        order = sorted(quorums, key=lambda q: commit_t[(step, q)])
        for early, late in zip(order, order[1:]):
            lo, hi = commit_t[(step, early)], commit_t[(step, late)]
            if any(lo < out_attempts[i]["t"] <= hi and out_attempts[i]["resumed_from"] < step
                   for i in committed_by[(step, late)]):
                recomputed += 1
                for i in committed_by[(step, early)]:
                    out_attempts[i]["recomputed_steps"] += 1
            else:
                problems.append(f"step {step} committed by quorums {sorted(quorums)}")
                break
        q = order[-1]
        ep = epoch_of.get(step, -1)
        steps_per_epoch[ep] += 1
        for ids in shares.get((step, q), []):
            used[ep].update(ids.tolist())
    uncommitted = sum(1 for (step, q) in shares if q not in commits.get(step, set()))
    out_epochs = {}
    for ep in epoch_list:
        c = used.get(ep, Counter())
        ids = np.fromiter(c.keys(), dtype=np.int64, count=len(c))
        out_epochs[ep] = {"committed_ids": sorted(int(x) for x in ids), "steps": steps_per_epoch.get(ep, 0),
                          "repeated": int(sum(n - 1 for n in c.values() if n > 1)),
                          "lost": int(len(np.setdiff1d(universe, ids))),
                          "unknown": int(len(np.setdiff1d(ids, universe)))}
    ok = not problems and all(e["repeated"] == 0 and e["lost"] == 0 and e["unknown"] == 0
                              for e in out_epochs.values())
    return {"attempts": out_attempts, "epochs": out_epochs, "ok": ok, "problems": problems,
            "uncommitted_attempts": uncommitted, "recomputed_steps": recomputed,
            "world_sizes": [a["world_size"] for a in out_attempts]}


def format_audit(report: dict) -> str:
    """A human-readable table of ``audit``'s result."""
    lines = ["attempt  world_size  resumed_from  committed  recomputed  ranks_equal"]
    for i, a in enumerate(report["attempts"]):
        lines.append(f"{i:7d}  {a['world_size']:10d}  {a['resumed_from']:12d}  "
                     f"{a['committed_steps']:9d}  {a['recomputed_steps']:10d}  {a['ranks_equal']}")
    lines.append("epoch  steps  ids_used  repeated  lost  unknown  skipped")
    for ep, e in sorted(report["epochs"].items()):
        lines.append(f"{ep:5d}  {e['steps']:5d}  {len(e['committed_ids']):8d}  "
                     f"{e['repeated']:8d}  {e['lost']:4d}  {e['unknown']:7d}  {e.get('skipped', 0):7d}")
    lines.append("OK: every sample once per epoch" if report["ok"] else "NOT OK")
    return "\n".join(lines)
