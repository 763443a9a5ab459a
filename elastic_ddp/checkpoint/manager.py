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
by bytes before staging (``replicated_share``: each tensor copied and written once). The optimizer state is flattened (one key
per parameter and state), so a checkpoint written at N ranks loads at any M: DCP
reshards on load. No rank ever holds the full state.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from elastic_ddp.fencing import Fence, check as check_fence
from elastic_ddp.checkpoint.checksum import (
    ALGO, digest_bytes, share_of, size_mismatches, start_verify)
from elastic_ddp.checkpoint.dcp_io import load_powersgd_keys, local_copy, powersgd_keys, single_process
from elastic_ddp.checkpoint.upload import (CheckpointWriteError, local_records, my_files,
                                           remove_staging, staging_dir, upload)
from elastic_ddp.checkpoint.layout import (
    CONFIG, FORMAT, LEGACY_FORMAT, MANIFEST, RUN_STATE, CheckpointCorruptError, CheckpointError,
    checkpoint_name, complete_checkpoints, describe, free_name, incomplete_checkpoints,
    is_complete, mark_rejected, none_verifies, read_manifest, rejected_paths, run_dir)

#: What a run state holds (JSON): the trainer's progress and counters, the data it was
#: written on, and per-step fault tolerance's torchft step counters.
RUN_KEYS = ("progress", "counters", "data", "torchft")


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
        self.fence = fence
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
        name = self._broadcast(name)
        dest = f"{base}/{name}"
        if not writes:
            if report:
                self._report(metrics, fs, dest, name, lead=False)
            return None
        state = self.model_optimizer_state(strategy)
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
                dcp_save(state, storage_writer=FileSystemWriter(target), no_dist=not self.collective)
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
                fault_hook=None) -> dict:
        """This rank's files of the checkpoint DCP wrote into local directory ``target``,
        with their sizes and checksums (read from ``target``); on a remote file system
        then uploaded into ``dest`` (``checkpoint.upload``).

        Raises:
            CheckpointWriteError: an upload failed (one line: rank, key, the store's error).
        """
        me = self.rank if self.collective else 0
        mine = my_files(target, me, lead)
        records = local_records(target, mine)
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
        """Remove the run's unreported checkpoints (manifest ``reported: false``) that are
        not among its ``keep`` newest complete ones; returns their paths. Ray Train's
        ``CheckpointConfig(num_to_keep)`` removes only the checkpoints it registered, so
        without this a run whose quorum stays partial would keep every one it wrote.
        Reported ones are left to Ray Train. Costs a listing and a manifest read per
        checkpoint past the newest ``keep``."""
        fs, _ = run_dir(self.storage, self.run_name)
        check_fence(self.fence, "the pruning of unreported checkpoints")
        removed = []
        good = complete_checkpoints(self.storage, self.run_name)
        # A rejected one goes once `keep` good ones are newer (nothing else removes it).
        oldest_kept = good[keep - 1][0] if keep and len(good) >= keep else None
        rejected = [] if oldest_kept is None else [
            (k, p) for k, p in complete_checkpoints(self.storage, self.run_name, sizes=False, rejected=True)
            if k < oldest_kept and p in rejected_paths(fs, [p])]
        for _, path in good[keep:] + rejected:
            try:
                if read_manifest(fs, path).get("reported", True) is False:
                    fs.delete_dir(path)
                    removed.append(path)
            except (OSError, ValueError) as e:  # gone already, or unreadable: left as it is
                self.log(f"elastic-ddp: warning: could not remove the unreported checkpoint {path}: {e}")
        return removed

    # --------------------------------------------------------------------- restore
    def restore(self, strategy, ray_checkpoint=None) -> Optional[tuple[dict, str]]:
        """Load the newest checkpoint that verifies into ``strategy``; every rank calls it.
        Candidates: the run's complete checkpoints in storage, newest first (a report the
        controller had not registered yet included), else Ray Train's. Each rank checks
        the size and checksum of its share of the files (``_load_verified``); a checkpoint
        with a bad file is named in a warning and a ``checkpoint_rejected`` event, and the
        next older one is tried (its load overwrites all of the rejected one's state).

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
        if not cands and ray_checkpoint is not None and not rejected_paths(
                ray_checkpoint.filesystem, [ray_checkpoint.path]):
            fs, cands = ray_checkpoint.filesystem, [ray_checkpoint.path]
        cands = self._broadcast(cands)
        rejected: list[tuple[str, list[str]]] = []
        for path in cands:
            manifest = read_manifest(fs, path)
            if manifest.get("format") == LEGACY_FORMAT or "state_bytes" in manifest:
                if not is_complete(fs, path, manifest):
                    rejected.append((path, ["state.pt (not the size its manifest names)"]))
                    self._reject(path, rejected[-1][1], fs)
                    continue
                return self._load_legacy(strategy, fs, path), path
            names = sorted(manifest["files"])
            share = share_of(names, self.rank, self.world_size) if self.collective else names
            bad = self._all(size_mismatches(fs, path, manifest, share))
            if not bad:
                bad, run_state = self._load_verified(strategy, fs, path, manifest, share)
            if bad:
                rejected.append((path, bad))
                self._reject(path, bad, fs)
                continue
            # Restart mode only: every rank is restoring, so no write is under way (in
            # per-step mode a replacement restores while the quorum may be writing).
            if self.rank == 0 and self.storage and (self.collective or self.world_size == 1):
                check_fence(self.fence, "the removal of incomplete checkpoints")
                for p in incomplete_checkpoints(self.storage, self.run_name, manifest["step"]):
                    if p not in {r[0] for r in rejected}:
                        fs.delete_dir(p)
            self.log(f"restored {path} ({describe(manifest)}) at world size {self.world_size}")
            return run_state, path
        if rejected:
            raise CheckpointCorruptError(none_verifies(self.run_name, rejected))
        return None

    def _reject(self, path: str, bad: list[str], fs=None) -> None:
        """Rank 0: say so (this process's stderr; the driver's console through the
        tracker's notices, as it happens), record a ``checkpoint_rejected`` event, and
        mark the checkpoint rejected on storage, so that no later restore tries it (or
        warns about it) again."""
        text = (f"checkpoint {path} fails its checksums: {', '.join(bad)}; "
                "trying the previous checkpoint")
        if self.rank == 0:
            msg = f"elastic-ddp: warning: {text}"
            sys.stderr.write(msg + "\n")
            sys.stderr.flush()
            self.log(msg)
            if fs is not None:
                mark_rejected(fs, path, bad, by=f"a restore at world size {self.world_size}")
            if self.tracker is not None:
                self.tracker.event({"type": "checkpoint_rejected", "t": time.time(),
                                    "checkpoint": path, "bad_files": bad, "cause": msg,
                                    "warning": text})

    def _load_verified(self, strategy, fs, path: str, manifest: dict,
                       share: list[str]) -> tuple[list[str], Optional[dict]]:
        """Load the checkpoint at ``path`` while a thread hashes this rank's ``share`` of its
        files (the bytes the load reads, from the page cache: the check costs its hashing,
        on a core of its own where one is free). Only DCP's read touches unverified bytes:
        the state reaches the optimizer, the hook and the run state once every rank's files
        verify, and no step runs before. Returns (every rank's bad files, the run state:
        None when a file is bad). Raises CheckpointError: the files verify and do not fit
        this config's model."""
        import contextlib

        import pyarrow.fs as pafs
        from torch.distributed.checkpoint import CheckpointException, FileSystemReader
        from torch.distributed.checkpoint import load as dcp_load

        from elastic_ddp.checkpoint.remote_read import overlay, share_view
        from elastic_ddp.checkpoint.store_reader import StoreReader

        local = isinstance(fs, pafs.LocalFileSystem)
        # Object storage: this rank's share of the files downloaded (and verified there),
        # the rest of what it loads by ranged reads; never the whole checkpoint.
        view = (contextlib.nullcontext(path) if local
                else share_view(fs, path, sorted(set(share) | {".metadata"})))
        views: list = []

        def reader():
            if local:
                return FileSystemReader(d)
            view, remote_bytes = overlay(fs, path, d)
            views.append(remote_bytes)
            return StoreReader(path, filesystem=view)

        with view as d:
            check = start_verify(pafs.LocalFileSystem(), d, manifest, share)
            state, error = self.model_optimizer_state(strategy), None
            # Replicated tensors (ddp, zero1's model): each rank reads its share, then the
            # shares are broadcast; a world_size-fold read becomes one read and a broadcast.
            parts = (REPLICATED_PARTS.get(strategy.name, ())
                     if self.collective and self.world_size > 1 else ())
            mine = replicated_share(state, parts, self.rank, self.world_size)
            try:
                with single_process(not self.collective):
                    dcp_load(mine, storage_reader=reader(), no_dist=not self.collective)
                for part in parts:  # DCP sets non-tensor values in the dicts it was given
                    state[part].update(mine[part])
            # DCP wraps every rank's error in a CheckpointException (a BaseException).
            except (Exception, CheckpointException) as e:  # noqa: BLE001
                error = e
            bad = self._all(check.result())
            if bad:
                return bad, None
            if parts and not self._all([self.rank] if error is not None else []):
                broadcast_shares(state, parts, self.world_size)
            try:
                if error is None:
                    self._set_model_optimizer_state(strategy, state)
            except Exception as e:  # noqa: BLE001 - as DCP's: the state does not fit
                error = e
            if error is not None:
                raise _misfit(path, describe(manifest), error) from error
            if strategy.hook_state is not None:
                load_powersgd_keys(strategy, reader(), self.rank, self.world_size)
            with fs.open_input_stream(f"{path}/{RUN_STATE}") as f:
                run_state = json.loads(f.read())
            if not local:
                self.read_bytes = (sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))
                                   + sum(n() for n in views))
        return [], {k: run_state[k] for k in RUN_KEYS if k in run_state}

    #: Bytes this rank read from object storage at its last restore (downloaded share
    #: and ranged reads; the small files read whole not counted); 0 on local storage.
    read_bytes = 0

    def _load_legacy(self, strategy, fs, path: str) -> dict:
        from elastic_ddp.checkpoint.legacy import load_state

        with local_copy(fs, path) as d:
            state = load_state(d)
        try:
            strategy.load_full_state(state)
        except (RuntimeError, ValueError, KeyError) as e:
            raise _misfit(path, f"format {LEGACY_FORMAT}", e) from e
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
    def _all(self, items: list) -> list:
        """Every rank's ``items``, concatenated in rank order."""
        if not self.collective:
            return list(items)
        parts: list = [None] * self.world_size
        dist.all_gather_object(parts, items)
        return [x for p in parts for x in p]

    def _broadcast(self, obj):
        if not self.collective:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


#: The parts of ``model_optimizer_state`` that every rank holds identically, per strategy:
#: ddp replicates model and optimizer; zero1 the model (its optimizer is partitioned);
#: fsdp's parts are DTensors, each rank holding its shard.
REPLICATED_PARTS = {"ddp": ("model", "optim"), "zero1": ("model",)}


def share_owners(state: dict[str, Any], parts, world_size: int) -> dict[tuple[str, str], int]:
    """The rank that writes (and, at a restore, reads) each plain tensor of the replicated
    ``parts`` of ``state``: ``{(part, key): rank}``. Tensors by size, largest first (ties
    by key), each to the rank with the fewest bytes so far (ties to the lowest rank), the
    greedy "largest first" rule for balancing (Graham 1969, "Bounds on multiprocessing
    timing anomalies"); the same on every rank, since the replicated tensors' shapes are.
    DTensors (a rank's shard) and non-tensor values are not in it."""
    from torch.distributed.tensor import DTensor

    sizes = []
    for part in parts:
        for key, value in state.get(part, {}).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                sizes.append((-value.numel() * value.element_size(), part, key))
    loads = [0] * world_size
    owners = {}
    for neg, part, key in sorted(sizes):
        owner = min(range(world_size), key=lambda r: (loads[r], r))
        loads[owner] -= neg
        owners[(part, key)] = owner
    return owners


def replicated_share(state: dict[str, Any], parts, rank: int, world_size: int) -> dict[str, Any]:
    """``state`` with the plain tensors of its replicated ``parts`` cut to ``rank``'s share
    (``share_owners``), so that each rank stages (copies to host memory) and writes only
    what it writes anyway, and at a restore reads only its share (the rest arrives by
    broadcast from the rank that read it).

    DCP's planner would dedup the replicated tensors at the plan, after ``async_save``
    has staged the whole state on every rank: a world_size-fold copy for a 1/world_size
    write. Non-tensor values (step counts, learning rates) stay on every rank; DCP dedups
    them. The checkpoint's metadata is the union of the ranks' plans, so a restore at any
    world size finds every key."""
    owners = share_owners(state, parts, world_size)
    out = dict(state)
    for part in parts:
        if part in out:
            out[part] = {k: v for k, v in out[part].items() if owners.get((part, k), rank) == rank}
    return out


def broadcast_shares(state: dict[str, Any], parts, world_size: int) -> None:
    """After each rank loaded its ``replicated_share`` of ``state`` in place: every other
    tensor of the replicated ``parts`` from the rank that read it (one broadcast per
    tensor, in ``share_owners``' order, on the job's process group). Collective."""
    for (part, key), owner in share_owners(state, parts, world_size).items():
        dist.broadcast(state[part][key], src=owner)


def _misfit(path: str, what: str, e: BaseException) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} ({what}) does not fit this config's model/optimizer "
        f"({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}); resume it "
        "with its own config (config.json beside it) or set a new run.name")
