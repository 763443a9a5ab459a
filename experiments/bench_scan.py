"""The driver's scan of a data set of many small Parquet files on an S3 server: footers
(and id columns) read ``FOOTER_THREADS`` at a time, against one after another, side by
side in one run.

    .venv/bin/python experiments/bench_scan.py --files 1000 --latency-ms 0,20

Starts moto's S3 server (``ThreadedMotoServer``) in a process of its own on 127.0.0.1,
writes ``--files`` Parquet files of ``--rows`` rows (``sample_id`` int64, ``x`` int64)
into a bucket, then times ``elastic_ddp.data.scan.scan_parquet`` of ``s3://bucket/set``
(listing, every footer, the id column of every file for the uniqueness check) with
``FOOTER_THREADS = 16`` (the default) and ``= 1`` (one request after another), each
``--repeat`` times (best kept). ``--latency-ms``: a TCP proxy in front of the server that
holds each request for that many milliseconds first, for a store further away than
loopback (a region's S3 answers a small GET in about 10-30 ms); 0 = no proxy.

Prints one row per latency: seconds for each mode and the ratio.
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", "import time; from moto.server import ThreadedMotoServer "
                             f"as T; T(ip_address='127.0.0.1', port={port}, verbose=False).start(); "
                             "time.sleep(1e6)"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("moto's S3 server did not start in 60 s")
            time.sleep(0.2)


class DelayProxy:
    """Holds every chunk a client sends for ``delay`` seconds before passing it on (a
    request is one chunk: one round trip's latency per request)."""

    def __init__(self, upstream: str, delay: float):
        host, port = upstream.split("//", 1)[1].split(":")
        self.upstream, self.delay = (host, int(port)), delay
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pipe, args=(client, server, self.delay), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, 0.0), daemon=True).start()

    @staticmethod
    def _pipe(src, dst, delay):
        try:
            while data := src.recv(1 << 16):
                if delay:
                    time.sleep(delay)
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


def write_files(endpoint: str, bucket: str, n: int, rows: int) -> None:
    import boto3
    from concurrent.futures import ThreadPoolExecutor

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    rng = np.random.default_rng(0)

    def put(i: int) -> None:
        buf = io.BytesIO()
        ids = np.arange(i * rows, (i + 1) * rows, dtype=np.int64)
        pq.write_table(pa.table({"sample_id": ids, "x": rng.integers(0, 10, rows)}), buf)
        client.put_object(Bucket=bucket, Key=f"set/part-{i:05d}.parquet", Body=buf.getvalue())

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, range(n)))


def time_scan(uri: str, threads: int, repeat: int) -> float:
    from elastic_ddp.data import scan
    from elastic_ddp.tasks.protocol import Column

    scan.FOOTER_THREADS = threads
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        info = scan.scan_parquet(uri, {"x": Column.integer()})
        best = min(best, time.perf_counter() - t0)
    assert len(info.files) > 0
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--rows", type=int, default=100)
    ap.add_argument("--latency-ms", default="0,20", help="comma-separated; 0 = no proxy")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()

    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
    proc, endpoint = start_server()
    try:
        t0 = time.perf_counter()
        write_files(endpoint, "bench", args.files, args.rows)
        print(f"{args.files} files x {args.rows} rows written to moto's S3 server in "
              f"{time.perf_counter() - t0:.1f} s; CPUs: {os.cpu_count()}")
        from elastic_ddp.data.scan import FOOTER_THREADS

        print(f"{'latency_ms':>10} {'parallel_s':>11} {'sequential_s':>13} {'ratio':>6}")
        for ms in (float(v) for v in args.latency_ms.split(",")):
            proxy = DelayProxy(endpoint, ms / 1000) if ms else None
            os.environ["AWS_ENDPOINT_URL"] = proxy.url if proxy else endpoint
            try:
                par = time_scan("s3://bench/set", FOOTER_THREADS, args.repeat)
                seq = time_scan("s3://bench/set", 1, args.repeat)
            finally:
                if proxy:
                    proxy.close()
            print(f"{ms:>10g} {par:>11.2f} {seq:>13.2f} {seq / par:>6.1f}", flush=True)
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
