"""Readying what a scheduling loop can reach before its first request (``prepare``), and listing it without
readying anything (``prepared_set``): every bucket's members (``jaxspec.engine.policy.planner.Planner``), the prefill
chunks, the row operations and re-layouts (``jaxspec.engine.device.executor.Executor``), compiled or loaded; under
auto each bucket's members measured, or, where this machine recorded their costs, readied beside the loop or (a job on
the CPU backend) before it as its tokens can repay them."""

from __future__ import annotations

import sys
import time
from typing import Callable, Sequence

import jax

from jaxspec.cache import STATS
from jaxspec.config import bucket
from jaxspec.decoding import sampling
from jaxspec.engine.device.prepare import Job, describe_timings
from jaxspec.engine.loop import Loop


def prepared_set(loop: Loop, warps: Sequence[sampling.WarpSpec] | None = None, grammar: bool = False,
                 callbacks: bool = True, longest: int | None = None) -> list[Job]:
    """Everything ``prepare`` with these arguments readies (every bucket's members, prefills, row operations and
    re-layouts) that is not ready yet, listed from shapes alone (``jax.eval_shape``): nothing compiles or is
    allocated, so its size can be read at any configuration."""
    warps = tuple(warps or sampling.BATCH_WARPS)
    buckets = [(w, r, c) for w in warps for r in loop.row_buckets for c in loop.capacity_buckets]
    return loop.executor.listed(loop.planner.step_jobs(buckets, grammar, callbacks),
                                loop.chunks.reachable(longest), loop.row_buckets, loop.capacity_buckets)


def prepare(loop: Loop, warps: Sequence[sampling.WarpSpec] | None = None, rows: Sequence[int] | None = None,
            capacities: Sequence[int] | None = None, grammar: bool = False, progress: bool = True,
            say: Callable[[str], None] | None = None, longest: int | None = None, callbacks: bool = True,
            beside: bool = False, load_all: bool = False, owed: Sequence[int] | None = None) -> float:
    """Readies every executable the loop can reach before its first request; returns the seconds it took.

    Every (warp x row bucket x capacity bucket)'s members (``Planner.members``; ``grammar``: their grammar steps
    too), each staging capacity's prefill chunks (the chunk search's next size included), every bucket's row
    bookkeeping and re-layouts, the prefix cache's copies: compiled on the host's cores or loaded from the
    executable store, then under auto each bucket's members measured (cached per machine). Defaults: every
    batch warp, row bucket and capacity bucket. ``progress`` shows the bars on stderr; ``say`` hears, where
    anything compiled fresh, that this machine was prepared and how long it took (later starts load it).
    ``longest``: the longest prompt of a job known ahead (``jaxspec generate``): its prefills stop at the chunk
    size that holds it (``ChunkSizer.reachable``); None (a server): every size the loop may feed. ``callbacks``
    False leaves out the grammar steps of SSM drafts (their masks come from a host callback: no store keeps them,
    so every start would compile them again). ``beside``: under auto, where every member's cost at these buckets
    is recorded on this machine already (nothing to measure), only the plain step is readied here and the other
    members on host threads while the first requests run (``Beside``; the chooser takes each up once loaded),
    each where the tokens left can repay its load, or (``load_all``: a server) every one at once; a grammar's
    steps are readied here with the plain step's, where ``callbacks`` is False (no SSM draft's grammar step).
    ``owed``: each request's new tokens, for a job known ahead: where the device is this host's own cores (the CPU
    backend), loading beside the loop would take from its decoding, so the members of the row bucket the job starts
    at that its tokens can repay are loaded here instead (``Planner.load_for_job``), each step of that bucket runs
    once, and what that adds to start-up is said apart.
    """
    began, fresh = time.perf_counter(), STATS.fresh_compiles
    if grammar:
        loop.check_structured()
    warps = tuple(warps or sampling.BATCH_WARPS)
    rows, caps = tuple(rows or loop.row_buckets), tuple(capacities or loop.capacity_buckets)
    buckets = [(w, r, c) for w in warps for r in rows for c in caps]
    sizes = loop.chunks.reachable(longest)  # the chunk search's next size too; a job's: up to its longest prompt
    timings: list[tuple[str, float]] = []
    defer = (beside and not (grammar and callbacks) and loop.planner.loader is None and jax.process_count() == 1
             and not loop.sync.fresh_costs and loop.planner.known(buckets))
    told = (lambda text: print(f"[jaxspec] {text}", file=sys.stderr, flush=True)) if progress else loop.verbose
    listed = loop.executor.prepare(loop.planner.step_jobs(buckets, grammar, callbacks, plain=defer), sizes, rows,
                                   caps, progress, timings, told)
    if loop.verbose is not None and timings:
        loop.verbose(f"prepared {listed} executables in {time.perf_counter() - began:.1f} s: "
                     f"{describe_timings(timings)}")
    loop.planner.measure(buckets, progress)  # their steps compiled above; under auto each measured
    if defer:  # every cost read above from this machine's records: members load beside the loop where they pay
        loop.planner.defer(buckets, timings, loop.verbose, eager=load_all)
        if owed is not None and not load_all:
            _ready_job(loop, buckets, owed, progress, told)
    loop.prepared = True
    seconds = time.perf_counter() - began
    made = STATS.fresh_compiles - fresh
    if made and say is not None:
        say(f"prepared this machine for {len(buckets)} step bucket(s) in {seconds:.1f} s ({listed} "
            f"executables, {made} compiled fresh); later starts load what the executable store kept")
    return seconds


def _ready_job(loop: Loop, buckets: list, owed: Sequence[int], progress: bool,
               told: Callable[[str], None] | None) -> None:
    """A job's start under auto with its members deferred (``prepare``'s ``owed``): at the row bucket it starts at,
    on the CPU backend the members its tokens can repay are loaded now (``Planner.load_for_job``); then every step
    ready there runs once on a throwaway state, so no request pays an executable's first run. Said apart."""
    began, tokens = time.perf_counter(), sum(owed)
    rows_now = bucket(min(len(owed), loop.row_buckets[-1]), loop.row_buckets)
    cpu = jax.default_backend() == "cpu"
    loaded = loop.planner.load_for_job(tokens, rows_now, progress)[0] if cpu else 0
    ran = sum(loop.engine.first_runs(w, c, r, loop.planner.members(w, r)) for w, r, c in buckets if r == rows_now)
    if told is not None and (loaded or ran):
        told(f"auto's start-up for this job's {tokens} tokens: {loaded} speculative step(s) loaded (the ones they "
             f"can repay at {rows_now} row(s)), {ran} first run(s), {time.perf_counter() - began:.1f} s")
