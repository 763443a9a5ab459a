"""Checkpoint cost by model size: this project's sharded path (synchronous and
asynchronous), the full-state path of an older checkout (one ``state.pt`` built by rank 0)
and plain DCP ``async_save`` (the torchtitan way), side by side in one run, on 2 ranks of
gloo started by ``torchrun`` (``--device cuda``: NCCL, ``--nproc`` ranks of one GPU each,
the state staged into pinned host memory; the full-state path is for the CPU).

    .venv/bin/python experiments/bench_checkpoint.py --sizes 2x128,4x256,8x512
    .venv/bin/python experiments/bench_checkpoint.py --checkout <commit>   # the old path
    .venv/bin/python experiments/bench_checkpoint.py --sizes 24x1024 --paths "" --interleave
    .venv/bin/python experiments/bench_checkpoint.py --sizes 8x512 --paths sharded,sharded_async \
        --storage local,s3     # the sharded paths on local disk and on an S3 server side by side
    .venv/bin/python experiments/bench_checkpoint.py --wall-steps 12 --sizes 12x1024   # a checkpoint's wall-clock cost: sync, thread, process
    .venv/bin/python experiments/bench_checkpoint.py --device cuda --nproc 1 --sizes 20x2048 \
        --strategies fsdp --paths sharded_async,dcp_async --repeat 1   # a GPU: gpu_check.sh

Model: the gpt task widened (``n_layer x n_embd``, block 64), AdamW, strategies ddp and
fsdp. Per (size, strategy, path), printed: parameters, state bytes on disk, one training
step (s), training-blocked seconds of one checkpoint (the slowest rank's time inside the
save call), seconds until persisted (from the save call until this rank's write, its
manifest share included, is done, timed by a thread while one training step runs), restore
seconds (a fresh process group, a fresh model; checksums included for this project),
bytes read per rank at restore (``rchar`` of /proc/self/io: page-cache reads count too)
and the load's part of them (``rchar`` less the small files the restore's checksum thread
hashes whole; the shards are verified block by block in the load's own reads)
and peak RSS per rank; then the ratios against the first row. ``step s*``: one training
step while the background write runs (the asynchronous path; against ``step s``, what
the write costs the training it overlaps). Each row is the median of ``--repeat``
checkpoints after one warm-up.

``--storage s3``: the sharded paths write to an S3 server the bench starts in its own
process (moto's ``ThreadedMotoServer`` on 127.0.0.1: a Python server, so its own CPU
time shares the machine's cores with the ranks); restore bytes per rank are then the
bytes the rank fetched from the store (its ranged reads, widened to the blocks of the
shards' block checksums: ``CheckpointManager.read_bytes``), and disk MB the newest checkpoint's
objects. moto's server reads a whole object into memory for every request, a ranged
read included (8 in flight per rank at a restore), and joins a multipart upload's parts
in memory: at hundreds of millions of parameters ``--files-per-rank`` (the config's
``train.checkpoint_files_per_rank``) keeps its objects small enough for this machine.

``--checkout REV``: the commit whose ``elastic_ddp`` is the full-state path (default:
the parent of the commit that made ``elastic_ddp/checkpoint.py`` a package), checked
out with ``git worktree`` into a temporary directory.

``--driver-sizes``: the driver's side instead. Per size, one ``elastic-ddp train`` job
of the ``bench_gpt`` preset widened to that size (2 workers, 4 steps, a checkpoint at
step 2 and the final one, local Ray, local MLflow) and the driver process's peak RSS
(``ru_maxrss`` at its exit), printed beside the model's fp32 weight bytes: the driver
builds the model once on the meta device and once on the CPU for its dry run, and logs
the final model to MLflow only when it is small, so its peak should grow by at most one
copy of the weights.

    .venv/bin/python experiments/bench_checkpoint.py --driver-sizes 2x128,8x512,24x1024
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("full_state", "sharded", "sharded_async", "dcp_async")


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(ln for ln in f if ln.startswith("rchar")).split()[1])


def _when_done(wait, t_call: float):
    """Time the background write's end while the caller trains: ``wait`` (blocks until
    this rank's write is done; None: already done at ``t_call``) runs in a thread; the
    returned function joins it and gives the moment it returned (perf_counter s)."""
    import threading

    box = [t_call]
    if wait is None:
        return lambda: box[0]

    def run():
        wait()
        box[0] = time.perf_counter()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return lambda: (th.join(), box[0])[1]


def _cfg(size: str, strategy: str):
    from elastic_ddp.config import Config

    layers, width = (int(v) for v in size.split("x"))
    return Config.from_dict({
        "data": {"train_path": "unused"}, "task": {"kwargs": {"block_size": 64}},
        "model": {"name": "gpt", "kwargs": {"n_layer": layers, "n_head": max(1, width // 64),
                                             "n_embd": width}},
        "optim": {"name": "adamw", "lr": 1e-3}, "parallel": {"strategy": strategy},
        "batch": {"global_batch_size": 4, "micro_batch_size": 2},
        "scaling": {"min_workers": 1, "max_workers": 2}})


def worker(args) -> None:
    """One rank under torchrun: train a step, checkpoint ``--repeat``+1 times, restore."""
    import torch
    import torch.distributed as dist

    from elastic_ddp.parallel.strategies import build_strategy
    from elastic_ddp.tasks.loading import build_model, load_task

    cuda = args.device == "cuda"
    if cuda:  # NCCL, one GPU per rank; the state is staged into pinned host memory
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    cfg = _cfg(args.size, args.strategy)
    task = load_task(cfg)

    def fresh():
        torch.manual_seed(0)
        return build_strategy(cfg, build_model(cfg, task).to(device), device, ws)

    s = fresh()
    x = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(rank)).to(device)

    def step() -> float:
        t = time.perf_counter()
        loss, _ = task.loss(s.model, {"tokens": x})
        loss.mean().backward()
        s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    step()
    step_s = step()
    store = Path(args.out)
    s3 = args.storage == "s3"
    # On S3: the bench's own S3 server (main starts it); a run directory per invocation.
    where = f"s3://{os.environ['BENCH_S3_BUCKET']}/{store.name}" if s3 else str(store)
    blocked, persisted, during = [], [], []
    path = args.path
    conf = {"train": {"checkpoint_files_per_rank": args.files_per_rank}}
    if path == "interleaved":
        return _interleaved(args, s, step, store, rank, ws, device)
    if path.startswith("wall:"):
        from bench_checkpoint_wall import wall_worker

        return wall_worker(args, s, step, store, rank, ws)
    for k in range(args.repeat + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if path == "full_state":
            from elastic_ddp.checkpoint import save_state

            state = s.full_state(rank)
            if rank == 0:
                save_state(store / f"ck{k}", {**state, "progress": {}, "counters": {}, "data": {}})
            dist.barrier()  # ray.train.report's barrier: every rank waits for rank 0
            t1 = t2 = time.perf_counter()
        elif path.startswith("sharded"):
            from elastic_ddp.checkpoint.manager import CheckpointManager

            m = CheckpointManager(where, "run", conf, rank, ws, collective=True,
                                  log=lambda _: None, strategy_name=args.strategy)
            m.save(k, s, {"progress": {}}, report=False, asynchronous=path == "sharded_async")
            t1 = time.perf_counter()
            done = _when_done(m.pending.thread.join if m.pending is not None else None, t1)
            busy = m.pending is not None and m.pending.thread.is_alive()
            d = step()  # the loop goes on while the write runs
            if busy and k:
                during.append(d)
            m.wait()
            t2 = done()
            if s3 and k and rank == 0:  # keep the server's store to the newest checkpoint
                from elastic_ddp.checkpoint.layout import checkpoint_name, run_dir

                fs, base = run_dir(where, "run")
                fs.delete_dir(f"{base}/{checkpoint_name(k - 1)}")
        else:  # plain DCP async_save, the torchtitan way
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            if k == 0:
                pg = dist.new_group(backend="gloo")
            msd, osd = get_state_dict(s.module, s.optimizer)
            fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(store / f"ck{k}"),
                                 process_group=pg)
            t1 = time.perf_counter()
            done = _when_done(fut.result, t1)
            step()
            fut.result()
            t2 = done()
        dt = torch.tensor([t1 - t0, t2 - t0], device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if k:
            blocked.append(float(dt[0]))
            persisted.append(float(dt[1]))
    last = args.repeat
    del s
    s = fresh()
    dist.barrier()
    r0, t0 = _rchar(), time.perf_counter()
    if path == "full_state":
        from elastic_ddp.checkpoint import load_state

        s.load_full_state(load_state(store / f"ck{last}"))
    elif path.startswith("sharded"):
        mr = CheckpointManager(where, "run", conf, rank, ws, collective=True, log=lambda _: None)
        mr.restore(s)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(s.module, s.optimizer)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(store / f"ck{last}"))
        set_state_dict(s.module, s.optimizer, model_state_dict=msd, optim_state_dict=osd)
    restore = time.perf_counter() - t0
    read = _rchar() - r0
    hashed = 0
    if s3:  # from the store: the share downloaded and the ranged reads (rchar misses sockets)
        read = mr.read_bytes
    elif path.startswith("sharded"):
        # The restore's checksum thread reads this rank's share of the files hashed whole
        # beside the load (shards with block checksums are verified in the load's own
        # reads: only the small files are hashed apart); rchar counts both.
        from elastic_ddp.checkpoint import MANIFEST
        from elastic_ddp.checkpoint.checksum import share_of
        from elastic_ddp.checkpoint.verified_read import verifiable

        ck = max(store.rglob(MANIFEST), key=lambda f: f.parent.name)  # the restored one: the newest
        manifest = json.loads(ck.read_text())
        files = manifest["files"]
        hashed = sum(files[n]["bytes"] for n in share_of(sorted(files), rank, ws)
                     if not (verifiable(manifest) and n.endswith(".distcp")))
    out = {"rank": rank, "step_s": step_s,
           "during_s": statistics.median(during) if during else None,
           "blocked_s": statistics.median(blocked),
           "persisted_s": statistics.median(persisted), "restore_s": restore, "read_bytes": read,
           "load_bytes": read - hashed,
           "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "params": sum(p.numel() for p in s.module.parameters()),  # DTensor: the global count
           "gpu_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None}
    parts = [None] * ws
    dist.all_gather_object(parts, out)
    if rank == 0 and s3:
        import pyarrow.fs as pafs

        from elastic_ddp.checkpoint.layout import run_dir

        fs, base = run_dir(where, "run")
        disk = sum(i.size or 0 for i in fs.get_file_info(pafs.FileSelector(base, recursive=True))
                   if i.type == pafs.FileType.File)  # the newest checkpoint alone
        print("RESULT " + json.dumps({"ranks": parts, "disk_bytes": disk}), flush=True)
    elif rank == 0:
        disk = sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) / (args.repeat + 1)
        print("RESULT " + json.dumps({"ranks": parts, "disk_bytes": disk}), flush=True)
    dist.destroy_process_group()


def _interleaved(args, s, step, store: Path, rank: int, ws: int, device) -> None:
    """This project's asynchronous save, plain DCP ``async_save`` and DCP ``async_save``
    with one stager kept across its saves, alternated in one process group, ``--repeat``
    + 1 each (the first of each a warm-up), a training step during every write: all see
    the same machine load, so their ratios hold on a noisy machine where separate runs
    swing by 2x.

    ``dcp_async`` is ``async_save`` with its defaults (torchtitan's ``async_mode:
    async``): it makes a ``DefaultStager`` for each save, which allocates its host copy
    afresh. ``dcp_async_kept`` passes one ``DefaultStager`` to every save
    (``async_stager=``), which copies into the buffers of its first save, as this
    project's save does: the pair compares the same staging and leaves the project's own
    steps (directory name, its broadcast, the flattened state dict) as the difference."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from elastic_ddp.checkpoint.manager import CheckpointManager

    pg = dist.new_group(backend="gloo")
    cuda = device.type == "cuda"  # as this project's stager: pinned, non-blocking copies on CUDA
    kept = DefaultStager(StagingOptions(cuda, False, False, cuda))
    m = CheckpointManager(str(store), "run", {}, rank, ws, collective=True,
                          log=lambda _: None, strategy_name=args.strategy)
    # Host copies alive at once on every rank: this project's kept one, a fresh one of
    # dcp_async while it writes, and dcp_async_kept's. Kinds whose copies do not fit in
    # the memory available (every rank on this machine) are left out, named in RESULT.
    from elastic_ddp.checkpoint.shares import REPLICATED_PARTS, replicated_share
    from elastic_ddp.checkpoint.state import model_optimizer_state

    full = model_optimizer_state(s)
    ours = replicated_share(full, REPLICATED_PARTS.get(args.strategy, ()), rank, ws)
    need = torch.tensor([float(_staged_bytes(ours)), float(_staged_bytes(full))], device=device)
    dist.all_reduce(need)  # over the ranks: this project's share, DCP's whole local state
    free = _mem_available()
    copies = [float(need[0]), float(need[0] + need[1]), float(need[0] + 2 * need[1])]
    kinds = tuple(k for k, c in zip(("sharded_async", "dcp_async", "dcp_async_kept"), copies)
                  if c < 0.9 * free)
    if len(kinds) < 2:
        if rank == 0:
            print("RESULT " + json.dumps({"skipped": f"{copies[1] / 1e9:.1f} GB "
                                          f"of host copies needed, {free / 1e9:.1f} GB available"}),
                  flush=True)
        dist.destroy_process_group()
        return None
    got: dict[str, list] = {kind: [] for kind in kinds}
    for k in range(len(kinds) * (args.repeat + 1)):
        kind = kinds[k % len(kinds)]
        dist.barrier()
        t0 = time.perf_counter()
        if kind == "sharded_async":
            m.save(k, s, {"progress": {}}, report=False, asynchronous=True)
            t1 = time.perf_counter()
            done = _when_done(m.pending.thread.join, t1)
            step()
            m.wait()
        else:
            msd, osd = get_state_dict(s.module, s.optimizer)
            fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(store / f"dcp{k}"),
                                 process_group=pg,
                                 async_stager=kept if kind == "dcp_async_kept" else None)
            t1 = time.perf_counter()
            done = _when_done(fut.result, t1)
            step()
            fut.result()
        dt = torch.tensor([t1 - t0, done() - t0], device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if k >= len(kinds):
            got[kind].append((float(dt[0]), float(dt[1])))
        dist.barrier()
        if rank == 0:  # keep the disk bounded: only the newest checkpoint stays
            for d in store.rglob("*"):
                if d.is_dir() and d.name.startswith(("dcp", "checkpoint_step")) and \
                        not d.name.endswith((f"{k:08d}", f"dcp{k}")):
                    shutil.rmtree(d, ignore_errors=True)
    kept.close()
    out = {kind: {"blocked_s": statistics.median(b for b, _ in v),
                  "persisted_s": statistics.median(q for _, q in v)} for kind, v in got.items()}
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def _staged_bytes(state) -> int:
    """Bytes of the tensors in ``state`` (a DTensor: its local shard)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return sum(_staged_bytes(v) for v in state.values())
    if isinstance(state, DTensor):
        return state._local_tensor.nbytes
    return getattr(state, "nbytes", 0)


def _mem_available() -> int:
    """``MemAvailable`` of /proc/meminfo, bytes."""
    with open("/proc/meminfo") as f:
        return 1024 * int(next(ln for ln in f if ln.startswith("MemAvailable")).split()[1])


def _old_checkout(rev: str | None) -> Path:
    if rev is None:
        made = subprocess.run(["git", "-C", str(ROOT), "rev-list", "-1", "HEAD", "--",
                               "elastic_ddp/checkpoint.py"], capture_output=True, text=True,
                              check=True).stdout.strip()
        rev = f"{made}^"
    d = Path(tempfile.mkdtemp(prefix="bench-ckpt-old-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(d), rev],
                   check=True, capture_output=True)
    return d


def run_one(size: str, strategy: str, path: str, repeat: int, code: Path,
            device: str = "cpu", nproc: int = 2, storage: str = "local",
            s3_env: dict | None = None, files_per_rank: int = 1) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as out:
        # The code under test first; the caller's PYTHONPATH (packages installed outside the
        # interpreter's site-packages) stays behind it.
        pythonpath = os.pathsep.join(x for x in (str(code), os.environ.get("PYTHONPATH", "")) if x)
        env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1", **(s3_env or {}))
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node",
               str(nproc), str(Path(__file__).resolve()), "--worker", "--size", size,
               "--strategy", strategy, "--path", path, "--repeat", str(repeat), "--out", out,
               "--device", device, "--storage", storage, "--files-per-rank", str(files_per_rank)]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600, check=False)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"{size} {strategy} {path} {storage} failed:\n{p.stderr[-3000:]}")
        return json.loads(line[len("RESULT "):])


DRIVER = ("import atexit, resource, sys\n"
          "atexit.register(lambda: print('DRIVER_MAXRSS_KB', resource.getrusage("
          "resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr, flush=True))\n"
          "from elastic_ddp.driver.cli import main\n"
          "sys.exit(main(sys.argv[1:]))\n")


def driver_rss(size: str) -> dict:
    """One ``elastic-ddp train`` job at ``size``; the driver's peak RSS (MB) and the
    model's fp32 weight bytes. Raises RuntimeError if the job fails."""
    layers, width = (int(v) for v in size.split("x"))
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-driver-") as out:
        sets = {"model.kwargs": f"{{n_layer: {layers}, n_head: {max(1, width // 64)}, n_embd: {width}}}",
                "batch.global_batch_size": "4", "batch.micro_batch_size": "2",
                "train.max_steps": "4", "train.checkpoint_every_steps": "2",
                "train.eval_max_batches": "1", "scaling.max_failures": "3", "run.name": f"driver-rss-{size}",
                "run.storage_path": f"{out}/ray_results",
                "run.tracking_uri": f"sqlite:///{out}/mlflow.db"}
        cmd = [sys.executable, "-c", DRIVER, "train", str(ROOT / "experiments/configs/bench_gpt.yaml"),
               "--no-progress"]
        for k, v in sets.items():
            cmd += ["--set", f"{k}={v}"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("RAY_ADDRESS", None)
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=3600,
                           check=False)
        line = next((ln for ln in p.stderr.splitlines() if ln.startswith("DRIVER_MAXRSS_KB")), None)
        if p.returncode != 0 or line is None:
            raise RuntimeError(f"driver job {size} failed (exit {p.returncode}):\n"
                               f"{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
        return {"rss_mb": int(line.split()[1]) / 1024, "weights_mb": 4 * _params(size) / 1e6}


def _s3_server():
    """moto's S3 server on 127.0.0.1 (a port of the OS's choosing) in this process, one
    bucket on it; (the server, the environment the ranks reach it with)."""
    import logging
    import uuid

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_EC2_METADATA_DISABLED": "true", "BENCH_S3_BUCKET": f"bench-{uuid.uuid4().hex[:8]}"}
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                 aws_access_key_id="bench", aws_secret_access_key="bench").create_bucket(
        Bucket=env["BENCH_S3_BUCKET"])
    return server, env


def _params(size: str) -> int:
    """The model's parameter count, built on the meta device (no memory)."""
    import torch

    from elastic_ddp.tasks.loading import build_model, load_task

    cfg = _cfg(size, "ddp")
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(cfg, load_task(cfg)).parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2x128,4x256,8x512", help="n_layer x n_embd, comma-separated")
    ap.add_argument("--strategies", default="ddp,fsdp")
    ap.add_argument("--paths", default=",".join(PATHS), help="a subset of " + ", ".join(PATHS))
    ap.add_argument("--interleave", action="store_true",
                    help="also time this project's async save against plain DCP async_save "
                         "alternated in one process group (a ratio that holds under load)")
    ap.add_argument("--repeat", type=int, default=2, help="checkpoints measured after one warm-up")
    ap.add_argument("--checkout", default=None, help="commit of the full-state path")
    ap.add_argument("--driver-sizes", default=None,
                    help="measure the driver's peak RSS of an elastic-ddp job at these sizes instead")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: NCCL, one GPU per rank, staging into pinned host memory")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (with cuda: at most the GPUs)")
    ap.add_argument("--files-per-rank", type=int, default=1,
                    help="the sharded paths' train.checkpoint_files_per_rank (DCP's thread_count)")
    ap.add_argument("--storage", default="local",
                    help="local, s3 or local,s3: where the sharded paths write (s3: an S3 server "
                         "of the bench's own, moto's, on 127.0.0.1; the other paths: local only)")
    ap.add_argument("--wall-steps", type=int, default=0,
                    help="measure instead the wall-clock cost of a checkpoint: a job of this "
                         "many steps without checkpoints and with one every 2 steps, per way "
                         "(--wall-modes), side by side (bench_checkpoint_wall.py)")
    ap.add_argument("--wall-modes", default="none,sync,thread,process",
                    help="with --wall-steps: a subset of none, sync, thread, process")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size"), ap.add_argument("--strategy"), ap.add_argument("--path")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.wall_steps:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_checkpoint_wall import run_wall

        return run_wall(args.sizes, args.strategies, args.wall_steps, max(1, args.repeat),
                        [m for m in args.wall_modes.split(",") if m], ROOT, Path(__file__).resolve())
    if args.driver_sizes:
        print(f"{'size':>8} {'weights MB':>10} {'driver peak RSS MB':>18} {'RSS - weights':>13}")
        for size in args.driver_sizes.split(","):
            r = driver_rss(size)
            print(f"{size:>8} {r['weights_mb']:>10.0f} {r['rss_mb']:>18.0f} "
                  f"{r['rss_mb'] - r['weights_mb']:>13.0f}", flush=True)
        return None
    paths = [p for p in args.paths.split(",") if p]
    storages = [x for x in args.storage.split(",") if x]
    old = _old_checkout(args.checkout) if "full_state" in paths else None
    server, s3_env = _s3_server() if "s3" in storages else (None, None)
    runs = [(p, st) for p in paths for st in storages if st == "local" or p.startswith("sharded")]
    try:
        print(f"{'size':>7} {'strat':>5} {'path':>13} {'store':>5} {'params':>9} {'disk MB':>8} {'step s':>7} "
              f"{'step s*':>7} {'blocked s':>9} {'persist s':>9} {'restore s':>9} {'read MB/rank':>12} "
              f"{'load MB/rank':>12} {'RSS MB r0/r1':>13}  ratios vs the first row (blocked, restore)"
              "   (step s*: a step while the background write runs)")
        for size in args.sizes.split(","):
            for strategy in args.strategies.split(","):
                ref = None
                for path, storage in runs:
                    r = run_one(size, strategy, path, args.repeat,
                                old if path == "full_state" else ROOT, args.device, args.nproc,
                                storage, s3_env, args.files_per_rank)
                    k = r["ranks"]
                    row = {f: max(x[f] for x in k) for f in ("step_s", "blocked_s", "persisted_s", "restore_s")}
                    ref = ref or row
                    reads = "/".join(f"{x['read_bytes'] / 1e6:.0f}" for x in k)
                    loads = "/".join(f"{x['load_bytes'] / 1e6:.0f}" for x in k)
                    rss = "/".join(f"{x['rss_mb']:.0f}" for x in k)
                    dur = [x["during_s"] for x in k if x.get("during_s") is not None]
                    dur = f"{max(dur):>7.2f}" if dur else f"{'-':>7}"
                    print(f"{size:>7} {strategy:>5} {path:>13} {storage:>5} {k[0]['params'] / 1e6:>8.1f}M "
                          f"{r['disk_bytes'] / 1e6:>8.1f} {row['step_s']:>7.2f} {dur} {row['blocked_s']:>9.3f} "
                          f"{row['persisted_s']:>9.3f} {row['restore_s']:>9.3f} "
                          f"{reads:>12} {loads:>12} {rss:>13}  "
                          f"{row['blocked_s'] / ref['blocked_s']:.2f}x, {row['restore_s'] / ref['restore_s']:.2f}x"
                          + (f"  GPU peak GB {max(x['gpu_gb'] for x in k):.1f}"
                             if k[0].get("gpu_gb") is not None else ""), flush=True)
        if args.interleave:
            print(f"\n{'size':>7} {'strat':>5}  interleaved, median of {args.repeat}: blocked s "
                  f"(this project / DCP async = ratio; / DCP async, kept stager = ratio), "
                  f"persisted s (this project / DCP async / DCP async, kept stager)")
            for size in args.sizes.split(","):
                for strategy in args.strategies.split(","):
                    r = run_one(size, strategy, "interleaved", args.repeat, ROOT, args.device,
                                args.nproc)
                    if "skipped" in r:
                        print(f"{size:>7} {strategy:>5}  left out: {r['skipped']}", flush=True)
                        continue
                    a, d = r["sharded_async"], r["dcp_async"]
                    e = r.get("dcp_async_kept")
                    kept = (f"; / {e['blocked_s']:.3f} = {a['blocked_s'] / e['blocked_s']:.2f}x"
                            if e else "; kept stager left out (memory)")
                    print(f"{size:>7} {strategy:>5}  {a['blocked_s']:.3f} / {d['blocked_s']:.3f} = "
                          f"{a['blocked_s'] / d['blocked_s']:.2f}x{kept}, {a['persisted_s']:.2f} / "
                          f"{d['persisted_s']:.2f}" + (f" / {e['persisted_s']:.2f}" if e else ""),
                          flush=True)
    finally:
        if server is not None:
            server.stop()
        if old is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)],
                           capture_output=True, check=False)
            shutil.rmtree(old, ignore_errors=True)


if __name__ == "__main__":
    main()
