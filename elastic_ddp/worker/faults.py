"""TEST HOOKS: faults injected into real worker processes (a rank SIGKILLs itself, dies
inside a checkpoint write, or raises a deterministic error), so that the elastic tests
and experiments exercise real failures. Set only through ``train(..., diagnostics=Diagnostics(fault=...))``; a
job without it pays one ``None`` check per step.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Optional


class Fault:
    """TEST HOOK: fault injection in real processes (``job["fault"]``, set only by
    ``train(..., diagnostics=Diagnostics(fault=...))``; None makes every method a no-op).

    ``{"rank": r, "at_step": k, "where": "step" | "kill_always" | "checkpoint_write" |
    "error", "marker": "/path/fired"}``:

    - ``step``: rank r SIGKILLs itself just before computing step k (its peers block in
      that step's all-reduce: a worker dying mid-step as seen by the group).
    - ``checkpoint_write``: rank r SIGKILLs itself inside the write of the checkpoint at
      step k (``CheckpointManager.save``), after its shards are written, with its first
      shard cut to half its size, and before the manifest (a checkpoint never complete).
    - ``kill_always``: rank r SIGKILLs itself inside step k on every attempt, after the
      step's rows are read (a worker the kernel OOM-kills at the same step each time).
    - ``error``: rank r raises ``ValueError`` at step k on every attempt (a deterministic
      user error).

    ``"step_s": t`` (any rank field): every rank's step takes at least ``t`` seconds
    more, as a larger model's would: a test of what happens while a replacement starts
    needs the others still training when it arrives.

    A ``step`` or ``checkpoint_write`` kill fires once per job: it creates ``marker``
    first and never fires while the marker exists (a restarted attempt passes step k
    again). ``error`` and ``kill_always`` ignore the marker for firing but create it
    (appending one line per firing), so a test can see how often they ran.
    """

    def __init__(self, spec: Optional[dict], rank: int):
        self.spec = spec if spec and int(spec.get("rank", 0)) == rank else None
        self.step_s = float((spec or {}).get("step_s", 0.0))

    def _arm(self, where: str, step: int) -> bool:
        s = self.spec
        if s is None or s.get("where") != where or int(s["at_step"]) != step:
            return False
        marker = Path(s["marker"])
        always = where in ("error", "kill_always")
        if not always and marker.exists():
            return False
        marker.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"t": time.time(), "step": step, "where": where, "pid": os.getpid()})
        if always:
            with open(marker, "a") as f:
                f.write(line + "\n")
        else:
            marker.write_text(line)
        return True

    def at_step(self, step: int) -> None:
        """Before computing ``step`` (counted from 1): kill or raise when armed here."""
        if self.step_s:
            time.sleep(self.step_s)
        if self._arm("error", step):
            raise ValueError(f"injected deterministic error at step {step}")
        if self._arm("step", step) or self._arm("kill_always", step):
            os.kill(os.getpid(), signal.SIGKILL)

    def checkpoint_hook(self, step: int):
        """The ``CheckpointManager.save(fault_hook=...)`` hook for the checkpoint at
        ``step`` (called with the path of one shard this rank wrote), or None."""
        if self.spec is None or self.spec.get("where") != "checkpoint_write" \
                or int(self.spec["at_step"]) != step:
            return None

        def hook(shard: str) -> None:
            if self._arm("checkpoint_write", step):
                # Leave a half-written file, as a crash inside the write would.
                with open(shard, "r+b") as f:
                    f.truncate(max(1, Path(shard).stat().st_size // 2))
                os.kill(os.getpid(), signal.SIGKILL)
        return hook
