"""XLA's own compile threads at the idle priority, so a compile for later never slows the step running now.

A background build or the cost curve's passes compile on threads XLA's client made at start-up (they do the
codegen; the Python worker that asked waits), at the process's usual priority. Where the device is the host's
own cores (a CPU), those threads then take cycles from the step beside them: on this 2-core CPU a cold
``generate`` ran its plain steps about 1.5x slower while auto's cost curve compiled. Nothing names those
threads, so they are found by watching: the threads that burn CPU while the loop waits for a compile are
compile threads, unless they also burn CPU while a step runs (the step's own threads are never touched).
Once found they are put in the scheduler's idle class (``jaxspec.cache.lower_priority``), which costs a
compile the loop waits for nothing (nothing else wants the cores then) and lets a step preempt one it does not.
Linux only (threads are scheduled apart there); elsewhere, or where nothing was seen, nothing changes.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Iterator

COMPILE_SHARE = 0.05  # CPU seconds over the compile's wall seconds at which a thread counts as compiling
RUN_SHARE = 0.01  # CPU seconds over a run's wall seconds at which a thread counts as running steps


def thread_seconds() -> dict[int, float]:
    """CPU seconds (user + system) per thread of this process, by native thread id; empty where /proc is absent."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # a thread that ended meanwhile
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15 of stat)
    return out


class CompileThreads:
    """The compile threads of this process as seen so far (``watch_compile``, ``watch_run``), and their demotion."""

    def __init__(self) -> None:
        self.compiling: set[int] = set()
        self.running: set[int] = set()
        self.lowered: set[int] = set()

    @contextlib.contextmanager
    def _watch(self, share: float) -> Iterator[set[int]]:
        seen: set[int] = set()
        before, began = thread_seconds(), time.perf_counter()
        try:
            yield seen
        finally:
            wall = max(time.perf_counter() - began, 1e-3)
            after = thread_seconds()
            me = threading.get_native_id()
            seen.update(t for t, s in after.items() if t != me and s - before.get(t, 0.0) >= share * wall)

    @contextlib.contextmanager
    def watch_compile(self) -> Iterator[None]:
        """Around a compile the loop waits for (nothing else runs): the threads busy meanwhile compile."""
        with self._watch(COMPILE_SHARE) as seen:
            yield
        self.compiling |= seen

    @contextlib.contextmanager
    def watch_run(self) -> Iterator[None]:
        """Around steps the loop times (no compile in flight): the threads busy meanwhile run steps, never lowered."""
        with self._watch(RUN_SHARE) as seen:
            yield
        self.running |= seen

    def lower(self) -> set[int]:
        """Puts every compile thread seen (and not a step's) in the idle class, once each; returns those lowered."""
        from jaxspec.cache import lower_priority  # noqa: PLC0415

        todo = self.compiling - self.running - self.lowered
        for tid in todo:
            lower_priority(tid)
        self.lowered |= todo
        return todo
