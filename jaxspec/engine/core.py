"""The one scheduling loop, ``EngineCore``: continuous batching of every request, one jitted iteration for all.

``jaxspec generate`` (every ``--max-batch``), ``Engine.generate``, the benches and ``jaxspec serve`` run requests
through it. Each ``step``: cancellations, admission (``jaxspec.engine.admission``: a waiting prompt prefilled chunk by
chunk into a one-row staging state, paced beside decoding rows, then inserted into a free row), then one decoding
iteration planned on the host (``jaxspec.engine.policy.iteration``: each row's proposals and the family member auto's
chooser picks), launched by the ``Executor`` (the device state, donated to every call, laid out for the smallest row
and capacity buckets holding the live rows: one request in a 16-slot server costs what it costs alone) and read back
while the next one runs (``jaxspec.engine.emission``: tokens counted, emitted; EOS, a stop string, the token limit or a
cancellation frees the row). The host-only ``Scheduler`` holds the queue, the rows' owners, their layout and pacing;
every executable the loop can reach is readied before its first request (``jaxspec.engine.preparation``). Greedy and
sampled rows share one executable; a request's output depends on its own seed only (docs/architecture.md).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterator, Sequence

import jax

from jaxspec.decoding import sampling
from jaxspec.decoding.step import StepOutput
from jaxspec.engine import drive, preparation
from jaxspec.engine.admission import Admission
from jaxspec.engine.clock import LoopClock
from jaxspec.engine.device.executor import Executor
from jaxspec.engine.emission import Emission, InFlight
from jaxspec.engine.policy.iteration import IterationPolicy
from jaxspec.engine.policy.planner import Planner
from jaxspec.engine.policy.prefill import ChunkSizer
from jaxspec.engine.device.prepare import Job
from jaxspec.engine.device.prefix import PrefixCache, default_bytes
from jaxspec.engine.device.runner import RequestError, ModelRunner
from jaxspec.engine.policy.scheduler import (IterationStats, Scheduler, Slot, Staging, Ticket, batch_buckets,
                                             capacity_buckets, deliver, reason_of)
from jaxspec.engine.sync import LoopSync
from jaxspec.errors import FailureLog
from jaxspec.request import Event, Generation, Request

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 1024  # the longest request a server holds (prompt + new tokens)


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
        self.capacity_buckets = capacity_buckets(self.max_capacity, engine.filled_only, self.max_capacity - max_model_len)
        self.vocab = engine.llm.cfg.vocab_size
        self.scheduler = Scheduler(max_batch, max_queue, self.row_buckets, self.capacity_buckets, self.max_capacity,
                                   self._max_emit + self._max_nodes, prefill_stall)
        self.prefill_stall = prefill_stall
        self._chunk_queued = False  # this iteration's admission queued a prompt chunk before its step
        bound = default_bytes() if prefix_cache_bytes is None else prefix_cache_bytes
        # processes evict alike only under one bound (each pastes what process 0 pastes, in the same programs)
        self.prefix = PrefixCache(self.sync.agree_int(bound) if reuse_prefix else 0)
        self.admission = Admission(self, self.prefix, reuse_prefix)  # staging, prompt chunks, prefix reuse
        self.emission = Emission(self)  # an iteration's tokens counted, emitted; finished requests retired
        self.executor = Executor(engine, self.row_buckets, self.capacity_buckets, bool(self.prefix.max_bytes))
        self.iterations = 0
        self._ran: set[tuple] = set()  # (member, forced depth, rows, capacity) the loop has launched: first runs
        self.clock = LoopClock()  # each iteration's span, host and wall seconds, member (``jaxspec.engine.clock``)
        self.planner = Planner(engine, lambda: self.sync)
        self.policy = IterationPolicy(engine, self.planner, self.clock, lambda: self.sync, self.failed)
        self.prepared = False  # ``prepare`` ran: the chunk search probes only sizes it compiled
        self._pending: InFlight | None = None  # the iteration in flight (host/device overlap)
        self.overlapped = 0  # iterations dispatched before the previous one's tokens were read

    # -- what the scheduler and the executor hold, as the loop's callers read it ----------
    @property
    def slots(self) -> list[Slot]:
        """Live requests; slots[i] owns row i of the state."""
        return self.scheduler.slots

    @property
    def staging(self) -> Staging | None:
        return self.scheduler.staging

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
    def resizes(self) -> int:
        """State re-layouts (bucket changes)."""
        return self.executor.resizes

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
        """Raises RequestError / SamplingError naming what is wrong with ``req`` (``Admission.check``)."""
        self.admission.check(req)

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

    def check_structured(self) -> None:
        """Grammars run on one process (a mesh included): each process would need the rows' matchers and masks."""
        if not self.sync.local:
            raise RequestError("structured output runs in one process for now: drop the multi-process flags")

    # -- prepare (``jaxspec.engine.preparation``) ---------------------------------------
    def prepared_set(self, warps: Sequence[sampling.WarpSpec] | None = None, grammar: bool = False,
                     callbacks: bool = True, longest: int | None = None) -> list[Job]:
        """What ``prepare`` with these arguments would ready, listed from shapes alone (nothing compiles)."""
        return preparation.prepared_set(self, warps, grammar, callbacks, longest)

    def prepare(self, warps: Sequence[sampling.WarpSpec] | None = None, rows: Sequence[int] | None = None,
                capacities: Sequence[int] | None = None, grammar: bool = False, progress: bool = True,
                say: Callable[[str], None] | None = None, longest: int | None = None, callbacks: bool = True,
                beside: bool = False, load_all: bool = False, owed: Sequence[int] | None = None) -> float:
        """Readies every executable the loop can reach before its first request; returns the seconds it took
        (``jaxspec.engine.preparation.prepare`` says what each argument asks)."""
        return preparation.prepare(self, warps, rows, capacities, grammar, progress, say, longest, callbacks, beside,
                                   load_all, owed)

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
        """Ends every waiting, staged and running request with ``reason`` (``Emission.cancel_all``)."""
        self._pending = None
        self.emission.cancel_all(reason)

    def fail_all(self, error: str) -> None:
        """Ends every request with ``error`` after the loop itself failed, its rows dropped (``Emission.fail_all``)."""
        self._pending = None
        self.emission.fail_all(error)

    def generate(self, requests: Sequence[Request],
                 on_finish: Callable[[int, Generation], None] | None = None,
                 on_event: Callable[[int, Event], None] | None = None) -> list[Generation]:
        """Runs ``requests`` through the loop in this thread; their Generations in order (``drive.generate``: a
        request that fails ends alone, with its error)."""
        return drive.generate(self, requests, on_finish, on_event)

    def stream(self, requests: Sequence[Request]) -> Iterator[tuple[int, Event, Generation | None]]:
        """``generate`` as an iterator of (k, event, request k's Generation on its final event) (``drive.stream``)."""
        return drive.stream(self, requests)

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
            self.emission.retire(slot, "cancelled")
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
            self._pending = None
            self.emission.drop_rows(reason_of(exc))

    def cancelled(self, ticket: Ticket) -> bool:
        """Whether to end ``ticket`` now; across processes only once process 0 announced it."""
        return ticket.cancelled.is_set() if self.sync.local else ticket.agreed_cancel

    # -- the state's shape follows the work ---------------------------------------------
    def fit(self, extra_rows: int = 0, need: int = 0) -> None:
        """Lays the state out for the live rows (+ ``extra_rows``) and the longest cache (at least ``need``): the
        smallest bucket that holds them, grown or shrunk at once (``prepare`` compiled every re-layout the loop can
        make; rows only grow while they live, so a bucket changes a few times per request at most)."""
        self.executor.resize(*self.scheduler.layout(extra_rows, need))

    def in_flight(self) -> StepOutput | None:
        """The device output of the iteration in flight (None: none), which a timed prefill waits for."""
        return self._pending.out if self._pending is not None else None

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

    def _dispatch(self, stale: bool) -> InFlight | None:
        """Picks this iteration's tree and launches it; None if ``stale`` and the pick drafts with the n-gram.

        ``stale``: an iteration is still in flight, so the host's counts (committed tokens,
        n-gram index, acceptance statistics) lag it by one iteration. Its host seconds go to the span being timed.
        """
        began, drafted = time.perf_counter(), self.clock.spent["drafting"]
        try:
            return self._launch(stale, began)
        finally:  # what it did not spend proposing (``_launch`` counts that) was the loop's other host work
            self.clock.spent["host"] += time.perf_counter() - began - (self.clock.spent["drafting"] - drafted)

    def _launch(self, stale: bool, began: float) -> InFlight | None:
        """``_dispatch``'s work (``began``: when it started): the iteration planned on the host, then launched by the
        executor; None where the plan needs the tokens in flight (``stale``)."""
        self.fit()
        plan = self.policy.plan(self.slots, self.rows, self.capacity, stale, self.iterations,
                                self.scheduler.tokens_owed, self._max_emit)
        if plan is None:
            return None
        ran = (plan.member, plan.cfg.forced_depth, plan.rows, plan.capacity)  # the executable this launch runs
        first = ran not in self._ran
        self._ran.add(ran)
        start = time.perf_counter()
        out = self.executor.execute(plan)
        host = time.perf_counter() - began  # the launch returns before the device is done
        self.iterations += 1
        return InFlight(plan, out, start, host, self._chunk_queued, self.planner.readies, began, first)

    def _process(self, it: InFlight) -> None:
        """Reads an iteration's tokens, updates the counters and emits to the rows still owned by its requests."""
        reading = time.perf_counter()
        emitted, num, depths = self.executor.read(it.out)
        if it.plan.constrained:  # the rows whose grammar failed, before dispatch or in the step's mask callback
            for row, exc in self.engine.row_masks().take_failed().items():
                self.failed("a grammar mask", exc)
                it.plan.failed.setdefault(row, reason_of(exc))
        now = time.perf_counter()
        try:
            self.emission.account(it, emitted, num, depths, now, now - reading)
        finally:
            after = time.perf_counter() - now
            self.clock.host.append(it.host + after)
            self.clock.spent["host"] += after  # the next span's: it runs after this read
