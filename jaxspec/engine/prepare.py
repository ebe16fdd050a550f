"""Readying executables before any request: a known, bounded set compiled (or loaded) on the host's cores.

``BatchEngine.prepare`` lists what a loop can reach (every step, prefill chunk, row operation and the prefix
cache's copies at every bucket); ``compile_all`` readies such a list on a pool of ``host_cores()`` threads (a trace
holds the interpreter, XLA's compile does not), with a progress bar that says what, how many and how long.
"""

from __future__ import annotations

import concurrent.futures
import sys
import time
from typing import Any, Callable, Sequence

from jaxspec.cache import host_cores

Job = tuple[str, Callable[[], Any]]  # (what it readies, in words; the call that readies it)


def compile_all(jobs: Sequence[Job], what: str, progress: bool = True) -> float:
    """Runs every job on ``host_cores()`` threads, the bar on stderr where ``progress``; returns the seconds taken.
    A job that fails is raised once the others finished (with what it was readying)."""
    if not jobs:
        return 0.0
    from tqdm import tqdm  # noqa: PLC0415

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


def abstract(tree: Any) -> Any:
    """``tree`` with every array replaced by its shape, dtype, weak type and placement: what compiling for it reads,
    without holding its memory (a state of every bucket at once would not fit)."""
    import jax  # noqa: PLC0415 (the command line imports this module before JAX is needed)

    def spec(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type)
        return x

    return jax.tree_util.tree_map(spec, tree)
