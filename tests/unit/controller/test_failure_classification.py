"""How the controller classifies a failed attempt, driven in this process in Ray Train's
callback order into a real tracker and sqlite store: the cause is the rank that died
(with its signal, node and step from its position record), not the peer that saw the
connection close; deaths at different steps are retried; the same error twice in any
phase, or an error that no retry can fix, stops the job naming the step, the rank and
the phase; error fingerprints ignore addresses, ports, pids and ids. Ranks that die are
real processes killed by SIGKILL."""

from __future__ import annotations

import os
import pickle

import pytest

from conftest import InProcess
from helpers import sigkilled_rank


def _actor_died(pid: int):
    """Ray Train's view of a rank whose process vanished: the health check failed with
    the ActorDiedError Ray builds from the raylet's report (its own message text)."""
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    ctx = ActorDiedErrorContext(
        error_message="The actor is dead because its worker process has died. Worker exit type: "
                      "SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection "
                      "error code 2. End of file. Some common causes include: (1) the process was "
                      "killed by the OOM killer due to high memory usage",
        pid=pid, node_ip_address="127.0.0.1", class_name="RayTrainWorker", actor_id=os.urandom(16))
    return WorkerHealthCheckFailedError("Worker health check failed.", ActorDiedError(ctx))


def _gloo_peer_error(step: int, port: int):
    from elastic_ddp.positions import located

    inner = RuntimeError(f"[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                         f"closed by peer [127.0.0.1]:{port}. This is typically caused by a remote "
                         "worker crashing.")
    return located(inner, 0, {"phase": "training step", "step": step, "epoch": 0})


@pytest.fixture()
def controller(tmp_path, mlflow_store):
    """ElasticEvents + ControllerEvents writing into a real tracker and sqlite store (the
    controller's callbacks, called in Ray Train's order, in this process)."""
    from mlflow.tracking import MlflowClient

    from elastic_ddp.controller.events import ElasticEvents

    from elastic_ddp.controller.lifecycle import ControllerEvents
    from elastic_ddp.tracking import JobTracker

    uri = mlflow_store
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("c", artifact_location=str(tmp_path / "a")))
    events = ElasticEvents(InProcess(JobTracker(uri, run.info.run_id)), run_name="job")
    return events, ControllerEvents(events)


def _fail(events, ctrl, exceptions, workers=None):
    from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision

    events.workers = workers or {}
    events.after_exception(None, exceptions)
    ctrl.before_controller_execute_failure_decision(FailureDecision.RETRY)
    return events.events[-1]


def test_deaths_at_different_steps_are_retried(controller):
    events, ctrl = controller
    for step in (3, 9, 15):  # a flaky node, not a deterministic failure
        pid = sigkilled_rank(0, step)
        ev = _fail(events, ctrl, {0: _actor_died(pid)}, {0: {"pid": pid, "node_ip": "127.0.0.1"}})
        assert ev["decision"] == "RETRY" and ev["step"] == step


@pytest.mark.parametrize("phase,error,needle", [
    ("evaluation", KeyError("'logits'"), "evaluate()"),
    # A Ray Data read task's error reaches the rank as a RayTaskError whose text names
    # the read task's pid and node address: different on every attempt.
    ("data read", None, "Parquet file"),  # the message is the read error, not the task's pid
    ("metrics", RuntimeError("Gloo all_reduce failed: [127.0.0.1]:{port} size mismatch 9 vs 8"),
     "metrics"),
    ("training step", ValueError("bad pixel at worker pid={port}"), "task's code"),
])
def test_the_same_error_in_any_phase_twice_is_deterministic(controller, phase, error, needle):
    """Errors raised in evaluation, in the data read, in metric logging and in a step
    carry the step; the same one twice (addresses, ports and pids differing) stops the
    job with the step, the rank, the phase and the likely cause."""
    from elastic_ddp.controller.events import DeterministicTrainingError
    from elastic_ddp.positions import located

    events, ctrl = controller

    def err(port):
        if error is None:
            from ray.exceptions import RayTaskError

            cause = OSError("Couldn't deserialize thrift: don't know what type: \n"
                            "Deserializing page header failed.")
            ip = f"10.0.0.{port % 200}"
            tb = (f"\x1b[36mray::ReadElasticDDPWindows->MapBatches(TaskTransform)()\x1b[39m "
                  f"(pid={port}, ip={ip})\n  File \"ingest.py\", line 51\nOSError: ...")
            return RayTaskError("ReadElasticDDPWindows->MapBatches(TaskTransform)", tb, cause,
                                pid=port, ip=ip).as_instanceof_cause()
        return type(error)(str(error.args[0]).format(port=port))

    ev = _fail(events, ctrl, {1: located(err(40001), 1, {"phase": phase, "step": 6, "epoch": 0})})
    assert ev["decision"] == "RETRY" and ev["step"] == 6 and ev["phase"] == phase
    with pytest.raises(DeterministicTrainingError) as e:
        _fail(events, ctrl, {1: located(err(40777), 1, {"phase": phase, "step": 6, "epoch": 0})})
    msg = str(e.value)
    assert "same error at the same step" in msg and "rank 1 failed at step 6" in msg, msg
    assert needle in msg and "\x1b" not in msg, msg
    if error is None:
        assert "OSError: Couldn't deserialize thrift" in msg and "ReadElasticDDPWindows" in msg, msg


@pytest.mark.parametrize("make", ["data_changed", "non_finite", "data_error"])
def test_fatal_errors_are_not_retried_even_once(controller, make):
    from elastic_ddp.data.scan import DataError as DE
    from elastic_ddp.controller.events import DeterministicTrainingError
    from elastic_ddp.positions import located
    from elastic_ddp.worker.trainer import DataChangedError, NonFiniteError, StepError

    events, ctrl = controller
    if make == "data_changed":
        e = located(DataChangedError("the checkpoint at step 3 was written on other data"), 0,
                    {"phase": "restore", "step": 3, "epoch": 0})
    elif make == "non_finite":
        try:
            try:
                raise NonFiniteError("3 consecutive steps had a non-finite loss")
            except NonFiniteError as inner:
                raise StepError("step 9 (epoch 0, rank 0): NonFiniteError: ...") from inner
        except StepError as outer:
            e = located(outer, 0, {"phase": "training step", "step": 9, "epoch": 0})
    else:
        e = located(DE("/d/a.parquet: column 'x' missing"), 1, {"phase": "data read", "step": 1, "epoch": 0})
    assert e.fatal
    # It crosses the process boundary as the controller receives it.
    e = pickle.loads(pickle.dumps(e))
    with pytest.raises(DeterministicTrainingError, match="not retried"):
        _fail(events, ctrl, {e.rank: e})


def test_error_fingerprints_ignore_addresses_ports_pids_and_ids():
    from elastic_ddp.controller.failures import normalise

    a = ("RayTaskError(OSError): ray::Read() (pid=1234, ip=10.0.0.7) Connection reset by peer "
         "[10.0.0.7]:41779 actor_id 3f2a9c0d1e5b7a6c01000000 at 2026-11-30 13:03:14,866 /tmp/tmpab12x/f")
    b = ("RayTaskError(OSError): ray::Read() (pid=99, ip=10.0.0.8) Connection reset by peer "
         "[10.0.0.8]:5512 actor_id 0badc0ffee0ddf0001000000 at 2026-12-01 01:00:00,001 /tmp/tmpzz9/f")
    assert normalise(a) == normalise(b)
    assert normalise("bad value 7 in column y") != normalise("bad value 8 in column y")


def test_a_worker_group_error_after_the_budget_names_the_dead_rank_not_the_peer():
    from ray.train.v2.api.exceptions import WorkerGroupError

    from elastic_ddp.controller.failures import describe_training_error

    e = WorkerGroupError("...", {0: _gloo_peer_error(3, 4242), 1: _actor_died(4321)})
    msg = describe_training_error(e)
    assert msg.startswith("rank 1 died") and "SIGKILL" in msg and "max_failures" in msg, msg


def test_a_controller_error_carries_its_cause_never_a_line_ending_at_a_colon():
    # Ray's ControllerError is "Training failed due to controller error:" and its cause
    # on the next line; an error whose message is empty still names its type.
    from ray.exceptions import ActorDiedError
    from ray.train.v2.api.exceptions import ControllerError

    from elastic_ddp.controller.failures import describe_training_error

    msg = describe_training_error(ControllerError(ActorDiedError()))
    assert msg.startswith("ControllerError: the Ray Train controller failed: ActorDiedError: "), msg
    assert not msg.rstrip().endswith(":") and len(msg) > 70, msg
    msg = describe_training_error(ControllerError(RuntimeError("placement failed:\n  node n1 gone")))
    assert msg.endswith("RuntimeError: placement failed: node n1 gone"), msg
    assert describe_training_error(ControllerError(KeyError())).endswith("KeyError (no message)")
    assert describe_training_error(RuntimeError("cause:\nthe disk")) == "RuntimeError: cause: the disk"


def test_a_long_error_keeps_its_end_where_the_fix_is():
    # A restore that finds no checkpoint that verifies names every bad file of every
    # checkpoint, then the fix: the cause line clips the middle, never the end.
    from elastic_ddp.controller.failures import classify, primary
    from elastic_ddp.positions import RankError

    bad = "; ".join(f"/work/trial/mine/ray_results/allbad/checkpoint_step{k:08d}: __0_0.distcp "
                    f"(0 bytes, the manifest says 1234567)" for k in range(60, 200, 20))
    text = (f"no checkpoint of run 'allbad' verifies: {bad}. Restore the files from a copy, "
            "or start a new run (another run.name)")
    err = RankError(f"step 0 (epoch 0, rank 0, restore): CheckpointCorruptError: {text}", rank=0,
                    step=0, epoch=0, phase="restore", error_type="CheckpointCorruptError",
                    fatal=True, detail=text)
    line = primary(classify({0: err})).describe()
    assert len(text) > 600 and len(line) < 700, len(line)
    assert line.endswith("Restore the files from a copy, or start a new run (another run.name)"), line
    assert "rank 0 failed at step 0 (restore): CheckpointCorruptError: no checkpoint of run 'allbad'" in line
    assert "characters ...]" in line
