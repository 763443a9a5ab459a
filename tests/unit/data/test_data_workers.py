"""The DataLoader worker pool of ``data.reader: dataloader`` (real worker processes over
real Parquet files): the same workers serve every epoch and data view of a process; a
stream dropped part-way holds nothing up; a chunk's error reaches the run that takes it,
with its type, and the pool goes on; a dead worker fails the run with the DataLoader's
error and the next stream gets new workers; a trainer killed with SIGKILL takes its
forkserver and its workers with it within seconds.

Ray: a Ray Train worker of a ``data.reader: dataloader`` job killed with SIGKILL (as the
fault and soak tests kill them, as the OOM killer does): its DataLoader forkserver and
workers end within seconds, and the job restarts and finishes (a real local Ray cluster,
a real job, a real signal)."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import alive_train_workers, digits_config
from elastic_ddp import train
from elastic_ddp.config import Config
from elastic_ddp.data.chunks import own_rows
from elastic_ddp.data.workers import READ_AHEAD_CHUNKS, WindowStream, data_workers
from elastic_ddp.tasks.transform import SEQ
from helpers.data_workers import ListRows, Pids, forkserver_of, gone_within, processes
from helpers.data_workers import rounds as _rounds, windows as _windows
from helpers.slow_task import SLOW_TASK

N = 480


def _data(tmp: Path) -> Path:
    for f, part in enumerate(np.array_split(np.arange(N), 3)):
        pq.write_table(pa.table({"sample_id": pa.array(part, pa.int64()), "x": pa.array(part, pa.int64())}),
                       tmp / f"part-{f}.parquet", row_group_size=20)
    return tmp


def test_the_same_workers_serve_every_epoch_and_stream(tmp_path):
    info, w0 = _windows(_data(tmp_path), 0)
    _, w1 = _windows(tmp_path, 1)
    task = Pids()
    pids, rows = set(), []
    for epoch, windows in ((0, w0), (1, w1)):
        rounds = _rounds(len(windows), 3)
        s = WindowStream(info, task, windows, rounds, 0, epoch, "train")
        got, a = [], 0
        for b in rounds:
            got += s.round(a, b)
            a = b
        assert [int(x[SEQ][0]) for x in got] == list(range(len(windows)))
        pids |= {int(p) for x in got for p in x["pid"]}
        rows.append(np.sort(np.concatenate([x["x"] for x in got])))
    assert all(np.array_equal(r, np.arange(N)) for r in rows)
    assert len(pids) == 2 and os.getpid() not in pids  # two workers, kept across epochs


def test_reading_leaves_the_trainers_global_torch_generator_alone(tmp_path):
    # The trainer seeds torch's global generator before each micro-step's dropout, and
    # the read-ahead thread starts the DataLoader's iterations while steps run: a draw
    # from that generator there would change a step's dropout masks (world sizes 1 and 2
    # then train apart).
    import torch

    info, w0 = _windows(_data(tmp_path), 0)
    _, w1 = _windows(tmp_path, 1)
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    for epoch, windows in ((0, w0), (1, w1)):  # two iterations of the same workers
        rounds = _rounds(len(windows), 2)
        s = WindowStream(info, Pids(), windows, rounds, 0, epoch, "train")
        a = 0
        for b in rounds:
            s.round(a, b)
            a = b
        assert torch.equal(torch.get_rng_state(), state), f"epoch {epoch}: the read drew from it"


def test_a_fixed_length_list_column_arrives_as_one_buffer(tmp_path):
    # A window's equal rows are handed over stacked, in one shared-memory tensor, and
    # come back as an object column of views of it: not one allocation per row in the
    # trainer's process (scattered through malloc's arenas, its RSS grows step by step).
    info, windows = _windows(_data(tmp_path), 0)
    got = WindowStream(info, ListRows(), windows, [len(windows)], 0, 0, "train").round(0, len(windows))
    assert len(got) == len(windows)
    for b in got:
        fixed, ragged = b["fixed"], b["ragged"]
        assert fixed.dtype == object and ragged.dtype == object and len(fixed) == len(b["x"]) > 1
        assert all(r.dtype == np.int16 and np.array_equal(r, np.arange(x, x + 3))
                   for r, x in zip(fixed, b["x"]))
        assert all(np.array_equal(r, np.arange(x % 3)) for r, x in zip(ragged, b["x"]))
        base = fixed[0].base
        assert base is not None and base.shape == (len(fixed), 3)
        assert all(r.base is base for r in fixed)  # views of one [B, 3] buffer
        assert all(r.base is None or r.base is not base for r in ragged)  # row by row
        # Rows kept for long (the permutation reader's share) get a buffer of their own.
        kept = own_rows({k: v[::2] for k, v in b.items()})
        assert kept["fixed"][0].base.shape == (len(kept["x"]), 3)
        assert all(np.array_equal(r, np.arange(x, x + 3)) for r, x in zip(kept["fixed"], kept["x"]))
        assert kept["ragged"] is not None and len(kept["ragged"]) == len(kept["x"])


def test_a_dropped_stream_holds_nothing_up(tmp_path):
    info, windows = _windows(_data(tmp_path), 0)
    task = Pids()
    rounds = _rounds(len(windows), 4)
    first = WindowStream(info, task, windows, rounds, 0, 0, "train")
    first.round(0, rounds[0])
    pool = first._pool
    rid = first._rid
    sent = pool._runs[rid].sent
    # Read ahead past the round asked for, bounded: the next round is not read whole.
    assert sent <= first._ends[0] + READ_AHEAD_CHUNKS < first.chunks
    del first
    gc.collect()
    assert rid not in pool._runs
    second = WindowStream(info, task, windows, [len(windows)], 0, 0, "train")
    assert second._pool is pool
    got = second.round(0, len(windows))
    assert np.array_equal(np.sort(np.concatenate([x["x"] for x in got])), np.arange(N))


def test_a_chunks_error_reaches_its_run_and_the_pool_goes_on(tmp_path):
    info, windows = _windows(_data(tmp_path), 0)
    last = len(windows) - 1
    task = Pids(bad=_row(info, windows[last].pieces[0]))  # a row of the last window only
    s = WindowStream(info, task, windows, [last, len(windows)], 0, 0, "train")
    assert len(s.round(0, last)) == last
    with pytest.raises(KeyError, match="is bad") as e:
        s.round(last, len(windows))
    assert any("in a DataLoader worker" in n for n in getattr(e.value, "__notes__", []))
    ok = WindowStream(info, task, windows[:last], [last], 0, 0, "train")
    assert ok._pool is s._pool and ok._pool.broken is None  # the same workers serve on
    assert len(ok.round(0, last)) == last


def _row(info, pc) -> int:
    """The data set row index of piece ``pc``'s first row."""
    start = sum(info.rows_per_file[:pc.file])
    for g in info.row_groups:
        if g.file == pc.file and g.index < pc.index:
            start += g.num_rows
    return start + pc.start


def test_a_dead_worker_fails_the_run_and_a_new_pool_serves(tmp_path):
    info, windows = _windows(_data(tmp_path), 0)
    task = Pids()
    rounds = _rounds(len(windows), 4)
    s = WindowStream(info, task, windows, rounds, 0, 0, "train")
    pids = {int(p) for x in s.round(0, rounds[0]) for p in x["pid"]}
    for p in pids:
        os.kill(p, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="DataLoader worker.*died"):
        a = rounds[0]
        for b in rounds[1:]:
            s.round(a, b)
            a = b
    assert s._pool.broken is not None
    fresh = data_workers(info, task)
    assert fresh is not s._pool
    t = WindowStream(info, task, windows, [len(windows)], 0, 0, "train")
    got = t.round(0, len(windows))
    assert np.array_equal(np.sort(np.concatenate([x["x"] for x in got])), np.arange(N))
    assert not pids & {int(p) for x in got for p in x["pid"]}


def test_a_killed_trainer_takes_its_forkserver_and_workers_with_it(tmp_path):
    """SIGKILL of the process that reads (a trainer killed by a test, the OOM killer):
    its forkserver and DataLoader workers end within seconds, where they used to wait
    for each other for as long as the machine ran (the forkserver for its workers' copies
    of its pipe, the workers for the forkserver)."""
    _data(tmp_path)
    code = textwrap.dedent(f"""
        import sys, time
        sys.path[:0] = [{str(Path(__file__).resolve().parents[2])!r}]  # tests/: its helpers
        from helpers.data_workers import Pids, rounds as _rounds, windows as _windows
        from elastic_ddp.data.workers import WindowStream

        info, w0 = _windows(__import__("pathlib").Path({str(tmp_path)!r}), 0)
        rounds = _rounds(len(w0), 3)
        WindowStream(info, Pids(), w0, rounds, 0, 0, "train").round(0, rounds[0])
        print("reading", flush=True)
        time.sleep(600)
    """)
    trainer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "reading"
        server, workers = forkserver_of(trainer.pid)
        assert len(workers) == 2, workers  # READ_TASKS DataLoader workers
    finally:
        trainer.kill()
        trainer.wait()
    assert gone_within([server, *workers], 10) == [], processes().get(server)


# --------------------------------------------------------------------------- Ray
def _reading_trainer() -> Optional[tuple[int, int, list[int]]]:
    """(a Ray Train worker, its forkserver, the forkserver's workers) once one reads."""
    procs = processes()
    for pid in alive_train_workers():
        servers = [p for p, (pp, _, cmd) in procs.items() if pp == pid and "forkserver import main" in cmd]
        for s in servers:
            workers = [p for p, (pp, st, _) in procs.items() if pp == s and st != "Z"]
            if len(workers) == 2:
                return pid, s, workers
    return None


@pytest.mark.slow
def test_a_killed_trainer_leaves_no_forkserver_or_data_workers(ray_cluster, digits_data, tmp_path,
                                                               mlflow_store):
    task_file = tmp_path / "slow_task.py"
    task_file.write_text(textwrap.dedent(SLOW_TASK))
    raw = digits_config(digits_data, tmp_path, {
        # Windows of 128 rows: several rounds per epoch, so each attempt's DataLoader
        # workers start after its first step (the first round is read in the trainer's
        # process).
        "data": {"reader": "dataloader", "shuffle_window_rows": 128}, "run": {"name": "forkserver-kill"},
        "train": {"epochs": 1, "checkpoint_every_steps": 5}, "scaling": {"max_failures": 1}})
    raw["task"]["path"] = f"{task_file}:SlowDigits"
    raw["model"].pop("name")
    raw["task"]["kwargs"]["sleep_per_loss"] = 0.2  # 23 steps of at least 0.4 s
    result: dict = {}

    def run():
        try:
            result["summary"] = train(Config.from_dict(raw), progress=False)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            result["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    found = None
    deadline = time.monotonic() + 300
    while found is None and th.is_alive() and time.monotonic() < deadline:
        found = _reading_trainer()
        time.sleep(0.2)
    assert found is not None, result
    trainer, server, workers = found
    os.kill(trainer, signal.SIGKILL)
    t0 = time.monotonic()
    left = gone_within([server, *workers], 10)
    assert left == [], {p: processes().get(p) for p in left}
    print(f"forkserver and {len(workers)} workers gone {time.monotonic() - t0:.1f} s after the kill")
    th.join(600)
    assert not th.is_alive()
    if "error" in result:
        raise result["error"]
    assert result["summary"].restarts == 1 and result["summary"].steps == 23
