"""One rank's training run: the ``Trainer`` owns the run state (progress, counters, model,
optimizer, strategy state) and builds the components of a step, each given what it uses;
its checkpoints go through ``elastic_ddp.checkpoint.manager``, the schema's only writer
and reader, when ``worker.checkpoint_policy`` says one is due.

    trainer = Trainer(job, rank, world_size, device)     # by elastic_ddp.worker.entry.train_func
    trainer.restore(ray.train.get_checkpoint())
    trainer.fit(enter, marks)

Everything that depends on the world size is derived here at every (re)start, because
Ray Train restarts the whole worker group on every failure and resize: the batch plan,
the model wrap, this rank's reader.

One step (``train_step``) goes through: ``rank_loader`` (the step's batch), the
``before_step`` observers (``observers``), ``micro_steps`` (forward and backward),
the fault-tolerance component (``fault_tolerance``/``per_step``: the gradient sync),
``update`` (the learning rate, clip and step, or skip), the ``after_step`` observers.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, fields
from typing import Any, Callable, Optional

import torch

from elastic_ddp.batching import run_length
from elastic_ddp.checkpoint.manager import CheckpointManager
from elastic_ddp.ledger import LedgerWriter
from elastic_ddp.metrics import StepWindow
from elastic_ddp.parallel.strategies import build_strategy
from elastic_ddp.positions import Position
from elastic_ddp.run_state import (Counters, DataChangedError, JobSpec, NonFiniteError,  # noqa: F401
                                   Progress, StepError, data_identity)
from elastic_ddp.tasks.loading import build_model
from elastic_ddp.tasks.protocol import model_inputs, parameter_dtype
from elastic_ddp.tracking import TrackerClient
from elastic_ddp.worker import fault_tolerance, notice as notices
from elastic_ddp.worker.checkpoint_policy import CheckpointPolicy
from elastic_ddp.worker.evaluation import Evaluator
from elastic_ddp.worker.faults import Fault
from elastic_ddp.worker.micro_steps import MicroSteps
from elastic_ddp.worker.observers import LedgerObserver, fault_observer
from elastic_ddp.worker.rank_loader import RankLoader
from elastic_ddp.worker.reporting import StepReporter
from elastic_ddp.worker.update import Update


class Trainer:
    """See the module docstring. ``rank``/``world_size`` of this attempt; ``device`` is
    the rank's CUDA device or the CPU.

    ``ft``: the fault-tolerance component of the mode (``fault_tolerance.build``), called
    at fixed points of the step and the run; ``roles``: which rank logs, evaluates and
    writes (``elastic_ddp.worker.roles``); ``before_step``/``after_step``: the step's
    observers (``worker.observers``)."""

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
        # Ranks of the torch.distributed group the strategy and the metric reductions use:
        # every worker (restart mode), or this replica alone (per-step fault tolerance).
        self.comm_size = fault_tolerance.comm_size(cfg, world_size)
        self.strategy = s = build_strategy(cfg, model, device, self.comm_size, self.run.total_steps)
        # The run state: the components hold these two objects (swap_run_state).
        self.progress, self.counters = Progress(), Counters()
        self.window = StepWindow()
        self.ft = fault_tolerance.build(job, rank, world_size, device, s, lambda: self.window,
                                        self.state_dict, self.adopt_live_state, self.log)
        self.roles = self.ft.roles
        self.resumed_from: Optional[int] = None
        self.restored_path: Optional[str] = None  # the checkpoint restore() loaded
        self.tracker = TrackerClient(job.tracker, enabled=self.roles.may_log)
        # Where this rank is (phase, step), for the controller when the process dies
        # without a Python error (elastic_ddp.controller.failures).
        self.position = Position(rank, cfg.run.name, node=_ray_node_id())
        self.loader = RankLoader(job, cfg, self.plan, world_size, device, mark=self.at)
        self.micro = MicroSteps(s, self.task, cfg, device, self.to_device, job.sample["train"],
                                job.train.id_column, self.ft.loss_weight)
        # Every rank reports its own rows with a non-finite loss (tracking.nonfinite).
        self.update = Update(s, cfg, self.run, self.counters, device, rank, world_size, job.train,
                             self.roles, self.log, self.tracker, TrackerClient(job.tracker))
        self.evaluator = Evaluator(job, s, device, self.to_device)
        self.report = StepReporter(cfg, self.run.total_steps, self.tracker, self.roles, rank,
                                   world_size, device, self.comm_size,
                                   self.ft.ledger_mode == "per_step", self.log)
        # The checkpoint's config.json: the config as JSON, for a person or a tool to read.
        self.ckpt = CheckpointManager(job.storage, cfg.run.name, cfg.model_dump(mode="json"),
                                      rank, world_size,
                                      collective=self.comm_size > 1, log=self.log,
                                      tracker=self.tracker, strategy_name=cfg.parallel.strategy,
                                      fence=job.fence)
        # restart mode: an agreed notice -> a checkpoint, then Preempted (None: a crash).
        self.listener = notices.build(job, rank, world_size, device, self.position)
        sources = [self.listener.due] if self.listener is not None else []
        self.policy = CheckpointPolicy(cfg, self.n_train, self.progress, sources + [self.ft.stop_due],
                                       leaving_alone=lambda: self.ft.leaving_alone)
        self.before_step: list[Callable] = []  # (progress, StepBatch), after the data read
        self.after_step: list[Callable] = []  # (progress, StepBatch, applied), once committed
        # Fault injection of tests and experiments only (Diagnostics.fault): None in a job.
        self.fault = Fault(job.fault, rank) if job.fault else None
        if self.fault is not None:
            self.before_step.append(fault_observer(self.fault))
        self.ledger: Optional[LedgerWriter] = None  # fit() opens it (a collective when on)

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

    def adopt_live_state(self, state: dict[str, Any]) -> None:
        """A healing replica takes a peer's ``state_dict()`` (torchft's
        ``load_state_dict``): model, optimizer, progress and counters, its own world
        sizes seen kept. The reader warmed at the restored cursor (``fit``) serves the
        moved position if it is in the same epoch (``RankLoader.ensure``)."""
        run = CheckpointManager.load_live_state(self.strategy, state)
        seen = self.counters.world_sizes_seen
        self.swap_run_state(Progress(**run["progress"]),
                            Counters(**{**run["counters"], "world_sizes_seen": seen}))

    def swap_run_state(self, progress: Progress, counters: Counters) -> None:
        """Make ``progress`` and ``counters`` this rank's run state, in place: the
        components (loader, update, checkpoint policy) hold the trainer's two objects."""
        for live, new in ((self.progress, progress), (self.counters, counters)):
            for f in fields(live):
                setattr(live, f.name, getattr(new, f.name))

    def load_run_state(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's run state (``run_state()``, written at any world size).

        Raises:
            DataChangedError: written on other data or another order (``data.on_change``).
        """
        self.swap_run_state(Progress(**state["progress"]), Counters(**state["counters"]))
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
            self.resumed_from = self.policy.checkpointed_step = self.progress.step
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
        """Commit the state (every rank calls it; ``_commit``, when the policy says one is
        due); the steps since the last checkpoint become committed time. ``final``: the
        run's last one. Where the mode may not report (``ft.may_report``: a partial
        quorum), the lead writes the state to storage unreported (``_write_unreported``),
        where a restore finds it."""
        p, c = self.progress, self.counters
        self.policy.checkpointed_step = p.step
        self.at("checkpoint", p.step)
        c.committed_train_s += c.uncommitted_train_s
        c.uncommitted_train_s = 0.0
        if not self.ft.may_report():
            self._write_unreported()
            return
        t0 = time.perf_counter()
        self.ckpt.save(p.step, self.strategy, self.run_state(),
                       {"step": p.step, "epoch": p.epoch, **metrics}, writer=self.roles.lead,
                       fault_hook=self.fault.checkpoint_hook(p.step) if self.fault else None,
                       asynchronous=self.cfg.train.async_checkpoint and not final)
        if self.roles.lead:  # what the loop waited for: the summary's checkpoint part (tracking.totals)
            self.tracker.log_metrics({"checkpoint_block_s": time.perf_counter() - t0}, p.step)

    def _write_unreported(self) -> None:
        """A checkpoint of a partial quorum (per-step mode): the lead writes the state
        straight to storage (no report: Ray Train's barrier would wait for the replicas
        outside the quorum) and removes its older unreported ones beyond
        ``train.keep_checkpoints`` (``CheckpointManager.prune_unreported``). A restore
        reads storage first, so the run's durable state keeps up with its committed steps
        while a replacement is starting or healing: when the last live replica then dies,
        the restart redoes at most a checkpoint interval. Costs the lead's synchronous
        write, which the other participants wait out in their next all-reduce."""
        if not self.roles.lead:
            return
        step = self.progress.step
        path = self.ckpt.save(step, self.strategy, self.run_state(), report=False, writer=True)
        removed = self.ckpt.prune_unreported(self.cfg.train.keep_checkpoints)
        self.log(f"checkpoint of {self.ft.quorum_line()} at step {step} written unreported: {path}"
                 + (f" (removed {len(removed)} older unreported)" if removed else ""))

    def _commit(self, dues) -> None:
        """Commit each checkpoint the policy says is due (``CheckpointPolicy.due``), then
        its ``then`` (a notice's or a stop's: closes the ledger and raises Preempted)."""
        for due in dues:
            if due.line:
                self.log(due.line)
            self.checkpoint({**(self.evaluate() if due.evaluate else {}), **due.metrics},
                            final=due.final)
            if due.then is not None:
                if self.ledger is not None:
                    self.ledger.close()
                due.then()

    # -------------------------------------------------------------------------- loop
    @property
    def done(self) -> bool:
        return self.policy.done

    def fit(self, enter: float = 0.0, marks: Optional[dict] = None) -> None:
        """Train from the restored state to the end of the run (inside ``ft.fit``).
        ``enter``: when the train function began, ``marks``: its finer start marks
        (seconds since the epoch; ``worker.entry.train_func``)."""
        self.ft.fit(lambda: self._loop(enter, marks or {}), fresh=self.restored_path is None,
                    done=lambda: self.done, warm=self.warm_reader)

    def _loop(self, enter: float, marks: dict) -> None:
        p, c = self.progress, self.cfg.train
        self.ledger = LedgerWriter(self.job.ledger_dir, self.rank, self.resumed_from, self.world_size,
                                   self.ft.ledger_mode)
        if self.ledger.enabled:  # Diagnostics.ledger_dir: tests and experiments
            observer = LedgerObserver(self.ledger, self.ft.ledger_extra)
            self.before_step.append(observer.before)
            self.after_step.append(observer.after)
        self.report.started(enter, marks, p.step, self.restored_path, self.counters)
        self._commit(self.policy.due("start"))
        while not self.done:
            committed = self.train_step()  # False: not committed (per-step mode), redo it
            if committed:
                self.report.stepped(p.step)
                self.maybe_log()
                self.ckpt.poll()  # an asynchronous checkpoint done on every rank: reported
                if c.checksum_every_steps and p.step % c.checksum_every_steps == 0:
                    self.strategy.check_params_equal(p.step)
            self._commit(self.policy.due("step" if committed else "redo"))
        self._commit(self.policy.due("end"))
        self.ledger.close()

    def warm_reader(self) -> None:
        """Open this rank's reader of its own view at the current position and read its
        first round now (``RankLoader.warm``)."""
        self.window.data_s += self.loader.warm(self.progress, self.rank, self.world_size)

    def train_step(self) -> bool:
        """One optimizer step over the global positions ``[cursor, cursor + G)``: this
        rank's rows in ``grad_accum_steps`` micro-batches (DDP ``no_sync`` on all but the
        last; ``MicroSteps.forward_backward``: each micro-batch seeded by its place in the
        step, so dropout does not depend on the rank), each micro-batch's loss weighted
        (``ft.loss_weight``) so that the all-reduced gradient is the exact mean over the
        step's rows. A step whose gradient is not finite on any rank is skipped by every
        rank (``Update.apply``: the same norm everywhere after the all-reduce). Returns
        False when the step was not committed (redo it).

        Raises:
            StepError: the step failed (its cause chained), naming step, epoch and rank."""
        p, w = self.progress, self.window
        t0 = time.perf_counter()
        batch = self.loader.next_batch(p, *self.ft.begin_step(p.step), w)
        lr = self.update.set_lr(p.samples_seen)
        log_step = self.report.should_log(p.step + 1)
        probe = log_step and p.step > 0 and self.strategy.can_probe
        try:
            for observe in self.before_step:
                observe(p, batch)
            micro = self.micro.forward_backward(batch, p.step, probe, w)
            # Per-step mode: the log step's metric sums ride in the gradient all-reduce.
            mine = w.row_sums(micro.sums) if self.ft.sums_in_step and log_step else None
            ok, summed = self.ft.sync_gradients(probe, mine)
            if not ok:
                self.update.drop(micro)
                return False
            applied = self.update.apply(micro, batch.n, p.step + 1, p.epoch, w)
        except Exception as e:
            raise StepError(f"step {p.step + 1} (epoch {p.epoch}, rank {self.rank}): "
                            f"{type(e).__name__}: {e}") from e
        w.quorum_sums = summed if applied else None
        for observe in self.after_step:
            observe(p, batch, applied)
        self._account(batch.n, lr, time.perf_counter() - t0)
        return True

    def _account(self, n: int, lr: float, dt: float) -> None:
        """A committed step of ``n`` rows that took ``dt`` seconds at learning rate ``lr``:
        the progress moves on, its time is uncommitted until the next checkpoint."""
        p = self.progress
        p.step += 1
        p.cursor += n
        p.samples_seen += n
        self.counters.uncommitted_train_s += dt
        self.window.add(n, dt, lr)

    def to_device(self, tensors: dict) -> dict:
        """A collated batch's tensors on this rank's device, floating ones in the model's
        parameter dtype (``tasks.protocol.model_inputs``)."""
        return model_inputs(tensors, self.device, self.input_dtype)

    def maybe_log(self) -> None:
        """On step 1 and every ``log_every_steps``: the window's metrics
        (``StepReporter.log_window``); a new window starts."""
        p = self.progress
        if not self.report.should_log(p.step):
            return
        self.at("metrics", p.step)
        self.report.log_window(self.window, p.step, p.epoch)
        self.window = StepWindow()

    def evaluate(self) -> dict[str, float]:
        """Validation metrics over the whole val split (``Evaluator.run``), shared as
        ``roles.eval_share`` says and logged by the lead; {} on a rank that does not
        evaluate."""
        share = self.roles.eval_share
        if share is None:
            return {}
        self.at("evaluation", self.progress.step)
        t0 = time.perf_counter()
        out = self.evaluator.run(self.progress.epoch, *share)
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


def _ray_node_id() -> Optional[str]:
    """This process's Ray node id (None outside Ray): stamped on the position record so
    that a controller on the same machine can read it without a task on the node."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
