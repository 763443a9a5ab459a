"""Checkpoint uploads that meet faults, on nodes that share no disk with the driver
(``nodisk_cluster``) and a fault proxy in front of the S3 server (``s3_faults``); slow.

* ``test_kill_during_background_upload``: a training worker SIGKILLed while its
  checkpoint's objects are being uploaded (the fault proxy holds those PUTs a moment,
  and fires the kill at the first one): the job resumes from the newest committed
  checkpoint, the sample ledger is clean (0 lost, 0 repeated) and the final model equals
  the uninterrupted run's.
* ``test_throttled_checkpoint_upload_is_retried``: 503 SlowDown for the first PUTs of a
  checkpoint: the writer retries and the checkpoint commits.
* ``test_stalled_checkpoint_upload_is_bounded``: PUTs accepted and never answered: the
  checkpoint is never committed and the job never hangs.
* ``test_twenty_kills_at_random_points_of_the_upload``: 20 SIGKILLs at random requests
  of the uploads: every restart resumes from a committed checkpoint, the ledger is clean
  and the final model is the uninterrupted run's.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from elastic_ddp import train
from elastic_ddp.config import Config
from helpers import _cluster_faults
from helpers.nodisk import DIGITS_FAST, STEPS
from helpers.nodisk import assert_ledger_clean as _assert_ledger_clean, diag as _diag, s3_job as _s3_job

pytestmark = pytest.mark.ray


@pytest.mark.slow
def test_kill_during_background_upload(nodisk_cluster, digits_data, s3, s3_faults, tmp_path):
    from elastic_ddp.checkpoint.export import model_state

    base_cfg = _s3_job(s3, digits_data, tmp_path / "base", "base")
    base_diag, base_ledger = _diag(nodisk_cluster, "base")
    baseline = train(base_cfg, diagnostics=base_diag, progress=False)
    _assert_ledger_clean(base_ledger, digits_data)

    # The step-40 checkpoint's uploads are held 1.5 s each; at the first one a training
    # worker is SIGKILLed (the step loop goes on meanwhile: the upload is in the
    # background). The restart must come from the step-20 checkpoint, the newest one
    # committed (its manifest written last).
    cfg = _s3_job(s3, digits_data, tmp_path / "kill", "kill")
    diag, ledger = _diag(nodisk_cluster, "kill")
    s3_faults.add("PUT", r"^runs/kill/checkpoint_step00000040/", "delay", times=4, seconds=1.5)
    killed: list[dict] = []

    def kill_once(seen) -> None:
        if killed or seen.method != "PUT" or "checkpoint_step00000040/" not in seen.key:
            return
        workers = _cluster_faults().train_workers()
        if workers:
            victim = sorted(workers, key=lambda w: w["pid"])[-1]
            killed.append({**victim, "key": seen.key, "t": time.time()})
            os.kill(victim["pid"], signal.SIGKILL)

    s3_faults.on_request(lambda seen: threading.Thread(target=kill_once, args=(seen,)).start())
    s = train(cfg, diagnostics=diag, progress=False)
    print(f"killed {killed}; events {[e for e in s.events if e['type'] == 'failure']}")
    assert killed, "no checkpoint upload of step 40 was seen"
    report = _assert_ledger_clean(ledger, digits_data)
    assert s.steps == STEPS and s.restarts == 1
    resumed = report["attempts"][1]["resumed_from"]
    assert resumed in (20, 40), report["attempts"]  # 40 only if it committed before the kill
    committed = [k for k in s3.keys("runs/kill/") if k.endswith("manifest.json")]
    print(f"committed checkpoints: {committed}")
    got, ref = model_state(s.checkpoint_path), model_state(baseline.checkpoint_path)
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.allclose(got[k].float(), ref[k].float(), rtol=1e-5, atol=1e-6), k


@pytest.mark.slow
def test_throttled_checkpoint_upload_is_retried(nodisk_cluster, digits_data, s3, s3_faults, tmp_path):
    """503 SlowDown for the first two PUTs of every object of the step-20 checkpoint: the
    writer retries with backoff and the checkpoint commits; the job finishes untouched."""
    # A collective timeout that a loaded 2-core machine's slow step never reaches: the
    # test is about the throttled upload, which the writer's retries absorb.
    cfg = _s3_job(s3, digits_data, tmp_path, "throttled", {"collective_timeout_s": 120})
    diag, ledger = _diag(nodisk_cluster, "throttled")
    s3_faults.add("PUT", r"^runs/throttled/checkpoint_step00000020/.*distcp", "slowdown", times=4)
    s = train(cfg, diagnostics=diag, progress=False)
    assert s3_faults.count("PUT", r"checkpoint_step00000020/", "slowdown") == 4
    assert s.steps == STEPS and s.restarts == 0
    assert not [e for e in s.events if e["type"] == "failure"], s.events
    # The throttled checkpoint committed: its manifest was written, through the proxy
    # (keep_checkpoints prunes it before the job ends).
    assert s3_faults.count("PUT", r"^runs/throttled/checkpoint_step00000020/manifest\.json$") == 1
    _assert_ledger_clean(ledger, digits_data)


@pytest.mark.slow
def test_stalled_checkpoint_upload_is_bounded(nodisk_cluster, digits_data, s3, s3_faults, tmp_path):
    """Every PUT of the step-20 checkpoint's rank-1 shard is accepted and never answered:
    the step-20 checkpoint is never committed and the job never hangs: it finishes from
    the next checkpoints, or stops naming the rank, the step and the phase (the write
    itself gives up within the store's request bound and names the rank and the key)."""
    cfg = _s3_job(s3, digits_data, tmp_path, "stalled")
    diag, _ = _diag(nodisk_cluster, "stalled")
    s3_faults.add("PUT", r"^runs/stalled/checkpoint_step00000020/__1_0\.distcp", "stall", times=None,
                  seconds=900)
    result: dict = {}

    def run():
        try:
            result["summary"] = train(cfg, diagnostics=diag, progress=False)
        except BaseException as e:  # noqa: BLE001 - inspected below
            result["error"] = e

    t = time.time()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(600)
    elapsed = time.time() - t
    assert not th.is_alive(), f"the job hangs on a stalled upload after {elapsed:.0f} s"
    if "error" in result:
        msg = str(result["error"])
        # Rank 0 waits for rank 1 at the checkpoint's gather for scaling.collective_timeout_s
        # (30 s), less than the store's request bound (60 s, 5 attempts): the job stops on
        # the second same hang, naming the rank, the step and the phase (not the key).
        assert "rank 1" in msg and "step 20 (checkpoint)" in msg, msg
    assert s3_faults.count("PUT", r"checkpoint_step00000020/__1_0\.distcp", "stall") >= 1
    assert "runs/stalled/checkpoint_step00000020/manifest.json" not in s3.keys("runs/stalled/")
    if "summary" in result:
        text = " ".join(map(str, result["summary"].events))
        assert "checkpoint_step00000020/__1_0.distcp" in text, result["summary"].events


@pytest.mark.slow
def test_twenty_kills_at_random_points_of_the_upload(nodisk_cluster, digits_data, s3, s3_faults, tmp_path):
    """20 SIGKILLs, each at a random request of a checkpoint's background upload (a shard,
    the run state or the manifest, the n-th PUT of the checkpoint with n drawn at random),
    one per attempt: every restart resumes from a committed checkpoint (none rejected as
    partial or damaged), the ledger is clean and the final model is the uninterrupted
    run's."""
    import random

    from elastic_ddp.checkpoint.export import model_state

    kills = 20
    job = {"train": {**DIGITS_FAST["train"], "epochs": 6, "checkpoint_every_steps": 5,
                     "async_checkpoint": True},
           "scaling": {**DIGITS_FAST["scaling"], "max_failures": kills + 2}}

    def cfg_for(name: str) -> Config:
        c = _s3_job(s3, digits_data, tmp_path / name, name)
        raw = c.model_dump(mode="json")
        raw["train"].update(job["train"])
        raw["scaling"].update(job["scaling"])
        return Config.from_dict(raw)

    base_diag, base_ledger = _diag(nodisk_cluster, "base20")
    baseline = train(cfg_for("base20"), diagnostics=base_diag, progress=False)
    _assert_ledger_clean(base_ledger, digits_data, epochs=6)

    # Every checkpoint PUT is held 0.2 s, so a kill lands while the upload is under way.
    s3_faults.add("PUT", r"^runs/kill20/checkpoint_step", "delay", times=None, seconds=0.2)
    rng = random.Random(0)
    state = {"ckpt": None, "n": 0, "target": rng.randint(1, 6), "armed_pids": None}
    killed: list[dict] = []
    lock = threading.Lock()

    def maybe_kill(seen) -> None:
        if seen.method != "PUT" or "/checkpoint_step" not in seen.key or not seen.key.startswith("runs/kill20/"):
            return
        ckpt = seen.key.split("/")[2]
        with lock:
            if len(killed) >= kills:
                return
            if ckpt != state["ckpt"]:
                state.update(ckpt=ckpt, n=0)
            state["n"] += 1
            if state["n"] != state["target"]:
                return
            # Not the checkpoint of the previous kill again: the attempt after a kill
            # redoes that checkpoint, and a second SIGKILL at its upload would be a death at
            # the same step on two attempts in a row, which the controller stops as
            # deterministic (an OOM kill looks the same) instead of restarting.
            if killed and killed[-1]["ckpt"] == ckpt:
                return
            workers = _cluster_faults().train_workers()
            pids = sorted(w["pid"] for w in workers)
            # One kill per attempt: the group must have been replaced since the last one.
            if not workers or (killed and set(pids) & set(killed[-1]["group"])):
                return
            victim = rng.choice(pids)
            killed.append({"pid": victim, "key": seen.key, "n": state["n"], "group": pids, "ckpt": ckpt})
            state["target"] = rng.randint(1, 6)
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass

    s3_faults.on_request(lambda seen: threading.Thread(target=maybe_kill, args=(seen,)).start())
    diag, ledger = _diag(nodisk_cluster, "kill20")
    s = train(cfg_for("kill20"), diagnostics=diag, progress=False)
    print(f"{len(killed)} kills at: {[(k['key'].split('/', 2)[2], k['n']) for k in killed]}")
    assert len(killed) == kills, killed
    assert s.restarts >= kills
    assert not [e for e in s.events if e["type"] == "checkpoint_rejected"], s.events
    report = _assert_ledger_clean(ledger, digits_data, epochs=6)
    resumed = [a["resumed_from"] for a in report["attempts"][1:]]
    print(f"resumed from steps {resumed}")
    assert all(r % 5 == 0 for r in resumed), resumed  # checkpoint steps only
    got, ref = model_state(s.checkpoint_path), model_state(baseline.checkpoint_path)
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.allclose(got[k].float(), ref[k].float(), rtol=1e-5, atol=1e-6), k
