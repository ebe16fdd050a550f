"""The host side of the loop: the queue, which request owns which state row, the buckets the rows need, the pacing of
prompt chunks beside decoding rows, the stop rule and retirement's row moves. No JAX and no device.

The loop (``jaxspec.engine.core.EngineCore``) asks the ``Scheduler`` what to do next and has the executor
(``jaxspec.engine.device.executor.Executor``) carry it out on the device, after vLLM's Scheduler / EngineCore split and
JetStream's engine API. Everything here is decided from host data alone (requests are plain data:
``jaxspec.request``), so it is unit-tested without a device (``tests/test_scheduler.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from jaxspec.config import bucket
from jaxspec.errors import FailureLog
from jaxspec.request import Event, Generation, Request

if TYPE_CHECKING:
    from jaxspec.speculators.ngram import NGramIndex

PREFILL_STALL = 0.5  # default pacing: prompt chunks take at most half the decoding rows' time while they decode
MIN_CAPACITY = 256  # the smallest cache bucket: below it a step's cost hardly depends on the cache

Listener = Callable[[Event], None]
log = logging.getLogger(__name__)


def reason_of(exc: BaseException) -> str:
    """A failure as one line: the exception's type and the first line of its message."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Row counts the state is laid out for: 1, 2, 4, ... below ``max_batch``, then ``max_batch``."""
    out = []
    b = 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return tuple(out) + (max_batch,)


def capacity_buckets(top: int, filled_only: bool = False, slack: int = 0) -> tuple[int, ...]:
    """Cache capacities the state is laid out for: 256, 512, ... below ``top - slack``, then ``top``: the top
    bucket is the longest request (``top - slack``) plus a step's ``slack`` of writes past it, with no near-twin
    power of two just under it. ``top`` alone where attention reads only a cache's filled slots (``filled_only``:
    a step then costs what its rows hold, at any capacity)."""
    if filled_only:
        return (top,)
    out = []
    c = MIN_CAPACITY
    while c < top - slack:
        out.append(c)
        c *= 2
    return tuple(out) + (top,)


def job_model_len(need: int, limit: int) -> int:
    """The request length a batch job whose longest request needs ``need`` tokens is laid out for: the capacity
    bucket at or above it (at most the model's ``limit``). A job's exact length would give it a cache bucket of its
    own, so every prompt set would compile its steps afresh; on the shared buckets a job reuses the steps earlier
    jobs (and auto's cost curve, timed at the smallest) compiled, and its rows fill only what they need."""
    size = MIN_CAPACITY
    while size < need:
        size *= 2
    return min(size, limit)


def cut_tokens(done: list[int], new: list[int], limit: int, stop_ids: set[int],
               stop: Callable[[list[int]], int | None] | None) -> tuple[list[int], str | None]:
    """Truncates one step's tokens at the token limit, then at EOS or a stop string; returns (kept, reason).

    EOS is looked for first, then a stop string over the text so far (a stop string that ends
    inside the tokens before an EOS wins, since the EOS is cut away with what follows it).
    """
    reason = None
    if len(done) + len(new) >= limit:
        new = new[: limit - len(done)]
        reason = "length"
    for i, t in enumerate(new):
        if t in stop_ids:
            new, reason = new[: i + 1], "eos"
            break
    if stop is not None:
        cut = stop(done + new)
        if cut is not None:
            return (done + new)[len(done): max(cut, len(done))], "stop"
    return new, reason


class QueueFull(RuntimeError):
    """``submit`` while ``max_queue`` requests already wait for a slot."""


@dataclasses.dataclass
class IterationStats:
    """One decoding iteration of the batch, for metrics."""

    tree: str  # family member run
    seconds: float
    active: int
    queued: int
    emitted: list[int]  # tokens emitted per active slot
    drafted: list[int]  # draft tokens verified per active slot, a grammar's forced ones included (0 without
    #                     speculation; the sum of the slot's ``ModelRunner.row_drafts``, no padding node)
    accepted_depth: list[int]  # per active slot: draft tokens accepted (depths 1..a)


class Ticket:
    """A submitted request's handle: ``cancel`` frees its slot at the next iteration."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.cancelled = threading.Event()
        self.agreed_cancel = False  # multi-process: process 0 announced the cancellation to every process
        self.seq = -1  # multi-process: the admission number every process knows this request by

    def cancel(self) -> None:
        self.cancelled.set()


@dataclasses.dataclass
class Slot:
    """A decoding request and the state row it owns."""

    ticket: Ticket
    on_event: Listener
    gen: Generation
    start: float
    index: NGramIndex | None
    committed: int  # tokens in the row's LLM cache
    stop_ids: set[int]
    row: int  # the state row it owns; -1 once retired
    matcher: object = None  # llguidance matcher at the committed text (requests with a grammar)
    read: float = 0.0  # perf_counter of its newest iteration's read (``start`` until the first): its next one's span

    def __post_init__(self) -> None:
        self.read = self.read or self.start


@dataclasses.dataclass
class Staging:
    """The request being prefilled, chunk by chunk."""

    ticket: Ticket
    on_event: Listener
    fed: int = 0
    cached: int = 0  # prompt tokens whose K/V were reused, not computed (the staging row's or the prefix cache's)
    probe: int | None = None  # the chunk size its first tokens time for the chunk search (``ChunkSizer.probe``)
    probe_seconds: float = 0.0  # its probe's chunks so far, each timed alone
    matcher: object = None  # the request's grammar matcher, made when it is staged
    began: float = dataclasses.field(default_factory=time.perf_counter)  # when its first chunk was staged


class Pacer:
    """``--prefill-stall`` R: while rows decode, a prompt's later chunks take at most R times the decoding time (a
    chunk runs, then the decoding rows run alone until they made up R times its seconds; None: no pacing)."""

    def __init__(self, stall: float | None) -> None:
        self.stall = stall
        self.debt = 0.0  # seconds of prompt chunks the decoding rows have not yet made up
        self.waits = 0  # iterations whose admission waited for the decoding rows

    def paced(self, decoding: bool) -> bool:
        """Whether this iteration's chunks are paced (only beside decoding rows)."""
        return self.stall is not None and decoding

    def budget(self, largest: int, decoding: bool, staging: bool, to_feed: bool) -> int:
        """Prompt tokens this iteration may feed: ``largest`` (one largest chunk), or 0 while the decoding rows
        still make up earlier chunks. A prompt's first chunk is never paced: only a long one's later chunks wait."""
        if not decoding or not staging:
            self.debt = 0.0
        if self.paced(decoding) and self.debt > 0:
            self.waits += to_feed
            return 0
        return largest

    def fed(self, seconds: float) -> None:
        """Paced chunks ran for ``seconds``: the decoding rows owe that time."""
        self.debt += seconds

    def decoded(self, seconds: float) -> None:
        """A decoding iteration of ``seconds`` made up part of the debt."""
        if self.stall is not None:
            self.debt = max(0.0, self.debt - self.stall * seconds)


class Scheduler:
    """The queue, the rows' owners and their layout, the pacing: what the loop does next, decided on the host.

    ``step_reach``: the cache slots one iteration may touch past a row's committed tokens (its most nodes written
    plus its most tokens committed), so a row is laid out where its next iteration fits. Thread-safe where it
    faces submitters (``submit``, ``take_incoming``, ``enqueue``, ``take_queued``); the rest runs on the loop's
    thread.
    """

    def __init__(self, max_batch: int, max_queue: int, row_buckets: Sequence[int], capacity_buckets: Sequence[int],
                 max_capacity: int, step_reach: int, prefill_stall: float | None = None) -> None:
        self.max_batch, self.max_queue = max_batch, max_queue
        self.row_buckets, self.capacity_buckets = tuple(row_buckets), tuple(capacity_buckets)
        self.max_capacity, self.step_reach = max_capacity, step_reach
        self.waiting: collections.deque[tuple[Ticket, Listener]] = collections.deque()
        self.incoming: collections.deque[tuple[Ticket, Listener]] = collections.deque()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.slots: list[Slot] = []  # live requests; slots[i] owns row i of the state
        self.staging: Staging | None = None
        self.pacer = Pacer(prefill_stall)

    # -- the queue ------------------------------------------------------------------------
    def submit(self, ticket: Ticket, on_event: Listener) -> None:
        """Queues ``ticket`` in ``incoming``; QueueFull where ``max_queue`` requests already wait."""
        with self.lock:
            waiting = len(self.waiting) + len(self.incoming)
            if waiting >= self.max_queue:
                raise QueueFull(f"{waiting} requests are already waiting (--max-queue {self.max_queue})")
            self.incoming.append((ticket, on_event))
        self.wake.set()

    def queued(self) -> int:
        """Requests submitted and not yet staged."""
        return len(self.waiting) + len(self.incoming)

    def queue_depth(self) -> int:
        """Requests not yet decoding: queued, or being prefilled."""
        return self.queued() + (self.staging is not None)

    def absorb(self) -> None:
        """Moves every submission into ``waiting`` (a single process: nothing to announce first)."""
        with self.lock:
            self.waiting.extend(self.incoming)
            self.incoming.clear()

    def take_incoming(self, accept: Callable[[Ticket], bool | None]) -> tuple[list, list]:
        """Takes submissions in order while ``accept`` says True; False leaves it and the rest for a later call;
        None takes it out to be refused. Returns ((ticket, on_event) taken, (ticket, on_event) refused)."""
        taken, refused = [], []
        with self.lock:
            while self.incoming:
                verdict = accept(self.incoming[0][0])
                if verdict is False:
                    break
                (taken if verdict else refused).append(self.incoming.popleft())
        return taken, refused

    def enqueue(self, admitted: Sequence[tuple[Ticket, Listener]]) -> None:
        """Queues requests for admission as they are (a multi-process run announced them already)."""
        with self.lock:
            self.waiting.extend(admitted)

    def take_queued(self) -> list[tuple[Ticket, Listener]]:
        """Empties the queue: every waiting and incoming request, with its listener."""
        with self.lock:
            queued = list(self.waiting) + list(self.incoming)
            self.waiting.clear()
            self.incoming.clear()
        return queued

    def drop_cancelled(self, cancelled: Callable[[Ticket], bool]) -> list[tuple[Ticket, Listener]]:
        """Takes the cancelled requests out of ``waiting`` (so they stop counting against ``max_queue``)."""
        with self.lock:
            flags = [cancelled(t) for t, _ in self.waiting]
            gone = [w for w, c in zip(self.waiting, flags) if c]
            if gone:
                self.waiting = collections.deque(w for w, c in zip(self.waiting, flags) if not c)
        return gone

    def next_waiting(self) -> tuple[Ticket, Listener] | None:
        """The request to stage next: the waiting head, while a row is free."""
        if len(self.slots) >= self.max_batch:
            return None
        with self.lock:
            return self.waiting.popleft() if self.waiting else None

    def may_admit_beside(self, largest: int) -> bool:
        """Whether a short waiting head (one chunk of at most ``largest`` tokens) may enter beside the long prompt
        being staged, keeping a row free for that one."""
        st = self.staging
        if st is None or len(st.ticket.request.prompt_ids) - st.fed <= largest:
            return False  # nothing long in the way
        if len(self.slots) + 2 > self.max_batch:
            return False
        with self.lock:
            return bool(self.waiting) and len(self.waiting[0][0].request.prompt_ids) <= largest

    # -- rows and their layout --------------------------------------------------------------
    def cache_need(self, committed: int) -> int:
        """Cache slots a row of ``committed`` tokens may touch before the host reads its next tokens."""
        return committed + self.step_reach

    def layout(self, extra_rows: int = 0, need: int = 0) -> tuple[int, int]:
        """The (rows, capacity) bucket holding the live rows (+ ``extra_rows``) and the longest cache (at least
        ``need``): the smallest, so a lone request in a wide server runs the 1-row executable."""
        rows = bucket(max(len(self.slots) + extra_rows, 1), self.row_buckets)
        want = max([need] + [self.cache_need(s.committed) for s in self.slots])
        return rows, bucket(min(want, self.max_capacity), self.capacity_buckets)

    def staging_layout(self, need: int, rows_capacity: int) -> int:
        """The staging row's capacity for ``need`` slots: at least the live rows' (its insert then needs no
        re-layout), its own bucket otherwise, so a long prompt entering changes nothing of the rows beside it."""
        return bucket(min(max(need, rows_capacity), self.max_capacity), self.capacity_buckets)

    def add(self, slot: Slot) -> None:
        """``slot`` takes the next row (its ``row`` must be it: the rows stay contiguous)."""
        if slot.row != len(self.slots):
            raise ValueError(f"a new request takes row {len(self.slots)}, not {slot.row}")
        self.slots.append(slot)

    def vacate(self, slot: Slot) -> tuple[int, int | None]:
        """What freeing ``slot``'s row takes, changing nothing: (the freed row, the last live row that moves into it,
        None where ``slot`` holds the last row). The device acts on it, then ``release`` records it."""
        row, last = slot.row, len(self.slots) - 1
        if row < 0 or row > last or self.slots[row] is not slot:
            raise ValueError("the request owns no row")
        return row, (last if row != last else None)

    def release(self, slot: Slot) -> tuple[int, int | None]:
        """Frees ``slot``'s row: the last live row moves into it (``vacate``'s plan, now recorded)."""
        row, moved = self.vacate(slot)
        slot.row = -1
        if moved is not None:
            self.slots[row] = self.slots[moved]
            self.slots[row].row = row
        self.slots.pop()
        return row, moved

    def drop_all(self) -> list[Slot]:
        """Forgets every row (after a failure the device state is not trusted): the slots, each with row -1."""
        slots, self.slots = self.slots, []
        for slot in slots:
            slot.row = -1
        return slots

    def tokens_left(self) -> int:
        """The longest live request's tokens still to come: the iterations its row has left, at most."""
        return max((s.ticket.request.max_new_tokens - len(s.gen.token_ids) for s in self.slots), default=0)

    def tokens_owed(self) -> int:
        """Tokens every admitted request may still ask for: the live rows' left, and each waiting one's whole."""
        left = sum(max(0, s.ticket.request.max_new_tokens - len(s.gen.token_ids)) for s in self.slots)
        with self.lock:  # submitters may append meanwhile
            return left + sum(t.request.max_new_tokens for t, _ in self.waiting)

    def live_tickets(self) -> list[Ticket]:
        """Every admitted request's ticket: waiting, being prefilled, decoding."""
        return ([t for t, _ in self.waiting] + ([self.staging.ticket] if self.staging else [])
                + [s.ticket for s in self.slots])

    def idle(self) -> bool:
        return not self.waiting and not self.incoming and self.staging is None and not self.slots


@dataclasses.dataclass
class IterationPlan:
    """One decoding iteration as decided on the host, before the device runs it (``Executor.execute``): the member
    and its configuration at the bucket (rows x capacity), the live rows, and what the host proposed for each row.
    Read back when its tokens are (``jaxspec.engine.emission.Emission.account``)."""

    member: str  # the family member that runs
    cfg: Any  # its ``jaxspec.decoding.step.DecodeConfig`` (a grammar's forced chain included)
    rows: int  # the row bucket
    capacity: int  # the capacity bucket
    live: list[tuple[int, Slot]]  # (row, its request) at planning
    proposals: list[list[int]]  # the n-gram's proposal per row
    matched: list[int]  # the n-gram's matched suffix length per row
    chains: list[list[int]]  # tokens each row's grammar forces after its root (empty without a grammar)
    failed: dict[int, str]  # row -> why its host work failed: it runs undrafted, then ends with that error
    constrained: bool  # some row has a grammar: masks' failures are read with the tokens; timed apart
    chooser: Any  # auto's ``TreeChooser`` for this warp (None: no auto)
    costs: dict[str, float] | None  # auto's measured costs at this bucket
    chain_masks: Any = None  # [rows, 1 + forced + n-gram, words] int32 masks from the host (None: the step's own)
    ahead: int = 0  # tokens the iteration still in flight may commit before this one writes


LISTENER_FAILURES = FailureLog(log)  # listeners that raised: the first logged with its stack, the rest counted


def deliver(on_event: Listener, event: Event) -> None:
    """Calls a request's listener; a listener that fails must not stop the engine (``LISTENER_FAILURES`` keeps it)."""
    try:
        on_event(event)
    except Exception as exc:  # noqa: BLE001
        LISTENER_FAILURES.report(type(exc).__name__, f"a request's listener (request {event.request_id})", exc)
