"""The epoch order and the per-rank readers, without Ray: every global step is the same set
of samples at every world size, every rank reads only its own partitions, a resume reads
from the window that holds the cursor, and the readers hand each rank exactly its rows
(the readers run their read and transform functions in-process, ``local=True``)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elastic_ddp.config import Config
from elastic_ddp.data.ingest import epoch_order, val_batches
from elastic_ddp.data.readers import open_train_reader
from elastic_ddp.data.order import EpochOrder, RowGroup, offset_in_partition, owner
from elastic_ddp.data.scan import scan_parquet
from elastic_ddp.tasks.protocol import Column, Task


def _groups(sizes, per_file=3):
    return [RowGroup(i // per_file, i % per_file, n, 100 * n) for i, n in enumerate(sizes)]


SIZES = [50, 50, 37, 50, 50, 50, 12, 50, 50, 41]  # 440 rows in 10 row groups, 4 files


@pytest.mark.parametrize("mode,p,w,block", [("windowed", 8, 64, None), ("windowed", 12, 400, 7),
                                            ("windowed", 5, 1, None), ("permutation", 1, 0, None)])
def test_each_epoch_is_a_permutation_reproducible_and_new(mode, p, w, block):
    rows = {e: EpochOrder(_groups(SIZES), 3, e, p, w, block, mode).global_rows() for e in (0, 1)}
    every = {(i, r) for i, n in enumerate(SIZES) for r in range(n)}
    assert len(rows[0]) == len(set(rows[0])) == sum(SIZES) and set(rows[0]) == every
    assert rows[0] == EpochOrder(_groups(SIZES), 3, 0, p, w, block, mode).global_rows()
    assert rows[0] != rows[1]
    assert rows[0] != EpochOrder(_groups(SIZES), 4, 0, p, w, block, mode).global_rows()


def test_steps_are_the_same_samples_at_every_world_size_and_ranks_read_only_their_partitions():
    o = EpochOrder(_groups(SIZES), 0, 2, partitions=12, window_rows=120)
    g = 32
    for c in range(0, o.num_rows, g):
        n = min(g, o.num_rows - c)
        segs = o.segments(c, n)
        assert sum(b - a for _, a, b in segs) == n
        for ws in (1, 2, 3, 4, 5, 6, 12):
            rows = o.rank_rows(c, n, ws)
            assert sum(rows) == n
            if 12 % ws == 0:  # balanced: shares differ by at most one row per partition
                assert max(rows) - min(rows) <= 12 // ws
            for r in range(ws):
                mine = {p for p, _, _ in segs if owner(p, 12, ws) == r}
                assert mine <= set(o.owned(r, ws))
    # A rank's windows hold only its partitions' rows, and all of them.
    for ws in (2, 3):
        got = sum(w.num_rows for r in range(ws) for w in o.rank_windows(r, ws, 0))
        assert got == o.num_rows


def test_round_robin_offsets_match_the_global_order():
    o = EpochOrder(_groups(SIZES), 1, 0, partitions=7, window_rows=70)
    rows = o.global_rows()
    streams = {p: [] for p in range(7)}
    for i, row in enumerate(rows):
        streams[i % 7].append(row)
    for c in (0, 1, 6, 7, 100, 439, 440):
        for p in range(7):
            assert offset_in_partition(p, 7, c) == sum(1 for i in range(c) if i % 7 == p)
    assert [len(s) for s in streams.values()] == o.sizes


def test_resume_reads_from_the_window_that_holds_the_cursor():
    o = EpochOrder(_groups(SIZES * 4), 0, 0, partitions=4, window_rows=200)
    full = o.rank_windows(1, 2, 0)
    later = o.rank_windows(1, 2, 900)
    assert len(later) < len(full)
    for w in later[:2]:  # the first window of each owned partition holds its offset
        off = offset_in_partition(w.partition, 4, 900)
        assert w.first <= off < w.first + w.num_rows
    assert o.rank_windows(0, 2, o.num_rows) == []


# ------------------------------------------------------------------ readers on real files
class Echo(Task):
    """x: the row's own id, so a reader's output can be checked row by row."""

    columns = {"x": Column.integer()}

    def loss(self, model, batch):  # pragma: no cover - never trained here
        raise NotImplementedError


T = {"sample_id": np.zeros(0, np.int64), "x": np.zeros(0, np.int64)}


def _data(tmp: Path, n=300, files=3, rg=16) -> Path:
    for f, part in enumerate(np.array_split(np.arange(n), files)):
        pq.write_table(pa.table({"sample_id": pa.array(part * 10, pa.int64()),
                                 "x": pa.array(part * 10, pa.int64())}),
                       tmp / f"part-{f}.parquet", row_group_size=rg)
    return tmp


def _cfg(tmp: Path, order="windowed", **data) -> Config:
    return Config.from_dict({"data": {"train_path": str(tmp), "order": order, **data},
                             "task": {"path": "tests:Echo"},
                             "batch": {"global_batch_size": 24, "policy": "uneven"},
                             "scaling": {"min_workers": 1, "max_workers": 4}})


@pytest.mark.parametrize("order,data", [("windowed", {"shuffle_window_rows": 64}),
                                        ("windowed", {"shuffle_window_rows": 1, "partitions": 12}),
                                        ("windowed", {"block_rows": 5}),
                                        ("permutation", {})])
def test_readers_give_every_rank_exactly_its_share_of_each_step(tmp_path, order, data):
    cfg = _cfg(_data(tmp_path), order, **data)
    info = scan_parquet(tmp_path, Echo.columns)
    o = epoch_order(info, cfg, 1)
    ids_of = {}
    for f in info.files:
        t = pq.ParquetFile(f)
        for g in range(t.num_row_groups):
            ids_of[(info.files.index(f), g)] = t.read_row_group(g)["sample_id"].to_numpy()
    expected = np.array([ids_of[(info.row_groups[i].file, info.row_groups[i].index)][r]
                         for i, r in o.global_rows()])
    g = cfg.batch.global_batch_size
    for ws in (1, 2, 3, 4):
        readers = [open_train_reader(info, Echo(), cfg, r, ws, 1, 0, g, local=True, template=T)[1] for r in range(ws)]
        for c in range(0, o.num_rows, g):
            n = min(g, o.num_rows - c)
            got = [rd.take(c, n) for rd in readers]
            assert [len(b["sample_id"]) for b in got] == o.rank_rows(c, n, ws)
            step = np.sort(np.concatenate([b["sample_id"] for b in got]))
            assert np.array_equal(step, np.sort(expected[c:c + n])), (ws, c)
            for b in got:  # the transform ran: x still equals the id
                assert np.array_equal(b["x"], b["sample_id"])


def test_a_reader_opened_at_the_cursor_continues_the_epoch_exactly(tmp_path):
    cfg = _cfg(_data(tmp_path, rg=4), shuffle_window_rows=48)
    info = scan_parquet(tmp_path, Echo.columns)
    g, ws = 24, 3
    fresh = [open_train_reader(info, Echo(), cfg, r, ws, 0, 0, g, local=True, template=T)[1] for r in range(ws)]
    steps = [[rd.take(c, min(g, 300 - c))["sample_id"] for rd in fresh] for c in range(0, 300, g)]
    cursor = 5 * g
    # At another world size after the restart: the union per step is unchanged.
    again = [open_train_reader(info, Echo(), cfg, r, 2, 0, cursor, g, local=True, template=T)[1] for r in range(2)]
    for k, c in enumerate(range(cursor, 300, g)):
        n = min(g, 300 - c)
        got = np.sort(np.concatenate([rd.take(c, n)["sample_id"] for rd in again]))
        assert np.array_equal(got, np.sort(np.concatenate(steps[5 + k])))
    # A resume does not re-read the epoch from its start: the windows before the cursor's
    # are skipped (5 of 12.5 steps done here).
    rest = sum(rd.bytes_read for rd in again)
    from_start = sum(open_train_reader(info, Echo(), cfg, r, 2, 0, 0, g, local=True, template=T)[1].bytes_read
                     for r in range(2))
    assert rest < 0.8 * from_start, (rest, from_start)


def test_bytes_read_per_rank_follow_the_share(tmp_path):
    """No read amplification: with row groups smaller than a window, each rank reads its
    partitions' row groups once; the total over ranks stays near the data set."""
    cfg = _cfg(_data(tmp_path, n=2000, files=4, rg=10), shuffle_window_rows=400, partitions=8)
    info = scan_parquet(tmp_path, Echo.columns)
    whole = sum(gr.nbytes for gr in info.row_groups)
    for ws in (1, 2, 4):
        per_rank = [open_train_reader(info, Echo(), cfg, r, ws, 0, 0, 24, local=True, template=T)[1].bytes_read
                    for r in range(ws)]
        window = whole * 400 / 2000 / 8 * 2
        assert all(b <= 1.1 * whole / ws + window for b in per_rank), (ws, per_rank, whole)
        assert sum(per_rank) <= 1.1 * whole


@pytest.mark.parametrize("order,data", [("windowed", {"shuffle_window_rows": 64}),
                                        ("windowed", {"shuffle_window_rows": 1, "partitions": 5}),
                                        ("permutation", {})])
def test_world_size_1_shards_hold_the_rows_of_world_size_2_ranks_in_their_order(tmp_path, order, data):
    """``EpochOrder.shard_index``: shard s of world size 1's batch is, row for row, what
    rank s of world size 2 reads for the same step (the remainder step included; 5
    partitions: ranks of unequal shares)."""
    cfg = _cfg(_data(tmp_path), order, **data)
    info = scan_parquet(tmp_path, Echo.columns)
    g = 24  # 300 rows: 12 steps and a remainder of 12
    o, one = open_train_reader(info, Echo(), cfg, 0, 1, 1, 0, g, [g], local=True, template=T)
    two = [open_train_reader(info, Echo(), cfg, r, 2, 1, 0, g, [g // 2] * 2, local=True, template=T)[1]
           for r in range(2)]
    for c in range(0, 300, g):
        n = min(g, 300 - c)
        ids = one.take(c, n)["sample_id"]
        shards = o.shard_index(c, n, 2)
        assert sorted(np.concatenate(shards).tolist()) == list(range(n))
        for r in range(2):
            assert ids[shards[r]].tolist() == two[r].take(c, n)["sample_id"].tolist(), (c, r)


def test_val_batches_same_count_on_every_rank_and_every_row_once(tmp_path):
    _data(tmp_path, n=50, files=2, rg=7)
    info = scan_parquet(tmp_path, Echo.columns)
    template = {"sample_id": np.zeros(0, np.int64), "x": np.zeros(0, np.int64)}
    for max_batches, rows in ((None, 50), (5, 20)):  # 5 batches of 4: the first 20 rows
        ref = None
        for ws in (1, 2, 3, 7, 64):  # 64 ranks: most have no row at all
            n_batches = math.ceil(math.ceil(rows / 4) / ws)
            got = []
            for r in range(ws):
                batches = list(val_batches(info, Echo(), 0, 0, r, ws, 4, max_batches, template, local=True))
                assert len(batches) == n_batches
                got.extend(b["sample_id"].tolist() for b in batches if len(b["sample_id"]))
            # The same batches, of the same rows in the same order, at every world size.
            ref = ref or got
            assert got == ref, (ws, max_batches)
            assert sorted(i for b in got for i in b) == list(range(0, 10 * rows, 10))


VAL_IN_PROCESS = """
import json, sys
import numpy as np
from elastic_ddp.data.ingest import val_batches
from elastic_ddp.data.scan import scan_parquet
from elastic_ddp.tasks.protocol import Column, Task

class Echo(Task):
    columns = {"x": Column.integer()}
    def loss(self, model, batch):
        raise NotImplementedError

info = scan_parquet(sys.argv[1], Echo.columns)
T = {"sample_id": np.zeros(0, np.int64), "x": np.zeros(0, np.int64)}
ids = [[b["sample_id"].tolist() for b in val_batches(info, Echo(), 0, 0, r, 2, 4, None, T)]
       for r in range(2)]
import ray
print(json.dumps({"ids": ids, "ray_started": ray.is_initialized()}))
"""


def test_a_small_val_share_is_read_in_the_ranks_process_not_by_ray_data(tmp_path):
    """An evaluation of a few MiB builds no Ray Data pipeline (whose start costs seconds
    per evaluation), with the same batches as the reader run in-process."""
    import json
    import subprocess
    import sys

    _data(tmp_path, n=50, files=2, rg=7)
    out = subprocess.run([sys.executable, "-c", VAL_IN_PROCESS, str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ray_started"] is False  # a Ray Data execution starts (or joins) Ray
    info = scan_parquet(tmp_path, Echo.columns)
    want = [[b["sample_id"].tolist() for b in val_batches(info, Echo(), 0, 0, r, 2, 4, None, T, local=True)]
            for r in range(2)]
    assert got["ids"] == want and sum(len(b) for r in want for b in r) == 50


def test_a_view_change_reuses_the_windows_held_and_reads_the_rest_first(tmp_path):
    """Per-step fault tolerance: rank 0 of 2 trains alone (view (0, 1)) from step 3 on.
    Its new reader takes the windows its (0, 2) reader holds and reads only the other
    partitions' windows, those the next step needs first; every step is still exactly
    the samples of the uninterrupted order."""
    cfg = _cfg(_data(tmp_path, n=600, rg=8), shuffle_window_rows=120, partitions=4)
    info = scan_parquet(tmp_path, Echo.columns)
    g = 24
    ref = open_train_reader(info, Echo(), cfg, 0, 1, 0, 0, g, local=True, template=T)[1]
    want = [ref.take(c, min(g, 600 - c))["sample_id"] for c in range(0, 600, g)]
    pair = [open_train_reader(info, Echo(), cfg, r, 2, 0, 0, g, local=True, template=T)[1] for r in range(2)]
    for c in range(0, 3 * g, g):
        for rd in pair:
            rd.take(c, g)
    held = pair[0].held_windows()
    assert held and {p for p, _ in held} == {0, 2}, held.keys()
    cursor = 3 * g
    alone = open_train_reader(info, Echo(), cfg, 0, 1, 0, cursor, g, local=True, template=T,
                              held=held)[1]
    fresh = open_train_reader(info, Echo(), cfg, 0, 1, 0, cursor, g, local=True, template=T)[1]
    assert 0 < alone.bytes_read < fresh.bytes_read
    # The first round: generation 0 of the partitions not held (1 and 3) and nothing else.
    first = alone._todo[:alone._rounds[0]]
    assert {w.partition for w in first} == {1, 3} and len(first) == 2, first
    for k, c in enumerate(range(cursor, 600, g)):
        got = alone.take(c, min(g, 600 - c))["sample_id"]
        assert np.array_equal(np.sort(got), np.sort(want[3 + k])), c


def test_read_tasks_cover_every_window_once_in_order():
    from elastic_ddp.data.ingest import read_chunks

    for n in (0, 1, 2, 3, 7, 60):
        for tasks in (1, 2, 5):
            chunks = read_chunks(n, tasks)
            assert len(chunks) == min(n, tasks)
            assert [i for a, b in chunks for i in range(a, b)] == list(range(n))
            if chunks:
                sizes = [b - a for a, b in chunks]
                assert max(sizes) - min(sizes) <= 1


def test_a_round_is_cut_into_read_tasks_by_its_bytes(tmp_path, monkeypatch):
    """A round of many bytes gets one read task per window (READ_TASKS in flight keep
    every slot busy to its end), a small one READ_TASKS; never more tasks than windows."""
    from elastic_ddp.data import ingest

    cfg = _cfg(_data(tmp_path, n=2000, files=4, rg=10), shuffle_window_rows=400, partitions=8)
    info = scan_parquet(tmp_path, Echo.columns)
    windows = open_train_reader(info, Echo(), cfg, 0, 1, 0, 0, 24, local=True, template=T)[1]._todo
    total = ingest.window_bytes(info, windows)
    assert ingest.read_task_count(info, windows) == ingest.READ_TASKS        # a few kB
    assert ingest.read_task_count(info, []) == 0
    monkeypatch.setattr(ingest, "READ_TASK_BYTES", total / 10)
    assert ingest.read_task_count(info, windows) == 10
    monkeypatch.setattr(ingest, "READ_TASK_BYTES", 1)
    assert ingest.read_task_count(info, windows) == len(windows)             # one per window
    chunks = ingest.read_chunks(len(windows), ingest.read_task_count(info, windows))
    assert [b - a for a, b in chunks] == [1] * len(windows)


def test_a_batch_spanning_two_windows_is_split_between_them(tmp_path):
    """Should Ray Data hand over two windows' blocks as one batch, each window still
    gets exactly its rows."""
    from elastic_ddp.data import ingest

    cfg = _cfg(_data(tmp_path, n=200, rg=10), shuffle_window_rows=80, partitions=4)
    info = scan_parquet(tmp_path, Echo.columns)
    rd = open_train_reader(info, Echo(), cfg, 0, 1, 0, 0, 20, local=True, template=T)[1]
    ref = open_train_reader(info, Echo(), cfg, 0, 1, 0, 0, 20, local=True, template=T)[1]
    merged = ingest.concat_rows([rd._next_batch(), rd._next_batch()])
    assert len(np.unique(merged[ingest.SEQ])) == 2
    rd._ready.appendleft(merged)
    for c in range(0, 200, 20):
        assert np.array_equal(rd.take(c, 20)["sample_id"], ref.take(c, 20)["sample_id"]), c


def test_default_partitions_fit_few_row_groups_so_reads_stay_within_the_bound(tmp_path):
    """Partition boundaries cut row groups, and a cut row group is read by both owners:
    with 60 partitions over 336 row groups each rank of 2 reads ~15% more than its share.
    Unset, ``data.partitions`` is fitted to the row groups (12 here): within the
    bound of 1.1 x data / N + one window (here one row group)."""
    from elastic_ddp.data.ingest import epoch_partitions

    _data(tmp_path, n=3000, files=4, rg=9)
    info = scan_parquet(tmp_path, Echo.columns)
    whole = sum(g.nbytes for g in info.row_groups)
    bound = 1.1 * whole / 2 + max(g.nbytes for g in info.row_groups)
    got = {}
    for parts in (None, 60):
        cfg = Config.from_dict({"data": {"train_path": str(tmp_path), "shuffle_window_rows": 60,
                                         **({"partitions": parts} if parts else {})},
                                "task": {"path": "tests:Echo"},
                                "batch": {"global_batch_size": 24, "policy": "uneven"},
                                "scaling": {"min_workers": 1, "max_workers": 2}})
        got[parts] = (epoch_partitions(info, cfg), max(
            open_train_reader(info, Echo(), cfg, r, 2, 0, 0, 24, local=True, template=T)[1].bytes_read
            for r in range(2)))
    assert got[None][0] == 12 and got[60][0] == 60
    assert got[None][1] <= bound < got[60][1], (got, bound)


def test_fit_partitions_keeps_the_balanced_world_sizes_and_depends_on_no_world_size():
    from elastic_ddp.batching import default_partitions, fit_partitions

    for max_workers in (1, 2, 3, 4, 5, 6, 12):
        base = default_partitions(max_workers)
        balanced = {ws for ws in range(1, max_workers + 1) if base % ws == 0}
        for row_groups in (1, 8, 64, 265, 600, 5000):
            p = fit_partitions(base, max_workers, row_groups, rows=10**6)
            assert base % p == 0 and p >= max_workers
            assert {ws for ws in range(1, max_workers + 1) if p % ws == 0} == balanced
            if row_groups >= 10 * base:
                assert p == base  # many row groups: the default unchanged
    assert fit_partitions(60, 2, 265, 10**6) == 12    # bench_data's smallest set
    assert fit_partitions(60, 2, 8, 10**6) == 12      # digits
    # Up to 4 workers, one order on the same data (a sweep's children compare curves).
    assert {fit_partitions(60, mw, rg, 10**6) for mw in (1, 2, 3, 4) for rg in (8, 265)} == {12}
    assert fit_partitions(60, 2, 8, rows=1) == 1      # never more partitions than rows


def test_fit_partitions_keeps_a_round_near_the_window_whatever_the_data_size():
    """A partition's window is at least one row group: with W / P below a row group's rows,
    a round (a restart's first read) grows with P. Fitted to the window, the partitions
    (and the round) are the same for a 20x larger data set of the same row groups."""
    from elastic_ddp.batching import fit_partitions

    W, rg = 65536, 8192
    for row_groups in (265, 1325, 5300):
        assert fit_partitions(60, 2, row_groups, row_groups * rg) == (12 if row_groups < 600 else 60)
        p = fit_partitions(60, 2, row_groups, row_groups * rg, window_rows=W, unit_rows=rg)
        assert p == 12, (row_groups, p)
    # Small row groups: the window allows more partitions, the row-group count decides.
    assert fit_partitions(60, 2, 5300, 5300 * 512, window_rows=W, unit_rows=512) == 60
    assert fit_partitions(60, 2, 5300, 5300 * 2048, window_rows=W, unit_rows=2048) == 12
    # Larger windows allow more partitions again (W / unit_rows = 64 >= 60).
    assert fit_partitions(60, 2, 5300, 5300 * rg, window_rows=64 * rg, unit_rows=rg) == 60


def test_epoch_partitions_counts_blocks_as_the_shuffled_units(tmp_path):
    from elastic_ddp.data.ingest import epoch_partitions

    _data(tmp_path, n=12000, files=4, rg=20)   # 600 row groups of 20 rows
    info = scan_parquet(tmp_path, Echo.columns)

    def parts(**data):
        return epoch_partitions(info, Config.from_dict({
            "data": {"train_path": str(tmp_path), **data}, "task": {"path": "tests:Echo"},
            "batch": {"global_batch_size": 24, "policy": "uneven"},
            "scaling": {"min_workers": 1, "max_workers": 2}}))

    assert parts(shuffle_window_rows=1200) == 60   # 60 windows of one row group each
    assert parts(shuffle_window_rows=600) == 12    # 60 would hold 2x the window per round
    assert parts(shuffle_window_rows=600, block_rows=10) == 60   # blocks of 10 rows fit
    assert parts(shuffle_window_rows=600, partitions=60) == 60   # set: used as is


def test_prefetch_reads_the_first_round_in_the_background_and_changes_no_row(tmp_path):
    """The next epoch's reader (Trainer.prefetch_next) starts its first round early; its
    rows are those of a reader opened at the epoch's start. ``last_round_started`` turns
    true only once every round is read or being read."""
    cfg = _cfg(_data(tmp_path, n=600, rg=8), shuffle_window_rows=48, partitions=4)
    info = scan_parquet(tmp_path, Echo.columns)
    g = 24
    early = open_train_reader(info, Echo(), cfg, 1, 2, 1, 0, g, local=True, template=T)[1]
    plain = open_train_reader(info, Echo(), cfg, 1, 2, 1, 0, g, local=True, template=T)[1]
    assert len(early._rounds) > 1 and not early.last_round_started
    early.prefetch()
    assert early._pending is not None and not early.last_round_started
    for c in range(0, 600, g):
        assert np.array_equal(early.take(c, min(g, 600 - c))["sample_id"],
                              plain.take(c, min(g, 600 - c))["sample_id"]), c
    assert early.last_round_started and plain.last_round_started


def test_a_small_first_round_is_read_here_and_the_next_round_waits_for_the_first_step(tmp_path):
    """At a (re)start the first round is read in the trainer's process when its row groups
    hold at most ``local_first_bytes`` (Ray Data's first execution would start worker
    processes first); the next round starts once the first step is done, not on the cores
    that step runs on. A prefetched reader (background) keeps Ray Data. No row changes."""
    cfg = _cfg(_data(tmp_path, n=600, rg=8), shuffle_window_rows=48, partitions=4)
    info = scan_parquet(tmp_path, Echo.columns)
    g = 24

    def reader(**kw):
        return open_train_reader(info, Echo(), cfg, 1, 2, 1, 0, g, local=True, template=T,
                                 reader="ray_data", **kw)[1]

    fast, ref = reader(local_first_bytes=2**30), reader()
    assert fast._local_first and not ref._local_first
    assert not reader(local_first_bytes=1)._local_first    # a round larger than the bound
    pre = reader(local_first_bytes=2**30)
    pre.prefetch()
    assert not pre._local_first and pre._pending is not None
    first = fast._rounds[0]
    assert np.array_equal(fast.take(0, g)["sample_id"], ref.take(0, g)["sample_id"])
    assert fast._pending is None and fast._read_at == first        # deferred
    assert ref._pending is not None and ref._read_at > first        # started at once
    for c in range(g, 600, g):
        assert np.array_equal(fast.take(c, min(g, 600 - c))["sample_id"],
                              ref.take(c, min(g, 600 - c))["sample_id"]), c
        assert fast._read_at > first, c                              # from the second step on
    assert fast.last_round_started
