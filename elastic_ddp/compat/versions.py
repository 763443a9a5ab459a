"""The version guard of the compat seam: the Ray releases each override of Ray Train's
private parts was tested on, and which of them apply to the Ray installed here.

    from elastic_ddp.compat.versions import ray_plan

    plan = ray_plan()                    # for ray.__version__
    plan.applies("controller_host")      # True on a tested release
    plan.warning                         # None, or the one line the launcher prints

Each override replaces or patches a part of Ray Train that Ray may change in any release
without notice. On a release an override was not tested on, the launcher leaves that
part as Ray ships it (stock ``TorchTrainer``: Ray's own controller actor, synchronization
actor, runtime environment, ``TorchConfig`` and default callbacks) and prints one warning
line naming what is skipped, instead of failing somewhere inside Ray. Checkpoints, the
data order and the exact resume are the workers' own and hold either way; what a job
loses without an override is its ``buys``.

To support a new Ray release: run ``tests/e2e/restart/test_ray_versions.py`` with
``ELASTIC_DDP_TEST_RAY=<version>`` (slow tier: a virtualenv with that Ray, the digits
job and a resume after a SIGKILL) and the Ray tier in an environment that has it, then
add the version to :data:`TESTED_RAY` (or to the ``tested`` of the overrides it passed).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Optional

# Every release of the range pyproject.toml declares. The Ray Train code the overrides
# tested on all of them replace, patch or call is the same in all of them, except that
# SynchronizationActor has three more methods from 2.60 on
# (compat.ray_controller_host.SYNC_METHODS serves both sets); the .0 and .1 releases of
# 2.56, 2.57 and 2.58 ship identical ray/train sources. The three overrides tested on
# 2.60 only are skipped on 2.56 to 2.59 with the warning line (README.md's Ray range note
# says what a job loses there):
# - usable_node_count: before 2.60 ElasticScalingPolicy._count_possible_workers gets a
#   list of per-node resources without node ids, which it cannot filter by node;
# - replica_group_capacity: the controller and worker-group parts it patches are the
#   same in 2.58 and 2.59 (in 2.56 and 2.57 but for 2.60's preemption additions to the
#   worker group and its poll status, which it does not use), but per-step mode with a
#   lost node (tests/e2e/per_step/test_per_step_capacity.py) ran on 2.60 only, and the restart-mode
#   jobs of tests/e2e/restart/test_ray_versions.py never take its path;
# - grow_checkpoint: a grow notice is a notice, which before 2.60 is handled as a crash.
TESTED_RAY = ("2.56.0", "2.56.1", "2.57.0", "2.57.1", "2.58.0", "2.58.1", "2.59.0", "2.60.0")
# The first Ray release with Ray Train's TorchftConfig, which scaling.fault_tolerance=
# per_step runs on (a public module; every supported release has it).
TORCHFT_RAY = "2.55.0"
# The releases whose Ray Train has the preemption API (its watcher, PreemptionError,
# FailureConfig.max_preemption_failures) and on which compat.ray_train's preemption
# helpers were tested. Elsewhere a notice (node drain, SIGTERM) is handled as a crash.
PREEMPTION_RAY = ("2.60.0",)
# The torch and MLflow releases (major.minor) whose private parts compat.torch_ddp and
# compat.mlflow_store were tested on; elsewhere each takes the fallback its module
# names (read from the installed package's metadata: neither is imported for it).
TESTED_TORCH = ("2.13",)
TESTED_MLFLOW = ("3.17", "3.18")
# The releases whose Ray Train checkpoint-manager snapshot (its format, the deleting
# helper its pruning calls) compat.ray_snapshot was tested on; elsewhere it does nothing.
SNAPSHOT_RAY = ("2.60.0",)


@dataclasses.dataclass(frozen=True)
class Override:
    """One change elastic-ddp makes to Ray's private parts, or one reading of what Ray
    has no API for (its error messages, a reserved resource name).

    ``key``: what the code asks :meth:`RayPlan.applies`; ``name``: what the warning says
    is skipped; ``buys``: what a job has with it and loses without it; ``tested``: the
    exact Ray versions it ran on."""

    key: str
    name: str
    buys: str
    tested: tuple[str, ...] = TESTED_RAY


OVERRIDES: tuple[Override, ...] = (
    Override("controller_host", "controller host (compat.ray_controller_host)",
             "the controller's process boots before the input checks on a running cluster and "
             "serves each worker group's barrier (no SynchronizationActor process per start) and "
             "runs Ray 2.60's preemption watcher (no PreemptionWatcher process per start); "
             "the controller and the workers start without a runtime environment (no second "
             "import of Ray in setup_worker.py); Ctrl-C aborts the run (KILLED, exit 130)"),
    Override("default_callbacks", "default-callback trim (compat.ray_trainer)",
             "no DatasetManager actor per worker-group start and no PlacementGroupCleaner "
             "actor per job (the driver removes a dead controller's placement group)"),
    Override("process_group_backend", "torch-free process-group backend (compat.ray_backend)",
             "the controller never imports torch (about a second of every start and restart)"),
    Override("controller_events", "controller events (controller.lifecycle.ControllerEvents)",
             "each failure's cause (rank, signal, step) in the run's events, the stop after the "
             "same failure twice, the controller's start-up marks, and a worker death while "
             "its group starts retried rather than fatal, with that group's placement group "
             "and other workers shut down"),
    Override("replica_group_capacity", "replica-group capacity wait (compat.ray_capacity)",
             "in per_step mode a replica whose node is gone waits for room outside the "
             "controller's loop: a replica that dies meanwhile is replaced on its own live "
             "node at once, and the job ends when the survivors finish (Ray Train blocks on "
             "the lost node's replacement until a node joins)",
             tested=("2.60.0",)),
    Override("usable_node_count", "usable-node count of a restart (compat.ray_scaling)",
             "an elastic job's restart after a drain or a node's loss, and a running group's "
             "grow, ask for the workers that fit on the nodes alive and not draining now (Ray "
             "Train's view of the nodes keeps a draining node until it is gone and a removed one "
             "up to 20 s: a start sized by it waits for a worker there, "
             "scaling.placement_timeout_s at a time)",
             tested=("2.60.0",)),
    Override("grow_checkpoint", "checkpoint before a grow (compat.ray_grow)",
             "an elastic job's running group, before Ray Train restarts it onto more workers, "
             "commits a checkpoint at the next step boundary (a grow notice), so the grow "
             "recomputes no step (Ray Train restarts it from the last periodic checkpoint)",
             tested=("2.60.0",)),
    Override("death_messages", "cause of a worker's death read from Ray's message (compat.ray_errors)",
             "a dead rank's failure says how it died (Ray's memory monitor, its node lost or "
             "preempted, its exit code, a signal) and on which node and pid; without it, "
             "\"the process died\" and the worker group's own node and pid"),
    Override("head_node_resource", "head node by its node:__internal_head__ resource (compat.ray_nodes)",
             "the job's tracker actor is placed on the head node, which no scale-down "
             "removes; without it, on the driver's node (a worker node when the driver is "
             "attached to one)"),
)


def release_key(version: str) -> tuple:
    """``"2.56.1"`` -> ``(2, 56, 1)``: for ordering releases (a non-numeric part sorts
    as -1, so ``2.61.0.dev0`` sorts before ``2.61.0``)."""
    return tuple(int(p) if p.isdigit() else -1 for p in version.split("."))


@dataclasses.dataclass(frozen=True)
class RayPlan:
    """Which overrides run on Ray ``version``: ``applied`` and ``skipped`` hold
    :class:`Override` objects."""

    version: str
    applied: tuple[Override, ...]
    skipped: tuple[Override, ...]

    def applies(self, key: str) -> bool:
        """True when the override ``key`` (an :data:`OVERRIDES` key) runs.

        Raises:
            KeyError: no override has that key."""
        if key not in {o.key for o in OVERRIDES}:
            raise KeyError(f"no compat override {key!r}; known: {', '.join(o.key for o in OVERRIDES)}")
        return any(o.key == key for o in self.applied)

    @property
    def warning(self) -> Optional[str]:
        """One line naming what is skipped, or None when every override runs."""
        if not self.skipped:
            return None
        if self.version in TESTED_RAY:  # a part whose Ray Train code is newer than the release
            return (f"elastic-ddp: warning: on Ray {self.version}, running Ray Train as shipped, "
                    "without: " + "; ".join(f"{o.name} (tested on Ray {', '.join(o.tested)})"
                                            for o in self.skipped))
        tested = sorted({v for o in self.skipped for v in o.tested}, key=release_key)
        stock = "stock Ray Train" if not self.applied else "Ray Train as shipped for these parts"
        return (f"elastic-ddp: warning: Ray {self.version} is not a release elastic-ddp was tested "
                f"on ({tested[0]} to {tested[-1]}); running {stock}, without: "
                + "; ".join(o.name for o in self.skipped))


def ray_plan(version: Optional[str] = None) -> RayPlan:
    """The overrides that apply on Ray ``version`` (default: the installed ``ray.__version__``)."""
    if version is None:
        import ray

        version = ray.__version__
    applied = tuple(o for o in OVERRIDES if version in o.tested)
    return RayPlan(version, applied, tuple(o for o in OVERRIDES if o not in applied))


def preemption_supported(plan: RayPlan) -> bool:
    """Whether a notice becomes a checkpoint and a preemption on ``plan``'s Ray: a
    release of :data:`PREEMPTION_RAY` with the controller overrides applied (the
    controller host forwards the driver's stop; the controller events count notices)."""
    return (plan.version in PREEMPTION_RAY and plan.applies("controller_host")
            and plan.applies("controller_events"))


def preemption_notice_line(plan: RayPlan) -> Optional[str]:
    """The one line a job prints on a Ray without the preemption API, else None."""
    if preemption_supported(plan):
        return None
    return (f"elastic-ddp: Ray {plan.version} has no preemption support elastic-ddp uses "
            f"(Ray {PREEMPTION_RAY[0]}): a node drain or SIGTERM is handled as a crash "
            "(counted in scaling.max_failures)")


def minor_release(version: str) -> str:
    """``"2.13.0+cpu"`` -> ``"2.13"``."""
    return ".".join(version.split("+")[0].split(".")[:2])


def tested_release(distribution: str, tested: tuple[str, ...]) -> bool:
    """Whether the installed ``distribution`` (a PyPI name: ``torch``, ``mlflow``) is a
    major.minor release of ``tested``; False when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return minor_release(version(distribution)) in tested
    except PackageNotFoundError:
        return False


_warned: set[str] = set()


def warn_skipped(plan: RayPlan) -> None:
    """Print ``plan.warning`` to stderr, once per process and version (a sweep's trials
    share one line)."""
    if plan.warning is not None and plan.version not in _warned:
        _warned.add(plan.version)
        print(plan.warning, file=sys.stderr, flush=True)
