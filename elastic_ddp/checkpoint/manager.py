"""The checkpoint manager: the only writer and reader of the checkpoint schema
(``elastic_ddp.checkpoint.layout``), for both fault-tolerance modes. This module holds
the save and its commit (the manifest, then ``ray.train.report``); the restore is
``checkpoint.restore``, the pruning of unreported checkpoints ``checkpoint.prune``, the
state a checkpoint holds (and a healing replica's live state) ``checkpoint.state``, the
ranks' shares of replicated state ``checkpoint.shares``.

    ckpt = CheckpointManager(storage, run_name, config, rank, world_size, collective=True)
    ckpt.save(step, strategy, run_state, metrics)        # every rank; a Ray Train report
    found = ckpt.restore(strategy)                       # every rank; (run_state, path) or None

Sharded: every rank writes its own part of the model and optimizer state with
``torch.distributed.checkpoint`` (DCP) straight into the checkpoint directory on
storage, and reads back only the parts its own shards need. FSDP's parameters and
optimizer state are DTensors (each rank its shards); ZeRO-1's optimizer state is each
rank's partition, keyed by parameter name; DDP's replicated state is split among the ranks
by bytes before staging (``checkpoint.shares``: each tensor copied and written once). The
optimizer state is flattened (one key per parameter and state), so a checkpoint written
at N ranks loads at any M: DCP reshards on load. No rank ever holds the full state.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable, Optional

import torch.distributed as dist

from elastic_ddp.fencing import Fence, check as check_fence
from elastic_ddp.checkpoint import state as ckpt_state
from elastic_ddp.checkpoint.prune import prune_unreported
from elastic_ddp.checkpoint.restore import restore as restore_newest
from elastic_ddp.checkpoint.checksum import ALGO, digest_bytes
from elastic_ddp.checkpoint.dcp_io import powersgd_keys, single_process
from elastic_ddp.checkpoint.shares import REPLICATED_PARTS, replicated_share
from elastic_ddp.checkpoint.upload import (CheckpointWriteError, local_records, my_files,
                                           remove_staging, staging_dir, upload)
from elastic_ddp.checkpoint.layout import (CONFIG, FORMAT, MANIFEST, RUN_STATE, checkpoint_name,
                                           free_name, run_dir)


def _already_persisted(checkpoint, _dir_name: str):
    """Ray Train's ``checkpoint_upload_fn``: the ranks wrote the checkpoint on storage."""
    return checkpoint


def _ray_storage_filesystem():
    """The file system of the run's storage as Ray Train holds it in this worker
    (``ray.train.get_context().get_storage().storage_filesystem``), or None outside a
    Ray Train worker."""
    try:
        import ray.train

        return ray.train.get_context().get_storage().storage_filesystem
    except Exception:  # noqa: BLE001 - not in a Ray Train worker (tests, the driver)
        return None


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
        fence: the job's lease token (:mod:`elastic_ddp.fencing`): checked before a
            checkpoint's directory is claimed, before its manifest (the commit), before
            ``ray.train.report`` (whose registration makes Ray Train prune older ones) and
            before any checkpoint is removed; :class:`~elastic_ddp.fencing.FencedError`
            once another job took the run over. None: not checked.
    """

    def __init__(self, storage: str, run_name: str, config: Optional[dict], rank: int,
                 world_size: int, collective: bool, log: Callable[[str], None] = print,
                 tracker=None, strategy_name: str = "ddp", fence: Optional[Fence] = None):
        self.storage, self.run_name, self.config = storage, run_name, config
        #: Where an asynchronous checkpoint is serialised: "thread" (a thread of this
        #: process) or "process" (``checkpoint.writer_process``); the config's
        #: ``train.checkpoint_writer``.
        train = (config or {}).get("train") or {}
        self.writer = train.get("checkpoint_writer", "thread")
        #: DCP's ``thread_count``: the files each writing rank writes (the config's
        #: ``train.checkpoint_files_per_rank``).
        self.files_per_rank = int(train.get("checkpoint_files_per_rank") or 1)
        self.fence = fence
        self.rank, self.world_size, self.collective = rank, world_size, collective
        self.log, self.tracker, self.strategy_name = log, tracker, strategy_name

    # ---------------------------------------------------------------- live (healing)
    #: What a healing replica receives from a live peer, and its load
    #: (``checkpoint.state.live_state``, ``load_live_state``; the worker's healing path).
    live_state = staticmethod(ckpt_state.live_state)
    load_live_state = staticmethod(ckpt_state.load_live_state)

    # ------------------------------------------------------------------------ save
    def save(self, step: int, strategy, run_state: dict, metrics: Optional[dict] = None,
             report: bool = True, writer: bool = True,
             fault_hook: Optional[Callable[[str], None]] = None,
             asynchronous: bool = False) -> Optional[str]:
        """Write the checkpoint of ``step`` into storage and, with ``report``, commit it
        through ``ray.train.report`` (a barrier over every rank; registered by Ray Train
        once every rank reported). Every rank calls it. Not ``collective``: only the
        ``writer`` writes. Returns the checkpoint's path (the writing ranks).

        ``asynchronous`` (collective): returns once the state is staged to host memory
        (DCP ``async_save``); the write (on object storage: into a local staging
        directory, then uploaded), the checksums and the manifest finish in the
        background, and the report follows at the first ``poll()`` that finds every
        rank's write done (``checkpoint.inflight``). At most one is in flight: a save
        waits for the previous one first. A background write that fails is said in one
        line at that ``poll()`` and not reported; training goes on.

        Costs: each rank's share of the state serialised once and read once more (from
        the page cache) for its XXH3 checksum; on object storage, a local copy of this
        rank's files while they upload; one ``all_gather_object`` of the file records;
        rank 0 writes the small files.
        ``fault_hook(shard_path)``: a test hook run after this rank's shards are written
        (locally) and before their upload and the manifest (the window a crash must not
        turn into a checkpoint).

        Raises:
            CheckpointWriteError: a synchronous write failed on some rank (one line: the
                rank, the key, the store's error); nothing is reported."""
        import pyarrow.fs as pafs

        from elastic_ddp.checkpoint.inflight import save_async

        self.wait()
        fs, base = run_dir(self.storage, self.run_name)
        writes = self.collective or writer
        lead = self.rank == 0 if self.collective else writer
        local = isinstance(fs, pafs.LocalFileSystem)
        name = checkpoint_name(step)
        if lead:
            check_fence(self.fence, f"the checkpoint of step {step}")
            name = free_name(fs, base, step)
            if local:  # an object store has no directories (a marker object: one more PUT)
                fs.create_dir(f"{base}/{name}", recursive=True)
        name = self.broadcast(name)
        dest = f"{base}/{name}"
        if not writes:
            if report:
                self._report(metrics, fs, dest, name, lead=False)
            return None
        state = ckpt_state.model_optimizer_state(strategy)
        if self.collective and self.world_size > 1:
            state = replicated_share(state, REPLICATED_PARTS.get(strategy.name, ()),
                                     self.rank, self.world_size)
        if strategy.hook_state is not None:
            state["comm_hook"] = powersgd_keys(strategy.hook_state, self.rank, self.world_size)
        if asynchronous and self.collective:
            self.pending = save_async(self, state, fs, dest, name, step, dict(run_state),
                                      metrics, fault_hook, report, local)
            return dest
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint import save as dcp_save

        target, records, error = dest if local else staging_dir(), {}, None
        try:
            with single_process(not self.collective):
                dcp_save(state, storage_writer=FileSystemWriter(target, thread_count=self.files_per_rank),
                         no_dist=not self.collective)
            records = self.records(fs, target, dest, lead, local, fault_hook)
        except CheckpointWriteError as e:  # every rank still meets the others' gather
            error = str(e)
        finally:
            if not local:
                remove_staging(target)
        try:
            self.finish_write(fs, dest, step, run_state, records, lead, reported=report,
                              error=error)
        except CheckpointWriteError as e:
            # Synchronous: the step loop waited for this checkpoint; the job stops with
            # the line (a restart resumes from the previous checkpoint).
            self.failed(e, fs, dest)
            raise
        if report:
            self._report(metrics, fs, dest, name, lead)
        return dest

    def records(self, fs, target: str, dest: str, lead: bool, local: bool,
                fault_hook=None, known: Optional[dict] = None) -> dict:
        """This rank's files of the checkpoint DCP wrote into local directory ``target``,
        with their sizes and checksums (read from ``target``); on a remote file system
        then uploaded into ``dest`` (``checkpoint.upload``).

        Raises:
            CheckpointWriteError: an upload failed (one line: rank, key, the store's error).
        """
        me = self.rank if self.collective else 0
        mine = my_files(target, me, lead)
        known = known or {}
        records = {**local_records(target, [n for n in mine if n not in known]),
                   **{n: known[n] for n in mine if n in known}}
        if fault_hook is not None and mine:
            fault_hook(os.path.join(target, mine[0]))
        if not local:
            upload(fs, target, mine, dest, self.rank)
        return records

    def finish_write(self, fs, dest: str, step: int, run_state: dict, records: dict, lead: bool,
                     group=None, reported: bool = True, error: Optional[str] = None) -> None:
        """Gather every rank's file records (or its write's ``error`` line); rank 0 writes
        the small files and the manifest, last, once every rank's files are on storage
        (``reported``: whether the checkpoint is committed through ``ray.train.report``).

        Raises:
            CheckpointWriteError: on every rank, when any rank's write failed (the first
                failing rank's line); no manifest is written.
        """
        if not self.collective:
            files, errors = dict(records), [error] if error else []
        else:
            parts: list = [None] * self.world_size
            dist.all_gather_object(parts, (records, error), group=group)
            files = {k: v for r, _ in parts for k, v in r.items()}
            errors = [e for _, e in parts if e]
        if errors:
            raise CheckpointWriteError(errors[0])
        if lead:
            self._write_small(fs, dest, step, run_state, files, reported)

    def failed(self, e: BaseException, fs, dest: str) -> None:
        """A checkpoint whose write failed (every rank, after the gather): rank 0 says so
        in one line (stderr, the run's log, a ``checkpoint_failed`` event) and removes what
        was written of it (best effort: a store that refuses writes may refuse that too;
        a directory without a manifest is never used, and a restore removes it)."""
        if self.rank != 0:
            return
        msg = f"elastic-ddp: warning: {e}; the previous checkpoint stays the restart point"
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()
        self.log(msg)
        if self.tracker is not None:
            self.tracker.event({"type": "checkpoint_failed", "t": time.time(), "checkpoint": dest,
                                "cause": msg})
        try:
            fs.delete_dir(dest)
        except OSError:
            pass

    def _report(self, metrics, fs, dest: str, name: str, lead: bool) -> None:
        import ray.train
        from ray.train import Checkpoint

        # Ray Train keeps a checkpoint only on its own storage file system (an equal one:
        # pyarrow compares the options, endpoint and credentials included), so the
        # checkpoint is named on the file system the driver gave Ray Train. This rank's
        # may differ in its options where a node reaches the same store otherwise (another
        # endpoint, a proxy, its own credentials); the path is the same on both.
        if lead:
            # A report registers the checkpoint, and Ray Train then prunes the run's oldest.
            check_fence(self.fence, f"the report of checkpoint {name}")
            fs = _ray_storage_filesystem() or fs
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
        if isinstance(p.error, CheckpointWriteError):
            # A background write that failed: said in one line, not reported; training
            # goes on, and the previous checkpoint stays the restart point.
            self.failed(p.error, p.fs, p.dest)
            return
        p.raise_error()
        if p.report:
            self._report(p.metrics, p.fs, p.dest, p.name, self.rank == 0)

    def _write_small(self, fs, dest: str, step: int, run_state: dict, files: dict,
                     reported: bool = True) -> None:
        """run_state.json, config.json, then the manifest (to a temporary name, moved).
        The manifest's ``reported: false`` marks a checkpoint Ray Train never registers
        (a partial quorum's): ``prune_unreported`` removes those, Ray Train its own."""
        small = {RUN_STATE: json.dumps({"format": FORMAT, **run_state}, indent=1).encode()}
        if self.config is not None:
            small[CONFIG] = json.dumps(self.config, indent=2).encode()
        for n, data in small.items():
            with fs.open_output_stream(f"{dest}/{n}") as out:
                out.write(data)
            files[n] = {"bytes": len(data), ALGO: digest_bytes(data)}
        manifest = {"format": FORMAT, "step": step, "world_size": self.world_size,
                    "strategy": self.strategy_name, "checksum": ALGO,
                    "files": dict(sorted(files.items()))}
        if not reported:
            manifest["reported"] = False
        check_fence(self.fence, f"the manifest of the checkpoint of step {step}")  # the commit
        with fs.open_output_stream(f"{dest}/{MANIFEST}.tmp") as out:
            out.write(json.dumps(manifest, indent=1).encode())
        fs.move(f"{dest}/{MANIFEST}.tmp", f"{dest}/{MANIFEST}")

    def prune_unreported(self, keep: int) -> list[str]:
        """Remove the run's unreported checkpoints past its ``keep`` newest complete ones
        (``checkpoint.prune.prune_unreported``, fenced); returns their paths."""
        return prune_unreported(self.storage, self.run_name, keep, self.fence, self.log)

    # --------------------------------------------------------------------- restore
    def restore(self, strategy, ray_checkpoint=None) -> Optional[tuple[dict, str]]:
        """Load the newest checkpoint that verifies into ``strategy`` (every rank;
        ``checkpoint.restore.restore``). Returns (the run state, the checkpoint's path),
        or None: no checkpoint. Raises CheckpointCorruptError: checkpoints exist and none
        verifies; CheckpointError: the newest that verifies does not fit the model."""
        return restore_newest(self, strategy, ray_checkpoint)

    #: Bytes this rank read from object storage at its last restore (downloaded share
    #: and ranged reads; the small files read whole not counted); 0 on local storage.
    read_bytes = 0

    # ------------------------------------------------------------------ collectives
    def all_ranks(self, items: list) -> list:
        """Every rank's ``items``, concatenated in rank order (collective)."""
        if not self.collective:
            return list(items)
        parts: list = [None] * self.world_size
        dist.all_gather_object(parts, items)
        return [x for p in parts for x in p]

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank (collective)."""
        if not self.collective:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
