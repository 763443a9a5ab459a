"""The sections of the config tree (``data``, ``task``, ``model``, ``optim``, ``parallel``,
``batch``, ``train``, ``scaling``, ``run``): one pydantic model each, a description on every
field, unknown keys refused. :class:`~elastic_ddp.config.schema.Config` composes them.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


# run.name becomes a directory under run.storage_path (Ray Train's run directory), the
# MLflow run name (runs.name is VARCHAR(250) in MLflow's SQL stores) and, with suffixes the
# product adds (``-<run id prefix>``, 9 bytes; a sweep's ``-sweep-<time>-ws<N>``, ~27),
# one file-name component, which Linux file systems cap at 255 bytes (NAME_MAX).
MAX_RUN_NAME_BYTES = 200


def check_run_name(name: str) -> str:
    """``name`` if it can name a run; else ValueError saying what is wrong and the rule."""
    rule = (f"a run name is one directory name of at most {MAX_RUN_NAME_BYTES} bytes "
            "(UTF-8), without '/', NUL or control characters, and not '.' or '..'")
    size = len(name.encode("utf-8", "surrogatepass"))
    if not name:
        raise ValueError(f"is empty; {rule}")
    if size > MAX_RUN_NAME_BYTES:
        raise ValueError(f"is {size} bytes long, the longest allowed is {MAX_RUN_NAME_BYTES} "
                         f"(it becomes a directory under run.storage_path and the MLflow run "
                         f"name, with suffixes); shorten it ({rule})")
    bad = sorted({c for c in name if c == "/" or ord(c) < 32 or ord(c) == 127})
    if bad:
        shown = ", ".join(repr(c) for c in bad)
        raise ValueError(f"contains {shown}; {rule}")
    if name.strip() in (".", ".."):
        raise ValueError(f"{name!r} names no directory of its own; {rule}")
    return name


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(Section):
    """Where the Parquet data lives and in what order it is read (the task names the
    columns it reads: ``Task.input_columns``)."""

    train_path: str = Field(description="Directory (or file) of training Parquet files: a "
                                        "local path or an s3://, gs:// or file:// URI.")
    val_path: Optional[str] = Field(
        None, description="Directory of validation Parquet files (a local path or an s3://, "
                          "gs:// or file:// URI); none skips validation."
    )
    id_column: str = Field(
        "sample_id", description=(
            "Column holding a unique integer id per row (checked by the driver's scan): rows "
            "are named by it in the sample ledger, warnings and errors, and a transform's "
            "random numbers derive from it with seed and epoch.")
    )
    order: Literal["windowed", "permutation"] = Field(
        "windowed",
        description=(
            "windowed: each epoch shuffles the row groups, cuts them into data.partitions "
            "canonical partitions and shuffles rows within windows; a rank reads only its "
            "own partitions (memory and reads follow the batch, not the data set). "
            "permutation: a full random permutation per epoch, every rank reads every row "
            "and keeps 1/world_size of them (small data sets only)."),
    )
    partitions: Optional[int] = Field(
        None, ge=1, description=(
            "windowed: canonical partitions (fixed for the job: the order does not depend "
            "on the world size). A world size that divides it is balanced. null: 60 (or "
            "the smallest multiple of 60 >= max_workers), or a divisor of it that keeps the "
            "same world sizes balanced (12 for up to 4 workers) when at 60 a partition would "
            "have fewer than 10 row groups or a window (shuffle_window_rows / partitions) "
            "fewer rows than a row group; at most the rows of the data set."),
    )
    shuffle_window_rows: int = Field(
        65536, ge=1, description=(
            "windowed: rows shuffled together, summed over all partitions (each partition "
            "shuffles ceil(this / partitions) rows at a time, at least one row group). A "
            "rank holds about 2 x this / world_size rows (plus Ray Data's prefetch)."),
    )
    block_rows: Optional[int] = Field(
        None, ge=1, description=(
            "windowed: split row groups into blocks of at most this many rows before the "
            "shuffle (finer shuffle, but a row group shared by blocks is read once per "
            "block). null: whole row groups."),
    )
    read_ahead_mib: float = Field(
        256.0, gt=0, description=(
            "Object-store memory (MiB) each rank's Ray Data pipeline may fill with windows "
            "read and transformed ahead of training. Without a cap Ray Data reads ahead until "
            "its object store budget is full (GBs, spilled to disk), on the training cores."),
    )
    reader: Literal["auto", "dataloader", "ray_data"] = Field(
        "auto", description=(
            "Who reads and transforms a rank's training rows (the rows, their order and a "
            "resume are the same either way). dataloader: read_tasks torch DataLoader worker "
            "processes on the trainer's node, started from a forkserver once and kept for the "
            "run (what they hold ahead is bounded in chunks of ~8 MiB of Parquet, not by "
            "read_ahead_mib). ray_data: a "
            "Ray Data pipeline per rank and round (read and transform tasks, at most "
            "read_ahead_mib ahead in the object store). auto: dataloader, the faster on "
            "the trainer's node (docs/benchmarks.md)."),
    )
    read_tasks: int = Field(
        2, ge=1, le=64, description=(
            "Read and transform processes per rank: DataLoader workers (dataloader) or Ray "
            "Data tasks at a time (ray_data). More keep a fast step fed where the cores "
            "exist; each DataLoader worker holds a Python process with torch and the task."),
    )
    task_cpus: float = Field(
        0.0, ge=0, description=(
            "ray_data: logical CPUs each read and transform task reserves. 0: none (the "
            "tasks never wait for a CPU and share the cores of the nodes they land on). "
            "> 0: Ray runs them where CPUs are free, a CPU-only node or CPUs training leaves, "
            "up to read_tasks at a time, so a node added to the cluster adds data-path "
            "throughput; a round that finds fewer CPUs free reserves none (warned once). "
            "Ignored by the dataloader reader, whose workers run on the trainer's node."),
    )
    on_change: Literal["refuse", "restart_epoch"] = Field(
        "refuse", description=(
            "A resume whose checkpoint was written on other data (rows added, removed or "
            "renumbered) or another order: refuse (start a new run.name instead), or keep "
            "the weights and restart the current epoch."),
    )


class TaskConfig(Section):
    """The user's task (model, per-sample loss, CPU transform, collate): see
    ``elastic_ddp.tasks.protocol``."""

    path: Optional[str] = Field(
        None, description=(
            "'package.module:Name' or 'path/to/file.py:Name' of an elastic_ddp.Task "
            "subclass (or instance or factory); or a built-in: mlp, cnn, gpt. Default: "
            "the built-in named by model.name."))
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the task's constructor.")


class ModelConfig(Section):
    """How the network is built: ``Task.build_model(**kwargs)`` or ``factory(**kwargs)``."""

    name: Optional[Literal["mlp", "cnn", "gpt"]] = Field(
        None, description="Short alias of a built-in task (sets task.path).")
    factory: Optional[str] = Field(
        None, description="'package.module:fn' or 'file.py:fn' returning the nn.Module; "
                          "default: the task's build_model.")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the model factory.")


class OptimConfig(Section):
    """Optimizer and LR schedule (warm-up then cosine)."""

    name: Literal["adamw", "sgd", "lars", "lamb"] = Field(
        "adamw", description="Optimizer; lars/lamb (large batches) from pytorch-optimizer.")
    lr: float = Field(1e-3, gt=0, description="Peak LR at batch.global_batch_size.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps to the peak LR.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine floor / peak LR.")
    grad_clip: float = Field(0.0, ge=0, description="Max global grad norm; 0 disables.")


class ParallelConfig(Section):
    """How the model is replicated or sharded, and the DDP knobs (``elastic_ddp/parallel/``)."""

    strategy: Literal["ddp", "zero1", "fsdp"] = Field(
        "ddp", description="ddp; zero1 = DDP + ZeroRedundancyOptimizer; fsdp = FSDP2 fully_shard.")
    bucket_cap_mb: float = Field(25.0, gt=0, description="DDP gradient bucket size (MiB).")
    gradient_as_bucket_view: bool = Field(
        False, description="DDP: grads alias the all-reduce buckets (saves one grad copy).")
    static_graph: bool = Field(False, description="DDP: the graph is the same every step.")
    find_unused_parameters: bool = Field(
        False, description="DDP: tolerate params without grads (costs a graph walk per step).")
    comm_hook: Literal["none", "bf16", "fp16", "powersgd"] = Field(
        "none", description="DDP communication hook: compression of the gradient all-reduce.")
    powersgd_rank: int = Field(
        8, ge=1, description=(
            "PowerSGD matrix approximation rank. 8: rank 2 cost +4% val loss on the gpt "
            "preset and +19% or more on digits; rank 8 +0.8% and +2% (docs/benchmarks.md)."))
    powersgd_start_iter: Optional[int] = Field(
        None, ge=1, description=(
            "PowerSGD: plain all-reduce for the first N optimizer steps. null: "
            "max(optim.warmup_steps, 20% of the run's steps) "
            "(elastic_ddp.parallel.comm_hooks.powersgd_start_step)."))
    fsdp_keep_params_between_fwd_bwd: bool = Field(
        False, description="fsdp: reshard_after_forward=False (ZeRO-2-like).")
    sync_batchnorm: bool = Field(
        False, description="Convert BatchNorm to SyncBatchNorm (global-batch statistics).")
    bf16: bool = Field(False, description="bf16 autocast for forward/backward.")


class BatchConfig(Section):
    """Global batch arithmetic. global = micro-batch x grad_accum_steps x world_size."""

    global_batch_size: int = Field(64, ge=1, description="Samples per optimizer step.")
    micro_batch_size: int = Field(
        64, ge=1, description="Largest per-rank forward/backward batch (memory bound)."
    )
    policy: Literal["fixed_global", "uneven", "scale_lr"] = Field(
        "fixed_global",
        description=(
            "fixed_global: keep the global batch; refuse world sizes in [min, max] that "
            "do not divide it. uneven: keep the global batch at every world size, ranks "
            "differ by at most one row (loss-weighted, exact mean). scale_lr: per-rank "
            "batch fixed at global_batch_size/min_workers, global batch and LR scale "
            "with world size (Goyal et al. 2017)."
        ),
    )
    lr_scaling: Literal["linear", "sqrt"] = Field(
        "linear", description="scale_lr only: LR multiplier rule for a larger batch."
    )


class TrainConfig(Section):
    """Loop lengths and cadences, in optimizer steps."""

    epochs: int = Field(5, ge=1, description="Passes over the training data.")
    max_steps: Optional[int] = Field(None, ge=1, description="Stop early after this step.")
    checkpoint_every_steps: int = Field(20, ge=1, description="Checkpoint cadence.")
    log_every_steps: int = Field(10, ge=1, description="Metrics cadence (and step 1).")
    keep_checkpoints: int = Field(3, ge=1, description="Checkpoints kept (newest K).")
    async_checkpoint: bool = Field(
        False, description="Write checkpoints in the background (restart mode, several workers, "
        "local, shared or object storage): the step loop waits only while the state is copied to "
        "host memory; a checkpoint counts once every rank's write and the manifest are done."
    )
    checkpoint_writer: Literal["thread", "process"] = Field(
        "thread", description="Where an asynchronous checkpoint is serialised and checksummed: "
        "'thread' (a thread of each worker) or 'process' (a process of each worker's own, at a "
        "lower CPU priority, fed from the staged host copy: it holds no GIL of the step loop)."
    )
    checkpoint_files_per_rank: int = Field(
        1, ge=1, le=64, description="Files each writing rank splits its part of a checkpoint "
        "into, written by as many threads (DCP's FileSystemWriter thread_count), balanced by "
        "size. On object storage each is its own object, uploaded in parallel (4 per rank at "
        "once) and read by ranged reads: more, smaller objects for a store whose per-request "
        "cost grows with the object's size. Any value restores at any world size."
    )
    checksum_every_steps: int = Field(
        0, ge=0, description="Compare a parameter checksum across ranks; 0 disables."
    )
    eval_max_batches: Optional[int] = Field(
        None, ge=1, description=(
            "Validate on the first eval_max_batches x 2 x micro_batch_size rows of the val "
            "split only, shared by the ranks: the same rows at every world size (quick runs)."))
    max_nonfinite_steps: int = Field(
        3, ge=1, description=(
            "A step whose gradient is not finite (NaN/inf on any rank) is skipped by every "
            "rank; this many in a row stop the job with an error."))


class ScalingConfig(Section):
    """How many Ray Train workers, and on what."""

    min_workers: int = Field(2, ge=1, description="Fewest workers training may run with.")
    max_workers: int = Field(2, ge=1, description="Most workers; == min for a fixed size.")
    use_gpu: Literal["auto", True, False] = Field(
        "auto", description="auto: GPU (NCCL) when the cluster has GPUs, else CPU (gloo)."
    )
    cpus_per_worker: float = Field(1.0, gt=0, description="Logical CPUs per worker.")
    gpus_per_worker: float = Field(
        1.0, gt=0, le=1, description="GPUs per worker when on GPUs; below 1 packs several "
        "workers on one GPU, which NCCL refuses for ranks of one process group.")
    torch_threads: Optional[int] = Field(
        None, ge=1, description="torch.set_num_threads per worker; default its CPU share."
    )
    max_failures: int = Field(
        3, ge=-1, description="Worker failures allowed (-1: unlimited); preemptions are not counted."
    )
    max_preemptions: int = Field(
        -1, ge=-1, description=(
            "Preemptions allowed (Ray Train's max_preemption_failures; -1: unlimited): a "
            "node drained with notice, a worker's SIGTERM, a node reclaimed after a drain."),
    )
    preemption_checkpoint: bool = Field(
        True, description=(
            "Ray 2.60. restart mode: on a notice (node drain, a worker's or the driver's "
            "SIGTERM) every rank learns it at a step boundary (one small all-reduce every "
            "notice_agreement_s of training), commits a checkpoint there and the job "
            "restarts from it (the driver's: stops, exit 143). per_step mode: the replica on a drained node or "
            "with a SIGTERM leaves its quorum at the next step boundary, the others "
            "continue and Ray replaces it; the driver's SIGTERM rides in a step's all-reduce "
            "and every replica commits a checkpoint of that step and stops (exit 143). false: "
            "a notice is handled as a crash."),
    )
    notice_agreement_s: float = Field(
        1.0, ge=0, description=(
            "restart mode with preemption_checkpoint: seconds of training between two of "
            "the workers' agreements on a notice; a notice is acted on within about this "
            "plus one step (0: an agreement at every step, acted on within two steps)."),
    )
    fault_tolerance: Literal["restart", "per_step"] = Field(
        "restart", description=(
            "restart: a failure or resize restarts every worker from the last checkpoint. "
            "per_step: every worker is a torchft replica group (Ray Train's TorchftConfig); "
            "a quorum is decided each step, survivors keep training when a replica dies and "
            "Ray replaces only that one, which heals from a live peer (needs the 'ft' extra, "
            "parallel.strategy ddp, no comm hook; runs max_workers replicas, commits a step "
            "with at least min_workers)."),
    )
    health_check_interval_s: float = Field(
        0.5, gt=0, description=(
            "Ray Train controller poll period (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S): bounds "
            "how fast a dead worker is noticed and how long a report waits to be consumed "
            "(Ray's default 2 s makes every checkpoint cost up to 2 s)."),
    )
    collective_timeout_s: int = Field(
        60, ge=5, description="gloo/NCCL collective timeout (a hung peer's upper bound)."
    )
    placement_timeout_s: Optional[float] = Field(
        None, gt=0, description=(
            "How long a worker group may wait for its placement group before the attempt "
            "fails and is retried with a fresh view of the cluster "
            "(RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S). null: 25 s for an elastic job "
            "(min_workers < max_workers: Ray's view of the nodes refreshes every 20 s, so "
            "after a node loss a stale request for it fails fast and the retry asks for the "
            "workers that fit), 600 s for a fixed size (an autoscaler may need minutes to "
            "add nodes)."),
    )
    resize_monitor_interval_s: float = Field(
        60.0, ge=0, description=(
            "Elastic jobs only (min_workers < max_workers): how often a healthy worker "
            "group checks for room to grow (Ray Train's elastic_resize_monitor_interval_s). "
            "A grow restarts the group; with preemption_checkpoint (restart mode) the "
            "workers first commit a checkpoint at the next step boundary, so no step is "
            "recomputed (grow_checkpoint_timeout_s); Ray sees new nodes only every ~20 s."),
    )
    grow_checkpoint_timeout_s: float = Field(
        60.0, ge=0, description=(
            "restart mode with preemption_checkpoint, elastic jobs: when the group grows "
            "onto more workers, how long the controller waits for the checkpoint the "
            "workers commit at the next step boundary before it restarts the group from "
            "the newest checkpoint anyway (one line says so; the steps since it are "
            "recomputed). 0: no checkpoint first."),
    )

    @model_validator(mode="after")
    def _min_le_max(self) -> "ScalingConfig":
        if self.min_workers > self.max_workers:
            raise ValueError(
                f"scaling.min_workers ({self.min_workers}) > scaling.max_workers "
                f"({self.max_workers}); set max_workers >= min_workers"
            )
        return self


class RunConfig(Section):
    """Names and places: Ray storage and the MLflow store."""

    name: str = Field("elastic-ddp", description=(
        "The run's key: its directory under run.storage_path (Ray Train's run name) and its "
        "MLflow run name; a job whose run of this name did not finish resumes it."))
    storage_path: str = Field(
        "ray_results", description=(
            "Where the runs' checkpoints (run.storage_path/run.name/checkpoint_stepK) and "
            "leases (.leases/) live: a local path (made absolute) or an s3://, gs:// or "
            "file:// URI; every node must reach it (a shared disk or object storage on a "
            "multi-node cluster).")
    )
    experiment_name: str = Field("elastic-ddp", description="MLflow experiment of the run (created when missing).")
    tracking_uri: Optional[str] = Field(
        None,
        description="MLflow URI; default $MLFLOW_TRACKING_URI, else sqlite:///$PWD/mlflow.db.",
    )
    resume: bool = Field(
        True, description=("Resume an unfinished run of the same run.name: its MLflow run and "
                           "newest checkpoint. false: start a new run.")
    )

    @field_validator("name")
    @classmethod
    def _name_is_a_directory_name(cls, v: str) -> str:
        return check_run_name(v)
