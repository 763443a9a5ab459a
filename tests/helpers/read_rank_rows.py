"""Read one rank's rows of an epoch, as a trainer's process does, and save them: the
reader paths that run in other processes (DataLoader workers, Ray Data's tasks) start
from this fresh process, with the environment the test gives it (an object store's
endpoint and credentials), as on a cluster's node.

    python read_rank_rows.py INFO.pkl CONFIG.json READER RANK WORLD_SIZE OUT.npz

``INFO.pkl``: a pickled ``DatasetInfo`` (the driver's scan); READER: ``local`` (the read
and transform functions in this process), ``dataloader`` or ``ray_data``. OUT holds, per
step, the rank's ``sample_id`` and ``s`` (the row's pixel sum) arrays."""

from __future__ import annotations

import json
import pickle
import sys

import numpy as np

from elastic_ddp import Task
from elastic_ddp.config import Config
from elastic_ddp.data.readers import open_train_reader
from elastic_ddp.tasks.protocol import Column


class Rows(Task):
    """The row's label and pixel sum: enough to tell any two digits rows apart."""

    columns = {"x": Column.list_of("float", length=64), "y": Column.integer(min=0, max=9)}

    def transform(self, batch, ctx):
        x = np.stack(list(batch["x"])).astype(np.float64)
        return {"s": x.sum(axis=1), "y": np.asarray(batch["y"], np.int64)}

    def loss(self, model, batch):  # pragma: no cover - never trained
        raise NotImplementedError


class Ids(Task):
    """``x``: an integer column (the bytes test's data)."""

    columns = {"x": Column.integer()}

    def loss(self, model, batch):  # pragma: no cover - never trained
        raise NotImplementedError


T_ROWS = {"sample_id": np.zeros(0, np.int64), "s": np.zeros(0, np.float64), "y": np.zeros(0, np.int64)}
T_IDS = {"sample_id": np.zeros(0, np.int64), "x": np.zeros(0, np.int64)}


def rank_steps(info, cfg, reader: str, rank: int, ws: int, epoch: int = 1) -> list[dict]:
    """Every step of ``epoch`` from its start: this rank's rows."""
    task, t = (Rows(), T_ROWS) if "x" in info.columns and info.schema.field("x").type != "int64" \
        else (Ids(), T_IDS)
    g = cfg.batch.global_batch_size
    rd = open_train_reader(info, task, cfg, rank, ws, epoch, 0, g, local=reader == "local",
                           template=t, reader=None if reader == "local" else reader)[1]
    return [rd.take(c, min(g, info.num_rows - c)) for c in range(0, info.num_rows, g)]


def main(argv: list[str]) -> None:
    info_path, cfg_path, reader, rank, ws, out = argv
    with open(info_path, "rb") as f:
        info = pickle.load(f)
    with open(cfg_path) as f:
        cfg = Config.from_dict(json.load(f))
    if reader == "ray_data":
        from elastic_ddp.driver.local_ray import init_local_ray

        init_local_ray(num_cpus=2, logging_level="ERROR")
    steps = rank_steps(info, cfg, reader, int(rank), int(ws))
    np.savez(out, **{f"{k}_{i}": v for i, s in enumerate(steps) for k, v in s.items()})


if __name__ == "__main__":
    main(sys.argv[1:])
