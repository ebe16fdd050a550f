"""Readying executables before any request: a known, bounded set compiled (or loaded) on the host's cores.

``EngineCore.prepare`` lists what a loop can reach (every step, prefill chunk, row operation and the prefix
cache's copies at every bucket); ``compile_all`` readies such a list on a pool of ``host_cores()`` threads (a trace
holds the interpreter, XLA's compile does not), with a progress bar that says what, how many and how long.

A loaded XLA:CPU executable holds hundreds of memory mappings, and Linux refuses a process more than
``vm.max_map_count`` (65,530 by default): past it LLVM fails to allocate and the process dies. ``check_room``
counts a prepared set against that limit before anything compiles, and ``compile_all`` stops with the same
clear error where the mappings it watches while compiling reach it anyway.
"""

from __future__ import annotations

import concurrent.futures
import queue
import re
import sys
import threading
import time
from typing import Any, Callable, Sequence

from jaxspec.cache import host_cores
from jaxspec.errors import RequestError, warn_once

Job = tuple[str, Callable[[], Any]]  # (what it readies, in words; the call that readies it)


class Ready:
    """The call of a ``Job`` that readies one stored executable: ``fn.compiled(*args, **kwargs)``, then ``then()``.
    ``stored()`` says, without tracing, whether that is a load rather than a compile (``describe_set``)."""

    def __init__(self, fn: Any, args: tuple, kwargs: dict | None = None,
                 then: Callable[[], None] | None = None) -> None:
        self.fn, self.args, self.kwargs, self.then = fn, args, kwargs or {}, then

    def __call__(self) -> None:
        self.fn.compiled(*self.args, **self.kwargs)
        if self.then is not None:
            self.then()

    def stored(self) -> bool:
        return self.fn.stored(*self.args, **self.kwargs)


def kind_of(label: str) -> str:
    """A job's kind for counting and timing: "step", "prefill" or "row operation"."""
    return "step" if label.startswith("step") else "prefill" if label.startswith("prefill") else "row operation"


def loads(jobs: Sequence[Job]) -> list[bool]:
    """Per job, whether readying it is a load from the store rather than a compile (``Ready.stored``; asked before
    anything runs: afterwards every job is a load)."""
    return [bool(getattr(run, "stored", lambda: False)()) for _, run in jobs]


def describe_set(jobs: Sequence[Job], loaded: Sequence[bool], seconds: dict | None = None) -> str:
    """A prepared set before anything compiles, in one line: its size by kind, how many load from the store and how
    many compile (``loaded``: ``loads``), and the time that should take from ``seconds`` ({"compile"|"load": {kind:
    mean seconds}}: ``timed_means`` of this machine's last preparation) where it holds every kind needed."""
    counts: dict[tuple[str, str], int] = {}
    for (label, _), load in zip(jobs, loaded):
        key = ("load" if load else "compile", kind_of(label))
        counts[key] = counts.get(key, 0) + 1
    kinds: dict[str, int] = {}
    for (_, kind), n in counts.items():
        kinds[kind] = kinds.get(kind, 0) + n
    compiles = sum(n for (how, _), n in counts.items() if how == "compile")
    text = (f"{len(jobs)} executables ({', '.join(f'{n} {k}s' for k, n in sorted(kinds.items()))}): "
            f"{compiles} to compile, {len(jobs) - compiles} to load")
    known = seconds or {}
    if all(kind in known.get(how, {}) for how, kind in counts):
        cores = max(1, min(host_cores(), len(jobs)))
        total = sum(n * known[how][kind] for (how, kind), n in counts.items()) / cores
        return text + f", about {total:.0f} s by this machine's last preparation"
    return text + " (not timed on this machine yet)"


def timed_means(jobs: Sequence[Job], loaded: Sequence[bool], timings: Sequence[tuple[str, float]],
                before: dict | None = None) -> dict:
    """``before`` ({"compile"|"load": {kind: mean seconds}}) with the kinds ``timings`` (each job's seconds on its
    thread) hold replaced by their means now: what ``describe_set`` times the next preparation here by."""
    how_of = {label: "load" if load else "compile" for (label, _), load in zip(jobs, loaded)}
    out = {how: dict(v) for how, v in (before or {}).items()}
    sums: dict[tuple[str, str], list[float]] = {}
    for label, sec in timings:
        sums.setdefault((how_of.get(label, "compile"), kind_of(label)), []).append(sec)
    for (how, kind), secs in sums.items():
        out.setdefault(how, {})[kind] = sum(secs) / len(secs)
    return out


# Memory mappings one loaded executable holds on XLA:CPU (2026-12-04, the default model: 28 k at 42 executables,
# 65 k at 95; docs/architecture.md): a model-running one (a step, a prefill), and a row operation's (a tiny model's
# steps held ~250 and its row operations ~45 on the same day: a row operation's code does not grow with the model).
STEP_MAPS = 650
ROW_OP_MAPS = 100
ROOM = 0.75  # share of vm.max_map_count a prepared set may fill (the loop, llguidance and later loads need the rest)
STOP = 0.9  # share at which compiling stops before the process could die
DEFAULT_MAX_MAP_COUNT = 65530  # Linux's default, where /proc/sys/vm/max_map_count cannot be read
REDUCE = ("fewer executables: --max-batch (row buckets), --max-model-len (cache buckets), --forced-tokens 0, "
          "--mode incremental; or raise the limit: sysctl -w vm.max_map_count=262144")


def map_limit() -> int:
    """``vm.max_map_count``: the most memory mappings one process may hold."""
    try:
        with open("/proc/sys/vm/max_map_count", encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return DEFAULT_MAX_MAP_COUNT


def mapped() -> int:
    """Memory mappings this process holds now (0 where /proc cannot say)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def estimated_maps(labels: Sequence[str]) -> int:
    """Mappings the executables ``labels`` (``Job`` labels) will hold once loaded, on XLA:CPU."""
    return sum(STEP_MAPS if label.startswith(("step", "prefill")) else ROW_OP_MAPS for label in labels)


def check_room(jobs: Sequence[Job], limit: int | None = None, platform: str | None = None) -> None:
    """Refuses, before anything compiles, a prepared set whose executables would fill more than ``ROOM`` of
    ``limit`` (default ``vm.max_map_count``) with what this process holds already: naming the limit, the count and
    the flags that reduce it, where compiling on would end in LLVM failing to allocate. Only XLA:CPU executables are
    counted (``platform``: default JAX's backend)."""
    if platform is None:
        import jax  # noqa: PLC0415 (the command line imports this module before JAX is needed)

        platform = jax.default_backend()
    if platform != "cpu" or not jobs:
        return
    limit = map_limit() if limit is None else limit
    now, need = mapped(), estimated_maps([label for label, _ in jobs])
    if now + need > ROOM * limit:
        raise RequestError(f"this configuration prepares {len(jobs)} executables, about {need:,} memory mappings on "
                           f"top of the {now:,} this process holds, over {ROOM:.0%} of the limit of {limit:,} "
                           f"(vm.max_map_count) one process may hold; use {REDUCE}")


def compile_all(jobs: Sequence[Job], what: str, progress: bool = True,
                timings: list[tuple[str, float]] | None = None) -> float:
    """Runs every job on ``host_cores()`` threads, the bar on stderr where ``progress``; returns the seconds taken.
    ``timings`` receives each job's (what it readied, its seconds on its thread). A job that fails is raised once the
    others finished (with what it was readying)."""
    if not jobs:
        return 0.0
    from tqdm import tqdm  # noqa: PLC0415

    if timings is not None:
        jobs = [(label, _timed(label, run, timings)) for label, run in jobs]
    began, failed, limit = time.perf_counter(), None, map_limit()
    every = 0.1 if sys.stderr.isatty() else 10.0  # a log file gets a line every 10 s, not every executable
    with (tqdm(total=len(jobs), desc=what, unit="exe", file=sys.stderr, disable=not progress, mininterval=every) as bar,
          concurrent.futures.ThreadPoolExecutor(min(host_cores(), len(jobs)), "jaxspec-prepare") as pool):
        futures = {pool.submit(run): label for label, run in jobs}
        try:
            for future in concurrent.futures.as_completed(futures):
                if future.exception() is not None and failed is None:
                    failed = (futures[future], future.exception())
                bar.update()
                if (now := mapped()) > STOP * limit:
                    raise RequestError(f"preparing stopped at {now:,} memory mappings, near the limit of {limit:,} "
                                       f"(vm.max_map_count) one process may hold; use {REDUCE}")
        except BaseException:  # Ctrl-C, SIGTERM: the jobs not yet started are dropped (the pool's exit would run them)
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    if failed is not None:
        raise RuntimeError(f"preparing {failed[0]} failed: {type(failed[1]).__name__}: {failed[1]}") from failed[1]
    return time.perf_counter() - began


class Beside:
    """Executables readied on host threads while the loop runs, as the loop asks for them (``add``): what a loop can
    start without (auto's speculative members, each worth loading only where the tokens left can repay it) need not
    hold back its first token. On a device host the cores are idle while the device steps; one core is left to the
    loop's own host work. ``stop`` drops the jobs not started (those in hand finish)."""

    def __init__(self, on_ready: Callable[[str, float], None] | None = None) -> None:
        self.ready: list[tuple[str, float]] = []  # (what, seconds) readied, in order
        self.failed: list[tuple[str, BaseException]] = []  # jobs that raised: their member stays out of reach
        self._todo: "queue.SimpleQueue[Job]" = queue.SimpleQueue()
        self._stop = threading.Event()
        self._on_ready = on_ready
        self._threads: list[threading.Thread] = []
        self._size = max(1, host_cores() - 1)

    def add(self, job: Job) -> None:
        """Queues one job (its thread started at the first)."""
        self._todo.put(job)
        if len(self._threads) < self._size:
            thread = threading.Thread(target=self._work, name=f"jaxspec-beside-{len(self._threads)}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                label, run = self._todo.get(timeout=0.1)
            except queue.Empty:
                continue
            if self._stop.is_set():
                return
            began = time.perf_counter()
            try:
                run()
            except BaseException as exc:  # noqa: BLE001 — one member's load must not end the loop that runs without it
                self.failed.append((label, exc))
                warn_once(f"beside {label}", f"readying {label} beside the loop failed ({type(exc).__name__}: {exc}); "
                                             "the loop runs on without it")
                continue
            seconds = time.perf_counter() - began
            self.ready.append((label, seconds))
            if self._on_ready is not None:
                self._on_ready(label, seconds)

    def stop(self, wait: bool = True) -> None:
        """Drops the jobs not started; ``wait``: waits for those in hand."""
        self._stop.set()
        for thread in self._threads if wait else ():
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join()


def _timed(label: str, run: Callable[[], Any], timings: list[tuple[str, float]]) -> Callable[[], Any]:
    def timed() -> Any:
        began = time.perf_counter()
        try:
            return run()
        finally:
            timings.append((label, time.perf_counter() - began))  # list.append: atomic across the pool's threads

    return timed


def describe_timings(timings: Sequence[tuple[str, float]], slowest: int = 3) -> str:
    """Where preparing went, in one line: count and seconds per kind of executable (a label's words before its first
    size: "step ssm", "prefill", "re-layout"), the costliest first, then the ``slowest`` jobs."""
    kinds: dict[str, list[float]] = {}
    for label, seconds in timings:
        kind = re.sub(r"\s+(of\s+)?\d.*$", "", label.split(",")[0])
        kinds.setdefault(kind, []).append(seconds)
    order = sorted(kinds.items(), key=lambda kv: -sum(kv[1]))
    parts = [f"{kind} {len(s)} in {sum(s):.1f} s" for kind, s in order]
    worst = sorted(timings, key=lambda ls: -ls[1])[:slowest]
    return "; ".join(parts) + " (slowest: " + "; ".join(f"{label} {seconds:.2f} s" for label, seconds in worst) + ")"


def abstract(tree: Any) -> Any:
    """``tree`` with every array replaced by its shape, dtype, weak type and placement: what compiling for it reads,
    without holding its memory (a state of every bucket at once would not fit)."""
    import jax  # noqa: PLC0415 (the command line imports this module before JAX is needed)

    def spec(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type)
        return x

    return jax.tree_util.tree_map(spec, tree)
