"""What verifying a checkpoint costs beside reading it: the crc32 check of a restore
(``elastic_ddp.checkpoint.layout.bad_files``, every file the rank loads read once in full)
against the load itself (``torch.distributed.checkpoint.load`` of the same files into a
model and its Adam state), on one DCP checkpoint written here.

    .venv/bin/python experiments/bench_checksum.py                   # ~0.4 GB of state
    .venv/bin/python experiments/bench_checksum.py --width 2048 --layers 8 --repeat 5

Both sides run with the files in the page cache (each is timed after a warm-up read), so
the figure is the CPU cost of the check; on a cold or network file system the check
reads the bytes once more, which the load then reads from the cache. Prints the median
of ``--repeat`` runs of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def build(width: int, layers: int):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    opt.step()  # Adam's exp_avg / exp_avg_sq exist: the state is 3x the parameters
    return model, opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    import pyarrow.fs as pafs
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from elastic_ddp.checkpoint.layout import bad_files, file_record

    model, opt = build(args.width, args.layers)
    with tempfile.TemporaryDirectory(prefix="bench-checksum-") as d:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=d)
        fs = pafs.LocalFileSystem()
        names = sorted(p.name for p in Path(d).iterdir())
        manifest = {"files": {n: file_record(fs, f"{d}/{n}") for n in names}}
        total = sum(r["bytes"] for r in manifest["files"].values())

        def load() -> None:
            m, o = get_state_dict(model, opt)
            dcp.load({"model": m, "optim": o}, checkpoint_id=d)
            set_state_dict(model, opt, model_state_dict=m, optim_state_dict=o)

        def verify() -> None:
            assert bad_files(fs, d, manifest, names) == []

        times: dict[str, list[float]] = {"load": [], "verify": []}
        load(), verify()  # warm-up: files in the page cache
        for _ in range(args.repeat):
            for name, fn in (("load", load), ("verify", verify)):
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    n_params = sum(p.numel() for p in model.parameters())
    print(f"state {total / 2**20:.0f} MiB in {len(names)} files ({n_params / 1e6:.1f}M params + Adam)")
    print(f"  dcp.load      {med['load']:.3f} s   ({total / 2**30 / med['load']:.2f} GiB/s)")
    print(f"  crc32 verify  {med['verify']:.3f} s   ({total / 2**30 / med['verify']:.2f} GiB/s)")
    print(f"  verify / load = {med['verify'] / med['load']:.2f}")
    print(json.dumps({"bytes": total, "load_s": med["load"], "verify_s": med["verify"],
                      "ratio": med["verify"] / med["load"]}))


if __name__ == "__main__":
    main()
