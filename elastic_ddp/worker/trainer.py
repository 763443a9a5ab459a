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
from elastic_ddp.data.scan import locate_ids
from elastic_ddp.batching import lr_at, run_length, step_rows
from elastic_ddp.checkpoint.manager import CheckpointManager
from elastic_ddp.positions import Position
from elastic_ddp.worker import fault_tolerance, notice as notices
from elastic_ddp.worker.evaluation import evaluate
from elastic_ddp.worker.faults import Fault
from elastic_ddp.ledger import LedgerWriter
from elastic_ddp.metrics import StepWindow
from elastic_ddp.parallel.strategies import build_strategy
from elastic_ddp.worker.micro_steps import forward_backward, restore_bn
from elastic_ddp.worker.rank_loader import RankLoader
from elastic_ddp.tasks.loading import build_model
from elastic_ddp.tasks.protocol import model_inputs, parameter_dtype
from elastic_ddp.run_state import (Counters, DataChangedError, JobSpec, NonFiniteError,  # noqa: F401
                                   Progress, StepError, data_identity)
from elastic_ddp.tracking import TrackerClient
from elastic_ddp.tracking.nonfinite import row_report


class Trainer:
    """See the module docstring. ``rank``/``world_size`` of this attempt; ``device`` is
    the rank's CUDA device or the CPU.

    ``ft``: the fault-tolerance component of the mode (``fault_tolerance.build``), called
    at fixed points of the step and the run; ``roles``: which rank logs, evaluates and
    writes (``elastic_ddp.worker.roles``)."""

    def __init__(self, job: JobSpec, rank: int, world_size: int, device: torch.device):
        self.job, self.rank, self.world_size, self.device = job, rank, world_size, device
        self.cfg = cfg = job.config  # validated once, by the driver
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
        self.ft = fault_tolerance.build(self)
        self.roles = self.ft.roles
        # Ranks of the torch.distributed group the strategy and the metric reductions use:
        # every worker (restart mode), or this replica alone (per-step fault tolerance).
        self.comm_size = self.ft.comm_size
        self.strategy = build_strategy(cfg, model, device, self.comm_size, self.run.total_steps)
        self.has_batchnorm = any(isinstance(m, BatchNormBase)
                                 for m in model.modules())
        self.progress = Progress()
        self.counters = Counters()
        self.resumed_from: Optional[int] = None
        self.restored_path: Optional[str] = None  # the checkpoint restore() loaded
        self.checkpointed_step: Optional[int] = None  # the step of the last checkpoint() call
        self.tracker = TrackerClient(job.tracker, enabled=self.roles.may_log)
        # Every rank reports its own rows with a non-finite loss (tracking.nonfinite).
        self.row_reports = TrackerClient(job.tracker)
        # Fault injection of tests and experiments only (Diagnostics.fault): None in a job.
        self.fault = Fault(job.fault, rank) if job.fault else None
        # Where this rank is (phase, step), for the controller when the process dies
        # without a Python error (elastic_ddp.controller.failures).
        self.position = Position(rank, cfg.run.name, node=_ray_node_id())
        self.window = StepWindow()
        self._nonfinite_run = 0
        self.nonfinite_ids: list = []  # this step's rows with a non-finite loss (micro_steps)
        self.nonfinite_losses: list[float] = []  # and their losses
        self.loader = RankLoader(job, cfg, self.plan, world_size)
        self._eval_names: Optional[list[str]] = None
        # The checkpoint's config.json: the config as JSON, for a person or a tool to read.
        self.ckpt = CheckpointManager(job.storage, cfg.run.name, cfg.model_dump(mode="json"),
                                      rank, world_size,
                                      collective=self.comm_size > 1, log=self.log,
                                      tracker=self.tracker, strategy_name=cfg.parallel.strategy,
                                      fence=job.fence)
        self.listener = notices.build(self)  # a notice -> a checkpoint here (None: a crash)

    # ---------------------------------------------------------------- checkpoint state
    def run_state(self) -> dict[str, Any]:
        """The small exact state a checkpoint keeps beside the model and optimizer (JSON):
        ``progress``, ``counters``, ``data`` (the training set's fingerprint and the order
        settings), and the fault-tolerance component's own (torchft's step counters)."""
        return {"progress": asdict(self.progress), "counters": asdict(self.counters),
                "data": self.state_dict_data(), **self.ft.state_dict()}

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
        self.ft.load_state_dict(state)

    def state_dict_data(self) -> dict[str, Any]:
        return data_identity(self.cfg, self.job.train.fingerprint)

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
            self.resumed_from = self.checkpointed_step = self.progress.step
            self.log(f"resume_step={self.progress.step} epoch={self.progress.epoch + 1} "
                     f"cursor={self.progress.cursor} from {path}")
        self.counters.world_sizes_seen.append(self.world_size)
        # The job's worker-group starts so far (rank 0 asks the tracker): a restart
        # before the first checkpoint, or one from a checkpoint older than the last
        # restart, counts too.
        seen = self.tracker.start_attempt(self.world_size) if self.roles.records_start else None
        if seen is not None:
            self.counters.restarts = max(self.counters.restarts, seen["attempts"] - 1)
            if len(seen["world_sizes"]) >= len(self.counters.world_sizes_seen):
                self.counters.world_sizes_seen = list(seen["world_sizes"])
        self.counters.uncommitted_train_s = 0.0

    def checkpoint(self, metrics: dict[str, float], final: bool = False) -> None:
        """Commit the state (every rank calls it); the steps since the last checkpoint
        become committed time. ``final``: the run's last one. Where the mode may not
        report (``ft.may_report``: a partial quorum), the lead writes the state to storage
        unreported (``ft.write_unreported``), where a restore finds it."""
        self.checkpointed_step = self.progress.step
        self.at("checkpoint", self.progress.step)
        if not self.ft.may_report():
            self.ft.write_unreported()
            return
        c = self.counters
        c.committed_train_s += c.uncommitted_train_s
        c.uncommitted_train_s = 0.0
        p = self.progress
        t0 = time.perf_counter()
        self.ckpt.save(p.step, self.strategy, self.run_state(),
                       {"step": p.step, "epoch": p.epoch, **metrics}, writer=self.roles.lead,
                       fault_hook=self.fault.checkpoint_hook(p.step) if self.fault else None,
                       asynchronous=self.cfg.train.async_checkpoint and not final)
        if self.roles.lead:  # what the loop waited for: the summary's checkpoint part (tracking.totals)
            self.tracker.log_metrics({"checkpoint_block_s": time.perf_counter() - t0}, p.step)

    # -------------------------------------------------------------------------- loop
    @property
    def done(self) -> bool:
        p, c = self.progress, self.cfg.train
        return p.epoch >= c.epochs or (c.max_steps is not None and p.step >= c.max_steps)

    def fit(self) -> None:
        """Train from the restored state to the end of the run (inside ``ft.fit``)."""
        self.ft.fit(self._loop)

    def _loop(self) -> None:
        p, c = self.progress, self.cfg.train
        self.ledger = LedgerWriter(self.job.ledger_dir, self.rank, self.resumed_from, self.world_size,
                                   self.ft.ledger_mode)
        starts = self.roles.records_start
        # Per-step mode: every replica's start is an attempt of its own, named by its rank
        # (a replacement joins the live quorum, or restarts the run from storage).
        mine = {"rank": self.rank} if self.ft.ledger_mode == "per_step" else {}
        if self.roles.records_attempt:
            self.tracker.attempt(enter=self._t_enter, ready=time.time(), world_size=self.world_size,
                                 resumed_from=p.step, checkpoint=self.restored_path,
                                 committed_s=self.counters.committed_train_s, **mine,
                                 **self._start_marks)
        if starts:
            import torch.distributed as dist

            self.tracker.set_tags({"elastic_ddp.world_size": self.world_size,
                                   "elastic_ddp.restarts": self.counters.restarts,
                                   # gloo or nccl: what this attempt's collectives ran on.
                                   "elastic_ddp.backend": dist.get_backend() if dist.is_initialized() else "none",
                                   "elastic_ddp.device": str(self.device)})
        first = self.roles.records_attempt
        while not self.done:
            while p.cursor < self.n_train and not self.done:
                if not self.train_step():
                    continue  # not committed (per-step fault tolerance): redo it
                if first:
                    self.tracker.attempt(first_step=time.time(), step=p.step, **mine)
                    first = False
                self.maybe_log()
                self.ckpt.poll()  # an asynchronous checkpoint done on every rank: reported
                if self.listener is not None and not self.done and (agreed := self.listener.agreed()):
                    self.listener.checkpoint_and_stop(agreed)  # raises notice.Preempted
                if self.ft.stop_agreed and not self.done:
                    self.ft.stop_here()  # per-step mode, the driver's stop: raises notice.Preempted
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

    def warm_reader(self) -> None:
        """Open this rank's reader of its own view at the current position and read its
        first round now (``Reader.warm``)."""
        self.window.data_s += self.loader.ensure(self.progress, self.rank, self.world_size)
        self.loader.reader.warm()

    def train_step(self) -> bool:
        """One optimizer step over the global positions ``[cursor, cursor + G)``: this
        rank's rows in ``grad_accum_steps`` micro-batches (DDP ``no_sync`` on all but the
        last; ``micro_steps.forward_backward``: each micro-batch seeded by its place in the
        step, so dropout does not depend on the rank), each micro-batch's loss weighted
        (``ft.loss_weight``) so that the all-reduced gradient is the exact mean over the
        step's rows. A step whose gradient is not finite on any rank is skipped by every
        rank (the same norm everywhere after the all-reduce). Returns False when the step
        was not committed (redo it)."""
        p, cfg = self.progress, self.cfg
        t0 = time.perf_counter()
        rank, ws = self.ft.begin_step()
        n = step_rows(self.n_train, p.cursor, self.plan.global_batch_size)
        clock = self.window.clock(self.device)
        t = clock.start()
        if rank is not None:
            self.window.data_s += self.loader.ensure(p, rank, ws)
            rows = self.loader.rank_rows(p.cursor, n, ws)
            self.at("data read", p.step + 1)
            batch = self.loader.take(p.cursor, n)
            self.at("training step", p.step + 1)
            self.loader.prefetch_next(p, rank, ws)
        else:  # a replica healing this step computes nothing (zero gradient)
            rows, rank = [0] + [n], 0
            batch = {k: v[:0] for k, v in self.job.sample["train"].items()}
        clock.stop("data", t)
        lr = lr_at(p.samples_seen, self.run.schedule_samples, self.run.peak_lr,
                   self.run.warmup_samples, cfg.optim.min_lr_ratio)
        for g in self.strategy.optimizer.param_groups:
            g["lr"] = lr
        ids = np.asarray(batch[self.job.train.id_column])
        probe = self.should_log(p.step + 1) and p.step > 0 and self.strategy.can_probe
        try:
            if self.fault is not None:
                self.fault.at_step(p.step + 1)
            self.nonfinite_ids, self.nonfinite_losses = [], []
            sums, bn_saved = forward_backward(self, batch, rows, rank, n, probe)
            if self.ledger.enabled:  # Diagnostics.ledger_dir: tests and experiments
                self.ledger.record(p.epoch, p.step + 1, ids, **self.ft.ledger_extra())
            # Per-step mode: the log step's metric sums ride in the gradient all-reduce.
            mine = (self.window.row_sums(sums) if self.ft.sums_in_step and self.should_log(p.step + 1)
                    else None)
            ok, summed = self.ft.sync_gradients(probe, mine)
            if not ok:
                self.strategy.optimizer.zero_grad(set_to_none=True)
                if bn_saved is not None:
                    restore_bn(bn_saved)
                return False
            finite = self._update(sums, bn_saved, n)
        except Exception as e:
            raise StepError(f"step {p.step + 1} (epoch {p.epoch}, rank {self.rank}): "
                            f"{type(e).__name__}: {e}") from e
        self.window.quorum_sums = summed if finite else None
        self.ledger.commit(p.epoch, p.step + 1, skipped=not finite, **self.ft.ledger_extra())
        p.step += 1
        p.cursor += n
        p.samples_seen += n
        dt = time.perf_counter() - t0
        self.counters.uncommitted_train_s += dt
        self.window.add(n, dt, lr)
        return True

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

    def _skip_step(self, bn_saved, n: int) -> None:
        if bn_saved is not None:  # the forward's batch statistics saw the non-finite rows
            restore_bn(bn_saved)
        self.counters.skipped_steps += 1
        self.counters.skipped_samples += n
        self._nonfinite_run += 1
        rows = self.describe_nonfinite_rows()
        line = (f"step {self.progress.step + 1}: non-finite gradient, step skipped on every rank "
                f"({self._nonfinite_run} in a row); {rows}")
        if self.nonfinite_ids and not self.roles.lead:  # the rank that holds the rows says so
            sys.stdout.write(f"[rank {self.rank}/{self.world_size}] {line}\n")
            sys.stdout.flush()
        self.log(line)
        if self.nonfinite_ids:  # the console's warning and the run's record of the rows
            self.row_reports.nonfinite_rows(row_report(
                self.progress.step + 1, self.progress.epoch + 1, self.rank, n,
                self.job.train.id_column, self.nonfinite_ids, self.nonfinite_losses,
                locate_ids(self.job.train, self.nonfinite_ids)))
        if self.roles.lead:
            self.tracker.log_metrics({"skipped_steps": self.counters.skipped_steps,
                                      "skipped_samples": self.counters.skipped_samples},
                                     self.progress.step + 1)
        if self._nonfinite_run >= self.cfg.train.max_nonfinite_steps:
            raise NonFiniteError(
                f"{self._nonfinite_run} consecutive steps had a non-finite loss or gradient (up to "
                f"step {self.progress.step + 1}; {rows}): look for NaN/inf in the data (nulls "
                "inside list columns read as NaN) or lower optim.lr; train.max_nonfinite_steps sets "
                "the limit")

    def describe_nonfinite_rows(self) -> str:
        """Which of this rank's rows of the step had a non-finite per-sample loss, by the id
        column (at most 8 named), or that none had: the gradient itself overflowed."""
        ids, col = self.nonfinite_ids, self.job.train.id_column
        if not ids:
            return f"rank {self.rank}'s rows all had a finite loss"
        more = f" and {len(ids) - 8} more" if len(ids) > 8 else ""
        return (f"rank {self.rank}'s rows with a non-finite loss: {col} "
                f"{', '.join(map(str, ids[:8]))}{more}")

    def to_device(self, tensors: dict) -> dict:
        """A collated batch's tensors on this rank's device, floating ones in the model's
        parameter dtype (``tasks.protocol.model_inputs``)."""
        return model_inputs(tensors, self.device, self.input_dtype)

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.cfg.train.log_every_steps == 0

    def maybe_log(self) -> None:
        """On step 1 and every ``log_every_steps``: reduce the window across ranks (two
        small collectives; per-step mode: the row sums came summed over the step's quorum
        with its gradients, the timings are the lead's own) and the lead sends it to the
        tracker."""
        p = self.progress
        if not self.should_log(p.step):
            return
        self.at("metrics", p.step)
        m = self.window.reduce(self.comm_size, self.device)
        self.window = StepWindow()
        if not self.roles.lead:
            return
        # epoch 1-based, as every line a person reads counts it (progress, logs, summary).
        m.update(step=p.step, epoch=p.epoch + 1, world_size=self.world_size)
        self.tracker.log_metrics(m, p.step)
        loss = f"{m['train_loss']:.4f}" if "train_loss" in m else "- (steps skipped)"
        self.log(f"epoch {p.epoch + 1} step {p.step}/{self.run.total_steps} loss {loss} "
                 f"lr {m['lr']:.2e} {m['samples_per_s']:.0f} samples/s")

    def evaluate(self) -> dict[str, float]:
        """Validation metrics over the whole val split (``evaluation.evaluate``), shared
        as ``roles.eval_share`` says and logged by the lead; {} on a rank that does not
        evaluate."""
        share = self.roles.eval_share
        if share is None:
            return {}
        self.at("evaluation", self.progress.step)
        t0 = time.perf_counter()
        out = evaluate(self, *share)
        if out and self.roles.lead:
            # eval_time_s: the summary's evaluation part (tracking.totals).
            self.tracker.log_metrics({**out, "eval_time_s": time.perf_counter() - t0}, self.progress.step)
            self.log(f"epoch {self.progress.epoch} done: " + " ".join(f"{k}={v:.4f}" for k, v in out.items()))
        return out

    def finish(self) -> None:
        """Send the run-wide counters and close the position record."""
        if self.roles.records_start:
            self.tracker.set_tags({"elastic_ddp.world_sizes_seen": self.counters.world_sizes_seen})
        self.position.close()

    def at(self, phase: str, step: int) -> None:
        """Record where this rank is (``failures.Position``): the phase and the step it
        is computing (or, for metrics, evaluation and checkpoints, has just finished)."""
        self.position.at(phase, step, self.progress.epoch)

    def log(self, msg: str) -> None:
        """A rank-prefixed line in the lead's log (Ray's worker log file; ``roles.lead``)."""
        if self.roles.lead:
            # sys.stdout, not print: Ray Train patches print() into its logger.
            sys.stdout.write(f"[rank {self.rank}/{self.world_size}] {msg}\n")
            sys.stdout.flush()

    _t_enter = 0.0
    _start_marks: dict = {}  # worker.entry.train_func's finer start marks (seconds since the epoch)


def _ray_node_id() -> Optional[str]:
    """This process's Ray node id (None outside Ray): stamped on the position record so
    that a controller on the same machine can read it without a task on the node."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
