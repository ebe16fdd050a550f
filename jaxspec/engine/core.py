"""The one scheduling loop: continuous batching of every request, one jitted iteration for all of them.

``jaxspec generate`` (every ``--max-batch``, 1 included), ``Engine.generate``, the benches
and ``jaxspec serve`` all run requests through ``EngineCore``. The device state (KV
caches, histories, roots, one PRNG key and sampling values per row, an active mask) is
donated to every call. Its shape follows the work: the live rows are kept contiguous
(a retired row's place is taken by the last live row) and the state is laid out for
the smallest batch bucket (1, 2, 4, ... ``max_batch``) holding them and, where attention
scores every cache slot (``dense``), the smallest capacity bucket (256, 512, ... below
``max_model_len``, then it plus a step's slack) holding their caches, so one request in a 16-slot
server costs what it costs alone; where it reads only filled slots (``blocks``, the CPU's)
there is one capacity, ``max_capacity`` (docs/architecture.md gives the measurements). Each
(bucket, tree, warp) is one executable, every one of them compiled or loaded by ``prepare``
before the first request (the JetStream / MaxText ``prefill`` / ``insert`` / ``generate`` split):

* admission: a waiting request is prefilled chunk by chunk into a one-row staging state laid
  out for its own prompt (the live rows keep their buckets and executables meanwhile), in
  chunk sizes found on the device (``jaxspec.engine.policy.prefill``), paced beside decoding rows
  (``prefill_stall``), then inserted into a free slot;
* the iteration: ONE jitted step for every live row — draft, every slot's tree packed into one
  LLM pass, accept, commit — of the family member the cost model picks for the current
  batch (``jaxspec.engine.policy.auto``: expected tokens summed over the active slots per second of
  that member at this bucket, so speculation shrinks to nothing where it stops paying);
* retirement: EOS, a stop string, the token limit or a cancellation frees the slot.

Greedy and sampled requests share one executable (a greedy row is a one-hot distribution,
which multi-step speculative sampling verifies exactly as argmax); each iteration runs the
warp its rows need (``sampling.batch_warp``: greedy alone, or every sampling stage, whose top-k / top-p sort
of the vocabulary at every tree node runs only in iterations where a sampled row asks for it). A request's
output depends on its own seed only: each slot draws from its own key.

Which members each bucket runs, at what measured cost, is ``jaxspec.engine.policy.planner.Planner``. The loop is the
engine contract's driver: the host-only ``jaxspec.engine.policy.scheduler.Scheduler`` holds the queue, the rows' owners,
their layout and the pacing, and decides; ``jaxspec.engine.device.executor.Executor`` owns the device state and the
executables and carries the decisions out; this module joins them: admission (``jaxspec.engine.admission``), each
iteration planned (``IterationPlan``), executed (``Executor.execute``) and accounted, emission and retirement.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import sys
import threading
import time
from typing import Callable, Iterator, Sequence

import jax
import numpy as np

from jaxspec.cache import STATS
from jaxspec.decoding import sampling
from jaxspec.decoding.step import StepOutput
from jaxspec.engine.admission import Admission
from jaxspec.engine.policy.auto import TreeChooser
from jaxspec.engine.clock import LoopClock
from jaxspec.engine.device.executor import Executor
from jaxspec.engine.policy.planner import Planner
from jaxspec.engine.policy.prefill import ChunkSizer
from jaxspec.engine.device.prepare import Job, describe_timings
from jaxspec.engine.device.prefix import PrefixCache, default_bytes
from jaxspec.engine.device.runner import RequestError, ModelRunner
from jaxspec.engine.policy.scheduler import (IterationPlan, IterationStats, Scheduler, Slot, Staging, Ticket, batch_buckets,
                                      capacity_buckets, cut_tokens, deliver, reason_of)
from jaxspec.engine.stops import check_stops
from jaxspec.errors import FailureLog
from jaxspec.request import Event, Generation, Request, finished
from jaxspec.speculators.ngram import NGramIndex
from jaxspec.structured import GrammarError

log = logging.getLogger(__name__)

# What the span between two reads of the loop's iterations went on (``-v``): blocked on the device for the tokens;
# proposing on the host (the n-gram's lookup, a grammar's forced chains; an SSM drafts inside the device step);
# the loop's other host work (choosing, launching, reading, emitting); and the rest (admission, prefill chunks,
# other threads).
WANT_EVERY = 4  # iterations between two looks at which members beside the loop would pay
DEFAULT_MAX_MODEL_LEN = 1024  # the longest request a server holds (prompt + new tokens)
def filled_only(engine: ModelRunner) -> bool:
    """Whether the LLM's attention reads only a cache's filled slots (``blocks`` over the unrolled layout, where the
    cache is written in place): a step's cost then follows what its rows hold, not the capacity."""
    return engine.lowering.attention == "blocks" and engine.unroll and not engine.stacked


class LoopSync:
    """What the processes of a multi-process run agree on each iteration; a single process agrees with itself.

    ``exchange`` runs before every iteration (process 0 announces its admissions, cancellations
    and whether to stop; the others replay them); ``agree_pick`` makes auto's pick process 0's.
    ``fresh_costs``: every process measures auto's costs itself (the measuring steps are
    collectives, so no process may skip them by reading a cached calibration). ``local``:
    this process's own submissions and cancellations take effect at once (nothing to announce).
    ``failed`` hears every failure inside the loop: one process fails the requests concerned and
    goes on; in a multi-process run no process may go on alone, so the run ends.
    """

    fresh_costs = False
    local = True
    shared = False  # several processes run this loop: every decision must be the same in each

    def exchange(self, batch: "EngineCore", stopping: bool) -> bool:
        return stopping

    def agree_pick(self, name: str, names: list[str]) -> str:
        return name

    def agree_int(self, value: int) -> int:
        """Process 0's ``value`` (a setting every process must share, e.g. the prefix cache's bound)."""
        return value

    def failed(self, what: str, exc: BaseException) -> None:
        """Called before the loop handles a failure locally; a multi-process sync ends the process here."""


class EngineCore:
    """Slots, admission, one jitted iteration for every live row, retirement: the one scheduling loop.

    It drives the engine contract: ``scheduler`` (host-only: queue, rows, layout, pacing) decides and ``executor``
    (device state and executables) carries out; ``planner`` says which member each bucket runs.
    """

    def __init__(
        self,
        engine: ModelRunner,
        max_batch: int = 16,
        max_model_len: int | None = None,
        max_queue: int = 256,
        on_iteration: Callable[[IterationStats], None] | None = None,
        prefill_chunk: int | None = None,
        sync: LoopSync | None = None,
        verbose: Callable[[str], None] | None = None,
        reuse_prefix: bool = True,
        prefill_stall: float | None = None,
        prefix_cache_bytes: int | None = None,
    ) -> None:
        """``sync`` joins a multi-process run (``jaxspec.parallel.distributed``); ``verbose`` hears what compiles when;
        ``reuse_prefix``: a request sharing a prompt prefix with the one staged before it starts after that prefix;
        ``prefill_chunk``: the
        largest prompt chunk (None: found on this device, ``jaxspec.engine.policy.prefill``); ``prefill_stall`` R: while
        requests decode, a prompt's later chunks take at most R times the decoding time (a chunk runs, then the
        decoding rows run alone until they made up R times its seconds; None: one chunk every iteration);
        ``prefix_cache_bytes``: the bound of the prefix cache (``jaxspec.engine.device.prefix``; None: a share of free
        memory, 0: off; off as well without ``reuse_prefix``)."""
        if max_batch < 1:
            raise RequestError(f"--max-batch must be >= 1, got {max_batch}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise RequestError(f"--prefill-chunk must be >= 1, got {prefill_chunk}")
        if prefill_stall is not None and not prefill_stall > 0:
            raise RequestError(f"--prefill-stall must be > 0, got {prefill_stall}")
        if prefill_stall is not None and (sync or LoopSync()).shared:
            raise RequestError("--prefill-stall paces admissions by this process's clock: a multi-process run "
                               "cannot use it (its processes must admit in the same iterations)")
        limit = engine.llm.cfg.max_position_embeddings
        max_model_len = max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN)
        if not 1 < max_model_len <= limit:
            raise RequestError(f"--max-model-len must lie in [2, {limit}] (the model's context), got {max_model_len}")
        if prefix_cache_bytes is not None and prefix_cache_bytes < 0:
            raise RequestError(f"--prefix-cache-gb must be >= 0, got {prefix_cache_bytes / 2**30:g}")
        self.engine = engine
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.max_queue = max_queue
        self.on_iteration = on_iteration
        self.sync = sync or LoopSync()
        self.verbose = verbose
        self.failures = FailureLog(log)  # failures the loop survived, by kind: the first of each logged with its stack
        # the processes of a multi-process run must feed alike: no search there (timings differ per process)
        searched = prefill_chunk is None and jax.process_count() == 1
        self.chunks = ChunkSizer(prefill_chunk, engine.prefill_chunks() if searched else None, search=searched,
                                 save=engine.prefill_chunks if searched else None)
        # most cache slots one iteration writes per row, most tokens it commits (any member, greedy or sampled)
        self._max_nodes, self._max_emit = engine.step_bounds()
        # Every write fits by construction: a row holds < max_model_len committed tokens before a
        # step that writes num_nodes more; a prefill chunk ends within the capacity (``ChunkSizer.size``).
        self.max_capacity = max_model_len + max(self._max_nodes + self._max_emit, self.chunks.sizes[0])
        self.row_buckets = batch_buckets(max_batch)
        self.capacity_buckets = capacity_buckets(self.max_capacity, filled_only(engine), self.max_capacity - max_model_len)
        self.vocab = engine.llm.cfg.vocab_size
        self.scheduler = Scheduler(max_batch, max_queue, self.row_buckets, self.capacity_buckets, self.max_capacity,
                                   self._max_emit + self._max_nodes, prefill_stall)
        self.prefill_stall = prefill_stall
        self._chunk_queued = False  # this iteration's admission queued a prompt chunk before its step
        bound = default_bytes() if prefix_cache_bytes is None else prefix_cache_bytes
        # processes evict alike only under one bound (each pastes what process 0 pastes, in the same programs)
        self.prefix = PrefixCache(self.sync.agree_int(bound) if reuse_prefix else 0)
        self.admission = Admission(self, self.prefix, reuse_prefix)  # staging, prompt chunks, prefix reuse
        self.executor = Executor(engine, self.row_buckets, self.capacity_buckets, bool(self.prefix.max_bytes))
        self.iterations = 0
        self._ran: set[tuple] = set()  # (member, forced depth, rows, capacity) the loop has launched: first runs
        self.planner = Planner(engine, lambda: self.sync)
        self.prepared = False  # ``prepare`` ran: the chunk search probes only sizes it compiled
        self._pending: _InFlight | None = None  # the iteration in flight (host/device overlap)
        self.clock = LoopClock()  # each iteration's span, host and wall seconds, member (``jaxspec.engine.clock``)
        self.overlapped = 0  # iterations dispatched before the previous one's tokens were read

    # -- what the scheduler and the executor hold, as the loop's callers read it ----------
    @property
    def slots(self) -> list[Slot]:
        """Live requests; slots[i] owns row i of the state."""
        return self.scheduler.slots

    @property
    def staging(self) -> Staging | None:
        return self.scheduler.staging

    @staging.setter
    def staging(self, value: Staging | None) -> None:
        self.scheduler.staging = value

    @property
    def state(self):
        """The batched device state (``DecodeState``, rows x capacity)."""
        return self.executor.state

    @property
    def rows(self) -> int:
        return self.executor.rows

    @property
    def capacity(self) -> int:
        return self.executor.capacity

    @property
    def staging_capacity(self) -> int:
        return self.executor.staging_capacity

    @property
    def resizes(self) -> int:
        """State re-layouts (bucket changes)."""
        return self.executor.resizes

    @property
    def prefill_waits(self) -> int:
        """Iterations whose admission waited for the decoding rows (``prefill_stall``)."""
        return self.scheduler.pacer.waits

    def host_report(self) -> list[str]:
        """Where the loop's time went since ``reset_timings`` (``LoopClock.report``); empty before any iteration."""
        return self.clock.report(self.iterations, self.overlapped)

    def reset_timings(self) -> None:
        """Forgets the iterations timed so far (a server's warm-up is not its serving)."""
        self.clock.reset()

    def failed(self, what: str, exc: BaseException) -> None:
        """A failure inside the loop: ``sync.failed`` first (a multi-process run ends there), then, in a run that
        goes on, the first failure of its kind logged with its full stack (``failures``); the caller ends the
        requests concerned with ``reason_of(exc)``."""
        self.sync.failed(what, exc)
        self.failures.report(f"{what}: {type(exc).__name__}", what, exc)

    # -- requests ---------------------------------------------------------------------
    def check(self, req: Request) -> None:
        """Raises RequestError / SamplingError naming what is wrong with ``req``."""
        n = len(req.prompt_ids)
        if n < 1:
            raise RequestError("the prompt is empty")
        if req.max_new_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {req.max_new_tokens}")
        if n + req.max_new_tokens > self.max_model_len:
            limit = self.engine.llm.cfg.max_position_embeddings
            what = (f"the model's context of {limit} tokens" if self.max_model_len == limit
                    else f"--max-model-len {self.max_model_len}")
            raise RequestError(f"prompt of {n} tokens plus {req.max_new_tokens} new tokens exceeds {what}")
        bad = [t for t in req.prompt_ids if not 0 <= t < self.vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary of {self.vocab}")
        check_stops(req.stop_strings)
        sampling.SamplerParams(req.params.temperature, req.params.top_k, req.params.top_p, req.params.seed)
        if req.grammar is not None:
            self._check_structured()
            try:
                self.engine.row_masks().vocab.compile(req.grammar)
            except GrammarError as e:
                raise RequestError(str(e)) from None

    def submit(self, req: Request, on_event: Callable[[Event], None]) -> Ticket:
        """Queues ``req`` (thread-safe); ``on_event`` hears its tokens from the engine thread.

        Submissions wait in ``incoming`` until the loop's next ``sync.exchange`` moves them
        into ``waiting`` (a multi-process run announces them there first).
        """
        self.check(req)
        ticket = Ticket(req)
        self.scheduler.submit(ticket, on_event)
        return ticket

    def queue_depth(self) -> int:
        return self.scheduler.queue_depth()

    def tokens_left(self) -> int:
        """The longest live request's tokens still to come: the iterations its row has left, at most."""
        return self.scheduler.tokens_left()

    # -- what a multi-process run's synchroniser (``jaxspec.engine.lockstep``) asks of the loop -------------
    def live_tickets(self) -> list[Ticket]:
        """Every admitted request's ticket: waiting, being prefilled, decoding."""
        return self.scheduler.live_tickets()

    def take_incoming(self, accept: Callable[[Ticket], bool | None]) -> tuple[list, list]:
        """Takes submissions in order while ``accept`` says True (``Scheduler.take_incoming``)."""
        return self.scheduler.take_incoming(accept)

    def enqueue(self, admitted: Sequence[tuple[Ticket, Callable[[Event], None]]]) -> None:
        """Queues requests for admission as they are (the multi-process run announced them already)."""
        self.scheduler.enqueue(admitted)

    def active_slots(self) -> int:
        return len(self.slots)

    def idle(self) -> bool:
        return self.scheduler.idle()

    def _check_structured(self) -> None:
        """Grammars run on one process (a mesh included): each process would need the rows' matchers and masks."""
        if not self.sync.local:
            raise RequestError("structured output runs in one process for now: drop the multi-process flags")

    # -- prepare ----------------------------------------------------------------------
    def prepared_set(self, warps: Sequence[sampling.WarpSpec] | None = None, grammar: bool = False,
                     callbacks: bool = True, longest: int | None = None) -> list[Job]:
        """Everything ``prepare`` with these arguments readies (every bucket's members, prefills, row operations and
        re-layouts) that is not ready yet, listed from shapes alone (``jax.eval_shape``): nothing compiles or is
        allocated, so its size can be read at any configuration."""
        warps = tuple(warps or sampling.BATCH_WARPS)
        buckets = [(w, r, c) for w in warps for r in self.row_buckets for c in self.capacity_buckets]
        return self.executor.listed(self.planner.step_jobs(buckets, grammar, callbacks),
                                    self.chunks.reachable(longest), self.row_buckets, self.capacity_buckets)

    def prepare(self, warps: Sequence[sampling.WarpSpec] | None = None, rows: Sequence[int] | None = None,
                capacities: Sequence[int] | None = None, grammar: bool = False, progress: bool = True,
                say: Callable[[str], None] | None = None, longest: int | None = None, callbacks: bool = True,
                beside: bool = False, load_all: bool = False, owed: int | None = None) -> float:
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
        ``owed``: the tokens a job's requests ask for, known ahead: where the device is this host's own cores (the
        CPU backend), loading beside the loop would take from its decoding, so the members those tokens can repay
        are loaded here instead (``Planner.load_for_job``), and what that adds to start-up is said apart.
        """
        began, fresh = time.perf_counter(), STATS.fresh_compiles
        if grammar:
            self._check_structured()
        warps = tuple(warps or sampling.BATCH_WARPS)
        rows, caps = tuple(rows or self.row_buckets), tuple(capacities or self.capacity_buckets)
        buckets = [(w, r, c) for w in warps for r in rows for c in caps]
        sizes = self.chunks.reachable(longest)  # the chunk search's next size too; a job's: up to its longest prompt
        timings: list[tuple[str, float]] = []
        defer = (beside and not (grammar and callbacks) and self.planner.loader is None and jax.process_count() == 1
                 and not self.sync.fresh_costs and self.planner.known(buckets))
        told = (lambda text: print(f"[jaxspec] {text}", file=sys.stderr, flush=True)) if progress else self.verbose
        listed = self.executor.prepare(self.planner.step_jobs(buckets, grammar, callbacks, plain=defer), sizes, rows,
                                       caps, progress, timings, told)
        if self.verbose is not None and timings:
            self.verbose(f"prepared {listed} executables in {time.perf_counter() - began:.1f} s: "
                         f"{describe_timings(timings)}")
        self.planner.measure(buckets, progress)  # their steps compiled above; under auto each measured
        if defer:  # every cost read above from this machine's records: members load beside the loop where they pay
            self.planner.defer(buckets, timings, self.verbose, eager=load_all)
            if owed is not None and not load_all:
                self._ready_job(buckets, owed, progress, told)
        self.prepared = True
        seconds = time.perf_counter() - began
        made = STATS.fresh_compiles - fresh
        if made and say is not None:
            say(f"prepared this machine for {len(buckets)} step bucket(s) in {seconds:.1f} s ({listed} "
                f"executables, {made} compiled fresh); later starts load what the executable store kept")
        return seconds

    def _ready_job(self, buckets: list, owed: int, progress: bool, told: Callable[[str], None] | None) -> None:
        """A job's start under auto with its members deferred (``prepare``'s ``owed``): on the CPU backend the
        members its tokens can repay are loaded now (``Planner.load_for_job``); then every step ready at the job's
        buckets runs once on a throwaway state, so no request pays an executable's first run. Said apart."""
        began = time.perf_counter()
        loaded = self.planner.load_for_job(owed, progress)[0] if jax.default_backend() == "cpu" else 0
        ran = sum(self.engine.first_runs(w, c, r, self.planner.members(w, r)) for w, r, c in buckets)
        if told is not None and (loaded or ran):
            told(f"auto's start-up for this job's {owed} tokens: {loaded} speculative step(s) loaded (the ones they "
                 f"can repay), {ran} first run(s), {time.perf_counter() - began:.1f} s")

    @property
    def buckets(self) -> tuple[int, ...]:
        """The prompt chunk sizes fed now, ascending (one prefill executable each; the largest is searched for)."""
        return tuple(b for b in self.chunks.sizes if b <= self.chunks.largest)

    # -- the loop ---------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """The engine loop (its own thread) until ``stop``; then cancels what is in flight."""
        try:
            while True:
                if self.sync.exchange(self, stop.is_set()):
                    break
                if self.idle():
                    self.scheduler.wake.wait(0.05)
                    self.scheduler.wake.clear()
                    continue
                self.step()
        except Exception as exc:
            self.failed("the scheduling loop", exc)
            self.fail_all(f"the scheduling loop failed ({reason_of(exc)})")
            raise
        self.cancel_all("cancelled")

    def cancel_all(self, reason: str) -> None:
        """Ends every waiting, staged and running request with ``reason``."""
        for ticket, on_event in self.scheduler.take_queued():
            deliver(on_event, Event(ticket.request.id, [], reason, prompt_tokens=len(ticket.request.prompt_ids)))
        if self.staging is not None:
            st, self.staging = self.staging, None
            deliver(st.on_event, Event(st.ticket.request.id, [], reason,
                                       prompt_tokens=len(st.ticket.request.prompt_ids)))
        for slot in list(self.slots):
            self._retire(slot, reason)
        self._pending = None

    def fail_all(self, error: str) -> None:
        """Ends every waiting, staged and running request with ``error`` after the loop itself failed: the device
        state is not trusted (nothing runs on it), so the rows are dropped, not retired."""
        waiting = self.scheduler.take_queued() + [(st.ticket, st.on_event) for st in self.admission.drop()]
        for ticket, on_event in waiting:
            deliver(on_event, Event(ticket.request.id, [], "error", error,
                                    prompt_tokens=len(ticket.request.prompt_ids)))
        self._drop_rows(error)

    def _drop_rows(self, error: str) -> None:
        """Ends every running request with ``error`` without touching the device state (not trusted after a
        failure): each keeps the tokens it emitted."""
        self._pending = None
        for slot in self.scheduler.drop_all():
            slot.gen.finish_reason, slot.gen.error = "error", error
            deliver(slot.on_event, Event(slot.ticket.request.id, [], "error", error,
                                         prompt_tokens=len(slot.ticket.request.prompt_ids),
                                         completion_tokens=len(slot.gen.token_ids), generation=slot.gen,
                                         cached_tokens=slot.gen.cached_tokens))
            self._finish_learning(slot)

    def generate(self, requests: Sequence[Request],
                 on_finish: Callable[[int, Generation], None] | None = None,
                 on_event: Callable[[int, Event], None] | None = None) -> list[Generation]:
        """Runs ``requests`` through the loop in this thread and returns their Generations in order.

        A request that fails ends alone, as a Generation with ``finish_reason`` "error" and its ``error``; the others
        run on (where the loop itself fails, every request not finished ends with that error). ``on_finish(k, gen)``
        hears that request k finished, in completion order (progress, output written as it comes);
        ``on_event(k, event)`` hears every event of request k (streaming). A request the engine cannot serve at all
        (``check``: too long, bad parameters) raises RequestError before any runs.
        """
        out: dict[int, Generation] = {}
        for req in requests:
            self.check(req)

        def hear(k: int) -> Callable[[Event], None]:
            def listener(ev: Event) -> None:
                if ev.finish_reason is not None:  # kept before the caller's hooks run: one that fails loses no result
                    out[k] = finished(requests[k], ev)
                if on_event is not None:
                    on_event(k, ev)
                if ev.finish_reason is not None and on_finish is not None:
                    on_finish(k, out[k])
            return listener

        for _ in self._drive(requests, hear):
            pass
        return [out[k] for k in range(len(requests))]

    def stream(self, requests: Sequence[Request]) -> Iterator[tuple[int, Event, Generation | None]]:
        """``generate`` as an iterator: (k, event, request k's Generation on its final event, else None) as events
        come, in this thread; closing it early cancels the requests not finished (their rows retired before it
        returns)."""
        for req in requests:
            self.check(req)
        heard: collections.deque[tuple[int, Event, Generation | None]] = collections.deque()
        tickets: list[Ticket] = []

        def hear(k: int) -> Callable[[Event], None]:
            def listener(ev: Event) -> None:
                heard.append((k, ev, finished(requests[k], ev) if ev.finish_reason is not None else None))
            return listener

        left = len(requests)
        try:
            for _ in self._drive(requests, hear, tickets):
                while heard:
                    k, ev, gen = heard.popleft()
                    left -= gen is not None
                    yield k, ev, gen
        finally:
            if left:  # closed early: the rest are cancelled and their rows retired now
                for ticket in tickets:
                    ticket.cancel()
                for _ in self._drive((), hear):  # the cancelled rows retire; their events go unheard
                    pass

    def _drive(self, requests: Sequence[Request], hear: Callable[[int], Callable[[Event], None]],
               tickets: list[Ticket] | None = None) -> Iterator[None]:
        """Submits ``requests`` as the queue has room (each with listener ``hear(k)``; their tickets into
        ``tickets``) and steps the loop until it is idle, yielding after every step. Where the loop itself fails,
        every request not finished ends with that error and the drive stops (what finished is kept)."""
        pending = collections.deque(enumerate(requests))
        while pending or not self.idle():
            while pending and self.scheduler.queued() < self.max_queue:
                k, req = pending.popleft()
                ticket = self.submit(req, hear(k))
                if tickets is not None:
                    tickets.append(ticket)
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 — what finished is kept; the rest end with the loop's error
                self.failed("the scheduling loop", exc)
                error = f"the scheduling loop failed ({reason_of(exc)})"
                self.fail_all(error)
                for k, req in pending:
                    hear(k)(Event(req.id, [], "error", error, prompt_tokens=len(req.prompt_ids)))
                yield
                return
            yield

    def step(self) -> None:
        """One iteration: cancellations, admission (prefill chunks of at most one largest bucket), decoding.

        Short prompts are admitted several per iteration; a long one is fed one chunk per
        iteration, so the running rows keep streaming while it is prefilled.
        """
        sched = self.scheduler
        if self.sync.local:  # nothing to announce: submissions queue at once
            sched.absorb()
        for ticket, on_event in sched.drop_cancelled(self.cancelled):
            deliver(on_event, Event(ticket.request.id, [], "cancelled", prompt_tokens=len(ticket.request.prompt_ids)))
        for slot in [s for s in self.slots if self.cancelled(s.ticket)]:
            self._retire(slot, "cancelled")
        self._chunk_queued = self.admission.feed()
        if not self.slots:
            self._pending = None  # an iteration of retired rows only: nothing left to read
            self.clock.ran_empty()
            self.fit()
            return
        try:
            self._decode()
        except Exception as exc:  # noqa: BLE001 — fail the batch's requests, keep serving
            self.failed("a decoding step", exc)
            self.executor.reset()
            self._drop_rows(reason_of(exc))

    def cancelled(self, ticket: Ticket) -> bool:
        """Whether to end ``ticket`` now; across processes only once process 0 announced it."""
        return ticket.cancelled.is_set() if self.sync.local else ticket.agreed_cancel

    # -- the state's shape follows the work ---------------------------------------------
    def cache_need(self, committed: int) -> int:
        """Cache slots a row of ``committed`` tokens may touch before the host reads its next tokens."""
        return self.scheduler.cache_need(committed)

    def fit(self, extra_rows: int = 0, need: int = 0) -> None:
        """Lays the state out for the live rows (+ ``extra_rows``) and the longest cache (at least ``need``): the
        smallest bucket that holds them, grown or shrunk at once (``prepare`` compiled every re-layout the loop can
        make; rows only grow while they live, so a bucket changes a few times per request at most)."""
        self.executor.resize(*self.scheduler.layout(extra_rows, need))

    def in_flight(self) -> StepOutput | None:
        """The device output of the iteration in flight (None: none), which a timed prefill waits for."""
        return self._pending.out if self._pending is not None else None

    def join(self, st: Staging, row: int) -> Slot:
        """The slot of a request whose prompt ``Admission`` fed and inserted into ``row`` (the scheduler adds it);
        where making it fails, the row is taken back on the device before the failure goes on."""
        e, req = self.engine, st.ticket.request
        try:
            index = NGramIndex(req.prompt_ids, e.ngram.max_n, e.ngram.min_n) if e.ngram else None
            stop_ids = set(e.llm.cfg.eos_token_ids if req.stop_ids is None else req.stop_ids)
            now = time.perf_counter()
            gen = Generation([], 0, 0, 0.0, "length", prefill_seconds=now - st.began, cached_tokens=st.cached)
            return Slot(st.ticket, st.on_event, gen, now, index, len(req.prompt_ids), stop_ids, row, st.matcher)
        except BaseException:  # the row went live on the device but no slot tracks it: take it back
            self.executor.release(row)
            raise

    def emit_first(self, slot: Slot, first: int) -> None:
        """Emits a joined request's first token (from its prompt's last chunk); a failure ends that request alone."""
        try:
            self._emit(slot, [first])
        except Exception as exc:  # noqa: BLE001
            self.failed("emitting a first token", exc)
            if slot.row >= 0:
                self._retire(slot, "error", error=reason_of(exc))

    def _emit(self, slot: Slot, new: list[int], tree: str | None = None) -> None:
        """Cuts ``new`` at the request's limits, delivers it, and retires the row when it finished."""
        req = slot.ticket.request
        new, reason = cut_tokens(slot.gen.token_ids, new, req.max_new_tokens, slot.stop_ids, req.stop)
        if slot.matcher is not None and self.engine.row_masks().vocab.advance(slot.matcher, new)[0] != len(new):
            raise RuntimeError(f"the engine emitted tokens its grammar forbids: {new}")  # masks make it unreachable
        slot.gen.token_ids.extend(new)
        slot.gen.seconds = time.perf_counter() - slot.start
        if slot.index is not None:
            slot.index.extend(new)
        if reason:
            self._retire(slot, reason, new, tree=tree)
            return
        deliver(slot.on_event, Event(req.id, new, None, prompt_tokens=len(req.prompt_ids),
                                     completion_tokens=len(slot.gen.token_ids), tree=tree,
                                     cached_tokens=slot.gen.cached_tokens))

    def _retire(self, slot: Slot, reason: str, new: Sequence[int] = (), error: str | None = None,
                tree: str | None = None) -> None:
        """Ends ``slot``'s request; the last live row moves into its row, and the state shrinks if it can."""
        req = slot.ticket.request
        if reason != "error" and self.prefix.max_bytes:
            try:  # the row's committed K/V: the prompt and every emitted token but the last (the root, never fed)
                # drafts write past the prompt only, so an SSM that never drafted for the row holds exactly the
                # prompt (one whose drafting iteration is still in flight does too): no read of the row's lengths
                held = None if slot.gen.ssm_steps else len(req.prompt_ids)
                self.admission.remember(list(req.prompt_ids) + slot.gen.token_ids[:-1], slot.row, held)
            except Exception as exc:  # noqa: BLE001 (the request still ends; only its blocks go uncached)
                self.failed("caching a finished request's blocks", exc)
        row, moved = self.scheduler.vacate(slot)
        if moved is None:
            self.executor.release(row)
        else:
            self.executor.move(moved, row)
        self.scheduler.release(slot)  # recorded once the device did it
        self.fit()
        slot.gen.finish_reason = reason
        deliver(slot.on_event, Event(req.id, list(new), reason, error, prompt_tokens=len(req.prompt_ids),
                                     completion_tokens=len(slot.gen.token_ids), generation=slot.gen, tree=tree,
                                     cached_tokens=slot.gen.cached_tokens))
        self._finish_learning(slot)

    def _finish_learning(self, slot: Slot) -> None:
        """Folds a request that left its row into auto's statistics (a request never observed changes nothing)."""
        if self.engine.auto:
            for chooser in self.engine.choosers.values():
                chooser.finish(slot.ticket)

    def _decode(self) -> None:
        """Dispatches the next iteration, then reads and emits the previous one's tokens while it runs.

        Host and device overlap where the data allows: the next iteration needs only device
        state, unless it drafts with the n-gram speculator (whose proposal needs the tokens
        still in flight) or every live row is about to reach its token limit. A row that
        finished in the iteration being read runs one iteration more, whose tokens are
        dropped (its row is retired, or already serves another request).
        """
        if self._pending is not None and not self._may_overlap():
            self._read_pending()
        nxt = None
        if self.slots:
            nxt = self._dispatch(stale=self._pending is not None)
            if nxt is None:  # the pick drafts with the n-gram: its proposal needs the tokens in flight
                self._read_pending()
                nxt = self._dispatch(stale=False) if self.slots else None
            elif self._pending is not None:
                self.overlapped += 1
        if self._pending is not None:
            self._read_pending()
        self._pending = nxt

    def _read_pending(self) -> None:
        it, self._pending = self._pending, None
        self._process(it)

    def _may_overlap(self) -> bool:
        """Whether some live row may still run after the iteration in flight (each emits at least one token)."""
        return self.tokens_left() > 1

    def _dispatch(self, stale: bool) -> "_InFlight | None":
        """Picks this iteration's tree and launches it; None if ``stale`` and the pick drafts with the n-gram.

        ``stale``: an iteration is still in flight, so the host's counts (committed tokens,
        n-gram index, acceptance statistics) lag it by one iteration. Its host seconds go to the span being timed.
        """
        began, drafted = time.perf_counter(), self.clock.spent["drafting"]
        try:
            return self._launch(stale, began)
        finally:  # what it did not spend proposing (``_launch`` counts that) was the loop's other host work
            self.clock.spent["host"] += time.perf_counter() - began - (self.clock.spent["drafting"] - drafted)

    def _launch(self, stale: bool, began: float) -> "_InFlight | None":
        """``_dispatch``'s work (``began``: when it started): the iteration planned on the host, then launched by the
        executor; None where the plan needs the tokens in flight (``stale``)."""
        plan = self._plan(stale)
        if plan is None:
            return None
        ran = (plan.member, plan.cfg.forced_depth, plan.rows, plan.capacity)  # the executable this launch runs
        first = ran not in self._ran
        self._ran.add(ran)
        start = time.perf_counter()
        out = self.executor.execute(plan)
        host = time.perf_counter() - began  # the launch returns before the device is done
        self.iterations += 1
        return _InFlight(plan, out, start, host, self._chunk_queued, self.planner.readies, began, first)

    def _plan(self, stale: bool) -> IterationPlan | None:
        """This iteration decided on the host: the rows' layout, each row's n-gram proposal and grammar-forced chain
        (their seconds go to the span's drafting), the member the chooser picks for them at this bucket. None where
        ``stale`` (an iteration in flight) and the pick needs its tokens: a grammar's masks, or an n-gram draft."""
        e = self.engine
        self.fit()
        live = list(enumerate(self.slots))
        warp = sampling.batch_warp([s.ticket.request.params for _, s in live])
        family = e.family(warp)
        proposals: list[list[int]] = [[] for _ in range(self.rows)]
        matched = [0] * self.rows
        failed: dict[int, str] = {}  # row -> why its host work failed: it runs undrafted, then ends with that error
        if e.ngram is not None and e.ngram_depth:
            proposing = time.perf_counter()
            for i, s in live:
                try:
                    proposals[i] = s.index.propose(e.ngram_depth)
                    matched[i] = s.index.matched
                except Exception as exc:  # noqa: BLE001 — one row's proposal must not fail the batch
                    self.failed("an n-gram proposal", exc)
                    proposals[i], matched[i], failed[i] = [], 0, reason_of(exc)
            self.clock.spent["drafting"] += time.perf_counter() - proposing
        constrained = any(s.matcher is not None for _, s in live)
        if stale and constrained:  # masks walk the rows' matchers: they hold every token
            return None
        chains: list[list[int]] = [[] for _ in range(self.rows)]
        if constrained:
            proposing = time.perf_counter()
            masks = e.row_masks()
            masks.begin([s.matcher for _, s in live] + [None] * (self.rows - len(live)))
            chains = [masks.forced(i, e.forced_depth) for i in range(self.rows)]
            self.clock.spent["drafting"] += time.perf_counter() - proposing
        costs = self.planner.costs(warp, self.rows, self.capacity)
        chooser = e.chooser(warp) if e.auto else None
        if self.planner.beside and chooser is not None and not constrained and self.iterations % WANT_EVERY == 0:
            try:
                self.planner.want(warp, self.rows, self.capacity, chooser,
                                  [(len(proposals[i]), matched[i]) for i, _ in live], self.scheduler.tokens_owed())
            except Exception as exc:  # noqa: BLE001 — the loop runs on with the members it has
                self.failed("weighing which members to load", exc)
        name, longest = self._pick(warp, family, chooser, costs, live, proposals, matched, chains, stale)
        cfg = family[name]
        if stale and cfg.ngram_depth:  # the n-gram's proposal needs the tokens in flight
            return None
        if constrained:
            longest = longest if longest in e.forced_depths(warp, [name]).get(name, (0,)) else 0
            if cfg.active or longest:  # masks from a callback (SSM drafts), or a forced chain
                cfg = e.constrained(cfg, longest)
        chain_masks = None  # no SSM drafts: every node's path is known now, so are its masks
        if cfg.host_masks and constrained:
            chain_masks = masks.chain_masks(chains, proposals, cfg.forced_depth, cfg.ngram_depth)
        return IterationPlan(name, cfg, self.rows, self.capacity, live, proposals, matched, chains, failed,
                             constrained, chooser, costs, chain_masks, self._max_emit if stale else 0)

    def _pick(self, warp: sampling.WarpSpec, family: dict, chooser: TreeChooser | None, costs: dict | None,
              live: list[tuple[int, Slot]], proposals: list[list[int]], matched: list[int], chains: list[list[int]],
              stale: bool) -> tuple[str, int]:
        """The member to run and its forced chain's depth: auto's chooser over the rows' drafts at this bucket's
        measured costs (under a grammar, among the members and chain depths prepared), else the family's one."""
        e = self.engine
        keys = [s.ticket for _, s in live]  # each row's pick reads its own request's counts
        longest = e.forced_bucket(max(map(len, chains), default=0))
        if chooser is None:
            return next(iter(family)), longest
        if any(s.matcher is not None for _, s in live):
            depths = e.forced_depths(warp, list(costs or chooser.costs))  # the members and chains prepared
            allowed = {n: c for n, c in (costs or chooser.costs).items() if n in depths}
            rows3 = [(len(proposals[i]), matched[i], len(chains[i])) for i, _ in live]
            depths = {n: tuple(d for d in ds if d in (0, longest)) for n, ds in depths.items()}
            return chooser.pick_constrained(rows3, allowed, depths, keys=keys)
        rows = [(len(proposals[i]), matched[i]) for i, _ in live]
        serial = self.clock.host_seconds() if stale else 0.0  # what an n-gram pick costs in lost overlap
        name = self.sync.agree_pick(chooser.pick_batch(rows, costs, keys=keys, serial=serial, bucket=self.rows),
                                    list(family))
        return (chooser.retimed(name, self.rows) if "none" in (costs or ()) else name), longest

    def _process(self, it: "_InFlight") -> None:
        """Reads an iteration's tokens, updates the counters and emits to the rows still owned by its requests."""
        reading = time.perf_counter()
        emitted, num, depths = self.executor.read(it.out)
        if it.plan.constrained:  # the rows whose grammar failed, before dispatch or in the step's mask callback
            for row, exc in self.engine.row_masks().take_failed().items():
                self.failed("a grammar mask", exc)
                it.plan.failed.setdefault(row, reason_of(exc))
        now = time.perf_counter()
        try:
            self._account(it, emitted, num, depths, now, now - reading)
        finally:
            after = time.perf_counter() - now
            self.clock.host.append(it.host + after)
            self.clock.spent["host"] += after  # the next span's: it runs after this read

    def _account(self, it: "_InFlight", emitted: np.ndarray, num: np.ndarray, depths: np.ndarray, now: float,
                 blocked: float = 0.0) -> None:
        """The update after an iteration's read: its tokens [B, P] / [B] / [B, sources] counted into rows, the chooser
        and the stream, then emitted (``blocked``: seconds its read waited on the device)."""
        plan, cfg = it.plan, it.plan.cfg
        seconds, span = self.clock.read(plan.member, it.start, it.began, now, blocked, it.prefilled)
        self.scheduler.pacer.decoded(seconds)
        stalled = self.planner.readies != it.readies  # the loop readied a bucket while it ran: not its cost
        live = [(i, s) for i, s in plan.live if s.row >= 0]  # a request retired meanwhile: its tokens are dropped
        failed = [(i, s) for i, s in live if i in plan.failed]  # their host work failed: they end, tokens dropped
        live = [(i, s) for i, s in live if i not in plan.failed]
        stats = IterationStats(plan.member, seconds, len(live), self.queue_depth(), [], [], [])
        chooser = plan.chooser
        for i, slot in live:
            n, forced = int(num[i]), len(plan.chains[i])
            if chooser is not None and slot.ticket.request.learn and not forced:  # warm-up teaches nothing; forced
                # levels would pass as the drafters' hits
                chooser.observe(plan.member, depths[i], len(plan.proposals[i]), plan.matched[i], key=slot.ticket)
            slot.committed += n
            drafted, accepted = self.engine.row_drafts(cfg, len(plan.proposals[i]), forced, depths[i], n)
            slot.gen.count_step(n, plan.member, drafted, accepted, now - slot.read)
            slot.read = now
            slot.gen.ssm_steps += cfg.draft_levels
            stats.emitted.append(n)
            stats.drafted.append(sum(drafted.values()))
            stats.accepted_depth.append(n - 1)
        if chooser is not None and live and not stalled and not it.first and span is not None:  # not its cost:
            # a prompt fed meanwhile, a bucket readied, or the executable's first run
            if plan.constrained:  # a grammar step also waits on host masks: timed apart
                chooser.observe_constrained_time(plan.member, cfg.forced_depth, span, plan.costs)
            else:
                chooser.observe_time(plan.member, span, plan.costs, plan.rows)
        for i, slot in failed:
            if slot.row >= 0:
                self._retire(slot, "error", error=plan.failed[i])
        for i, slot in live:
            if slot.row < 0:
                continue  # retired by an earlier row's failure in this loop
            try:
                self._emit(slot, [int(t) for t in emitted[i, : int(num[i])]], plan.member)
            except Exception as exc:  # noqa: BLE001 — e.g. a stop matcher that raised: fail this request only
                self.failed("emitting tokens", exc)
                if slot.row >= 0:
                    self._retire(slot, "error", error=reason_of(exc))
        if self.on_iteration is not None and live:
            self.on_iteration(stats)


@dataclasses.dataclass
class _InFlight:
    """A launched iteration whose tokens the host has not read yet: its plan, its device outputs, its timings."""

    plan: IterationPlan
    out: StepOutput  # device arrays, not read yet
    start: float  # perf_counter at its launch
    host: float = 0.0  # host seconds from planning it to its launch returning
    prefilled: bool = False  # a prompt chunk was queued on the device before it: its seconds include the chunk
    readies: int = 0  # ``Planner.readies`` at its launch (a later one: the loop readied a bucket while it ran)
    began: float = 0.0  # perf_counter when its planning began (its span's start after the loop ran empty)
    first: bool = False  # its executable's first run in this loop (one-time costs: not what the member costs)
