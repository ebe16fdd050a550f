"""The device side of the loop: the batched decoding state, the staging row, and the executables that change them.

``Executor`` owns the runner (its parameters and steps) and every executable of the loop's row operations; each
public method is one device operation the scheduler's decisions call for (prepare, prefill a chunk, insert, step
of a family member, read, release, move, re-layout, the prefix cache's cut and paste), after JetStream's engine API
(``prefill`` / ``insert`` / ``generate``) and vLLM's EngineCore. It decides nothing: which row, which bucket, which
member and when are the scheduler's and the planner's.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding import constrain, ngram, sampling
from jaxspec.decoding.step import (DecodeConfig, DecodeState, StepOutput, insert_row, move_row, prefill_row, resize,
                                   set_inactive)
from jaxspec.engine.device.executables import Stored
from jaxspec.engine.device.prefix import committed, cut_block, paste_block
from jaxspec.engine.device.prepare import Job, Ready, check_room, compile_all, describe_set, loads, timed_means
from jaxspec.engine.device.runner import ModelRunner, check_fits
from jaxspec.engine.policy.scheduler import IterationPlan
from jaxspec.parallel.sharding import fetch, pinned
from jaxspec.request import SamplerParams, seed_words


def _put(v: int) -> jax.Array:
    """A row index or slot on the device, as every row operation takes it."""
    return jax.device_put(np.int32(v))


def _neighbours(buckets: Sequence[int], b: int) -> list[int]:
    """The buckets beside ``b`` in ``buckets`` (ascending): one smaller and one larger, where they exist."""
    if b not in buckets:
        return []
    i = buckets.index(b)
    return [buckets[j] for j in (i - 1, i + 1) if 0 <= j < len(buckets)]


class Executor:
    """The batched state (``rows`` x ``capacity``) and the staging row (``staging_capacity``), and what runs on them.

    ``row_buckets`` and ``capacity_buckets`` are the layouts the state takes (the first of each at the start); a
    re-layout moves one bucket in one dimension at a time, so the prepared set holds a few re-layouts per bucket
    (not one for every pair) and a larger move chains them. ``prefix``: the prefix cache is on (its cut and paste
    are prepared with the rest).
    """

    def __init__(self, runner: ModelRunner, row_buckets: Sequence[int], capacity_buckets: Sequence[int],
                 prefix: bool) -> None:
        self.runner = runner
        self.row_buckets, self.capacity_buckets = tuple(row_buckets), tuple(capacity_buckets)
        rows, capacity = self.row_buckets[0], self.capacity_buckets[0]
        self.prefix = prefix
        self.vocab = runner.llm.cfg.vocab_size
        self.rows, self.capacity = rows, capacity
        self.state = runner.init_state(rows, capacity, sampling.MIXED, active=False)
        self.staging_capacity = capacity  # the staging row's own bucket: its prompt's, at least the rows'
        self.staging_state = runner.init_state(1, capacity, sampling.MIXED, active=False)
        self.resizes = 0  # state re-layouts (bucket changes)
        self._spare: tuple[DecodeState, int] | None = None  # a second staging row, for prompts admitted beside
        self._compiled: dict = {}
        self.prefill_ready: set[tuple[int, int]] = set()  # (chunk size, staging capacity) compiled by ``prepare``
        self._prefix_ready: set[int] = set()  # staging capacities whose cut and paste are compiled
        self._no_proposal: dict[tuple[int, int], tuple[jax.Array, jax.Array]] = {}

    # -- executables --------------------------------------------------------------------
    def _prefill_cfg(self) -> DecodeConfig:
        cfg = next(iter(self.runner.family(sampling.MIXED).values()))
        return dataclasses.replace(cfg, topologies=(None,) * len(cfg.topologies), tree_budget=None, ngram_depth=0)

    def fn(self, name: str) -> Stored:
        """The row operation ``name`` (``prefill``, ``insert``, ``move``, ``retire``, ``cut``, ``committed``,
        ``paste``): one ``Stored`` executable set, loaded from disk as the steps are."""
        if name not in self._compiled:
            e, cfg = self.runner, self._prefill_cfg()
            ssm_fwds = tuple(e.ssm_forwards[g.members[0]] for g in cfg.ssm_groups)
            if name == "prefill":
                def fn(llm_params, ssm_params, staged, tokens, start, count, last, seed, values, first_mask=None):
                    e.count_trace(f"prefill of {tokens.shape[1]} tokens", staged.llm_cache)
                    return pinned(prefill_row, e.mesh)(cfg, e.forward, ssm_fwds, llm_params, ssm_params, staged,
                                                       jnp.int32(0), tokens, start, count, last, seed, values,
                                                       first_mask)

                self._compiled[name] = Stored(fn, {"what": "prefill", "cfg": repr(cfg), **e.identity()}, fixed=2,
                                              donate_argnums=(2,))
            else:
                def insert(state, staged, slot):
                    return insert_row(cfg, state, staged, slot)

                fns = {"insert": (pinned(insert, e.mesh), (0,)), "move": (pinned(move_row, e.mesh), (0,)),
                       "retire": (pinned(set_inactive, e.mesh), (0,)),
                       # the prefix cache's copies (one program serves the staging row's cut and a live row's)
                       "cut": (cut_block, ()), "committed": (committed, ()), "paste": (pinned(paste_block, e.mesh), (0,))}
                if name not in fns:
                    raise KeyError(name)
                fn, donate = fns[name]
                self._compiled[name] = Stored(fn, {"what": name, "cfg": repr(cfg), **e.identity()},
                                              donate_argnums=donate)
        return self._compiled[name]

    def _resizer(self, rows: int, capacity: int) -> Stored:
        """The executable laying a state out for ``rows`` x ``capacity`` (one per source shape)."""
        key = ("resize", rows, capacity)
        if key not in self._compiled:
            self._compiled[key] = Stored(pinned(lambda s: resize(s, rows, capacity), self.runner.mesh),
                                         {"what": "resize", "rows": rows, "capacity": capacity,
                                          "cfg": repr(self._prefill_cfg()), **self.runner.identity()})
        return self._compiled[key]

    # -- prepare ------------------------------------------------------------------------
    def prepare(self, steps: Sequence[Job], sizes: Sequence[int], rows: Sequence[int], capacities: Sequence[int],
                progress: bool = True, timings: list[tuple[str, float]] | None = None,
                say: Callable[[str], None] | None = None) -> int:
        """Readies ``steps`` (the planner's members at each bucket), the prefill of every chunk of ``sizes`` into a
        staging row of each of ``capacities``, every bucket's row operations and re-layouts, and the prefix cache's
        copies: compiled on the host's cores or loaded from the executable store. Returns how many executables were
        listed (those not ready yet); ``timings`` receives each one's seconds (``compile_all``); ``say`` hears the
        set's size and expected time before anything compiles (``describe_set``). A set that would not fit in this
        process's memory mappings is refused before anything compiles (``check_room``)."""
        from jaxspec.engine.device import costs  # noqa: PLC0415

        jobs = self.listed(steps, sizes, rows, capacities)
        check_room(jobs)
        if jobs:
            loaded, record = loads(jobs), {"what": "prepare-seconds", **self.runner.identity()}
            before = costs.load(record)
            if say is not None:
                say(f"preparing {describe_set(jobs, loaded, before)}")
            timings = [] if timings is None else timings
            start = len(timings)
            compile_all(jobs, "preparing executables", progress, timings)
            costs.load_or_measure(record, lambda: timed_means(jobs, loaded, timings[start:], before), refresh=True)
        self.prepare_prefix(capacities)
        return len(jobs)

    def listed(self, steps: Sequence[Job], sizes: Sequence[int], rows: Sequence[int],
               capacities: Sequence[int]) -> list[Job]:
        """What ``prepare`` readies, not ready yet: ``steps``, the prefills, the row operations (nothing compiles)."""
        return [*steps, *self.prefill_jobs(sizes, capacities), *self.row_jobs(rows, capacities)]

    def prefill_jobs(self, sizes: Sequence[int], capacities: Sequence[int]) -> list[Job]:
        """The prefill of every chunk of ``sizes`` that fits into a staging row of each of ``capacities`` slots."""
        fn, jobs = self.fn("prefill"), []
        for cap in capacities:
            staged = self.runner.abstract_state(1, cap)
            for size in (b for b in sizes if b <= cap):
                if (size, cap) in self.prefill_ready:
                    continue
                call = self.chunk_args(np.zeros((1, size), np.int32), 0, size, True, 0, staged=staged)
                jobs.append((f"prefill of {size} tokens, {cap} slots",
                             Ready(fn, call, then=lambda key=(size, cap): self.prefill_ready.add(key))))
        return jobs

    def row_jobs(self, rows: Sequence[int], capacities: Sequence[int]) -> list[Job]:
        """Each bucket's row bookkeeping: a prompt's insertion, a retirement (the last row moved into the freed one,
        or the last row ended), the prefix cache's reads of a finishing row, and its re-layouts to the neighbouring
        buckets (``relayouts``), the staging row's included."""
        calls: dict[tuple, tuple[str, Stored, tuple]] = {}  # one per executable (the staging row's re-layouts are
        for cap in capacities:                               # a 1-row state's)
            staged = self.runner.abstract_state(1, cap)
            for r2, to in self.relayouts(1, cap, rows_too=False):
                calls[("resize", 1, cap, r2, to)] = (f"staging re-layout to {to} slots", self._resizer(r2, to), (staged,))
            for r in rows:
                state = self.runner.abstract_state(r, cap)
                for name, args in [("insert", (state, staged, _put(0))), ("move", (state, _put(0), _put(0))),
                                   ("retire", (state, _put(0)))]:
                    calls[(name, r, cap)] = (f"{name}, {r} row(s) x {cap} slots", self.fn(name), args)
                if self.prefix:
                    calls[("cut", r, cap)] = (f"cut, {r} row(s) x {cap} slots", self.fn("cut"), (state, _put(0), _put(0)))
                    if state.ssm_caches:
                        calls[("committed", r, cap)] = (f"committed, {r} row(s) x {cap} slots",
                                                        self.fn("committed"), (state, _put(0)))
                for r2, c2 in self.relayouts(r, cap):
                    calls[("resize", r, cap, r2, c2)] = (f"re-layout {r} -> {r2} row(s) x {cap} -> {c2} slots",
                                                         self._resizer(r2, c2), (state,))
        return [(what, Ready(fn, args)) for what, fn, args in calls.values() if not fn.has(*args)]

    def relayouts(self, rows: int, capacity: int, rows_too: bool = True) -> list[tuple[int, int]]:
        """The layouts a state of ``rows`` x ``capacity`` may move to in one re-layout: the neighbouring capacity
        buckets and (``rows_too``) row buckets, one dimension at a time."""
        out = [(rows, c) for c in _neighbours(self.capacity_buckets, capacity)]
        return out + [(r, capacity) for r in _neighbours(self.row_buckets, rows)] if rows_too else out

    def _path(self, rows: int, capacity: int, to_rows: int, to_capacity: int) -> list[tuple[int, int]]:
        """The layouts a re-layout from ``rows`` x ``capacity`` to ``to_rows`` x ``to_capacity`` passes through, one
        neighbouring bucket at a time, shrinks first (the copies never hold more than either end); none where they
        are one layout, the target alone where either end lies off the buckets."""
        rb, cb = self.row_buckets, self.capacity_buckets
        if (rows, capacity) == (to_rows, to_capacity):
            return []
        if rows not in rb or to_rows not in rb or capacity not in cb or to_capacity not in cb:
            return [(to_rows, to_capacity)]
        r, c, r_to, c_to = rb.index(rows), cb.index(capacity), rb.index(to_rows), cb.index(to_capacity)
        path = []
        for grow in (False, True):
            while (r < r_to) == grow and r != r_to:
                r += 1 if grow else -1
                path.append((rb[r], cb[c]))
            while (c < c_to) == grow and c != c_to:
                c += 1 if grow else -1
                path.append((rb[r], cb[c]))
        return path

    def prepare_prefix(self, capacities: Sequence[int]) -> None:
        """The prefix cache's cut and paste of a staging row of each capacity (the paste compiled for the block a cut
        of a row of its own returns)."""
        for cap in capacities:
            if self.prefix and cap not in self._prefix_ready:
                staged = self.runner.init_state(1, cap, sampling.MIXED, active=False)
                block = self.fn("cut").compiled(staged, _put(0))(staged, _put(0))
                self.fn("paste").compiled(staged, block, _put(0))
                self._prefix_ready.add(cap)

    def ready_prefix(self) -> None:
        """The prefix cache's cut and paste compile with the staging capacity's first chunk where ``prepare`` did not
        compile them (a hit later compiles nothing): a block cut and pasted back where it was."""
        if self.prefix and self.staging_capacity not in self._prefix_ready:
            self._prefix_ready.add(self.staging_capacity)
            at = _put(0)
            self.staging_state = self.fn("paste")(self.staging_state, self.fn("cut")(self.staging_state, at), at)

    # -- the state's layout -------------------------------------------------------------
    def resize(self, rows: int, capacity: int) -> None:
        """Lays the batched state out for ``rows`` x ``capacity`` (its rows' contents kept)."""
        for r, c in self._path(self.rows, self.capacity, rows, capacity):
            self.state = self._resizer(r, c)(self.state)
            self.rows, self.capacity = r, c
            self.resizes += 1

    def resize_staging(self, capacity: int) -> None:
        """Lays the staging row out for ``capacity`` slots (a shrink cuts slots [capacity, ...))."""
        for _, c in self._path(1, self.staging_capacity, 1, capacity):
            self.staging_state = self._resizer(1, c)(self.staging_state)
            self.staging_capacity = c

    def swap_staging(self, other: tuple[DecodeState, int] | None = None) -> tuple[DecodeState, int]:
        """Puts ``other`` (a staging row and its capacity; None: the spare row, made at the rows' capacity) in the
        staging row's place and returns the one it replaced: how a short prompt enters beside a long one."""
        if other is None:
            if self._spare is None:
                self._spare = (self.runner.init_state(1, self.capacity, sampling.MIXED, active=False), self.capacity)
            other, self._spare = self._spare, None
        out = (self.staging_state, self.staging_capacity)
        self.staging_state, self.staging_capacity = other
        return out

    def keep_spare(self, spare: tuple[DecodeState, int]) -> None:
        """Keeps ``spare`` as the second staging row for the next prompt admitted beside."""
        self._spare = spare

    def reset(self) -> None:
        """A fresh, empty state of the current bucket (after a failed step: the old one is not trusted)."""
        self.state = self.runner.init_state(self.rows, self.capacity, sampling.MIXED, active=False)

    # -- a request's way through --------------------------------------------------------
    def chunk_args(self, tokens: np.ndarray, fed: int, count: int, last: bool, seed: int,
                   values: dict | None = None, first_mask: np.ndarray | None = None,
                   staged: DecodeState | None = None) -> tuple:
        """The prefill executable's arguments for one chunk into staging state ``staged`` (default: the staging row):
        ``tokens`` [1, size] (its first ``count`` real), fed from slot ``fed``; ``values`` the request's sampling
        values (default greedy's); ``first_mask`` [1, words] the first token's grammar mask (default: every token
        allowed)."""
        if values is None:
            values = sampling.row_values([SamplerParams()], self.vocab)
        if first_mask is None:
            first_mask = np.full((1, constrain.words(self.vocab)), -1, np.int32)
        args = jax.device_put((tokens, np.int32(fed), np.int32(count), np.bool_(last), seed_words(seed),
                               values, first_mask))
        return (self.runner.llm_params, self.runner.group_params,
                self.staging_state if staged is None else staged, *args)

    def prefill(self, call: tuple) -> None:
        """Feeds one chunk (``chunk_args``) into the staging row."""
        self.staging_state = self.fn("prefill")(*call)

    def timed_prefill(self, call: tuple, after: StepOutput | None = None) -> float:
        """Feeds one chunk timed alone (its executable ready, ``after`` and the chunk before it done first); returns
        its seconds."""
        exe = self.fn("prefill").compiled(*call)
        if after is not None:
            jax.block_until_ready(after.tokens)
        jax.block_until_ready(call[2].root)
        began = time.perf_counter()
        self.staging_state = exe(*call)
        jax.block_until_ready(self.staging_state.root)
        return time.perf_counter() - began

    def wait_staging(self) -> None:
        """Blocks until the staging row's chunks are done (a paced chunk is timed to its end)."""
        jax.block_until_ready(self.staging_state.root)

    def insert(self, row: int) -> int:
        """Moves the staged prompt into row ``row`` of the batched state; returns its first token (the prefill's)."""
        self.state = self.fn("insert")(self.state, self.staging_state, _put(row))
        try:
            return int(fetch(self.staging_state.root)[0])
        except BaseException:  # the row went live on the device but the host cannot track it: take it back
            self.release(row)
            raise

    def release(self, row: int) -> None:
        """Ends row ``row`` (the last live one)."""
        self.state = self.fn("retire")(self.state, _put(row))

    def move(self, src: int, dst: int) -> None:
        """Moves row ``src`` into row ``dst`` (a retired row's place taken by the last live row)."""
        self.state = self.fn("move")(self.state, *jax.device_put((np.int32(src), np.int32(dst))))

    def proposal_arrays(self, proposals: list[list[int]], depth: int) -> tuple[jax.Array, jax.Array]:
        """Device arrays (tokens [B, D], count [B]) of the rows' proposals for a chain of ``depth`` tokens (the n-gram's,
        or a grammar's forced one); the empty one is sent once per B and D."""
        if any(proposals):
            return jax.device_put(ngram.proposal_arrays(proposals, depth))
        if (len(proposals), depth) not in self._no_proposal:
            self._no_proposal[len(proposals), depth] = jax.device_put(ngram.proposal_arrays(proposals, depth))
        return self._no_proposal[len(proposals), depth]

    def execute(self, plan: IterationPlan) -> StepOutput:
        """Launches the iteration ``plan`` decided on every row: its rows' proposals and forced chains (and host
        masks) sent, every write checked to fit the capacity first; returns its outputs (device arrays, not read:
        the launch returns before the device is done)."""
        cfg, rows = plan.cfg, plan.rows
        for _, s in plan.live:
            check_fits(s.committed + plan.ahead + cfg.num_nodes, self.capacity, "a decoding step")
        arrays = self.proposal_arrays(plan.proposals if cfg.ngram_depth else [[]] * rows,  # no chain: sent once
                                      cfg.ngram_depth)
        if cfg.forced_depth:
            arrays = (*arrays, *self.proposal_arrays(plan.chains, cfg.forced_depth))
        extra = {}
        if cfg.host_masks:  # one executable serves rows with and without a grammar: all ones where none has one
            extra["chain_masks"] = (jax.device_put(plan.chain_masks) if plan.chain_masks is not None
                                    else self.runner.no_masks(rows, 1 + cfg.forced_depth + cfg.ngram_depth))
        self.state, out = self.runner.step(cfg, self.state, *arrays, **extra)
        return out

    @staticmethod
    def read(out: StepOutput) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """An iteration's tokens [B, P], counts [B] and accepted depth per source [B, sources], on the host."""
        return fetch((out.tokens, out.num, out.source_depth))

    @staticmethod
    def wait(out: StepOutput) -> None:
        """Blocks until the iteration ``out`` is done (a chunk is timed alone)."""
        jax.block_until_ready(out.tokens)

    # -- the prefix cache's copies ------------------------------------------------------
    def committed(self, row: int) -> int:
        """Tokens every cache of row ``row`` holds (an SSM may lag the LLM there); waits for the iteration in flight."""
        return int(fetch(self.fn("committed")(self.state, _put(row))))

    def cut(self, start: int, row: int | None = None) -> object:
        """The block of K/V (every cache's) at slots [start, start + BLOCK) of the staging row (``row`` None) or of
        live row ``row``."""
        if row is None:
            return self.fn("cut")(self.staging_state, _put(start))
        return self.fn("cut")(self.state, _put(start), _put(row))

    def paste(self, block: object, start: int) -> None:
        """Writes a cached block into the staging row at slot ``start``."""
        self.staging_state = self.fn("paste")(self.staging_state, block, _put(start))

