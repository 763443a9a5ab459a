"""One rank's training run: the ``Trainer`` owns the run state (progress, counters, model,
optimizer, strategy state); its checkpoints go through ``elastic_ddp.checkpoint.manager``,
the schema's only writer and reader.

    trainer = Trainer(job, rank, world_size, device)     # by elastic_ddp.worker.entry.train_func
    trainer.restore(ray.train.get_checkpoint())
    trainer.fit()

Everything that depends on the world size is derived here at every (re)start, because
Ray Train restarts the whole worker group on every failure and resize: the batch plan,
the model wrap, this rank's reader.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict
from typing import Any, Optional

import numpy as np
import torch

from elastic_ddp.compat.torch_nn import BatchNormBase
from elastic_ddp.parallel.batchnorm import batchnorm_guard
from elastic_ddp.batching import grad_accum_steps, lr_at, micro_slices, run_length, split_evenly, step_rows
from elastic_ddp.checkpoint.manager import CheckpointManager
from elastic_ddp.config import Config
from elastic_ddp.data.ingest import LOCAL_FIRST_ROUND_BYTES
from elastic_ddp.data.readers import open_train_reader
from elastic_ddp.worker.evaluation import evaluate
from elastic_ddp.positions import Position
from elastic_ddp.worker.faults import Fault
from elastic_ddp.ledger import LedgerWriter
from elastic_ddp.metrics import StepWindow, gradient_bytes
from elastic_ddp.parallel.strategies import build_strategy
from elastic_ddp.tasks.loading import build_model
from elastic_ddp.tasks.protocol import model_inputs, parameter_dtype, split_loss
from elastic_ddp.run_state import (Counters, DataChangedError, JobSpec, NonFiniteError,  # noqa: F401
                                   Progress, StepError)
from elastic_ddp.tracking import TrackerClient

# Readers of other data views of the epoch a rank keeps (Trainer.ensure_reader): its
# full-quorum view and the view of a quorum one replica short.
KEPT_VIEWS = 2


class Trainer:
    """See the module docstring. ``rank``/``world_size`` of this attempt; ``device`` is
    the rank's CUDA device or the CPU."""

    #: All workers in one torch.distributed group (DDP). Per-step fault tolerance: no.
    shares_process_group = True

    def __init__(self, job: JobSpec, rank: int, world_size: int, device: torch.device):
        self.job, self.rank, self.world_size, self.device = job, rank, world_size, device
        self.cfg = cfg = Config.from_dict(job.config)
        self.task = job.task
        self.n_train = job.train.num_rows
        self.plan, self.run = run_length(cfg, self.n_train, world_size)
        # Same seed on every rank: identical initial weights without a broadcast (DDP also
        # broadcasts rank 0's at wrap time; FSDP shards what each rank built).
        torch.manual_seed(cfg.seed)
        model = build_model(cfg, self.task).to(device)
        # Floating inputs are cast to it (tasks.protocol.model_inputs), before any
        # strategy wraps or shards the parameters.
        self.input_dtype = parameter_dtype(model)
        # Ranks of the torch.distributed group the strategy and the metric reductions use:
        # every worker (restart mode), or this replica alone (per-step fault tolerance).
        self.comm_size = world_size if self.shares_process_group else 1
        self.strategy = build_strategy(cfg, model, device, self.comm_size, self.run.total_steps)
        self.has_batchnorm = any(isinstance(m, BatchNormBase)
                                 for m in model.modules())
        self.progress = Progress()
        self.counters = Counters()
        self.resumed_from: Optional[int] = None
        self.restored_path: Optional[str] = None  # the checkpoint restore() loaded
        self.tracker = TrackerClient(job.tracker, enabled=rank == 0)
        self.fault = Fault(job.fault, rank)
        # Where this rank is (phase, step), for the controller when the process dies
        # without a Python error (elastic_ddp.controller.failures).
        self.position = Position(rank, cfg.run.name, node=_ray_node_id())
        self.window = StepWindow()
        self._nonfinite_run = 0
        self._reader = self._order = None
        self._reader_key: Optional[tuple] = None
        self._reader_at = -1
        self._views: dict[tuple, tuple] = {}  # other views' readers (ensure_reader)
        self._eval_names: Optional[list[str]] = None
        self.ckpt = CheckpointManager(job.storage, cfg.run.name, job.config, rank, world_size,
                                      collective=self.comm_size > 1, log=self.log,
                                      tracker=self.tracker, strategy_name=cfg.parallel.strategy)

    # ---------------------------------------------------------------- checkpoint state
    def run_state(self) -> dict[str, Any]:
        """The small exact state a checkpoint keeps beside the model and optimizer (JSON):
        ``progress``, ``counters``, ``data`` (the training set's fingerprint and the order
        settings)."""
        return {"progress": asdict(self.progress), "counters": asdict(self.counters),
                "data": self.state_dict_data()}

    def state_dict(self) -> dict[str, Any]:
        """The live state a healing replica receives from a peer
        (``CheckpointManager.live_state``): model, optimizer and the run state."""
        return CheckpointManager.live_state(self.strategy, self.run_state())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a peer's ``state_dict()`` (``CheckpointManager.load_live_state``)."""
        self.load_run_state(CheckpointManager.load_live_state(self.strategy, state))

    def load_run_state(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's run state (``run_state()``, written at any world size).

        Raises:
            DataChangedError: written on other data or another order (``data.on_change``).
        """
        self.progress = Progress(**state["progress"])
        self.counters = Counters(**state["counters"])
        mine = self.state_dict_data()
        if state["data"] != mine:
            changed = sorted(k for k in mine if state["data"].get(k) != mine[k])
            if self.cfg.data.on_change != "restart_epoch":
                raise DataChangedError(
                    f"the checkpoint at step {self.progress.step} was written on other data "
                    f"({', '.join(changed)} changed): resuming at its cursor would repeat and "
                    "skip samples. Start a new run (another run.name), or set "
                    "data.on_change=restart_epoch to keep the weights and restart the epoch")
            self.progress.cursor = 0

    def state_dict_data(self) -> dict[str, Any]:
        c = self.cfg
        return {"fingerprint": self.job.train.fingerprint, "order": c.data.order,
                "partitions": c.partitions, "window": c.data.shuffle_window_rows,
                "block_rows": c.data.block_rows, "seed": c.seed}

    def restore(self, checkpoint) -> None:
        """Load the newest checkpoint that verifies (``CheckpointManager.restore``: a newer
        one in storage than the one Ray Train hands over included). None: a fresh start."""
        self.at("restore", 0)
        found = self.ckpt.restore(self.strategy, checkpoint)
        if found is not None:
            run_state, path = found
            self.restored_path = path
            self.at("restore", self.progress.step)
            self.load_run_state(run_state)
            self.counters.restarts += 1
            self.resumed_from = self.progress.step
            self.log(f"resume_step={self.progress.step} epoch={self.progress.epoch + 1} "
                     f"cursor={self.progress.cursor} from {path}")
        self.counters.world_sizes_seen.append(self.world_size)
        # The job's worker-group starts so far (rank 0 asks the tracker): a restart
        # before the first checkpoint, or one from a checkpoint older than the last
        # restart, counts too.
        seen = self.tracker.start_attempt(self.world_size)
        if seen is not None:
            self.counters.restarts = max(self.counters.restarts, seen["attempts"] - 1)
            if len(seen["world_sizes"]) >= len(self.counters.world_sizes_seen):
                self.counters.world_sizes_seen = list(seen["world_sizes"])
        self.counters.uncommitted_train_s = 0.0

    def checkpoint(self, metrics: dict[str, float], final: bool = False) -> None:
        """Commit the state (every rank calls it); the steps since the last checkpoint
        become committed time. ``final``: the run's last one."""
        self.at("checkpoint", self.progress.step)
        c = self.counters
        c.committed_train_s += c.uncommitted_train_s
        c.uncommitted_train_s = 0.0
        p = self.progress
        self.ckpt.save(p.step, self.strategy, self.run_state(),
                       {"step": p.step, "epoch": p.epoch, **metrics}, writer=self.rank == 0,
                       fault_hook=self.fault.checkpoint_hook(p.step),
                       asynchronous=self.cfg.train.async_checkpoint and not final)

    # -------------------------------------------------------------------------- loop
    @property
    def done(self) -> bool:
        p, c = self.progress, self.cfg.train
        return p.epoch >= c.epochs or (c.max_steps is not None and p.step >= c.max_steps)

    def fit(self) -> None:
        """Train from the restored state to the end of the run."""
        p, c = self.progress, self.cfg.train
        self.ledger = LedgerWriter(self.job.ledger_dir, self.rank, self.resumed_from, self.world_size,
                                   getattr(self, "ledger_mode", "restart"))
        self.tracker.attempt(enter=self._t_enter, ready=time.time(), world_size=self.world_size,
                             resumed_from=p.step, checkpoint=self.restored_path)
        import torch.distributed as dist

        self.tracker.set_tags({"elastic_ddp.world_size": self.world_size,
                               "elastic_ddp.restarts": self.counters.restarts,
                               # gloo or nccl: what this attempt's collectives ran on.
                               "elastic_ddp.backend": dist.get_backend() if dist.is_initialized() else "none",
                               "elastic_ddp.device": str(self.device)})
        first = True
        while not self.done:
            while p.cursor < self.n_train and not self.done:
                if not self.train_step():
                    continue  # not committed (per-step fault tolerance): redo it
                if first:
                    self.tracker.attempt(first_step=time.time(), step=p.step)
                    first = False
                self.maybe_log()
                self.ckpt.poll()  # an asynchronous checkpoint done on every rank: reported
                if c.checksum_every_steps and p.step % c.checksum_every_steps == 0:
                    self.strategy.check_params_equal(p.step)
                if not self.done and p.step % c.checkpoint_every_steps == 0 and p.cursor < self.n_train:
                    self.checkpoint({})
            if p.cursor >= self.n_train:
                p.epoch, p.cursor = p.epoch + 1, 0
                self.checkpoint(self.evaluate(), final=self.done)
        if p.cursor != 0:  # stopped by max_steps inside an epoch
            self.checkpoint(self.evaluate(), final=True)
        self.ledger.close()

    # The steps of a step, overridden by per-step fault tolerance (fault_tolerance.py).
    def begin_step(self) -> tuple[Optional[int], int]:
        """This step's data view: (this rank's index, ranks sharing the step)."""
        return self.rank, self.world_size

    def loss_weight(self, n: int) -> float:
        """Per-sample loss weight of a step of ``n`` rows: DDP averages gradients over the
        ranks, so ``world_size / n`` gives the mean over the step's rows."""
        return self.world_size / n

    def sync_gradients(self, probe: bool) -> bool:
        """After the backward passes: the probe step's explicit all-reduce (DDP did the
        others inside backward). Returns whether the step may be applied."""
        if probe:
            clock = self.window.clock(self.device)
            t = clock.start()
            self.strategy.allreduce_gradients()
            clock.stop("allreduce_probe", t)
            self.window.probes += 1
        return True

    def ensure_reader(self, rank: int, ws: int) -> None:
        """This rank's reader for the epoch, (re)opened when the epoch, the data view or
        the expected position changed. Readers of other views of the epoch are kept (at
        most ``KEPT_VIEWS``): per-step fault tolerance switches views when the quorum
        shrinks and back when the replacement joins, and a kept windowed reader serves
        any later cursor of its view. A new view's reader takes the windows the kept
        ones hold and reads only the rest (a survivor taking over a dead replica's
        partitions reads those alone). Costs the kept views' windows in memory while the
        quorum is short."""
        p = self.progress
        key = (p.epoch, rank, ws)
        windowed = self.cfg.data.order == "windowed"

        def usable(at: int) -> bool:
            return at == p.cursor or (windowed and 0 <= at <= p.cursor)

        if self._reader is not None and self._reader_key == key and usable(self._reader_at):
            self._reader_at = p.cursor
            return
        if self._reader is not None and self._reader_key != key and self._reader_key[0] == p.epoch:
            self._views.pop(self._reader_key, None)  # re-inserted last: the newest
            self._views[self._reader_key] = (self._order, self._reader, self._reader_at)
        # This epoch's views, and the next epoch's reader already reading (prefetch_next).
        self._views = {k: v for k, v in self._views.items() if k[0] >= p.epoch}
        kept = self._views.pop(key, None)
        now = [k for k in self._views if k[0] == p.epoch]  # oldest first
        while len(now) > KEPT_VIEWS:
            self._views.pop(now.pop(0))
        if kept is not None and usable(kept[2]):
            self._order, self._reader, _ = kept
            self._reader_key, self._reader_at = key, p.cursor
            return
        # A view change within the epoch: the windows the other views' readers hold.
        others = [r for k, (_, r, _) in self._views.items() if k[0] == p.epoch]
        held = {w: a for r in others for w, a in r.held_windows().items()} if windowed and others else None
        t = time.perf_counter()
        self._order, self._reader = self._open_reader(rank, ws, p.epoch, p.cursor, held)
        self._reader_key, self._reader_at = key, p.cursor
        self.window.data_s += time.perf_counter() - t

    def prefetch_next(self, rank: int, ws: int) -> None:
        """Once this epoch's reader has started its last round, open this view's reader of
        the next epoch and start reading its first round in the background: the next
        epoch's first step then finds its windows (the first round otherwise stalls
        every rank at each epoch start). Windowed order, and only when the run goes on
        into that epoch. Costs one more window per owned partition in memory over the
        epoch's last round."""
        p, c = self.progress, self.cfg.train
        key = (p.epoch + 1, rank, ws)
        if (self.cfg.data.order != "windowed" or key in self._views or p.epoch + 1 >= c.epochs
                or not getattr(self._reader, "last_round_started", False)):
            return
        left = -(-(self.n_train - p.cursor) // self.plan.global_batch_size)
        if c.max_steps is not None and p.step + left >= c.max_steps:
            return
        order, reader = self._open_reader(rank, ws, p.epoch + 1, 0)
        reader.prefetch()
        self._views[key] = (order, reader, 0)

    def _open_reader(self, rank: int, ws: int, epoch: int, cursor: int, held: Optional[dict] = None):
        """(order, reader) of view (rank, ws) of ``epoch`` from ``cursor``."""
        return open_train_reader(
            self.job.train, self.task, self.cfg, rank, ws, epoch, cursor,
            self.plan.global_batch_size,
            list(self.plan.rows_per_rank) if ws == self.world_size else None,
            template=self.job.sample["train"], held=held, local_first_bytes=LOCAL_FIRST_ROUND_BYTES)

    def train_step(self) -> bool:
        """One optimizer step over the global positions ``[cursor, cursor + G)``: this
        rank's rows in ``grad_accum_steps`` micro-batches (DDP ``no_sync`` on all but the
        last), each micro-batch's loss weighted (``loss_weight``) so that the all-reduced
        gradient is the exact mean over the step's rows. A step whose gradient is not
        finite on any rank is skipped by every rank (the same norm everywhere after the
        all-reduce). Returns False when the step was not committed (redo it)."""
        p, cfg = self.progress, self.cfg
        t0 = time.perf_counter()
        rank, ws = self.begin_step()
        n = step_rows(self.n_train, p.cursor, self.plan.global_batch_size)
        clock = self.window.clock(self.device)
        t = clock.start()
        if rank is not None:
            self.ensure_reader(rank, ws)
            rows = self._order.rank_rows(p.cursor, n, ws, list(self.plan.rows_per_rank)
                                         if ws == self.world_size else None)
            self.at("data read", p.step + 1)
            batch = self._reader.take(p.cursor, n)
            self.at("training step", p.step + 1)
            self._reader_at = p.cursor + n
            self.prefetch_next(rank, ws)
        else:  # a replica healing this step computes nothing (zero gradient)
            rows, rank = [0] + [n], 0
            batch = {k: v[:0] for k, v in self.job.sample["train"].items()}
        clock.stop("data", t)
        lr = lr_at(p.samples_seen, self.run.schedule_samples, self.run.peak_lr,
                   self.run.warmup_samples, cfg.optim.min_lr_ratio)
        for g in self.strategy.optimizer.param_groups:
            g["lr"] = lr
        # Per-step seeding makes dropout a function of (seed, step, rank) alone: RNG
        # streams cannot "continue" across a resize, where ranks change their rows.
        torch.manual_seed(cfg.seed * 1_000_003 + p.step * 1009 + rank)
        ids = np.asarray(batch[self.job.train.id_column])
        probe = self.should_log(p.step + 1) and p.step > 0 and self.strategy.can_probe
        try:
            self.fault.at_step(p.step + 1)
            sums, bn_saved = self._forward_backward(batch, rows, rank, n, probe)
            self.ledger.record(p.epoch, p.step + 1, ids, **self.ledger_extra())
            if not self.sync_gradients(probe):
                self.strategy.optimizer.zero_grad(set_to_none=True)
                if bn_saved is not None:
                    self._restore_bn(bn_saved)
                return False
            finite = self._update(sums, bn_saved, n)
        except Exception as e:
            raise StepError(f"step {p.step + 1} (epoch {p.epoch}, rank {self.rank}): "
                            f"{type(e).__name__}: {e}") from e
        self.ledger.commit(p.epoch, p.step + 1, skipped=not finite, **self.ledger_extra())
        p.step += 1
        p.cursor += n
        p.samples_seen += n
        dt = time.perf_counter() - t0
        self.counters.uncommitted_train_s += dt
        self.window.add(n, dt, lr)
        return True

    def ledger_extra(self) -> dict:
        return {}

    def _forward_backward(self, batch: dict, rows: list[int], rank: int, n: int, probe: bool):
        """Every micro-batch's forward and backward; returns the per-micro-batch sums of
        loss and metrics and the BatchNorm buffers to restore if the step is dropped."""
        s, task, w, clock = self.strategy, self.task, self.window, self.window.clock(self.device)
        accum = grad_accum_steps(rows, self.cfg.batch.micro_batch_size)
        slices = micro_slices(rows[rank], accum)
        smallest = [min(split_evenly(r, accum)[i] for r in rows) for i in range(accum)]
        weight = self.loss_weight(n)
        bn_saved = self._save_bn() if self.has_batchnorm else None
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.parallel.bf16)
        sums: list[tuple[float, dict, int]] = []
        for i, (a, b) in enumerate(slices):
            t = clock.start()
            # An empty share still runs forward and backward (every rank joins every
            # all-reduce): on the one-row sample, weighted 0, so tasks never see B = 0.
            part = {k: v[a:b] for k, v in batch.items()} if b > a else self.job.sample["train"]
            tensors = self._to_device(task.collate(part))
            clock.stop("data", t)
            ctx, kind = s.micro_step(i == len(slices) - 1, probe)
            t = clock.start()
            with ctx, batchnorm_guard(s.model, smallest[i]), autocast:
                loss_vec, extra = split_loss(task.loss(s.model, tensors), max(1, b - a))
                (loss_vec.float().sum() * (weight if b > a else 0.0)).backward()
            clock.stop(kind, t)
            w.micro[kind] = w.micro.get(kind, 0) + 1
            tokens = task.tokens(tensors) if b > a else None
            if tokens is not None:
                w.tokens += tokens
                w.token_task = True
            # .item() is a device sync; free on CPU, one per micro-step on GPU.
            if b > a:
                sums.append((float(loss_vec.detach().float().sum()),
                             {k: float(v.detach().float().sum()) for k, v in extra.items()}, b - a))
            else:
                # An empty share still names the task's metrics: every rank must send the
                # same keys to the window's all-reduce (metrics.StepWindow.reduce).
                sums.append((0.0, {k: 0.0 for k in extra}, 0))
        if w.grad_bytes is None:
            w.grad_bytes = gradient_bytes(s.model.parameters())
        return sums, bn_saved

    def _update(self, sums: list, bn_saved, n: int) -> bool:
        """Clip and step the optimizer, or skip a step whose gradient is not finite."""
        s, w, clock = self.strategy, self.window, self.window.clock(self.device)
        t = clock.start()
        finite = math.isfinite(s.clip_grad_norm(self.cfg.optim.grad_clip))
        if finite:
            s.optimizer.step()
            for loss_sum, metric_sums, count in sums:
                w.add_rows(loss_sum, metric_sums, count)
            self._nonfinite_run = 0
        else:
            self._skip_step(bn_saved, n)
        s.optimizer.zero_grad(set_to_none=True)
        clock.stop("opt", t)
        return finite

    def _restore_bn(self, bn_saved) -> None:
        for buf, saved in bn_saved:
            buf.copy_(saved)

    def _skip_step(self, bn_saved, n: int) -> None:
        if bn_saved is not None:  # the forward's batch statistics saw the non-finite rows
            self._restore_bn(bn_saved)
        self.counters.skipped_steps += 1
        self.counters.skipped_samples += n
        self._nonfinite_run += 1
        self.log(f"step {self.progress.step + 1}: non-finite gradient, step skipped on every rank "
                 f"({self._nonfinite_run} in a row)")
        self.tracker.log_metrics({"skipped_steps": self.counters.skipped_steps,
                                  "skipped_samples": self.counters.skipped_samples},
                                 self.progress.step + 1)
        if self._nonfinite_run >= self.cfg.train.max_nonfinite_steps:
            raise NonFiniteError(
                f"{self._nonfinite_run} consecutive steps had a non-finite loss or gradient (up to "
                f"step {self.progress.step + 1}): look for NaN/inf in the data (nulls inside list "
                "columns read as NaN) or lower optim.lr; train.max_nonfinite_steps sets the limit")

    def _save_bn(self):
        return [(b, b.detach().clone()) for m in self.strategy.module.modules()
                if isinstance(m, BatchNormBase) for b in m.buffers()]

    def _to_device(self, tensors: dict) -> dict:
        return model_inputs(tensors, self.device, self.input_dtype)

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.cfg.train.log_every_steps == 0

    def maybe_log(self) -> None:
        """On step 1 and every ``log_every_steps``: reduce the window across ranks (two
        small collectives) and send it to the tracker."""
        p = self.progress
        if not self.should_log(p.step):
            return
        self.at("metrics", p.step)
        m = self.window.reduce(self.comm_size, self.device)
        # epoch 1-based, as every line a person reads counts it (progress, logs, summary).
        m.update(step=p.step, epoch=p.epoch + 1, world_size=self.world_size)
        self.tracker.log_metrics(m, p.step)
        self.log(f"epoch {p.epoch + 1} step {p.step}/{self.run.total_steps} loss "
                 f"{m['train_loss']:.4f} lr {m['lr']:.2e} {m['samples_per_s']:.0f} samples/s")
        self.window = StepWindow()

    def evaluate(self) -> dict[str, float]:
        """Validation metrics over the whole val split (``evaluation.evaluate``), logged."""
        self.at("evaluation", self.progress.step)
        out = evaluate(self)
        if out:
            self.tracker.log_metrics(out, self.progress.step)
            self.log(f"epoch {self.progress.epoch} done: " + " ".join(f"{k}={v:.4f}" for k, v in out.items()))
        return out

    def finish(self) -> None:
        """Send the run-wide counters and close the ledger."""
        self.tracker.set_tags({"elastic_ddp.world_sizes_seen": self.counters.world_sizes_seen})
        self.position.close()

    def at(self, phase: str, step: int) -> None:
        """Record where this rank is (``failures.Position``): the phase and the step it
        is computing (or, for metrics, evaluation and checkpoints, has just finished)."""
        self.position.at(phase, step, self.progress.epoch)

    def log(self, msg: str) -> None:
        """A rank-prefixed line in rank 0's log (Ray's worker log file)."""
        if self.rank == 0:
            # sys.stdout, not print: Ray Train patches print() into its logger.
            sys.stdout.write(f"[rank 0/{self.world_size}] {msg}\n")
            sys.stdout.flush()

    _t_enter = 0.0


def _ray_node_id() -> Optional[str]:
    """This process's Ray node id (None outside Ray): stamped on the position record so
    that a controller on the same machine can read it without a task on the node."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
