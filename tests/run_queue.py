"""How long processes waited for a CPU: the part of a wall-clock time limit that measures the machine, not the code.

A test's time limit is there to catch a hang or a wait that should not happen (a lost peer waited on, a rank that
never exits). On a loaded machine the same work also waits in the kernel's run queue: at a load of 20 on 2 cores a
process that wants the CPU gets about a tenth of it. Linux counts that wait per thread (``/proc/PID/task/TID/schedstat``,
its second field). A limit that adds the run-queue wait of the processes it times is as tight as before on a quiet
machine and no tighter on a loaded one; a hang (sleeping, blocked on a lock, a socket or a timeout) adds nothing, so
it still fails. Where schedstat is missing (not Linux, or a kernel without it) the wait reads 0: the plain limit.
"""

from __future__ import annotations

import os
import time


def _thread_waits(pid: int) -> dict[int, float]:
    """Seconds each live thread of ``pid`` has waited in a run queue, by thread id ({} once the process is gone)."""
    waits = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return waits
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                waits[int(tid)] = int(f.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            continue  # the thread ended meanwhile
    return waits


def _children(pids: set[int]) -> set[int]:
    """The processes whose parent is in ``pids``, from /proc (one pass)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if parent in pids:
                found.add(int(entry))
    return found


class RunQueueWaits:
    """The run-queue waits of some processes since this object was made, sampled by :meth:`sample`.

    A thread or process that ends keeps the wait of its last sample, so sample often (the tests poll every 50 ms to
    1 s anyway). ``descendants``: also follow the processes these start (found at each sample: one pass over /proc).
    """

    def __init__(self, pids: list[int], descendants: bool = False) -> None:
        self._roots, self._descendants = list(pids), descendants
        self._start: dict[int, dict[int, float]] = {}
        self._last: dict[int, dict[int, float]] = {}
        self._history: dict[int, list[tuple[float, float]]] = {}
        for pid in self._roots:
            self._follow(pid, time.monotonic())

    def _follow(self, pid: int, now: float) -> None:
        self._start[pid] = _thread_waits(pid)
        self._last[pid] = dict(self._start[pid])
        self._history[pid] = [(now, 0.0)]

    def sample(self) -> None:
        now = time.monotonic()
        if self._descendants:
            for pid in _children(set(self._start)) - set(self._start):
                self._follow(pid, now)  # its wait before it was found counts from here on: a few ms at most
        for pid, last in self._last.items():
            for tid, waited in _thread_waits(pid).items():
                last[tid] = max(waited, last.get(tid, 0.0))
            self._history[pid].append((now, self.waited(pid)))

    def waited(self, pid: int) -> float:
        """Seconds the threads of ``pid`` waited for a CPU since it was followed (summed over its threads)."""
        start = self._start[pid]
        return sum(waited - start.get(tid, 0.0) for tid, waited in self._last[pid].items())

    def waited_between(self, pid: int, since: float, until: float | None = None) -> float:
        """Seconds ``pid`` waited for a CPU between two monotonic times (``until`` None: its last sample), each read
        at the last sample taken at or before it."""
        history = self._history[pid]

        def at(moment: float) -> float:
            before = [waited for t, waited in history if t <= moment]
            return before[-1] if before else 0.0

        return (history[-1][1] if until is None else at(until)) - at(since)

    def most(self) -> float:
        """The longest wait of any one of the processes followed."""
        return max((self.waited(pid) for pid in self._start), default=0.0)
