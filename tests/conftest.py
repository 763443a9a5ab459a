"""Shared fixtures: real data on disk, a real local Ray cluster, and config dicts that
point MLflow and Ray storage into the test's tmp directory.

Nothing here mocks anything: the digits and pycode fixtures write real Parquet files
with ``elastic_ddp.data.prepare``; ``ray_cluster`` starts a real local Ray cluster; the
config helper puts a real sqlite MLflow store under ``tmp_path``.
"""

from __future__ import annotations

import copy
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Optional

import pytest

# No auto-connect in the test process: Ray reads RAY_ENABLE_AUTO_CONNECT once, as it is
# imported. A thread that outlives its test (the job thread of a test that failed while
# its job ran on) would otherwise connect again on its next Ray call after the fixture's
# ray.shutdown(), and every later module's ray.init would then fail as "called twice";
# with it off, that call raises in the leaked thread alone. (A job thread that is still
# inside Ray when the connection goes would end the whole test process: the cluster
# fixtures end such a job first, ``cluster_faults.end_running_jobs``.) The variable is removed again
# at once, so the CLI subprocesses and Ray's workers start with the environment as given.
if "ray" not in sys.modules and "RAY_ENABLE_AUTO_CONNECT" not in os.environ:
    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
    try:
        import ray  # noqa: F401
    finally:
        del os.environ["RAY_ENABLE_AUTO_CONNECT"]


# Ctrl-C as a terminal delivers it, in every process the tests start: a shell that runs
# the suite in the background (`make test &`, `nohup`) starts it with SIGINT ignored,
# every child inherits that, and the tests that send SIGINT (Ctrl-C during the scan, in
# a signal-held block, to a running job) would see it dropped. A caught SIGINT is reset
# to the default action across exec, and each child interpreter then installs
# KeyboardInterrupt as usual.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _deep_update(base: dict, extra: dict) -> dict:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_update(base[k], v)
        else:
            base[k] = v
    return base


@pytest.fixture(scope="session")
def digits_data(tmp_path_factory) -> Path:
    """scikit-learn's digits as Parquet (1,437 train / 360 val rows), prepared once per
    session into a tmp dir: ``<dir>/train``, ``<dir>/val``."""
    from elastic_ddp.data.prepare import prepare_digits

    out = tmp_path_factory.mktemp("digits")
    prepare_digits(out, num_files=4, val_fraction=0.2, seed=0)
    return out


@pytest.fixture(scope="session")
def pycode_data(tmp_path_factory) -> Path:
    """A ~200 kB slice of the stdlib byte corpus, 64-byte context (65-byte windows);
    about 3,000 train windows."""
    from elastic_ddp.data.prepare import prepare_pycode

    out = tmp_path_factory.mktemp("pycode")
    prepare_pycode(out, block_size=64, num_files=4, val_fraction=0.05, max_bytes=200_000)
    return out


@pytest.fixture(scope="session")
def _made_store(tmp_path_factory) -> Path:
    """An MLflow sqlite store with its tables made, once per session (per xdist worker):
    MLflow makes a new file's tables by running its whole chain of Alembic migrations,
    3-10 s of CPU on a busy 2-core machine."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("made-store") / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments(max_results=1)
    return db


@pytest.fixture()
def mlflow_store(tmp_path, _made_store) -> str:
    """``sqlite:///<tmp_path>/mlflow.db``, a real MLflow store whose tables exist: a copy of
    the session's made store (no experiment but MLflow's ``Default``). For tests whose
    subject is not a new store's creation, e2e jobs among them: a job on a new file waits
    for its MLflow helper to run the migrations (4-6 s of a 20-30 s job on a busy 2-core
    machine). The jobs that start their own local Ray (test_console, test_lease_jobs,
    test_failure_causes, test_stop_early, the Ctrl-C tests), the opener's and the lease's
    tests still create theirs."""
    import shutil

    db = tmp_path / "mlflow.db"
    shutil.copyfile(_made_store, db)
    return f"sqlite:///{db}"


@pytest.fixture(scope="module")
def ray_cluster():
    """A real local Ray cluster for one test module (4 logical CPUs: 2 workers plus
    Ray Data's read tasks), shut down afterwards so no processes outlive the module."""
    import ray

    if ray.is_initialized():  # a previous module leaked one; start clean
        ray.shutdown()
    from elastic_ddp.driver.local_ray import init_local_ray

    # A fresh cluster of our own (address="local"), every listener on 127.0.0.1.
    init_local_ray(num_cpus=4, configure_logging=True, logging_level="WARNING")
    try:
        yield ray
    finally:
        from helpers import _cluster_faults

        # A failed test's job thread still running: ended first, since Ray ends the whole
        # test process when a thread calls into it after ray.shutdown().
        _cluster_faults().end_running_jobs()
        ray.shutdown()


class S3Bucket:
    """One bucket of the test's own on the session's S3 server (moto's, on 127.0.0.1).

    ``uri(key)`` gives ``s3://<bucket>/<key>``; ``client`` is a boto3 S3 client on the
    server; ``env`` holds the variables a subprocess (the CLI, ``ray start``) needs to
    reach it (endpoint, region, test credentials), as the AWS SDKs read them."""

    def __init__(self, name: str, endpoint: str, env: dict[str, str]):
        import boto3

        self.name, self.endpoint, self.env = name, endpoint, dict(env)
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name=env["AWS_DEFAULT_REGION"],
                                   aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                                   aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
        self.client.create_bucket(Bucket=name)

    def uri(self, key: str = "") -> str:
        return f"s3://{self.name}/{key.lstrip('/')}" if key else f"s3://{self.name}"

    def keys(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix`` (all pages)."""
        out: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return out


def _atomic_conditional_writes(app):
    """WSGI middleware: a conditional write (``If-Match`` / ``If-None-Match`` on a PUT or
    DELETE) runs alone, as S3 guarantees (the check and the write are one step there).
    moto checks the condition, then writes, in the request's own thread: two racing
    conditional PUTs of one key can both pass its check, which S3 never lets happen."""
    lock = threading.Lock()

    def wrapped(environ, start_response):
        if environ.get("REQUEST_METHOD") in ("PUT", "DELETE") and (
                "HTTP_IF_MATCH" in environ or "HTTP_IF_NONE_MATCH" in environ):
            with lock:
                return list(app(environ, start_response))
        return app(environ, start_response)

    return wrapped


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 API server for the session: moto's server application (what its
    ``ThreadedMotoServer`` serves) on 127.0.0.1, a port of the OS's choosing, in a thread,
    each request in a thread of its own; conditional writes made atomic
    (``_atomic_conditional_writes``). Yields its endpoint URL
    (``http://127.0.0.1:<port>``). It answers a failed condition (``If-None-Match: *``
    on an existing key, ``If-Match`` on another ETag) with ``PreconditionFailed``."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication, MotoRequestHandler, create_backend_app)
    from werkzeug.serving import make_server

    app = _atomic_conditional_writes(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, name="s3-server", daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.shutdown()
        thread.join(30)


_S3_BUCKETS = iter(range(1, 1 << 30))


def s3_env(endpoint: str) -> dict[str, str]:
    """The variables that point the AWS SDKs (boto3, pyarrow's) at ``endpoint`` with the
    test credentials and region."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture()
def s3(s3_server, monkeypatch) -> S3Bucket:
    """A fresh bucket on the session's S3 server, and this process's environment pointed at
    the server (``AWS_ENDPOINT_URL``, region, test credentials) for the test's duration, so
    pyarrow, boto3 and every process the test starts (a local Ray cluster's workers, the
    CLI) reach it as a real cluster's nodes reach their object store."""
    env = s3_env(s3_server)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return S3Bucket(f"test-{os.getpid()}-{next(_S3_BUCKETS)}", s3_server, env)


@pytest.fixture(scope="session")
def s3_proxy(s3_server):
    """The session's :class:`S3FaultProxy` in front of ``s3_server`` (forwarding all
    until a test adds a rule through ``s3_faults``). The no-disk cluster's nodes reach
    the S3 server through it."""
    from helpers.s3_fault_proxy import S3FaultProxy

    proxy = S3FaultProxy(s3_server).start()
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture()
def s3_faults(s3_proxy):
    """The session's S3 fault proxy, its rules and counts fresh for this test (and
    cleared after it, stalled connections released): ``s3_faults.add("PUT", r"key$",
    "slowdown", times=2)``, ``s3_faults.endpoint`` for the clients that should see the
    faults, ``s3_faults.count(...)``."""
    s3_proxy.reset()
    try:
        yield s3_proxy
    finally:
        s3_proxy.reset()


@pytest.fixture(scope="module")
def nodisk_cluster(tmp_path_factory, s3_proxy):
    """A local Ray cluster whose two worker nodes share no disk with this process
    (``experiments/nodisk.py``): each runs in a mount namespace of its own with an empty
    tmpfs over ``/tmp``, the temp dirs, ``/dev/shm`` and this session's basetemp (every
    ``tmp_path``), so a path only the driver has is not there; the code and the
    virtualenv stay visible. The head (0 CPUs: no training worker or task lands on it)
    stays here with the driver, Ray Train's controller and the job's tracker. The nodes
    reach the S3 server through the session's fault proxy (``AWS_ENDPOINT_URL`` and test
    credentials in their environment). ``<basetemp>/shared`` is the one directory they
    see (for test diagnostics: ledger, fault markers). Skips where mount namespaces are
    not permitted, naming why. Yields the ``ray.cluster_utils.Cluster`` (its no-disk
    nodes in ``cluster.nodisk_nodes``); ``cluster.start_s`` is how long it took."""
    import time

    import ray

    from helpers import _cluster_faults

    why = _cluster_faults()._nodisk().namespaces_unavailable()
    if why:
        pytest.skip(why)
    if ray.is_initialized():
        ray.shutdown()
    base = tmp_path_factory.getbasetemp()
    shared = base / "shared"
    t = time.time()
    with _cluster_faults().local_cluster(2, 2, head_cpus=0, shared_disk=False, hide=[base],
                                         keep=[shared], node_env=s3_env(s3_proxy.endpoint),
                                         log_dir=tmp_path_factory.mktemp("nodisk-logs")) as c:
        c.start_s = time.time() - t
        c.shared = shared
        print(f"no-disk cluster up in {c.start_s:.1f} s; hidden on its nodes: {c.nodisk_hidden}")
        yield c


def digits_config(data_dir: Path, tmp: Path, extra: Optional[dict] = None) -> dict[str, Any]:
    """A small digits-cnn job as a plain config dict, with the MLflow store
    (``sqlite:///<tmp>/mlflow.db``) and Ray storage (``<tmp>/ray_results``) under ``tmp``.
    ``extra`` is deep-merged on top."""
    raw: dict[str, Any] = {
        "seed": 0,
        "data": {"train_path": str(data_dir / "train"), "val_path": str(data_dir / "val"),
                 "id_column": "sample_id"},
        "task": {"kwargs": {"feature_column": "x", "label_column": "y", "num_classes": 10,
                            "input_shape": [1, 8, 8]}},
        "model": {"name": "cnn", "kwargs": {"hidden": 32}},
        "optim": {"name": "adamw", "lr": 0.01, "weight_decay": 0.01, "warmup_steps": 5,
                  "min_lr_ratio": 0.05},
        "batch": {"global_batch_size": 64, "micro_batch_size": 32, "policy": "fixed_global"},
        "train": {"epochs": 4, "checkpoint_every_steps": 50, "log_every_steps": 5,
                  "keep_checkpoints": 2},
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1,
                    "max_failures": 2, "use_gpu": False},
        "run": {"name": "test-digits", "experiment_name": "tests",
                "tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}",
                "storage_path": str(tmp / "ray_results")},
    }
    return _deep_update(copy.deepcopy(raw), extra or {})


def pycode_config(data_dir: Path, tmp: Path, extra: Optional[dict] = None) -> dict[str, Any]:
    """A tiny byte-level gpt job on ``pycode_data`` (64-token context), MLflow and Ray
    storage under ``tmp``."""
    raw = digits_config(data_dir, tmp)
    raw["task"] = {"kwargs": {"column": "x", "vocab_size": 256, "block_size": 64}}
    raw["model"] = {"name": "gpt", "kwargs": {"n_layer": 1, "n_head": 2, "n_embd": 64}}
    raw["optim"] = {"name": "adamw", "lr": 3e-3, "warmup_steps": 5, "min_lr_ratio": 0.1}
    raw["batch"] = {"global_batch_size": 32, "micro_batch_size": 16, "policy": "fixed_global"}
    raw["train"] = {"epochs": 1, "max_steps": 40, "checkpoint_every_steps": 100,
                    "log_every_steps": 5, "eval_max_batches": 2}
    raw["run"]["name"] = "test-gpt"
    return _deep_update(raw, extra or {})


def mlflow_runs(tmp: Path, experiment_name: str = "tests") -> list:
    """Every run in the tmp sqlite store's experiment ([] when the store or the
    experiment does not exist)."""
    db = tmp / "mlflow.db"
    if not db.exists():
        return []
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name(experiment_name)
    if exp is None:
        return []
    return client.search_runs([exp.experiment_id])


def global_order_ids(cfg, split_dir: Path, epoch: int):
    """The sample ids of ``epoch`` in global order, from the library's epoch order over
    the split's real row groups: the reference the plain-PyTorch replays train on."""
    import numpy as np
    import pyarrow.parquet as pq

    from elastic_ddp.data.ingest import epoch_order
    from elastic_ddp.data.scan import scan_parquet

    info = scan_parquet(split_dir, {}, cfg.data.id_column)
    ids = {}
    for g in info.row_groups:
        ids[(g.file, g.index)] = pq.ParquetFile(info.files[g.file]).read_row_group(
            g.index, columns=[cfg.data.id_column])[cfg.data.id_column].to_numpy()
    order = epoch_order(info, cfg, epoch)
    return np.array([ids[(info.row_groups[i].file, info.row_groups[i].index)][r]
                     for i, r in order.global_rows()], dtype=np.int64)


def replay_plain_torch(cfg, data_dir: Path):
    """The job's training replayed in one process without Ray or DDP: same init seed,
    same per-epoch global order (the library's epoch order over the real row groups), same
    LR per sample count (``lr_at``), full-batch mean loss. Returns (every step's loss,
    model). By the world-size invariance of a step (test_batching), the 2-worker job must
    compute the same training up to float reassociation: the replay takes a step's rows in
    one batch where the product cuts them into shards, ~1e-7 apart in one step, which
    Adam's steps amplify over a run (digits, G=32: 2e-3 of the loss by step 131). A
    bit-for-bit reference is the product's own step at world size 1
    (``helpers.one_thread_steps``)."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    files = sorted((data_dir / "train").glob("*.parquet"))
    tables = [pq.read_table(f) for f in files]
    ids = np.concatenate([t["sample_id"].to_numpy() for t in tables])
    x = np.concatenate([np.stack(t["x"].to_numpy(zero_copy_only=False)) for t in tables]).astype(np.float32)
    y = np.concatenate([t["y"].to_numpy() for t in tables])
    pos = {int(i): k for k, i in enumerate(ids)}
    orders = [global_order_ids(cfg, data_dir / "train", e) for e in range(cfg.train.epochs)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ~3 s of tiny matmuls; more threads only contend on 2 cores
    try:
        return _replay_loop(cfg, orders, x, y, pos)
    finally:
        torch.set_num_threads(threads)


def _replay_loop(cfg, orders, x, y, pos):
    import numpy as np
    import torch

    from elastic_ddp.batching import lr_at
    from elastic_ddp.tasks.loading import build_model, load_task

    assert cfg.optim.name == "adamw"
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, load_task(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                            weight_decay=cfg.optim.weight_decay)
    g, total = cfg.batch.global_batch_size, len(orders[0]) * cfg.train.epochs
    seen, losses = 0, []
    for epoch in range(cfg.train.epochs):
        order = orders[epoch]
        for c in range(0, len(order), g):
            rows = np.array([pos[int(i)] for i in order[c:c + g]])
            for group in opt.param_groups:
                group["lr"] = lr_at(seen, total, cfg.optim.lr, cfg.optim.warmup_steps * g,
                                    cfg.optim.min_lr_ratio)
            loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x[rows])),
                                                     torch.from_numpy(y[rows]))
            losses.append(float(loss.detach()))
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen += len(rows)
    return losses, model


def alive_train_workers() -> list[int]:
    """PIDs of this cluster's live Ray Train worker actors, from the GCS actor table
    (no dashboard needed; never another cluster's processes)."""
    import ray._private.state as state

    pids = []
    for info in state.actors(actor_state_name="ALIVE").values():
        if info["ActorClassName"] == "RayTrainWorker" and info["Pid"]:
            try:  # the pid must still be a Ray worker process (its title is "ray::...")
                with open(f"/proc/{info['Pid']}/cmdline", "rb") as fh:
                    if not fh.read().startswith(b"ray::"):
                        continue
            except OSError:
                continue
            pids.append(int(info["Pid"]))
    return pids


class InProcess:
    """An object whose methods are called as ``handle.method.remote(...)`` (an actor's
    calling convention), run synchronously in this process."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        from types import SimpleNamespace

        return SimpleNamespace(remote=getattr(self.obj, name))


# Fixtures that start a Ray cluster: tests using them are marked ``ray`` and left out of
# the fast tier (``make test-fast``: -m "not ray and not slow").
_RAY_FIXTURES = {"ray_cluster", "cluster", "gpu_ray_cluster", "nodisk_cluster"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _RAY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.ray)
