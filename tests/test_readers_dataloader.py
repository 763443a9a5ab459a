"""``data.reader: dataloader`` (DataLoader worker processes, :class:`WindowStream`) hands
each rank the same rows in the same order as the in-process reference and as the Ray Data
path (``data.reader: ray_data``): every step of every rank, from the epoch's start, from a
mid-epoch cursor, and at another world size after that resume; several rounds per epoch,
the transform's per-sample randomness included."""

from __future__ import annotations

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
    step, epoch or id shows."""

    columns = {"x": Column.integer()}

    def transform(self, batch, ctx):
        noise = np.array([int(g.integers(0, 1000)) for g in ctx.rngs()], dtype=np.int64)
        ragged = np.empty(len(noise), dtype=object)  # an object column: pickled, not shared
        for i, v in enumerate(noise):
            ragged[i] = np.arange(v % 5, dtype=np.int32)
        return {"x": batch["x"] * 1000 + noise, "f": batch["x"].astype(np.float32) / 7, "r": ragged}

    def loss(self, model, batch):  # pragma: no cover - never trained here
        raise NotImplementedError


T = {"sample_id": np.zeros(0, np.int64), "x": np.zeros(0, np.int64), "f": np.zeros(0, np.float32),
     "r": np.zeros(0, object)}


def _data(tmp: Path, n=N, files=3, rg=8) -> Path:
    for f, part in enumerate(np.array_split(np.arange(n), files)):
        pq.write_table(pa.table({"sample_id": pa.array(part * 10, pa.int64()),
                                 "x": pa.array(part * 10, pa.int64())}),
                       tmp / f"part-{f}.parquet", row_group_size=rg)
    return tmp


def _cfg(tmp: Path, order="windowed", **data) -> Config:
    return Config.from_dict({"data": {"train_path": str(tmp), "order": order, **data},
                             "task": {"path": "tests:Echo"},
                             "batch": {"global_batch_size": G, "policy": "uneven"},
                             "scaling": {"min_workers": 1, "max_workers": 4}})


def _steps(info, cfg, kind: str, ws: int, cursor: int, epoch: int = 1) -> list[list[dict]]:
    """Every step from ``cursor`` to the epoch's end: each rank's rows, ``kind`` one of
    local (in-process reference), dataloader, ray_data."""
    readers = [open_train_reader(info, Noisy(), cfg, r, ws, epoch, cursor, G, local=kind == "local",
                                 template=T, reader=None if kind == "local" else kind)[1]
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


CASES = [("windowed", {"shuffle_window_rows": 48, "partitions": 4}),
         ("windowed", {"shuffle_window_rows": 1, "partitions": 12}),
         ("windowed", {"block_rows": 5, "shuffle_window_rows": 96}),
         ("permutation", {})]


def test_auto_is_the_dataloader(tmp_path):
    assert reader_kind(_cfg(tmp_path)) == "dataloader"
    assert reader_kind(_cfg(tmp_path, reader="ray_data")) == "ray_data"


@pytest.mark.parametrize("order,data", CASES)
def test_dataloader_reader_matches_the_in_process_reference(tmp_path, order, data):
    """Several rounds per epoch (windowed), from the start and from a mid-epoch cursor,
    at the world size the epoch started at and another one."""
    cfg = _cfg(_data(tmp_path), order, **data)
    info = scan_parquet(tmp_path, Noisy.columns)
    if order == "windowed":
        rd = open_train_reader(info, Noisy(), cfg, 0, 1, 1, 0, G, template=T)[1]
        assert len(rd._rounds) > 2 and rd._reader == "dataloader"
    for ws, cursor in ((1, 0), (3, 0), (3, 10 * G + 5), (2, 10 * G + 5), (4, N - G)):
        _same(_steps(info, cfg, "dataloader", ws, cursor), _steps(info, cfg, "local", ws, cursor))


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


def test_a_small_first_round_uses_the_workers(tmp_path):
    """The in-process first round is Ray Data's (whose first execution starts its
    workers); the DataLoader reader reads it with its workers."""
    cfg = _cfg(_data(tmp_path), shuffle_window_rows=48, partitions=4)
    info = scan_parquet(tmp_path, Noisy.columns)
    kw = dict(template=T, local_first_bytes=2**30)
    assert open_train_reader(info, Noisy(), cfg, 0, 1, 1, 0, G, reader="ray_data", **kw)[1]._local_first
    assert not open_train_reader(info, Noisy(), cfg, 0, 1, 1, 0, G, reader="dataloader", **kw)[1]._local_first


@pytest.mark.ray
@pytest.mark.parametrize("order,data", [CASES[0], CASES[3]])
def test_dataloader_reader_matches_the_ray_data_reader(tmp_path, ray_cluster, order, data):
    """The same rows in the same order as Ray Data's read and transform tasks: from the
    start at 3 ranks, from a mid-epoch cursor at 3, and from that cursor at 2."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cfg = _cfg(_data(tmp_path), order, **data)
    info = scan_parquet(tmp_path, Noisy.columns)
    for ws, cursor in ((3, 0), (3, 10 * G + 5), (2, 10 * G + 5)):
        _same(_steps(info, cfg, "dataloader", ws, cursor), _steps(info, cfg, "ray_data", ws, cursor))
