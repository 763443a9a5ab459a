"""experiments/soak.py: its fault schedule (only faults that are possible now, the cluster
refilled, reproducible from the seed), its arguments, the per-fault costs it reads from
real ledgers (``elastic_ddp.ledger.LedgerWriter`` files of a restart-mode and a per-step
job), and (``slow``) a short real soak on a local multi-node Ray cluster whose audit is
clean and whose exit status is 0."""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SOAK = ROOT / "experiments" / "soak.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_the_schedule_draws_only_possible_faults_and_refills_the_cluster(soak):
    def simulate(seed: int, kinds=soak.DEFAULT_KINDS, n: int = 3000, max_nodes: int = 3) -> tuple[list, Counter]:
        rng, nodes, drawn, seen = random.Random(seed), max_nodes, [], Counter()
        for _ in range(n):
            gap = soak.next_gap(rng, 30.0)
            assert 15.0 <= gap <= 45.0
            kind = soak.draw(rng, kinds, nodes, max_nodes, workers=min(nodes, 2))
            assert soak.possible(kind, nodes, max_nodes, min(nodes, 2)), (kind, nodes)
            assert kind not in ("drain", "evict", "remove") or nodes >= 2
            assert kind != "add" or nodes < max_nodes
            nodes += {"add": 1, "drain": -1, "evict": -1, "remove": -1}.get(kind, 0)
            drawn.append((round(gap, 6), kind))
            seen[nodes] += 1
        return drawn, seen

    drawn, nodes_seen = simulate(0)
    assert drawn == simulate(0)[0] and drawn != simulate(1)[0]  # the seed decides
    assert set(k for _, k in drawn) == set(soak.DEFAULT_KINDS)
    assert set(k for _, k in simulate(0, soak.KINDS)[0]) == set(soak.KINDS)
    # The default's removals (evict, remove) and additions balance: the cluster spends most
    # of its time with 2 or 3 nodes.
    assert nodes_seen[1] < 0.35 * sum(nodes_seen.values()), nodes_seen
    rng = random.Random(0)
    assert soak.draw(rng, ("drain", "evict", "remove"), 1, 3, 1) is None  # nothing possible
    assert {soak.draw(rng, ("sigkill", "add"), 3, 3, 2) for _ in range(50)} == {"sigkill"}
    with pytest.raises(ValueError, match="unknown fault kind"):
        soak.possible("reboot", 2, 3, 2)


def test_the_arguments(soak, capsys):
    a = soak.parse_args([])
    assert (a.mode, a.duration, a.interval, a.drain_deadline, a.kinds, a.nodes, a.baseline) == (
        "restart", 3600.0, 30.0, 20.0, soak.DEFAULT_KINDS, 3, "after")
    # The eviction replaces the bare GCS drain by default, and needs the nodes as pods.
    assert "evict" in a.kinds and "drain" not in a.kinds and a.pods
    assert (a.evict_grace, a.evict_deadline) == (45.0, 35.0)
    a = soak.parse_args(["--mode", "per_step", "--kinds", "drain, sigkill", "--duration", "90"])
    assert (a.mode, a.kinds, a.duration, a.pods) == ("per_step", ("sigkill", "drain"), 90.0, False)
    for bad in (["--kinds", "sigkill,reboot"], ["--kinds", ","], ["--mode", "torchrun"], ["--nodes", "1"],
                ["--baseline", "only"], ["--against", "x.json"], ["--evict-grace", "30", "--evict-deadline", "30"]):
        with pytest.raises(SystemExit) as e:
            soak.parse_args(bad)
        assert e.value.code == 2, bad
    err = capsys.readouterr().err
    assert "reboot" in err and "--nodes must be 2 or more" in err
    assert "--baseline only needs --epochs" in err and "--against goes with --baseline only" in err
    assert "--evict-deadline must be above 0 and below --evict-grace" in err


def test_the_uninterrupted_job_alone_against_soaks(soak, tmp_path, capsys):
    """``--baseline only``: each soak JSON's val_loss against the uninterrupted job's; one
    outside the tolerance, or of another length, makes the exit status 1."""
    import json

    from elastic_ddp.driver.report import Summary

    s = Summary(run_id="r", tracking_uri="", experiment_id="0", metrics={"val_loss": 2.0}, steps=1382,
                epochs=2, wall_s=300.0, world_sizes_seen=[2], restarts=0, goodput=0.9)

    def soaked(name, val, epochs=2):
        f = tmp_path / name
        f.write_text(json.dumps({"epochs": epochs, "val_loss": val, "args": {"mode": "restart"}}))
        return str(f)

    close, far, longer = soaked("a.json", 2.0 + 1e-4), soaked("b.json", 2.1), soaked("c.json", 2.0, epochs=3)
    args = soak.parse_args(["--baseline", "only", "--epochs", "2", "--against", close])
    assert soak.report_baseline(args, s, tmp_path, "x") == 0
    args = soak.parse_args(["--baseline", "only", "--epochs", "2", "--against", close, far, longer])
    assert soak.report_baseline(args, s, tmp_path, "y") == 1
    out = capsys.readouterr().out
    assert "5.0e-05 (within 1e-03)" in out and "5.0e-02 (OUTSIDE 1e-03)" in out, out
    assert "c.json: not comparable (3 epochs" in out, out
    assert json.loads((tmp_path / "soak-baseline-restart-y.json").read_text())["val_loss"] == 2.0


def _steps(writer, epoch: int, steps, quorum=None, n=None) -> None:
    for s in steps:
        ids = np.arange(4 * (s - 1), 4 * s)
        extra = {} if quorum is None else {"quorum": quorum, "n": n}
        writer.record(epoch, s, ids, **extra)
        writer.commit(epoch, s, **extra)
        time.sleep(0.01)


def test_per_fault_costs_of_a_restart_mode_ledger(soak, tmp_path):
    """A SIGKILL at step 7 (checkpoint at 5), a failure event after it: the next attempt
    resumes from 5, so 2 steps are recomputed, charged to the kill alone; a node added
    later, no event, restarted nothing."""
    from elastic_ddp.ledger import LedgerWriter

    w = LedgerWriter(str(tmp_path), 0, 0, 1)
    _steps(w, 0, range(1, 8))
    w.close()
    kill = soak.Fault("sigkill", time.time(), time.time(), "pid 1", 3)
    failure = {"type": "failure", "t": kill.t + 0.05}
    # A SIGTERM to a worker of the restart's group while it starts: that start fails, and
    # the attempt it finds is the one the kill ended, whose steps are the kill's.
    term = soak.Fault("sigterm", kill.t + 0.1, kill.t + 0.1, "pid 2", 3)
    start_failed = {"type": "failure", "t": kill.t + 0.12}
    time.sleep(0.2)
    w = LedgerWriter(str(tmp_path), 0, 5, 1)
    time.sleep(0.1)
    _steps(w, 0, range(6, 11))
    w.close()
    add = soak.Fault("add", time.time(), time.time(), "node x", 3)
    events = [failure, start_failed, {"type": "checkpoint_rejected", "t": add.t + 0.01}]  # not a restart
    assert soak.fault_events([kill, term, add], events) == [[failure], [start_failed], []]
    rows = soak.per_fault([kill, term, add], events, tmp_path, "restart", time.time() + 1)
    k, t, a = rows
    assert k["steps_recomputed"] == 2 and 0.3 <= k["recovery_s"] < 1.0, k
    assert k["stall_s"] >= k["recovery_s"] > 0, k
    assert t["steps_recomputed"] == 0 and t["recovery_s"] is not None, t
    assert (a["recovery_s"], a["stall_s"], a["steps_recomputed"]) == (None, None, 0), a
    table = soak.format_table(rows)
    assert "worker SIGKILL" in table and "node added" in table and "2 / 2" in table, table


def test_a_fault_with_two_restarts_is_charged_both_and_a_start_failure_after_them_none(soak, tmp_path):
    """A node removed at step 7 (checkpoint at 5): a failure, then the group grows back
    onto a new node at step 12 (checkpoint at 10), both events the removal's: it is
    charged 2 + 2 steps. A SIGTERM to the grown group while it starts fails that start,
    and the attempt it finds is the one the grow ended: 0 steps more."""
    from elastic_ddp.ledger import LedgerWriter

    def attempt(resumed: int, steps) -> None:
        w = LedgerWriter(str(tmp_path), 0, resumed, 1)
        time.sleep(0.05)
        _steps(w, 0, steps)
        w.close()
        time.sleep(0.05)

    attempt(0, range(1, 8))
    remove = soak.Fault("remove", time.time(), time.time(), "node a", 2)
    failure = {"type": "failure", "t": remove.t + 0.01}
    time.sleep(0.05)
    attempt(5, range(6, 13))
    grow = {"type": "resize", "t": time.time()}
    term = soak.Fault("sigterm", grow["t"] + 0.02, grow["t"] + 0.02, "pid 3", 3)
    start_failed = {"type": "failure", "t": grow["t"] + 0.04}
    time.sleep(0.1)
    attempt(10, range(11, 14))
    events = [failure, grow, start_failed]
    assert soak.fault_events([remove, term], events) == [[failure, grow], [start_failed]]
    r, t = soak.per_fault([remove, term], events, tmp_path, "restart", time.time() + 1)
    assert r["steps_recomputed"] == 4, r
    assert t["steps_recomputed"] == 0, t


def test_per_fault_costs_of_a_per_step_ledger(soak, tmp_path):
    """Replicas 0 and 1 commit steps 1-3 in quorum 1; replica 1 dies in step 4 (its share
    and replica 0's never commit); replica 0 redoes step 4 alone (quorum 2) and the
    replacement joins at step 5 (quorum 3): 1 step recomputed, recovery at the
    replacement's first commit."""
    from elastic_ddp.ledger import LedgerWriter

    a = LedgerWriter(str(tmp_path), 0, 0, 2, mode="per_step")
    b = LedgerWriter(str(tmp_path), 1, 0, 2, mode="per_step")
    for s in (1, 2, 3):
        _steps(a, 0, [s], quorum=1, n=2)
        _steps(b, 0, [s], quorum=1, n=2)
    a.record(0, 4, np.arange(12, 14), quorum=1, n=2)
    b.record(0, 4, np.arange(14, 16), quorum=1, n=2)
    b.close()
    kill = soak.Fault("sigkill", time.time(), time.time(), "pid 2", 3)
    _steps(a, 0, [4], quorum=2, n=1)
    time.sleep(0.2)  # the replacement starts after the failure event
    c = LedgerWriter(str(tmp_path), 1, 4, 2, mode="per_step")
    _steps(a, 0, [5], quorum=3, n=2)
    _steps(c, 0, [5], quorum=3, n=2)
    a.close()
    c.close()
    (row,) = soak.per_fault([kill], [{"type": "failure", "t": kill.t + 0.05}], tmp_path, "per_step",
                            time.time() + 1)
    assert row["steps_recomputed"] == 1, row
    assert 0.2 <= row["recovery_s"] < 1.0 and row["stall_s"] is not None, row


def test_ledger_goodput_counts_the_kept_steps_in_the_window(soak):
    """Process A trains steps 1-10 (0.1 s apart, an evaluation's 2 s before step 5) and
    dies; B resumes from step 5 and trains 6-15. Kept: A's 2-5 and B's 7-15 (A's 6-10
    were recomputed; a process's first step and the evaluation's gap are not training):
    3 + 9 gaps of 0.1 s."""
    a = [(0.1 * s + (2.0 if s >= 5 else 0.0), s) for s in range(1, 11)]
    b = [(4.0 + 0.1 * (s - 6), s) for s in range(6, 16)]
    procs = [{"t": 0.0, "steps": a}, {"t": 3.9, "steps": b}]
    assert soak.ledger_goodput(procs, 0.0, 10.0) == pytest.approx(1.2 / 10.0)
    assert soak.ledger_goodput(procs, 4.05, 5.0) == pytest.approx(0.9 / 0.95)  # B's 7-15 only
    assert soak.ledger_goodput(procs, 5.0, 5.0) is None


@pytest.mark.slow
@pytest.mark.ray  # its own 3-node cluster: it runs in the serial pass, with no test beside it
def test_a_short_soak_in_restart_mode_audits_clean_and_exits_0(soak, pycode_data, tmp_path):
    """About 75 s of faults (SIGTERM, SIGKILL, a pod evicted with the preStop hook, a
    node removed or added, a node drained) on a ~200 kB corpus; the job and its
    uninterrupted twin on a real local cluster of 3 worker pods (of 3 ``Cluster`` nodes
    and no eviction where mount namespaces are not permitted: not root)."""
    pods = not soak._nodisk().namespaces_unavailable()
    kinds = "sigkill,sigterm,evict,drain,remove,add" if pods else "sigkill,sigterm,drain,remove,add"
    out = subprocess.run(
        [sys.executable, str(SOAK), "--mode", "restart", "--duration", "75", "--interval", "15",
         "--drain-deadline", "10", "--evict-grace", "30", "--evict-deadline", "20", "--kinds", kinds,
         # Seed 8 draws an eviction first (of 3 nodes; then add, sigterm, remove).
         "--epochs", "3", "--data", str(pycode_data), "--seed", "8", "--out", str(tmp_path / "soak")],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(out.stdout[-6000:], out.stderr[-3000:])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    text = out.stdout
    assert "==== soak: restart mode" in text and "OK: every sample once per epoch" in text, text[-3000:]
    faults = [ln for ln in text.splitlines() if ln.startswith("[soak]") and "(worker nodes now" in ln]
    assert len(faults) >= 3, faults
    table = text[text.index("==== soak"):text.index("ledger audit:")]
    audit = text[text.index("ledger audit:"):]
    epochs = [ln.split() for ln in audit.splitlines() if ln.strip()[:1].isdigit() and len(ln.split()) == 7]
    assert len(epochs) == 3 and all(e[3] == "0" and e[4] == "0" for e in epochs), audit
    assert "val_loss" in text and "within" in text, table
    assert ("worker pods up" in text) == pods, text[:2000]
    assert "lost per fault:" in text, table
    if pods:  # each eviction's hook drained its node: a notice, 0 steps recomputed
        import json

        (figures,) = [json.loads(f.read_text()) for f in (tmp_path / "soak").glob("soak-restart-*.json")]
        evictions = [f for f in figures["faults"] if f["kind"] == "evict"]
        assert evictions, figures["faults"]
        for f in evictions:
            assert "hook rc 0" in f["detail"] and f["steps_recomputed"] == 0, f
