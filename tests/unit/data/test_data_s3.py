"""Data sets on object storage (moto's real S3 server on 127.0.0.1): the digits data set
uploaded to a bucket scans as the same data set as on local disk (rows, row groups, schema,
fingerprint), and each reader (the in-process functions, the DataLoader workers, Ray Data)
hands every rank the same rows in the same order as from local disk; a rank reads at most
1.1 x its share of the bytes, counted on the wire by a TCP proxy in front of the server; an
object rewritten under the same key changes the fingerprint."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elastic_ddp.config import Config
from elastic_ddp.data.scan import DataError, locate_ids, read_sample_ids, scan_parquet

HERE = Path(__file__).resolve().parents[2] / "helpers"  # read_rank_rows.py
sys.path.insert(0, str(HERE))
from read_rank_rows import Ids, Rows, rank_steps  # noqa: E402

G = 64


def upload(s3, local: Path, prefix: str) -> str:
    """Every file under ``local`` to ``s3://bucket/prefix/<relative path>``; the URI."""
    for f in sorted(local.rglob("*")):
        if f.is_file():
            s3.client.upload_file(str(f), s3.name, f"{prefix}/{f.relative_to(local).as_posix()}")
    return s3.uri(prefix)


def _cfg(path: str, ws: int = 2, **data) -> dict:
    return {"data": {"train_path": path, "shuffle_window_rows": 256, **data},
            "task": {"path": "tests:Echo"},
            "batch": {"global_batch_size": G, "policy": "uneven"},
            "scaling": {"min_workers": 1, "max_workers": ws, "cpus_per_worker": 1}}


def test_the_digits_on_s3_scan_as_the_same_data_set(s3, digits_data):
    uri = upload(s3, digits_data, "sets/digits")
    cols = Rows.columns
    here = scan_parquet(digits_data / "train", cols)
    there = scan_parquet(f"{uri}/train", cols)
    assert there.files == [f"{uri}/train/{Path(f).name}" for f in here.files]
    assert (there.num_rows, there.rows_per_file, there.row_groups, there.id_ranges) == \
        (here.num_rows, here.rows_per_file, here.row_groups, here.id_ranges)
    assert there.schema == here.schema and there.file_sizes == here.file_sizes
    assert there.fingerprint == here.fingerprint  # a copy elsewhere is the same data
    assert np.array_equal(read_sample_ids(f"{uri}/train"), read_sample_ids(digits_data / "train"))
    some = read_sample_ids(digits_data / "train")[[0, 700, -1]]
    assert locate_ids(there, some) == locate_ids(here, some) and len(locate_ids(there, some)) == 3
    one = scan_parquet(there.files[1], cols)  # one object, not a prefix
    assert one.files == [there.files[1]] and one.num_rows == here.rows_per_file[1]


def test_a_path_that_is_not_there_names_the_field(s3, digits_data):
    upload(s3, digits_data, "sets/digits")
    with pytest.raises(DataError, match=rf"^{s3.uri('sets/digit')}: path does not exist .*check data.val_path"):
        scan_parquet(s3.uri("sets/digit"), Rows.columns, field="data.val_path")
    s3.client.put_object(Bucket=s3.name, Key="empty/_SUCCESS", Body=b"")
    s3.client.put_object(Bucket=s3.name, Key="empty/notes.txt", Body=b"x")
    with pytest.raises(DataError, match=r"has no Parquet files .*skipped: _SUCCESS: hidden.*notes.txt: not"):
        scan_parquet(s3.uri("empty"), Rows.columns)


def test_rewriting_an_object_changes_the_fingerprint(s3, tmp_path):
    """Same key, same ids and row counts, other values: only the object's size tells."""
    ids = np.arange(4096)
    pq.write_table(pa.table({"sample_id": ids, "x": np.random.default_rng(0).integers(0, 1 << 40, ids.size)}),
                   tmp_path / "a.parquet", row_group_size=1024)
    s3.client.upload_file(str(tmp_path / "a.parquet"), s3.name, "d/a.parquet")
    before = scan_parquet(s3.uri("d"), Ids.columns)
    pq.write_table(pa.table({"sample_id": ids, "x": np.zeros(ids.size, np.int64)}),
                   tmp_path / "a.parquet", row_group_size=1024)
    s3.client.upload_file(str(tmp_path / "a.parquet"), s3.name, "d/a.parquet")
    after = scan_parquet(s3.uri("d"), Ids.columns)
    assert (after.num_rows, after.id_ranges) == (before.num_rows, before.id_ranges)
    assert after.fingerprint != before.fingerprint


def _read_elsewhere(tmp_path: Path, info, cfg: dict, reader: str, rank: int, ws: int,
                    env: dict) -> list[dict]:
    """``read_rank_rows.py`` in a fresh process (its DataLoader workers, its own Ray)."""
    ip, cp, out = tmp_path / "info.pkl", tmp_path / "cfg.json", tmp_path / f"{reader}-{rank}.npz"
    ip.write_bytes(pickle.dumps(info))
    cp.write_text(json.dumps(cfg))
    subprocess.run([sys.executable, str(HERE / "read_rank_rows.py"), str(ip), str(cp), reader,
                    str(rank), str(ws), str(out)], env={**os.environ, **env}, check=True, timeout=300,
                   cwd=tmp_path)
    z = np.load(out, allow_pickle=False)
    n = 1 + max(int(k.rsplit("_", 1)[1]) for k in z.files)
    return [{k: z[f"{k}_{i}"] for k in ("sample_id", "s", "y") if f"{k}_{i}" in z.files} for i in range(n)]


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert sorted(x) == sorted(y), i
        for k in x:
            assert np.array_equal(x[k], y[k]), (i, k)


@pytest.mark.parametrize("reader", ["local", "dataloader"])
def test_each_rank_reads_the_same_rows_in_the_same_order_from_s3(s3, digits_data, tmp_path, reader):
    uri = upload(s3, digits_data, "sets/digits")
    cols = Rows.columns
    here, there = scan_parquet(digits_data / "train", cols), scan_parquet(f"{uri}/train", cols)
    ws = 2
    cfg_here, cfg_there = _cfg(str(digits_data / "train")), _cfg(f"{uri}/train")
    for r in range(ws):
        want = rank_steps(here, Config.from_dict(cfg_here), "local", r, ws)
        got = (rank_steps(there, Config.from_dict(cfg_there), "local", r, ws) if reader == "local"
               else _read_elsewhere(tmp_path, there, cfg_there, reader, r, ws, s3.env))
        assert sum(len(s["sample_id"]) for s in want) > 600
        _same(want, got)


@pytest.mark.slow
@pytest.mark.ray
def test_ray_data_reads_the_same_rows_from_s3(s3, digits_data, tmp_path):
    """Ray Data's read tasks, in a Ray of the reading process's own (started with the
    store's environment, as a cluster's nodes have it)."""
    uri = upload(s3, digits_data, "sets/digits")
    cols = Rows.columns
    here, there = scan_parquet(digits_data / "train", cols), scan_parquet(f"{uri}/train", cols)
    want = rank_steps(here, Config.from_dict(_cfg(str(digits_data / "train"))), "local", 1, 2)
    _same(want, _read_elsewhere(tmp_path, there, _cfg(f"{uri}/train"), "ray_data", 1, 2, s3.env))


class CountingProxy:
    """A TCP proxy in front of the S3 server: ``received`` counts the bytes the server
    sent to any client through it (answers' headers and bodies), over every connection
    of every process pointed at it."""

    def __init__(self, upstream: str):
        host, port = upstream.split("//", 1)[1].split(":")
        self.upstream = (host, int(port))
        self.received = 0
        self._lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, src, dst, count):
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if count:
                    with self._lock:
                        self.received += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.sock.close()


# The DataLoader variant starts a fresh process (torch, its workers) per rank: ~90 s on 2 cores.
@pytest.mark.parametrize("reader", ["local", pytest.param("dataloader", marks=pytest.mark.slow)])
def test_a_rank_reads_its_share_of_the_bytes_from_s3(s3, tmp_path, monkeypatch, reader):
    """4 files of 8 row groups (12.8 MB); 2 ranks: each reads <= 1.1 x 6.4 MB on the wire,
    its footers, request headers and ranged reads included (a reader that fetched whole
    files, or re-read a footer per row group, would read about twice that)."""
    rng = np.random.default_rng(1)
    local = tmp_path / "big"
    local.mkdir()
    for f in range(4):
        ids = np.arange(f * 200_000, (f + 1) * 200_000)
        pq.write_table(pa.table({"sample_id": ids, "x": rng.integers(0, 1 << 62, ids.size)}),
                       local / f"part-{f}.parquet", row_group_size=25_000, compression="none")
    uri = upload(s3, local, "big")
    whole = sum(p.stat().st_size for p in local.iterdir())
    proxy = CountingProxy(s3.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    env = {**s3.env, "AWS_ENDPOINT_URL": proxy.url}
    try:
        info = scan_parquet(uri, Ids.columns)
        cfg = _cfg(uri, shuffle_window_rows=200_000, partitions=8)
        ws, seen = 2, []
        for r in range(ws):
            if reader == "local":
                start = proxy.received
                steps = rank_steps(info, Config.from_dict(cfg), "local", r, ws)
                got = proxy.received - start
            else:
                # The child's own scan is not done: it reads what the pickled scan names.
                start = proxy.received
                steps = _read_elsewhere(tmp_path, info, cfg, "dataloader", r, ws, env)
                got = proxy.received - start
            seen.append(np.concatenate([s["sample_id"] for s in steps]))
            print(f"{reader} rank {r}: {got} bytes on the wire, share {whole / ws:.0f}")
            assert got <= 1.1 * whole / ws, (r, got, whole)
            assert got >= 0.9 * whole / ws / 2, (r, got, whole)  # the reads went through the proxy
    finally:
        proxy.close()
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(800_000))


def test_prepare_writes_the_data_set_to_s3_and_replaces_its_files(s3, tmp_path):
    """`elastic-ddp prepare digits s3://...` (the CLI, as a user runs it): the bucket holds
    the same data set as a local prepare (rows, fingerprint); a second prepare with fewer
    files leaves none of the first one's behind."""
    from elastic_ddp.data.prepare import prepare_digits

    local = prepare_digits(tmp_path / "digits", num_files=4)
    uri = s3.uri("sets/digits")
    run = subprocess.run([sys.executable, "-m", "elastic_ddp.driver.cli", "prepare", "digits", uri],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"-> {uri}" in run.stdout
    cols = Rows.columns
    there = scan_parquet(f"{uri}/train", cols)
    here = scan_parquet(tmp_path / "digits" / "train", cols)
    assert there.num_rows == local["train"]["num_rows"] == here.num_rows
    assert there.fingerprint == here.fingerprint
    assert scan_parquet(f"{uri}/val", cols).num_rows == local["val"]["num_rows"]
    run = subprocess.run([sys.executable, "-m", "elastic_ddp.driver.cli", "prepare", "digits", uri,
                          "--num-files", "2"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    # (pyarrow's directory marker, the key ending in "/", is not a file)
    assert sorted(k.rsplit("/", 1)[1] for k in s3.keys("sets/digits/train/") if not k.endswith("/")) == \
        ["part-00000.parquet", "part-00001.parquet"]
    assert scan_parquet(f"{uri}/train", cols).num_rows == here.num_rows


def test_prepare_to_a_missing_bucket_is_one_line_exit_2(s3):
    run = subprocess.run([sys.executable, "-m", "elastic_ddp.driver.cli", "prepare", "digits",
                          f"s3://no-such-bucket-{os.getpid()}/digits"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "no-such-bucket" in lines[0] and "prepare OUT_DIR" in lines[0], run.stderr
    assert "Traceback" not in run.stderr
