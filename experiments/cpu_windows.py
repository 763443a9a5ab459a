"""CPU seconds a process tree spends in given time windows, by kind of process (Linux,
``/proc``): how much work a restart costs, a figure that other jobs on the machine
stretch less than its wall time.

    sampler = TreeCpu(os.getpid())        # samples every 0.2 s in a thread from now on
    ...
    sampler.stop()
    sampler.by_kind([(t0, t1), ...])      # {kind: [CPU s in each window]}

Each process's utime + stime (``/proc/<pid>/stat``, in clock ticks) is read every
``interval_s``; a process counts from its first sample (a process younger than one
interval when it ends is missed), its CPU at time t is its last sample at or before t,
so a window's figure is short by at most one interval's CPU at each end.
Processes are the descendants of ``root`` (pids reused inside one run are not told
apart).
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path

_HZ = os.sysconf("SC_CLK_TCK")

#: (kind, a substring of the command line), the first match wins.
KINDS = (("train worker", "RayTrainWorker"), ("data workers", "forkserver"),
         ("preemption watcher", "PreemptionWatcher"), ("controller", "ControllerHost"),
         ("tracker", "JobTracker"), ("idle Ray worker", "ray::IDLE"), ("Ray system", "raylet"),
         ("Ray system", "gcs_server"), ("Ray system", "dashboard"), ("Ray system", "runtime_env"),
         ("Ray system", "log_monitor"), ("MLflow helper", "tracking.opener"))


def kind(cmd: str) -> str:
    return next((k for k, pat in KINDS if pat in cmd), "other")


class TreeCpu:
    """Samples the CPU time of ``root`` and its descendants every ``interval_s`` in a
    daemon thread until :meth:`stop`."""

    def __init__(self, root: int, interval_s: float = 0.2):
        self.root, self.interval_s = root, interval_s
        self.procs: dict[int, dict] = {}  # pid -> {"cmd", "ppid", "t": [...], "cpu": [...]}
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run, name="tree-cpu", daemon=True)
        self._th.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            self._sample(t)
            self._stop.wait(max(0.0, self.interval_s - (time.time() - t)))

    def _sample(self, t: float) -> None:
        stats = {}
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                st = (p / "stat").read_text().rsplit(")", 1)[1].split()
                stats[int(p.name)] = (int(st[1]), (int(st[11]) + int(st[12])) / _HZ)
            except (OSError, IndexError, ValueError):
                continue
        kids: dict[int, list[int]] = {}
        for pid, (ppid, _) in stats.items():
            kids.setdefault(ppid, []).append(pid)
        todo, tree = [self.root], set()
        while todo:
            p = todo.pop()
            tree.add(p)
            todo += kids.get(p, [])
        for pid in tree & stats.keys():
            ppid, cpu = stats[pid]
            try:  # read each time: a Ray worker renames itself (ray::IDLE, ray::<actor>)
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmd = ""
            d = self.procs.setdefault(pid, {"cmd": cmd, "ppid": ppid, "t": [], "cpu": []})
            if cmd:
                d["cmd"] = cmd
            if not d["cpu"] or d["cpu"][-1] != cpu:
                d["t"].append(t)
                d["cpu"].append(cpu)

    def stop(self) -> None:
        self._stop.set()
        self._th.join()

    def by_kind(self, windows: list[tuple[float, float]]) -> dict[str, list[float]]:
        """CPU seconds of each kind of process in each window ``(t0, t1)`` (seconds since
        the epoch), one list entry per window, and ``"all"``."""
        out: dict[str, list[float]] = {}
        for i, (a, b) in enumerate(windows):
            acc: dict[str, float] = {"all": 0.0}
            for d in self.procs.values():
                c = _at(d, b) - _at(d, a)
                if c > 0:
                    k = kind(d["cmd"])
                    acc[k] = acc.get(k, 0.0) + c
                    acc["all"] += c
            for k, v in acc.items():
                out.setdefault(k, [0.0] * len(windows))[i] = v
        return out


def _at(d: dict, t: float) -> float:
    i = bisect.bisect_right(d["t"], t) - 1
    return d["cpu"][i] if i >= 0 else 0.0
