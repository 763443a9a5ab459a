"""What a checkpoint holds of a rank's training state: the model's and the optimizer's
state as ``torch.distributed.checkpoint`` (DCP) saves and loads it, the run state's keys,
and the live state a healing replica receives from a peer (per-step fault tolerance).

Used by ``checkpoint.manager`` (save), ``checkpoint.restore`` (load), ``checkpoint.export``
and the worker's healing path.
"""

from __future__ import annotations

from typing import Any

#: What a run state holds (JSON): the trainer's progress and counters, the data it was
#: written on, and per-step fault tolerance's torchft step counters.
RUN_KEYS = ("progress", "counters", "data", "torchft")


def run_state_of(state: dict) -> dict:
    """The run-state entries (``RUN_KEYS``) that ``state`` has."""
    return {k: state[k] for k in RUN_KEYS if k in state}


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


def set_model_optimizer_state(strategy, state: dict) -> None:
    """Load ``state`` (as :func:`model_optimizer_state` gives it) into ``strategy``'s
    module and optimizer. Raises what torch raises on a state that does not fit
    (``RuntimeError``, ``KeyError``, ``ValueError``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    opt = strategy.optimizer
    local = getattr(opt, "optim", opt)
    set_state_dict(strategy.module, local, model_state_dict=state["model"],
                   optim_state_dict=state["optim"],
                   options=StateDictOptions(flatten_optimizer_state_dict=True))


def live_state(strategy, run_state: dict) -> dict:
    """What a healing replica receives from a live peer (per-step fault tolerance,
    torchft's transport): the model's and the optimizer's in-memory state dicts and
    the run state. Replicated (ddp): one copy per replica, no gathering."""
    return {"model": strategy.module.state_dict(), "optimizer": strategy.optimizer.state_dict(),
            **run_state}


def load_live_state(strategy, state: dict) -> dict:
    """Load a peer's :func:`live_state` into ``strategy``; returns its run state."""
    strategy.module.load_state_dict(state["model"])
    strategy.optimizer.load_state_dict(state["optimizer"])
    return run_state_of(state)
