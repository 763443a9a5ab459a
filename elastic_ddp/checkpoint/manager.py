"""The checkpoint manager: the only writer and reader of the checkpoint schema
(``elastic_ddp.checkpoint.layout``), for both fault-tolerance modes, for a healing
replica's live state and for the driver's final model.

    ckpt = CheckpointManager(storage, run_name, config, rank, world_size, collective=True)
    ckpt.save(step, strategy, run_state, metrics)        # every rank; a Ray Train report
    found = ckpt.restore(strategy)                       # every rank; (run_state, path) or None

Sharded: every rank writes its own part of the model and optimizer state with
``torch.distributed.checkpoint`` (DCP) straight into the checkpoint directory on
storage, and reads back only the parts its own shards need. FSDP's parameters and
optimizer state are DTensors (each rank its shards); ZeRO-1's optimizer state is each
rank's partition, keyed by parameter name; DDP's replicated state is split among the ranks
by DCP's planner (each tensor written once). The optimizer state is flattened (one key
per parameter and state), so a checkpoint written at N ranks loads at any M: DCP
reshards on load. No rank ever holds the full state.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import torch.distributed as dist

from elastic_ddp.checkpoint.dcp_io import load_powersgd_keys, local_copy, powersgd_keys
from elastic_ddp.checkpoint.layout import (
    CONFIG, FORMAT, LEGACY_FORMAT, MANIFEST, RUN_STATE, CheckpointCorruptError, CheckpointError,
    bad_files, checkpoint_name, complete_checkpoints, describe, file_record, incomplete_checkpoints,
    is_complete,
    read_manifest, run_dir)

#: What a run state holds (JSON): the trainer's progress and counters, the data it was
#: written on, and per-step fault tolerance's torchft step counters.
RUN_KEYS = ("progress", "counters", "data", "torchft")


def _already_persisted(checkpoint, _dir_name: str):
    """Ray Train's ``checkpoint_upload_fn``: the ranks wrote the checkpoint on storage."""
    return checkpoint


class CheckpointManager:
    """One rank's view of the run's checkpoints.

    Args:
        storage, run_name: ``run.storage_path`` (a path or a URI) and ``run.name``;
            checkpoints live in ``storage/run_name/checkpoint_step<k>``.
        config: the job's config (``config.json`` of each checkpoint).
        rank, world_size: this worker in the job.
        collective: the ranks share a torch.distributed group (restart mode with several
            workers): they write and read one checkpoint together. False: one rank
            writes the whole (replicated) state alone (per-step fault tolerance, one worker).
        log: a line for the run's log (rank 0's). tracker: where a rejected checkpoint is
            recorded as an event (``TrackerClient``; None: not recorded).
    """

    def __init__(self, storage: str, run_name: str, config: Optional[dict], rank: int,
                 world_size: int, collective: bool, log: Callable[[str], None] = print,
                 tracker=None, strategy_name: str = "ddp"):
        self.storage, self.run_name, self.config = storage, run_name, config
        self.rank, self.world_size, self.collective = rank, world_size, collective
        self.log, self.tracker, self.strategy_name = log, tracker, strategy_name

    # ------------------------------------------------------------------ state to DCP
    @staticmethod
    def model_optimizer_state(strategy) -> dict[str, Any]:
        """The DCP state of ``strategy``: ``model`` (parameter names without DDP's prefix;
        DTensors under FSDP) and ``optim`` (flattened: ``state.<param>.<key>``,
        ``param_groups.<param>.<key>``; ZeRO-1: this rank's partition). Every rank calls
        it (FSDP: collective). A fresh optimizer's state is created by one zero step."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opt = strategy.optimizer
        local = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer: this rank's partition
        model, optim = get_state_dict(strategy.module, local,
                                      options=StateDictOptions(flatten_optimizer_state_dict=True))
        return {"model": model, "optim": optim}

    @staticmethod
    def _set_model_optimizer_state(strategy, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        opt = strategy.optimizer
        local = getattr(opt, "optim", opt)
        set_state_dict(strategy.module, local, model_state_dict=state["model"],
                       optim_state_dict=state["optim"],
                       options=StateDictOptions(flatten_optimizer_state_dict=True))

    # ------------------------------------------------------------------------ save
    def save(self, step: int, strategy, run_state: dict, metrics: Optional[dict] = None,
             report: bool = True, writer: bool = True,
             fault_hook: Optional[Callable[[str], None]] = None,
             asynchronous: bool = False) -> Optional[str]:
        """Write the checkpoint of ``step`` into storage and, with ``report``, commit it
        through ``ray.train.report`` (a barrier over every rank; registered by Ray Train
        once every rank reported). Every rank calls it. Not ``collective``: only the
        ``writer`` writes. Returns the checkpoint's path (the writing ranks).

        ``asynchronous`` (collective, local storage): returns once the state is
        staged to host memory (DCP ``async_save``); the write, the checksums and the
        manifest finish in the background, and the report follows at the first
        ``poll()`` that finds every rank's write done (``checkpoint.inflight``). At most
        one is in flight: a save waits for the previous one first.

        Costs: each rank's share of the state serialised once and read once more for its
        crc32; one ``all_gather_object`` of the file records; rank 0 writes the small files.
        ``fault_hook(shard_path)``: a test hook run after the shards are written and before
        the manifest (the window a crash must not turn into a checkpoint)."""
        import pyarrow.fs as pafs

        from elastic_ddp.checkpoint.inflight import save_async

        self.wait()
        fs, base = run_dir(self.storage, self.run_name)
        writes = self.collective or writer
        lead = self.rank == 0 if self.collective else writer
        local = isinstance(fs, pafs.LocalFileSystem)
        name = checkpoint_name(step)
        if lead:
            name = self._free_name(fs, base, step)
            fs.create_dir(f"{base}/{name}", recursive=True)
        name = self._broadcast(name)
        dest = f"{base}/{name}"
        if not writes:
            if report:
                self._report(metrics, fs, dest, name, lead=False)
            return None
        state = self.model_optimizer_state(strategy)
        if strategy.hook_state is not None:
            state["comm_hook"] = powersgd_keys(strategy.hook_state, self.rank, self.world_size)
        if asynchronous and self.collective and local:
            self.pending = save_async(self, state, fs, dest, name, step, dict(run_state),
                                      metrics, fault_hook, report)
            return dest
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint import save as dcp_save

        target = dest if local else tempfile.mkdtemp(prefix="elastic-ddp-ckpt-")
        try:
            dcp_save(state, storage_writer=FileSystemWriter(target), no_dist=not self.collective)
            records = self.records(fs, target, dest, lead, local, fault_hook)
        finally:
            if not local:
                shutil.rmtree(target, ignore_errors=True)
        self.finish_write(fs, dest, step, run_state, records, lead)
        if report:
            self._report(metrics, fs, dest, name, lead)
        return dest

    def records(self, fs, target: str, dest: str, lead: bool, local: bool,
                 fault_hook=None) -> dict:
        """This rank's files of the checkpoint written in local directory ``target``
        (copied to ``dest`` on a remote file system), with their sizes and crc32s."""
        import pyarrow.fs as pafs

        me = self.rank if self.collective else 0
        mine = sorted(f for f in os.listdir(target) if f.startswith(f"__{me}_"))
        if lead:
            mine.append(".metadata")
        if not local:
            for f in mine:
                pafs.copy_files(os.path.join(target, f), f"{dest}/{f}", destination_filesystem=fs)
        records = {f: file_record(pafs.LocalFileSystem(), os.path.join(target, f)) for f in mine}
        if fault_hook is not None and mine:
            fault_hook(os.path.join(target, mine[0]))
        return records

    def finish_write(self, fs, dest: str, step: int, run_state: dict, records: dict, lead: bool,
                group=None) -> None:
        """Gather every rank's file records; rank 0 writes the small files and the manifest."""
        files = self._gather(records, group)
        if lead:
            self._write_small(fs, dest, step, run_state, files)

    def _report(self, metrics, fs, dest: str, name: str, lead: bool) -> None:
        import ray.train
        from ray.train import Checkpoint

        ray.train.report({k: float(v) for k, v in (metrics or {}).items()},
                         checkpoint=Checkpoint(dest, filesystem=fs) if lead else None,
                         checkpoint_dir_name=name, checkpoint_upload_fn=_already_persisted)

    #: The asynchronous checkpoint in flight (``checkpoint.inflight.Pending``), or None.
    pending = None

    def poll(self) -> None:
        """At a step boundary, on every rank: report the checkpoint in flight once every
        rank's write is done (one small all-reduce while one is in flight)."""
        if self.pending is not None and self.pending.all_done():
            self._commit()

    def wait(self) -> None:
        """Wait for the checkpoint in flight and report it (every rank)."""
        if self.pending is not None:
            self.pending.join()
            self._commit()

    def _commit(self) -> None:
        p, self.pending = self.pending, None
        p.raise_error()
        if p.report:
            self._report(p.metrics, p.fs, p.dest, p.name, self.rank == 0)

    @staticmethod
    def _free_name(fs, base: str, step: int) -> str:
        """The directory name for step ``step``: ``checkpoint_step<k>``, or the next
        ``_r<n>`` when a checkpoint of that step with a manifest is there (one a restore
        rejected or passed over: Ray Train may have registered it, so it is left alone).
        A directory without a manifest is a write cut short: removed and reused."""
        import pyarrow.fs as pafs

        n = 0
        while True:
            name = checkpoint_name(step, n)
            info = fs.get_file_info(f"{base}/{name}")
            if info.type == pafs.FileType.NotFound:
                return name
            if fs.get_file_info(f"{base}/{name}/{MANIFEST}").type == pafs.FileType.NotFound:
                fs.delete_dir(f"{base}/{name}")
                return name
            n += 1

    def _write_small(self, fs, dest: str, step: int, run_state: dict, files: dict) -> None:
        """run_state.json, config.json, then the manifest (to a temporary name, moved)."""
        small = {RUN_STATE: json.dumps({"format": FORMAT, **run_state}, indent=1).encode()}
        if self.config is not None:
            small[CONFIG] = json.dumps(self.config, indent=2).encode()
        for n, data in small.items():
            with fs.open_output_stream(f"{dest}/{n}") as out:
                out.write(data)
            files[n] = {"bytes": len(data), "crc32": __import__("zlib").crc32(data)}
        manifest = {"format": FORMAT, "step": step, "world_size": self.world_size,
                    "strategy": self.strategy_name, "files": dict(sorted(files.items()))}
        with fs.open_output_stream(f"{dest}/{MANIFEST}.tmp") as out:
            out.write(json.dumps(manifest, indent=1).encode())
        fs.move(f"{dest}/{MANIFEST}.tmp", f"{dest}/{MANIFEST}")

    # --------------------------------------------------------------------- restore
    def restore(self, strategy, ray_checkpoint=None) -> Optional[tuple[dict, str]]:
        """Load the newest checkpoint that verifies into ``strategy``; every rank calls it.
        Candidates: the run's complete checkpoints in storage, newest first (a report the
        controller had not registered yet included), else Ray Train's. Each rank checks
        the crc32 of its share of the files; a checkpoint with a bad file is named in a
        warning and a ``checkpoint_rejected`` event, and the next older one is tried.

        Returns:
            (the run state, the checkpoint's path), or None: no checkpoint (a fresh start).
        Raises:
            CheckpointCorruptError: checkpoints exist and none verifies.
            CheckpointError: the newest that verifies does not fit this config's model.
        """
        fs = None
        cands: list[str] = []
        if self.storage:
            fs, _ = run_dir(self.storage, self.run_name)
            cands = [p for _, p in complete_checkpoints(self.storage, self.run_name, sizes=False)]
        if not cands and ray_checkpoint is not None:
            fs, cands = ray_checkpoint.filesystem, [ray_checkpoint.path]
        cands = self._broadcast(cands)
        rejected: list[tuple[str, list[str]]] = []
        for path in cands:
            manifest = read_manifest(fs, path)
            if manifest.get("format") == LEGACY_FORMAT or "state_bytes" in manifest:
                if not is_complete(fs, path, manifest):
                    rejected.append((path, ["state.pt (not the size its manifest names)"]))
                    self._reject(path, rejected[-1][1])
                    continue
                return self._load_legacy(strategy, fs, path), path
            names = sorted(manifest["files"])
            share = _share(names, self.rank, self.world_size) if self.collective else names
            bad = [b for part in self._gather_list(bad_files(fs, path, manifest, share)) for b in part]
            if bad:
                rejected.append((path, bad))
                self._reject(path, bad)
                continue
            run_state = self._load(strategy, fs, path, manifest)
            # Restart mode only: every rank is restoring, so no write is under way (in
            # per-step mode a replacement restores while the quorum may be writing).
            if self.rank == 0 and self.storage and (self.collective or self.world_size == 1):
                for p in incomplete_checkpoints(self.storage, self.run_name, manifest["step"]):
                    if p not in {r[0] for r in rejected}:
                        fs.delete_dir(p)
            self.log(f"restored {path} ({describe(manifest)}) at world size {self.world_size}")
            return run_state, path
        if rejected:
            raise CheckpointCorruptError(
                f"no checkpoint of run {self.run_name!r} verifies: " + "; ".join(
                    f"{p}: {', '.join(b)}" for p, b in rejected)
                + ". Restore the files from a copy, or start a new run (another run.name)")
        return None

    def _reject(self, path: str, bad: list[str]) -> None:
        msg = (f"elastic-ddp: warning: checkpoint {path} fails its checksums: {', '.join(bad)}; "
               "trying the previous checkpoint")
        if self.rank == 0:
            sys.stderr.write(msg + "\n")
            sys.stderr.flush()
            self.log(msg)
            if self.tracker is not None:
                self.tracker.event({"type": "checkpoint_rejected", "t": time.time(),
                                    "checkpoint": path, "bad_files": bad, "cause": msg})

    def _load(self, strategy, fs, path: str, manifest: dict) -> dict:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint import load as dcp_load

        with local_copy(fs, path) as d:
            state = self.model_optimizer_state(strategy)
            try:
                dcp_load(state, storage_reader=FileSystemReader(d), no_dist=not self.collective)
                self._set_model_optimizer_state(strategy, state)
            except Exception as e:  # noqa: BLE001 - DCP wraps every rank's error
                raise CheckpointError(
                    f"checkpoint {path} ({describe(manifest)}) does not fit this config's "
                    f"model/optimizer ({type(e).__name__}: {str(e).splitlines()[0][:300]}); "
                    "resume it with its own config (config.json beside it) or set a new "
                    "run.name") from e
            if strategy.hook_state is not None:
                load_powersgd_keys(strategy, d, self.rank, self.world_size)
            with open(os.path.join(d, RUN_STATE)) as f:
                run_state = json.load(f)
        return {k: run_state[k] for k in RUN_KEYS if k in run_state}

    def _load_legacy(self, strategy, fs, path: str) -> dict:
        from elastic_ddp.checkpoint.legacy import load_state

        with local_copy(fs, path) as d:
            state = load_state(d)
        try:
            strategy.load_full_state(state)
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(
                f"checkpoint {path} (format {LEGACY_FORMAT}) does not fit this config's "
                f"model/optimizer ({type(e).__name__}: {str(e).splitlines()[0][:300]}); resume "
                "it with its own config (config.json beside it) or set a new run.name") from e
        self.log(f"restored {path} (format {LEGACY_FORMAT}: one state.pt); the next checkpoint "
                 f"is written in format {FORMAT}")
        return {k: state[k] for k in RUN_KEYS if k in state}

    # ---------------------------------------------------------------- live (healing)
    @staticmethod
    def live_state(strategy, run_state: dict) -> dict:
        """What a healing replica receives from a live peer (per-step fault tolerance,
        torchft's transport): the model's and the optimizer's in-memory state dicts and
        the run state. Replicated (ddp): one copy per replica, no gathering."""
        return {"model": strategy.module.state_dict(), "optimizer": strategy.optimizer.state_dict(),
                **run_state}

    @staticmethod
    def load_live_state(strategy, state: dict) -> dict:
        """Load a peer's ``live_state`` into ``strategy``; returns its run state."""
        strategy.module.load_state_dict(state["model"])
        strategy.optimizer.load_state_dict(state["optimizer"])
        return {k: state[k] for k in RUN_KEYS if k in state}

    # ------------------------------------------------------------------ collectives
    def _gather(self, records: dict, group=None) -> dict:
        if not self.collective:
            return dict(records)
        parts: list = [None] * self.world_size
        dist.all_gather_object(parts, records, group=group)
        return {k: v for p in parts for k, v in p.items()}

    def _gather_list(self, items: list) -> list[list]:
        if not self.collective:
            return [items]
        parts: list = [None] * self.world_size
        dist.all_gather_object(parts, items)
        return parts

    def _broadcast(self, obj):
        if not self.collective:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _share(names: list[str], rank: int, world_size: int) -> list[str]:
    """The files ``rank`` verifies at a restore: the shards rank r wrote (``__r_*``) go
    to rank r mod world_size, so at the world size they were written at each rank checks
    the file it loads anyway (read once more, from the page cache); the others round-robin."""
    import re

    out = []
    for i, n in enumerate(names):
        m = re.match(r"__(\d+)_", n)
        if (int(m.group(1)) if m else i) % world_size == rank:
            out.append(n)
    return out
