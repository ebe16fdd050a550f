"""Readying executables before any request: a known, bounded set compiled (or loaded) on the host's cores.

``BatchEngine.prepare`` lists what a loop can reach (every step, prefill chunk, row operation and the prefix
cache's copies at every bucket); ``compile_all`` readies such a list on a pool of ``host_cores()`` threads (a trace
holds the interpreter, XLA's compile does not), with a progress bar that says what, how many and how long.
"""

from __future__ import annotations

import concurrent.futures
import re
import sys
import time
from typing import Any, Callable, Sequence

from jaxspec.cache import host_cores

Job = tuple[str, Callable[[], Any]]  # (what it readies, in words; the call that readies it)


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
    began, failed = time.perf_counter(), None
    every = 0.1 if sys.stderr.isatty() else 10.0  # a log file gets a line every 10 s, not every executable
    with (tqdm(total=len(jobs), desc=what, unit="exe", file=sys.stderr, disable=not progress, mininterval=every) as bar,
          concurrent.futures.ThreadPoolExecutor(min(host_cores(), len(jobs)), "jaxspec-prepare") as pool):
        futures = {pool.submit(run): label for label, run in jobs}
        try:
            for future in concurrent.futures.as_completed(futures):
                if future.exception() is not None and failed is None:
                    failed = (futures[future], future.exception())
                bar.update()
        except BaseException:  # Ctrl-C, SIGTERM: the jobs not yet started are dropped (the pool's exit would run them)
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    if failed is not None:
        raise RuntimeError(f"preparing {failed[0]} failed: {type(failed[1]).__name__}: {failed[1]}") from failed[1]
    return time.perf_counter() - began


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
