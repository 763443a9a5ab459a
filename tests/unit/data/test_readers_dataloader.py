"""``data.reader: dataloader`` (DataLoader worker processes, :class:`WindowStream`) hands
each rank the same rows in the same order as the in-process reference and as the Ray Data
path (``data.reader: ray_data``): every step of every rank, from the epoch's start, from a
mid-epoch cursor, and at another world size after that resume; several rounds per epoch,
the transform's per-sample randomness included."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elastic_ddp.config import Config
from elastic_ddp.data.ingest import epoch_order
from elastic_ddp.data.workers import WindowStream
from elastic_ddp.data.readers import open_train_reader, reader_kind
from elastic_ddp.data.scan import scan_parquet
from elastic_ddp.tasks.protocol import Column, Task
from elastic_ddp.tasks.transform import SEQ

N, G = 600, 24


class Noisy(Task):
    """``x``: the row's id; the transform adds a draw from the row's own generator
    (``(seed, epoch, sample_id)``) and a float column, so that a row handed to the wrong
    step, epoch or id shows; a ragged object column and one of equal rows (a fixed-length
    list column: stacked for the handover, ``data.chunks.StackedRows``)."""

    columns = {"x": Column.integer()}
    fixed = True  # with the column of equal rows

    def __init__(self, fixed: bool = True):
        self.fixed = fixed

    def transform(self, batch, ctx):
        noise = np.array([int(g.integers(0, 1000)) for g in ctx.rngs()], dtype=np.int64)
        ragged = np.empty(len(noise), dtype=object)  # an object column: pickled, not shared
        for i, v in enumerate(noise):
            ragged[i] = np.arange(v % 5, dtype=np.int32)
        fixed = np.empty(len(noise), dtype=object)  # equal rows: stacked for the handover
        for i, v in enumerate(noise):
            fixed[i] = np.array([v, v + 1, v + 2], dtype=np.int16)
        out = {"x": batch["x"] * 1000 + noise, "f": batch["x"].astype(np.float32) / 7, "r": ragged}
        return {**out, "l": fixed} if self.fixed else out

    def loss(self, model, batch):  # pragma: no cover - never trained here
        raise NotImplementedError


T = {"sample_id": np.zeros(0, np.int64), "x": np.zeros(0, np.int64), "f": np.zeros(0, np.float32),
     "r": np.zeros(0, object), "l": np.zeros(0, object)}


def _data(tmp: Path, n=N, files=3, rg=8) -> Path:
    for f, part in enumerate(np.array_split(np.arange(n), files)):
        pq.write_table(pa.table({"sample_id": pa.array(part * 10, pa.int64()),
                                 "x": pa.array(part * 10, pa.int64())}),
                       tmp / f"part-{f}.parquet", row_group_size=rg)
    return tmp


def _cfg(tmp: Path, order="windowed", cpus_per_worker: float = 1.0, **data) -> Config:
    return Config.from_dict({"data": {"train_path": str(tmp), "order": order, **data},
                             "task": {"path": "tests:Echo"},
                             "batch": {"global_batch_size": G, "policy": "uneven"},
                             "scaling": {"min_workers": 1, "max_workers": 4,
                                         "cpus_per_worker": cpus_per_worker}})


def _steps(info, cfg, kind: str, ws: int, cursor: int, epoch: int = 1,
           fixed: bool = True, tasks: list | None = None) -> list[list[dict]]:
    """Every step from ``cursor`` to the epoch's end: each rank's rows, ``kind`` one of
    local (in-process reference), dataloader, ray_data; ``fixed``: with ``Noisy``'s
    column of equal rows. ``tasks``: rank r's task object (a new ``Noisy(fixed)`` per
    rank when not given; the same object keeps the same workers)."""
    tmpl = T if fixed else {k: v for k, v in T.items() if k != "l"}
    readers = [open_train_reader(info, tasks[r] if tasks else Noisy(fixed), cfg, r, ws, epoch, cursor, G,
                                 local=kind == "local", template=tmpl,
                                 reader=None if kind == "local" else kind)[1]
               for r in range(ws)]
    return [[rd.take(c, min(G, N - c)) for rd in readers] for c in range(cursor, N, G)]


def _same(a: list[list[dict]], b: list[list[dict]]) -> None:
    assert len(a) == len(b)
    for k, (sa, sb) in enumerate(zip(a, b)):
        for r, (x, y) in enumerate(zip(sa, sb)):
            assert sorted(x) == sorted(y), (k, r)
            for col in x:
                assert x[col].dtype == y[col].dtype and len(x[col]) == len(y[col]), (k, r, col)
                if x[col].dtype == object:
                    assert all(np.array_equal(u, v) and u.dtype == v.dtype
                               for u, v in zip(x[col], y[col])), (k, r, col)
                else:
                    assert np.array_equal(x[col], y[col]), (k, r, col)


# About 37 s each on 2 cores (DataLoader worker processes for every rank of five world
# sizes and cursors): the default suite runs the common windowed layout; the two edge
# layouts (one-row windows over 12 partitions, 5-row blocks) and the permutation order
# run in the slow tier (the permutation order's rows through the product's reader:
# tests/e2e/resume/test_exact_world_sizes.py, its order: tests/unit/data/test_order.py).
CASES = [("windowed", {"shuffle_window_rows": 48, "partitions": 4}),
         pytest.param("windowed", {"shuffle_window_rows": 1, "partitions": 12}, marks=pytest.mark.slow),
         pytest.param("windowed", {"block_rows": 5, "shuffle_window_rows": 96}, marks=pytest.mark.slow),
         pytest.param("permutation", {}, marks=pytest.mark.slow)]


def test_auto_is_the_dataloader(tmp_path):
    assert reader_kind(_cfg(tmp_path)) == "dataloader"
    assert reader_kind(_cfg(tmp_path, reader="ray_data")) == "ray_data"


@pytest.mark.parametrize("order,data", CASES)
def test_dataloader_reader_matches_the_in_process_reference(tmp_path, order, data):
    """Several rounds per epoch (windowed), from the start and from a mid-epoch cursor,
    at the world size the epoch started at and another one. Rank r's readers share one
    task object, so its DataLoader workers, from one case to the next (as a trainer's
    process keeps its workers from one round and epoch to the next): ranks 1-2's first
    run starts at step 0, rank 3's at the epoch's last step."""
    cfg = _cfg(_data(tmp_path), order, **data)
    info = scan_parquet(tmp_path, Noisy.columns)
    tasks = [Noisy() for _ in range(4)]
    if order == "windowed":
        rd = open_train_reader(info, tasks[0], cfg, 0, 1, 1, 0, G, template=T)[1]
        assert len(rd._rounds) > 2 and rd._reader == "dataloader"
        del rd
    for ws, cursor in ((1, 0), (3, 0), (3, 10 * G + 5), (2, 10 * G + 5), (4, N - G)):
        _same(_steps(info, cfg, "dataloader", ws, cursor, tasks=tasks),
              _steps(info, cfg, "local", ws, cursor))


def test_stream_rounds_are_taken_in_order_only(tmp_path):
    """A round's batches are its windows, in order, one each; a round out of turn fails."""
    cfg = _cfg(_data(tmp_path), shuffle_window_rows=48, partitions=4)
    info = scan_parquet(tmp_path, Noisy.columns)
    windows = epoch_order(info, cfg, 0).rank_windows(0, 1, 0)
    s = WindowStream(info, Noisy(), windows, [4, 8, len(windows)], 0, 0, "train")
    assert [int(b[SEQ][0]) for b in s.round(0, 4)] == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="out of order"):
        s.round(0, 4)
    got = s.round(4, 8)
    assert [int(b[SEQ][0]) for b in got] == [4, 5, 6, 7]
    assert [len(b[SEQ]) for b in got] == [w.num_rows for w in windows[4:8]]


class Where(Noisy):
    """Noisy, plus ``pid``: the process that ran the transform. Raises in any process
    but ``home`` when ``fail_away``: a transform that works in the trainer's process
    and fails in the DataLoader workers."""

    def __init__(self, fail_away: bool = False):
        self.home, self.fail_away = os.getpid(), fail_away

    def transform(self, batch, ctx):
        if self.fail_away and os.getpid() != self.home:
            raise LookupError("this transform runs only in its own process")
        out = super().transform(batch, ctx)
        return {**out, "pid": np.full(len(out["x"]), os.getpid(), np.int64)}


TW = {**T, "pid": np.zeros(0, np.int64)}


def test_a_small_first_round_is_read_here_until_the_workers_run(tmp_path, monkeypatch):
    """In a process without DataLoader workers for the data set (a fresh worker after a
    start or restart), a first round of at most one read chunk is read in this process
    and the workers start only after the first step: the first step waits for no
    forkserver. The later rounds come from the workers, and the rows and their order are
    the reference's. A reader opened once the workers exist (the next epoch's) takes
    every round from them; Ray Data's reader always reads a small first round here."""
    from elastic_ddp.data import readers
    from elastic_ddp.data.workers import has_workers

    cfg = _cfg(_data(tmp_path), shuffle_window_rows=48, partitions=4)
    info = scan_parquet(tmp_path, Noisy.columns)
    task = Where()  # a task object no pool of this process serves yet
    kw = dict(template=TW, local_first_bytes=2**30)
    assert open_train_reader(info, task, cfg, 0, 1, 1, 0, G, reader="ray_data", **kw)[1]._local_first
    with monkeypatch.context() as m:  # a round larger than a read chunk: the workers split it
        m.setattr(readers, "READ_TASK_BYTES", 1)
        assert not open_train_reader(info, task, cfg, 0, 1, 1, 0, G, reader="dataloader", **kw)[1]._local_first
        assert open_train_reader(info, task, cfg, 0, 1, 1, 0, G, reader="ray_data", **kw)[1]._local_first
    rd = open_train_reader(info, task, cfg, 0, 1, 1, 0, G, reader="dataloader", **kw)[1]
    assert rd._local_first and len(rd._rounds) > 2
    first_round = sum(w.num_rows for w in rd._todo[:rd._rounds[0]])
    got = [rd.take(0, G)]
    assert not has_workers(info, task)  # the first step started no worker
    got += [rd.take(c, min(G, N - c)) for c in range(G, N, G)]
    assert has_workers(info, task)
    pids = np.concatenate([b["pid"] for b in got])
    here = {i for i, b in enumerate(got) if (b["pid"] == os.getpid()).all()}
    assert (pids == os.getpid()).sum() == first_round and 0 in here and len(here) < len(got)
    ref = _steps(info, cfg, "local", 1, 0)
    _same([[{k: v for k, v in b.items() if k != "pid"}] for b in got], ref)
    again = open_train_reader(info, task, cfg, 0, 1, 2, 0, G, reader="dataloader", **kw)[1]
    assert not again._local_first
    assert not (again.take(0, G)["pid"] == os.getpid()).any()


def test_a_worker_error_after_an_in_process_first_round_reaches_the_step(tmp_path):
    """A transform that fails only in the DataLoader workers: the first round, read in
    this process, trains; the first round the workers read raises the transform's own
    error at the step that needs it (its type kept, the worker's traceback as a note),
    and no step waits for ever."""
    cfg = _cfg(_data(tmp_path), shuffle_window_rows=48, partitions=4)
    info = scan_parquet(tmp_path, Noisy.columns)
    rd = open_train_reader(info, Where(fail_away=True), cfg, 0, 1, 1, 0, G, template=TW,
                           reader="dataloader", local_first_bytes=2**30)[1]
    c = 0
    with pytest.raises(LookupError, match="runs only in its own process") as e:
        while c < N:
            rd.take(c, min(G, N - c))
            c += G
    assert G <= c < N  # the in-process round's steps trained
    assert any("in a DataLoader worker" in n for n in getattr(e.value, "__notes__", []))


@pytest.mark.ray
@pytest.mark.parametrize("order,data", [CASES[0], CASES[3]])
def test_dataloader_reader_matches_the_ray_data_reader(tmp_path, ray_cluster, order, data):
    """The same rows in the same order as Ray Data's read and transform tasks: from the
    start at 3 ranks, from a mid-epoch cursor at 3, and from that cursor at 2."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cfg = _cfg(_data(tmp_path), order, **data)
    info = scan_parquet(tmp_path, Noisy.columns)
    # Without the column of equal rows: Ray Data's blocks hand it back as one 2-D array,
    # the other paths as an object column of rows (a task's collate takes either).
    for ws, cursor in ((3, 0), (3, 10 * G + 5), (2, 10 * G + 5)):
        _same(_steps(info, cfg, "dataloader", ws, cursor, fixed=False),
              _steps(info, cfg, "ray_data", ws, cursor, fixed=False))


def test_read_tasks_sets_the_workers_and_keeps_the_rows(tmp_path):
    """``data.read_tasks: 3``: the rank's pool has 3 DataLoader workers and the rows and
    their order are the reference's."""
    from elastic_ddp.data.workers import data_workers

    cfg = _cfg(_data(tmp_path), shuffle_window_rows=48, partitions=4, read_tasks=3)
    info = scan_parquet(tmp_path, Noisy.columns)
    task = Noisy()
    readers = [open_train_reader(info, task, cfg, r, 2, 1, 0, G, template=T)[1] for r in range(2)]
    got = [[rd.take(c, min(G, N - c)) for rd in readers] for c in range(0, N, G)]
    assert data_workers(info, task, 3).workers == 3 and not data_workers(info, task, 3).idle
    _same(got, _steps(info, cfg, "local", 2, 0))


class Assigned(Noisy):
    """Noisy, plus the logical CPUs Ray assigned to the task that ran the transform."""

    def transform(self, batch, ctx):
        import ray

        out = super().transform(batch, ctx)
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)
        return {**out, "cpus": np.full(len(out["x"]), cpus, dtype=np.float64)}


@pytest.mark.slow
@pytest.mark.ray
def test_task_cpus_reserve_cpus_and_none_when_training_holds_them(tmp_path, ray_cluster, caplog,
                                                                  monkeypatch):
    """``data.task_cpus: 1`` (ray_data): every read and transform task runs with 1 CPU
    reserved while the cluster has CPUs besides the training workers'; when training
    holds every CPU (a holder actor takes the 4, as 2 workers of 2 CPUs would), a
    round's tasks reserve none, a warning names ``data.task_cpus`` once, and the epoch is
    read (a task reserving a CPU would wait forever). The rows are the same either way."""
    import logging

    import ray
    import ray.cloudpickle

    from elastic_ddp.data import ingest

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    monkeypatch.setattr(ingest, "_TASK_CPUS_WARNED", False)
    data = _data(tmp_path)
    info = scan_parquet(tmp_path, Noisy.columns)
    # Without Noisy's column of equal rows: Ray Data hands it back as one 2-D array.
    tmpl = {**{k: v for k, v in T.items() if k != "l"}, "cpus": np.zeros(0, np.float64)}

    def steps(cpus_per_worker: float) -> list[list[dict]]:
        cfg = _cfg(data, shuffle_window_rows=48, partitions=4, reader="ray_data", task_cpus=1,
                   read_tasks=3, cpus_per_worker=cpus_per_worker)
        readers = [open_train_reader(info, Assigned(fixed=False), cfg, r, 2, 1, 0, G, template=tmpl)[1]
                   for r in range(2)]
        return [[rd.take(c, min(G, N - c)) for rd in readers] for c in range(0, N, G)]

    def cpus(steps) -> set:
        return {float(v) for s in steps for rows in s for v in rows["cpus"]}

    def strip(steps):
        return [[{k: v for k, v in rows.items() if k != "cpus"} for rows in s] for s in steps]

    free = steps(1.0)
    assert cpus(free) == {1.0}
    _same(strip(free), _steps(info, _cfg(data, shuffle_window_rows=48, partitions=4), "local", 2, 0,
                              fixed=False))

    @ray.remote(num_cpus=4)
    class Holder:
        def ready(self):
            return True

    holder = Holder.remote()
    ray.get(holder.ready.remote())
    try:
        with caplog.at_level(logging.WARNING, logger="elastic_ddp.data.ingest"):
            held = steps(2.0)
    finally:
        ray.kill(holder)
    assert cpus(held) == {0.0}
    _same(strip(held), strip(free))
    warned = [r for r in caplog.records if "data.task_cpus" in r.getMessage()]
    assert len(warned) == 1 and "CPU-only node" in warned[0].getMessage()
