"""What verifying a checkpoint costs beside reading it, and hashing it beside writing it,
through ``CheckpointManager`` (one process, no process group) on a model and its Adam
state written here.

    .venv/bin/python experiments/bench_checksum.py                   # ~0.4 GB of state
    .venv/bin/python experiments/bench_checksum.py --width 2048 --layers 8 --repeat 5

Restore, side by side (each the median of ``--repeat`` runs, interleaved):

- ``dcp.load alone``: the manager's state dict (``get_state_dict``), DCP's ``load`` of
  the files into it and ``set_state_dict``: no listing, no manifest, no check;
- ``restore, no check``: ``CheckpointManager.restore`` with the size check and the hash
  thread replaced by no-ops: the unverified restore, the reference of every ratio;
- ``restore, xxh3_64``: the restore as a job runs it (its share of the files hashed in a
  thread while DCP loads them; the state used once they verify);
- ``restore, crc32 manifest``: the same restore of the same files under a manifest of
  ``zlib.crc32`` records (checkpoints written before XXH3);
- ``check alone``: ``checkpoint.checksum.bad_files`` of every file, in each algorithm;
- ``check, then load``: the check alone followed by the unverified restore (a restore
  that does not overlap them), in each algorithm.

Write: ``CheckpointManager.save`` (synchronous, what the training thread waits for at a
checkpoint without ``train.async_checkpoint``: DCP's write with its fsync, the hash of
the written files, the manifest) beside the hash of the same files alone.

The files are in the page cache (each side is warmed first), so the figures are the CPU
cost of the check; on a cold file system the hash thread and the load read the same
bytes from storage side by side. ``os.getloadavg()`` is printed at the start and the end:
the machine's other load shares its cores with the hash thread.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace


def build(width: int, layers: int):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    opt.step()  # Adam's exp_avg / exp_avg_sq exist: the state is 3x the parameters
    return model, opt


def _no_check(*_a, **_k):
    f: Future = Future()
    f.set_result([])
    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    import pyarrow.fs as pafs
    import torch
    import torch.distributed.checkpoint as dcp

    from elastic_ddp.checkpoint import restore as restore_mod
    from elastic_ddp.checkpoint.checksum import bad_files, file_record
    from elastic_ddp.checkpoint.layout import MANIFEST, checkpoint_name
    from elastic_ddp.checkpoint.manager import CheckpointManager
    from elastic_ddp.checkpoint.state import model_optimizer_state, set_model_optimizer_state

    load0 = os.getloadavg()
    model, opt = build(args.width, args.layers)
    strategy = SimpleNamespace(module=model, optimizer=opt, hook_state=None)
    fs = pafs.LocalFileSystem()
    times: dict[str, list[float]] = {}

    def timed(name: str, fn) -> None:
        t = time.perf_counter()
        fn()
        times.setdefault(name, []).append(time.perf_counter() - t)

    with tempfile.TemporaryDirectory(prefix="bench-checksum-") as d:
        def mgr(run: str) -> CheckpointManager:
            return CheckpointManager(d, run, None, 0, 1, collective=False, log=lambda m: None)

        # ---- write: the synchronous save, and the hash of its files alone
        writer = mgr("write")
        for k in range(args.repeat + 1):
            timed("save", lambda: writer.save(k, strategy, {"progress": {"step": k}}, report=False))
            ck = f"{d}/write/{checkpoint_name(k)}"
            shards = sorted(f"{ck}/{n}" for n in os.listdir(ck) if n.endswith(".distcp"))
            for algo in ("xxh3_64", "crc32"):
                timed(f"hash {algo}", lambda: [file_record(fs, p, algo) for p in shards])
            if k:
                shutil.rmtree(f"{d}/write/{checkpoint_name(k - 1)}")
        for v in times.values():
            del v[0]  # the first round warms the page cache and the allocator
        # ---- restore: one checkpoint, under an xxh3_64 and (hard links) a crc32 manifest
        src = Path(d, "write", checkpoint_name(args.repeat))
        xdir = Path(d, "xxh3", checkpoint_name(1))
        cdir = Path(d, "crc32", checkpoint_name(1))
        for dst in (xdir, cdir):
            dst.mkdir(parents=True)
            for f in src.iterdir():
                os.link(f, dst / f.name)
        manifest = json.loads((src / MANIFEST).read_text())
        names = sorted(manifest["files"])
        total = sum(r["bytes"] for r in manifest["files"].values())
        crc = {**{k: v for k, v in manifest.items() if k != "checksum"},
               "files": {n: file_record(fs, f"{cdir}/{n}", "crc32") for n in names}}
        (cdir / MANIFEST).unlink()
        (cdir / MANIFEST).write_text(json.dumps(crc, indent=1))
        manifests = {"xxh3_64": (xdir, manifest), "crc32": (cdir, crc)}

        real = restore_mod.start_verify, restore_mod.size_mismatches

        def _before(*a):
            f: Future = Future()
            f.set_result(bad_files(*a))
            return f

        def restore(run: str, check) -> None:
            restore_mod.start_verify, restore_mod.size_mismatches = {
                True: real, False: (_no_check, lambda *a, **k: []),
                "before": (_before, real[1])}[check]
            try:
                found = mgr(run).restore(strategy)
            finally:
                restore_mod.start_verify, restore_mod.size_mismatches = real
            assert found is not None and found[1].endswith(checkpoint_name(1)), found

        def check_alone(algo: str) -> None:
            path, m = manifests[algo]
            assert bad_files(fs, str(path), m, names) == []

        def dcp_load() -> None:
            state = model_optimizer_state(strategy)
            dcp.load(state, checkpoint_id=str(xdir))
            set_model_optimizer_state(strategy, state)

        rounds = [("dcp.load alone", dcp_load),
                  ("restore, no check", lambda: restore("xxh3", False)),
                  ("restore, xxh3_64", lambda: restore("xxh3", True)),
                  ("restore, crc32 manifest", lambda: restore("crc32", True)),
                  ("restore, check before load", lambda: restore("xxh3", "before")),
                  ("check alone, xxh3_64", lambda: check_alone("xxh3_64")),
                  ("check alone, crc32", lambda: check_alone("crc32"))]
        for _, fn in rounds:
            fn()  # warm-up: the files in the page cache
        for _ in range(args.repeat):
            for name, fn in rounds:
                timed(name, fn)
    med = {k: statistics.median(v) for k, v in times.items()}
    for algo in ("xxh3_64", "crc32"):
        med[f"check, then load, {algo}"] = med[f"check alone, {algo}"] + med["restore, no check"]
    load1 = os.getloadavg()

    n_params = sum(p.numel() for p in model.parameters())
    base = med["restore, no check"]
    print(f"state {total / 2**20:.0f} MiB in {len(names)} files ({n_params / 1e6:.1f}M params "
          f"+ Adam); torch {torch.__version__}, {os.cpu_count()} cores, {torch.get_num_threads()} "
          f"torch threads; load average {load0[0]:.2f} at the start, {load1[0]:.2f} at the end")
    print(f"restore (median of {args.repeat})     seconds   GiB/s   cost over no check")
    for name in ("dcp.load alone", "restore, no check", "restore, xxh3_64", "restore, crc32 manifest",
                 "restore, check before load",
                 "check alone, xxh3_64", "check alone, crc32",
                 "check, then load, xxh3_64", "check, then load, crc32"):
        over = "" if name in ("restore, no check", "dcp.load alone") else (
            f"{med[name] / base:6.1%} of it" if name.startswith("check alone")
            else f"{(med[name] - base) / base:+6.1%}")
        print(f"  {name:28s} {med[name]:7.3f}  {total / 2**30 / med[name]:6.2f}   {over}")
    shard_bytes = total - sum(r["bytes"] for n, r in manifest["files"].items()
                              if not n.endswith(".distcp"))
    print(f"write (median of {args.repeat})       seconds   GiB/s   share of the save")
    for name in ("save", "hash xxh3_64", "hash crc32"):
        share = "" if name == "save" else f"{med[name] / med['save']:6.1%}"
        print(f"  {name:28s} {med[name]:7.3f}  {shard_bytes / 2**30 / med[name]:6.2f}   {share}")
    print(json.dumps({"bytes": total, "load_average": [round(load0[0], 2), round(load1[0], 2)],
                      **{k.replace(", ", "_").replace(" ", "_") + "_s": round(v, 4)
                         for k, v in med.items()},
                      "verify_cost": round((med["restore, xxh3_64"] - base) / base, 4),
                      "verify_cost_crc32": round((med["restore, crc32 manifest"] - base) / base, 4)}))


if __name__ == "__main__":
    main()
