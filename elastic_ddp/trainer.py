"""One rank's training run: the ``Trainer`` owns the run state (progress, counters, model,
optimizer, strategy state) and is the only writer and reader of the checkpoint schema.

    trainer = Trainer(job, rank, world_size, device)     # by elastic_ddp.worker.train_func
    trainer.restore(ray.train.get_checkpoint())
    trainer.fit()

Everything that depends on the world size is derived here at every (re)start, because
Ray Train restarts the whole worker group on every failure and resize: the batch plan,
the model wrap, this rank's reader.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from elastic_ddp.batching import grad_accum_steps, lr_at, micro_slices, run_length, split_evenly, step_rows
from elastic_ddp.checkpoint import CheckpointError, report
from elastic_ddp.config import Config
from elastic_ddp.data.ingest import open_train_reader, val_batches
from elastic_ddp.faults import Fault
from elastic_ddp.ledger import LedgerWriter
from elastic_ddp.metrics import StepWindow, gradient_bytes
from elastic_ddp.parallel import build_strategy
from elastic_ddp.tasks.loading import build_model
from elastic_ddp.tracking import TrackerClient

class StepError(RuntimeError):
    """An exception raised inside a training step, tagged with the step so the controller
    can tell a deterministic error (same step, same message, every attempt) from a
    failure worth a restart."""


class NonFiniteError(RuntimeError):
    """``train.max_nonfinite_steps`` consecutive steps had a non-finite gradient."""


class DataChangedError(CheckpointError):
    """The checkpoint was written on other data than the job now reads."""


@dataclass
class Progress:
    """Where the run is: optimizer steps done, the epoch, the global position in it
    (``cursor``, samples) and samples consumed over the run."""

    step: int = 0
    epoch: int = 0
    cursor: int = 0
    samples_seen: int = 0


@dataclass
class Counters:
    """Run-wide counters that travel in the checkpoint (seconds are wall-clock)."""

    committed_train_s: float = 0.0    # step time of steps covered by a checkpoint
    uncommitted_train_s: float = 0.0  # step time since the last checkpoint (lost on failure)
    restarts: int = 0
    world_sizes_seen: list[int] = field(default_factory=list)
    skipped_steps: int = 0            # steps whose gradient was not finite
    skipped_samples: int = 0


@dataclass
class JobSpec:
    """What the driver hands every worker (``train_loop_config``): small and picklable.

    ``sample``: ``{"train": row, "val": row}``, one transformed row of each split from
    the driver's dry run (``tasks.loading.preflight``): the shape of an empty batch for a
    rank whose share is empty. ``ledger_dir`` and ``fault`` are test hooks.
    """

    config: dict
    task: Any
    train: Any
    val: Any
    tracker: Any
    t0: float
    sample: dict
    storage: str = ""
    ledger_dir: Optional[str] = None
    fault: Optional[dict] = None


class Trainer:
    """See the module docstring. ``rank``/``world_size`` of this attempt; ``device`` is
    the rank's CUDA device or the CPU."""

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
        self.strategy = build_strategy(cfg, model, device, world_size, self.run.total_steps)
        self.has_batchnorm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                                 for m in model.modules())
        self.progress = Progress()
        self.counters = Counters()
        self.resumed_from: Optional[int] = None
        self.tracker = TrackerClient(job.tracker, enabled=rank == 0)
        self.fault = Fault(job.fault, rank)
        self.window = StepWindow()
        self._nonfinite_run = 0
        self._reader = self._order = None
        self._eval_names: Optional[list[str]] = None

    # ---------------------------------------------------------------- checkpoint schema
    def state_dict(self) -> dict[str, Any]:
        """The full state, gathered (loads at any world size and in plain PyTorch):
        ``model`` (no DDP prefix), ``optimizer`` (and ``comm_hook`` for PowerSGD),
        ``progress``, ``counters``, ``data`` (the training set's fingerprint and the order
        settings) and the torch RNG. Collective for zero1/fsdp/PowerSGD: every rank calls
        it; only rank 0's return is complete."""
        return {**self.strategy.full_state(self.rank), "progress": asdict(self.progress),
                "counters": asdict(self.counters), "data": self.state_dict_data(),
                "world_size": self.world_size, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()`` written at any world size.

        Raises:
            CheckpointError: another version, or a model/optimizer that does not fit.
            DataChangedError: written on other data or another order (``data.on_change``).
        """
        try:
            self.strategy.load_full_state(state)
        except (RuntimeError, ValueError, KeyError) as e:
            # The same on every attempt: as a CheckpointError the controller stops at once.
            raise CheckpointError(
                f"checkpoint at step {state['progress']['step']} does not fit this config's "
                f"model/optimizer ({type(e).__name__}: {str(e).splitlines()[0][:300]}); resume "
                "it with its own config (config.json beside state.pt) or set a new run.name") from e
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
        """Load the newest complete checkpoint: the one Ray Train hands over, or a newer
        one in storage that the controller had not registered yet when the group failed
        (``checkpoint.newest_complete``). None and none in storage: a fresh start."""
        from elastic_ddp.checkpoint import checkpoint_step, load_state, newest_complete

        if self.job.storage:
            newer = newest_complete(self.job.storage, self.cfg.run.name,
                                    checkpoint_step(checkpoint.path) if checkpoint is not None else -1)
            if newer is not None:
                self.log(f"resuming from {newer.path}, newer than Ray Train's "
                         f"{checkpoint.path if checkpoint is not None else 'none'}")
                checkpoint = newer
        if checkpoint is not None:
            with checkpoint.as_directory() as d:
                self.load_state_dict(load_state(d))
            self.counters.restarts += 1
            self.resumed_from = self.progress.step
        self.counters.world_sizes_seen.append(self.world_size)
        self.counters.uncommitted_train_s = 0.0

    def checkpoint(self, metrics: dict[str, float]) -> None:
        """Commit the state (every rank calls it); the steps since the last checkpoint
        become committed time."""
        c = self.counters
        c.committed_train_s += c.uncommitted_train_s
        c.uncommitted_train_s = 0.0
        state = self.state_dict()
        p = self.progress
        report(state if self.rank == 0 else None, {"step": p.step, "epoch": p.epoch, **metrics},
               p.step, config=self.job.config, before_replace=self.fault.checkpoint_hook(p.step))

    # -------------------------------------------------------------------------- loop
    @property
    def done(self) -> bool:
        p, c = self.progress, self.cfg.train
        return p.epoch >= c.epochs or (c.max_steps is not None and p.step >= c.max_steps)

    def fit(self) -> None:
        """Train from the restored state to the end of the run."""
        p, c = self.progress, self.cfg.train
        self.ledger = LedgerWriter(self.job.ledger_dir, self.rank, self.resumed_from, self.world_size)
        self.tracker.attempt(enter=self._t_enter, ready=time.time(), world_size=self.world_size,
                             resumed_from=p.step)
        import torch.distributed as dist

        self.tracker.set_tags({"elastic_ddp.world_size": self.world_size,
                               "elastic_ddp.restarts": self.counters.restarts,
                               # gloo or nccl: what this attempt's collectives ran on.
                               "elastic_ddp.backend": dist.get_backend() if dist.is_initialized() else "none",
                               "elastic_ddp.device": str(self.device)})
        first = True
        while not self.done:
            t = time.perf_counter()
            self._order, self._reader = open_train_reader(
                self.job.train, self.task, self.cfg, self.rank, self.world_size, p.epoch,
                p.cursor, self.plan.global_batch_size, list(self.plan.rows_per_rank),
                template=self.job.sample["train"])
            self.window.data_s += time.perf_counter() - t
            while p.cursor < self.n_train and not self.done:
                self.train_step()
                if first:
                    self.tracker.attempt(first_step=time.time(), step=p.step)
                    first = False
                self.maybe_log()
                if c.checksum_every_steps and p.step % c.checksum_every_steps == 0:
                    self.strategy.check_params_equal(p.step)
                if not self.done and p.step % c.checkpoint_every_steps == 0 and p.cursor < self.n_train:
                    self.checkpoint({})
            if p.cursor >= self.n_train:
                p.epoch, p.cursor = p.epoch + 1, 0
                self.checkpoint(self.evaluate())
        if p.cursor != 0:  # stopped by max_steps inside an epoch
            self.checkpoint(self.evaluate())
        self.ledger.close()

    def train_step(self) -> None:
        """One optimizer step over the global positions ``[cursor, cursor + G)``: this
        rank's rows in ``grad_accum_steps`` micro-batches (DDP ``no_sync`` on all but the
        last), each micro-batch's loss weighted by ``world_size / G`` so DDP's average is
        the exact mean over the step's rows. A step whose gradient is not finite on any
        rank is skipped by every rank (the same norm everywhere after the all-reduce)."""
        p, cfg, ws = self.progress, self.cfg, self.world_size
        t0 = time.perf_counter()
        n = step_rows(self.n_train, p.cursor, self.plan.global_batch_size)
        rows = self._order.rank_rows(p.cursor, n, ws, list(self.plan.rows_per_rank))
        accum = grad_accum_steps(rows, cfg.batch.micro_batch_size)
        clock = self.window.clock(self.device)
        t = clock.start()
        batch = self._reader.take(p.cursor, n)
        clock.stop("data", t)
        lr = lr_at(p.samples_seen, self.run.schedule_samples, self.run.peak_lr,
                   self.run.warmup_samples, cfg.optim.min_lr_ratio)
        for g in self.strategy.optimizer.param_groups:
            g["lr"] = lr
        # Per-step seeding makes dropout a function of (seed, step, rank) alone: RNG
        # streams cannot "continue" across a resize, where ranks change their rows.
        torch.manual_seed(cfg.seed * 1_000_003 + p.step * 1009 + self.rank)
        ids = np.asarray(batch[self.job.train.id_column])
        try:
            self.fault.at_step(p.step + 1)
            finite = self._micro_steps(batch, rows, accum, n)
        except Exception as e:
            raise StepError(f"step {p.step + 1} (epoch {p.epoch}, rank {self.rank}): "
                            f"{type(e).__name__}: {e}") from e
        self.ledger.record(p.epoch, p.step + 1, ids, skipped=not finite)
        p.step += 1
        p.cursor += n
        p.samples_seen += n
        dt = time.perf_counter() - t0
        self.counters.uncommitted_train_s += dt
        self.window.add(n, dt, lr)

    def _micro_steps(self, batch: dict, rows: list[int], accum: int, n: int) -> bool:
        s, task, w, clock = self.strategy, self.task, self.window, self.window.clock(self.device)
        probe = self.should_log(self.progress.step + 1) and self.progress.step > 0 and s.can_probe
        slices = micro_slices(rows[self.rank], accum)
        smallest = [min(split_evenly(r, accum)[i] for r in rows) for i in range(accum)]
        weight = self.world_size / n
        bn_saved = self._save_bn() if self.has_batchnorm else None
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.parallel.bf16)
        sums: list[tuple[float, dict, int]] = []
        for i, (a, b) in enumerate(slices):
            t = clock.start()
            # An empty share still runs forward and backward (every rank joins every
            # all-reduce): on the one-row sample, weighted 0, so tasks never see B = 0.
            rows = {k: v[a:b] for k, v in batch.items()} if b > a else self.job.sample["train"]
            tensors = self._to_device(task.collate(rows))
            clock.stop("data", t)
            ctx, kind = s.micro_step(i == len(slices) - 1, probe)
            t = clock.start()
            with ctx, _batchnorm_guard(s.model, smallest[i]), autocast:
                loss_vec, extra = _split_loss(task.loss(s.model, tensors), max(1, b - a))
                (loss_vec.float().sum() * (weight if b > a else 0.0)).backward()
            clock.stop(kind, t)
            w.micro[kind] = w.micro.get(kind, 0) + 1
            if w.tokens_per_sample is None:
                w.tokens_per_sample = task.tokens_per_sample(tensors) or 0
            # .item() is a device sync; free on CPU, one per micro-step on GPU.
            if b > a:
                sums.append((float(loss_vec.detach().float().sum()),
                             {k: float(v.detach().float().sum()) for k, v in extra.items()}, b - a))
        if w.grad_bytes is None:
            w.grad_bytes = gradient_bytes(s.model.parameters())
        if probe:
            t = clock.start()
            s.allreduce_gradients()
            clock.stop("allreduce_probe", t)
            w.probes += 1
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
            for buf, saved in bn_saved:
                buf.copy_(saved)
        self.counters.skipped_steps += 1
        self.counters.skipped_samples += n
        self._nonfinite_run += 1
        self.log(f"step {self.progress.step + 1}: non-finite gradient, step skipped on every rank "
                 f"({self._nonfinite_run} in a row)")
        if self._nonfinite_run >= self.cfg.train.max_nonfinite_steps:
            raise NonFiniteError(
                f"{self._nonfinite_run} consecutive steps had a non-finite loss or gradient (up to "
                f"step {self.progress.step + 1}): look for NaN/inf in the data (nulls inside list "
                "columns read as NaN) or lower optim.lr; train.max_nonfinite_steps sets the limit")

    def _save_bn(self):
        return [(b, b.detach().clone()) for m in self.strategy.module.modules()
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for b in m.buffers()]

    def _to_device(self, tensors: dict) -> dict:
        if self.device.type == "cpu":
            return tensors
        return {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v
                for k, v in tensors.items()}

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.cfg.train.log_every_steps == 0

    def maybe_log(self) -> None:
        """On step 1 and every ``log_every_steps``: reduce the window across ranks (two
        small collectives) and send it to the tracker."""
        p = self.progress
        if not self.should_log(p.step):
            return
        m = self.window.reduce(self.world_size, self.device)
        # epoch 1-based, as every line a person reads counts it (progress, logs, summary).
        m.update(step=p.step, epoch=p.epoch + 1, world_size=self.world_size)
        self.tracker.log_metrics(m, p.step)
        self.log(f"epoch {p.epoch + 1} step {p.step}/{self.run.total_steps} loss "
                 f"{m['train_loss']:.4f} lr {m['lr']:.2e} {m['samples_per_s']:.0f} samples/s")
        self.window = StepWindow()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation metrics over the whole val split (``val_<name>``, exact means over
        its rows whatever the split across ranks). Every rank runs the same number of
        batches and the same all-reduce, also a rank whose share is empty."""
        val = self.job.val
        if val is None:
            return {}
        s = self.strategy
        bs = max(1, self.cfg.batch.micro_batch_size * 2)
        n_batches = math.ceil(math.ceil(val.num_rows / self.world_size) / bs)
        if self.cfg.train.eval_max_batches:
            n_batches = min(n_batches, self.cfg.train.eval_max_batches)
        s.model.eval()
        if self._eval_names is None:
            # Every rank, the same one-row forward (collective under FSDP): the metric
            # names, hence the reduction vector, are the same on every rank.
            one = self._to_device(self.task.collate(self.job.sample["val"]))
            self._eval_names = sorted(self.task.evaluate(s.model, one))
        names = self._eval_names
        sums = torch.zeros(len(names) + 1, dtype=torch.float64)
        try:
            for batch in val_batches(val, self.task, self.cfg.seed, self.progress.epoch, self.rank,
                                     self.world_size, bs, n_batches, self.job.sample["val"]):
                k = len(batch[val.id_column])
                if k == 0:  # FSDP: the same forward count on every rank (the sample row)
                    if s.collective_forward:
                        self.task.evaluate(s.model, self._to_device(self.task.collate(self.job.sample["val"])))
                    continue
                out = self.task.evaluate(s.model, self._to_device(self.task.collate(batch)))
                for i, name in enumerate(names):
                    sums[i] += float(out[name].float().sum())
                sums[-1] += k
        finally:
            s.model.train()
        sums = sums.to(self.device)
        if s.distributed:
            import torch.distributed as dist

            dist.all_reduce(sums)
        count = max(1.0, float(sums[-1]))
        out = {f"val_{name}": float(sums[i]) / count for i, name in enumerate(names)}
        self.tracker.log_metrics(out, self.progress.step)
        self.log(f"epoch {self.progress.epoch} done: " + " ".join(f"{k}={v:.4f}" for k, v in out.items()))
        return out

    def finish(self) -> None:
        """Send the run-wide counters and close the ledger."""
        self.tracker.set_tags({"elastic_ddp.world_sizes_seen": self.counters.world_sizes_seen})

    def log(self, msg: str) -> None:
        """A rank-prefixed line in rank 0's log (Ray's worker log file)."""
        if self.rank == 0:
            # sys.stdout, not print: Ray Train patches print() into its logger.
            sys.stdout.write(f"[rank 0/{self.world_size}] {msg}\n")
            sys.stdout.flush()

    _t_enter = 0.0


def _split_loss(out, n: int) -> tuple[torch.Tensor, dict]:
    """``Task.loss``'s return as (loss [B], {name: [B]}).

    Raises:
        ValueError: the loss is not a per-sample vector of ``n`` values.
    """
    loss, extra = out if isinstance(out, tuple) else (out, {})
    if not torch.is_tensor(loss) or loss.dim() != 1 or loss.shape[0] != n:
        shape = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
        raise ValueError(f"Task.loss must return the per-sample loss, shape [{n}], got {shape} "
                         "(use reduction='none' and average over tokens within a sample)")
    return loss, extra


@contextlib.contextmanager
def _batchnorm_guard(model: torch.nn.Module, smallest_rows: int):
    """Run BatchNorm layers on their running statistics for a micro-step in which some
    rank holds fewer than 2 rows (batch statistics of 0 or 1 sample are undefined or
    raise). The decision uses the smallest slice over all ranks, so SyncBatchNorm's
    collective is skipped on every rank or on none."""
    if smallest_rows >= 2:
        yield
        return
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]
    for m in bns:
        m.eval()
    try:
        yield
    finally:
        for m in bns:
            m.train()

