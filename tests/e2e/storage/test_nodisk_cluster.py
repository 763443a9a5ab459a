"""The no-shared-disk cluster (``nodisk_cluster``, experiments/nodisk.py) is what it
claims: on its worker nodes a file the driver just wrote under the test's tmp dir or
under ``/tmp`` is not there, while a value passed through Ray arrives, the code and the
virtualenv are there, and a task reaches the S3 server with the endpoint and credentials
the node was started with. Training workers never land on the head.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import ray

pytestmark = pytest.mark.ray


def _worker_nodes() -> list[str]:
    return [n["NodeID"] for n in ray.nodes()
            if n["Alive"] and "node:__internal_head__" not in n["Resources"]]


def _on(node_id: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=False)


@ray.remote(num_cpus=1, max_retries=0)
def _look(paths: list[str], value: bytes) -> dict:
    import elastic_ddp

    out = {}
    for p in paths:
        try:
            with open(p, "rb") as f:
                out[p] = f.read()
        except FileNotFoundError:
            out[p] = "FileNotFoundError"
    return {"paths": out, "value": value, "code": os.path.exists(elastic_ddp.__file__),
            "python": os.path.exists(os.sys.executable), "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "endpoint": os.environ.get("AWS_ENDPOINT_URL"),
            "home": sorted(os.listdir(Path.home())) if Path.home().is_dir() else []}


def test_driver_paths_are_absent_on_the_nodes(nodisk_cluster, tmp_path):
    print(f"cluster start: {nodisk_cluster.start_s:.1f} s")
    token = uuid.uuid4().hex.encode()
    mine = [tmp_path / "data" / "part-0.parquet", Path(f"/tmp/nodisk-{os.getpid()}-{token[:8].decode()}")]
    for p in mine:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(token)
    try:
        nodes = _worker_nodes()
        assert len(nodes) == 2
        got = ray.get([_look.options(scheduling_strategy=_on(n)).remote([str(p) for p in mine], token)
                       for n in nodes], timeout=120)
    finally:
        mine[1].unlink()
    for g in got:
        assert g["paths"] == {str(p): "FileNotFoundError" for p in mine}, g
        assert g["value"] == token and g["code"] and g["python"]
    assert sorted(g["node"] for g in got) == sorted(nodes)
    # $HOME is hidden too, but for the interpreter's installation where it lies there.
    home = Path.home().resolve()
    image = {Path(k).relative_to(home).parts[0] for k in nodisk_cluster.nodisk_kept
             if home in Path(k).parents}
    assert all(set(g["home"]) <= image for g in got), ([g["home"] for g in got], image)
    # The same read on the head (in the driver's namespace) finds the files: the test
    # above fails for the nodes' want of a shared disk, not for a wrong path.
    head = next(n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"])
    mine[1].write_bytes(token)
    try:
        here = ray.get(_look.options(num_cpus=0, scheduling_strategy=_on(head)).remote(
            [str(p) for p in mine], token), timeout=120)
    finally:
        mine[1].unlink()
    assert here["paths"] == {str(p): token for p in mine}


def test_the_shared_diagnostics_dir_is_seen_by_the_nodes(nodisk_cluster):
    """``<basetemp>/shared`` (ledger, markers) is the one driver directory the nodes see."""
    p = nodisk_cluster.shared / f"probe-{uuid.uuid4().hex}"
    p.write_bytes(b"seen")
    (got,) = ray.get([_look.options(scheduling_strategy=_on(_worker_nodes()[0])).remote([str(p)], b"")])
    assert got["paths"][str(p)] == b"seen"


def test_a_node_writes_to_s3(nodisk_cluster, s3, s3_faults):
    @ray.remote(num_cpus=1, max_retries=0)
    def write(uri: str, body: bytes) -> str:
        from pyarrow import fs

        filesystem, path = fs.FileSystem.from_uri(uri)  # endpoint etc. from the environment
        with filesystem.open_output_stream(path) as f:
            f.write(body)
        return os.environ["AWS_ENDPOINT_URL"]

    body = os.urandom(1000)
    endpoints = ray.get([write.options(scheduling_strategy=_on(n)).remote(s3.uri(f"from-{i}"), body)
                         for i, n in enumerate(_worker_nodes())], timeout=120)
    # The nodes inherited the endpoint of `ray start`'s environment: the fault proxy in
    # front of the session's S3 server, which saw their writes.
    assert endpoints == [s3_faults.endpoint] * 2
    assert sorted(s3.keys()) == ["from-0", "from-1"]
    assert s3.client.get_object(Bucket=s3.name, Key="from-1")["Body"].read() == body
    assert s3_faults.count("*", r"^from-[01]$") >= 2


def test_no_training_worker_fits_on_the_head(nodisk_cluster):
    head = next(n for n in ray.nodes() if "node:__internal_head__" in n["Resources"])
    assert head["Resources"].get("CPU", 0) == 0
    assert sum(n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]) == 4
