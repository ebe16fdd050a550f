"""Compiles for later at the idle priority while they run beside steps, so they never take cycles a step wants.

A background build or the cost curve's passes compile partly on the Python worker that asks (tracing,
lowering) and mostly on threads XLA's client made at start-up (codegen), all at the process's usual priority.
Whether they slow the step beside them depends on the device: where the steps run on the host's own cores
they compete with them, where the steps leave the host's cores idle (a GPU's host) they do not. The rule
here needs no measurement of which case holds, because it is right in both: in the scheduler's idle class a
thread runs only on cycles no other thread wants, so a step preempts it at once where cores are scarce, and
it runs at full speed where they are idle. Nothing names XLA's compile threads, so they are found by watching
(``CompileThreads``): the threads that burn CPU while the loop waits for a compile are compile threads,
unless they also burn CPU while a step runs (a step's own threads are never touched) or are Python's (a
server's own). While background compiles are in flight, those threads and the workers sit in the idle class
(``Demotion``); whenever the loop itself waits for a compile (nothing background in flight, or a settle) they
are back at their own priority, so a compile the loop waits for is never starved by other processes. Linux
only; and only where the process may put a thread back (the idle class is one-way for an unprivileged
thread): elsewhere nothing changes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from typing import Iterable, Iterator

COMPILE_SHARE = 0.05  # CPU seconds over the compile's wall seconds at which a thread counts as compiling
RUN_SHARE = 0.01  # CPU seconds over a run's wall seconds at which a thread counts as running steps


def thread_seconds() -> dict[int, float]:
    """CPU seconds per thread of this process, by native thread id: the scheduler's nanoseconds on a CPU
    (``schedstat``), else user + system clock ticks (``stat``); empty where /proc is absent."""
    out = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
            continue
        except (OSError, IndexError, ValueError):
            pass
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # a thread that ended meanwhile
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (stat's fields 14 and 15)
    return out


@functools.cache
def restorable() -> bool:
    """Whether this process may put a thread it moved to the idle class back (tried once, on a thread of its own:
    an unprivileged thread may leave the idle class only as far as its RLIMIT_NICE allows)."""
    result = []

    def trial() -> None:
        tid = threading.get_native_id()
        try:
            policy, nice = os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(tid, policy, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            result.append(os.sched_getscheduler(tid) == policy)
        except (AttributeError, OSError):
            result.append(False)

    worker = threading.Thread(target=trial, name="jaxspec-priority-trial")
    worker.start()
    worker.join()
    return result[0]


class Demotion:
    """Threads of this process held in the idle class, with the policy and nice value each had before."""

    def __init__(self) -> None:
        self.saved: dict[int, tuple[int, int]] = {}  # tid -> (policy, nice) to put back
        self.lock = threading.Lock()  # a worker lowers itself on its own thread

    def lower(self, tids: Iterable[int]) -> None:
        """Moves ``tids`` (not already held) to the idle class, where the move can be undone; else leaves them."""
        tids = set(tids)
        if not tids or not restorable():
            return
        with self.lock:
            self._lower(tids - set(self.saved))

    def _lower(self, tids: set[int]) -> None:
        for tid in tids:
            try:
                saved = (os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid))
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except OSError:  # a thread that ended
                continue
            self.saved[tid] = saved

    def restore(self) -> None:
        """Puts every held thread back at its own policy and nice value."""
        with self.lock:
            held, self.saved = self.saved, {}
        for tid, (policy, nice) in held.items():
            try:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            except OSError:  # a thread that ended
                pass


class CompileThreads:
    """XLA's compile threads as watched so far (``watch_compile`` minus ``watch_run``)."""

    def __init__(self) -> None:
        self.compiling: set[int] = set()
        self.running: set[int] = set()
        self.identified = False  # ``identify`` ran (once at most)

    @contextlib.contextmanager
    def _watch(self, share: float) -> Iterator[set[int]]:
        seen: set[int] = set()
        before, began = thread_seconds(), time.perf_counter()
        try:
            yield seen
        finally:
            wall = max(time.perf_counter() - began, 1e-3)
            me = threading.get_native_id()
            seen.update(t for t, s in thread_seconds().items() if t != me and s - before.get(t, 0.0) >= share * wall)

    @contextlib.contextmanager
    def watch_compile(self) -> Iterator[None]:
        """Around a compile the loop waits for (nothing else runs): the threads busy meanwhile compile."""
        with self._watch(COMPILE_SHARE) as seen:
            yield
        self.compiling |= seen

    def identify(self) -> None:
        """Watches a small compile of its own and its runs, once, where the loop's own were not both seen (a warm
        start loads its executables and reads its costs): a program no cache holds (a constant of its own),
        compiled with XLA's persistent cache told not to keep it (on this thread only), then run a few times."""
        if self.identified or (self.compiling and self.running):
            return
        self.identified = True
        import jax  # noqa: PLC0415 (this module is read where no JAX is loaded)
        import jax.numpy as jnp  # noqa: PLC0415
        from jax._src import config as jax_config  # noqa: PLC0415 (the per-thread cache threshold)

        salt = float(time.perf_counter_ns() % 9973)

        def chain(x):  # [256, 256]: matrix products large enough for XLA's step threads to run them
            for i in range(16):
                x = jnp.tanh(x @ x * 1e-3 + salt + i)
            return x

        x = jnp.ones((256, 256), jnp.float32)
        with jax_config.persistent_cache_min_compile_time_secs(float("inf")), self.watch_compile():
            run = jax.jit(chain).lower(x).compile()
        with self.watch_run():
            for _ in range(8):
                x = run(x)
            jax.block_until_ready(x)

    @contextlib.contextmanager
    def watch_run(self) -> Iterator[None]:
        """Around steps the loop runs with no compile in flight: the threads busy meanwhile run steps."""
        with self._watch(RUN_SHARE) as seen:
            yield
        self.running |= seen

    @property
    def found(self) -> set[int]:
        """The compile threads: busy in a compile, never in a step, and none of Python's (a server's request
        threads may be busy during a compile; the loop's workers are held low by their own ids); none before a
        step was watched (a thread that runs steps must never be lowered, and until one ran, which those are
        is not known)."""
        if not self.running:
            return set()
        return self.compiling - self.running - {t.native_id for t in threading.enumerate()}
