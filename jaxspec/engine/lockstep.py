"""Multi-process runs of the scheduling loop: every process runs the same loop, process 0 decides.

Every process runs the same program and the same jitted steps on the global mesh, so every
host-side choice that could differ between processes is process 0's, broadcast through the
cluster (``jaxspec.parallel.distributed``: ``agree``): auto's picks, the prefix cache's bound,
and for a server what each iteration admits, cancels and whether the loop stops. ``generate``
runs the same requests everywhere (``loop_sync``); a server listens on process 0 only, which
announces its admissions before each iteration (``LeaderSync``) while the others replay them into
their own loop (``FollowerSync``). These synchronisers drive the loop through its public hooks
(``live_tickets``, ``take_incoming``, ``enqueue``); the cluster below knows nothing of them.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Callable

import numpy as np

from jaxspec.decoding.sampling import SamplerParams
from jaxspec.engine.core import EngineCore, Event, Request, Ticket
from jaxspec.engine.sync import LoopSync
from jaxspec.engine.stops import MAX_STOP_CHARS, MAX_STOPS
from jaxspec.parallel import distributed as cluster


class LockstepSync(LoopSync):
    """``generate`` over several processes: the same requests everywhere; picks and settings are process 0's."""

    fresh_costs = True
    shared = True

    def agree_pick(self, name: str, names: list[str]) -> str:
        return cluster.agree_pick(name, names)

    def agree_int(self, value: int) -> int:
        return cluster.agree_int(value)

    def failed(self, what: str, exc: BaseException) -> None:
        cluster.fail_run(what, exc)


def loop_sync() -> LoopSync | None:
    """The scheduling loop's ``LoopSync`` for ``generate`` in a multi-process run; None in a single process."""
    return LockstepSync() if cluster.active() is not None else None


# -- a multi-process server: process 0's queue, every process's batch -----------------------------
HEADER = 4  # [stop, cancellations, admissions, words used]
RECORD = 11  # per admission: seq, prompt length, max new tokens, seed (2 words), top-k, temperature, top-p, ...
# Stop strings travel as JSON code points (ensure_ascii off): each character, escaped, at most 2 words.
STOP_WORDS = MAX_STOPS * (2 * MAX_STOP_CHARS + 4) + 2


def message_size(max_model_len: int) -> int:
    """Words of the per-iteration message: room for at least one longest prompt and its stop strings."""
    return HEADER + 256 + 2 * (RECORD + max_model_len) + STOP_WORDS


def _bits(x: float) -> int:
    return int(np.asarray(x, np.float32).view(np.int32))


def _float(word: int) -> float:
    return float(np.asarray(word, np.int32).view(np.float32))


def _encode(ticket: Ticket) -> list[int]:
    """One admission as int32 words (floats by their bits, stop strings as code points of their JSON)."""
    req = ticket.request
    stops = [ord(c) for c in json.dumps(list(req.stop_strings), ensure_ascii=False)] if req.stop_strings else []
    stop_ids = list(req.stop_ids) if req.stop_ids is not None else []
    p = req.params
    head = [ticket.seq, len(req.prompt_ids), req.max_new_tokens, *p.seed_words.view(np.int32).tolist(),
            p.top_k, _bits(p.temperature), _bits(p.top_p), len(stops), int(req.stop_ids is not None), len(stop_ids)]
    return head + list(req.prompt_ids) + stops + stop_ids


def _decode(msg: list[int], at: int, make_stop: Callable[[list[str]], Any]) -> tuple[Request, int, int]:
    """The admission ``_encode`` wrote at word ``at`` of ``msg``: (its request, its seq, the word after it)."""
    seq, n, max_new, high, low, top_k, temp, top_p, n_stop, has_ids, n_ids = msg[at: at + RECORD]
    at += RECORD
    prompt = msg[at: at + n]
    stops = json.loads("".join(map(chr, msg[at + n: at + n + n_stop]))) if n_stop else []
    stop_ids = msg[at + n + n_stop: at + n + n_stop + n_ids] if has_ids else None
    high, low = np.asarray([high, low], np.int32).view(np.uint32).tolist()  # ``seed_words``
    params = SamplerParams(_float(temp), top_k, _float(top_p), high << 32 | low)
    req = Request(prompt, max_new, params, stop_ids=stop_ids, stop=make_stop(stops) if stops else None,
                  id=f"peer-{seq}", stop_strings=tuple(stops))
    return req, seq, at + n + n_stop + n_ids


class _ServerSync(LockstepSync):
    """A multi-process server's side of the loop: announced admissions on top of agreed picks."""

    local = False


class LeaderSync(_ServerSync):
    """Process 0's side: moves submissions into the queue and announces them."""

    def __init__(self, batch: EngineCore) -> None:
        self.size = message_size(batch.max_model_len)
        self.next_seq = 0
        batch.sync = self

    def exchange(self, b: EngineCore, stopping: bool) -> bool:
        cancels = [t for t in b.live_tickets() if t.cancelled.is_set() and not t.agreed_cancel][: 256]
        words = [t.seq for t in cancels]

        def accept(ticket: Ticket) -> bool | None:
            ticket.seq = self.next_seq
            record = _encode(ticket)
            if HEADER + len(words) + len(record) > self.size:
                return False if words else None  # the next message takes it; one that fits none is refused
            self.next_seq += 1
            words.extend(record)
            return True

        admitted, refused = b.take_incoming(accept)
        for ticket, on_event in refused:  # it fails alone, the loop goes on
            _refuse(ticket, on_event, f"request {ticket.request.id} does not fit the multi-process message")
        msg = np.zeros(self.size, np.int32)  # [size]
        msg[:HEADER] = (int(stopping), len(cancels), len(admitted), HEADER + len(words))
        msg[HEADER: HEADER + len(words)] = words
        cluster.agree(msg)
        for t in cancels:
            t.agreed_cancel = True
        b.enqueue(admitted)
        return stopping


def _refuse(ticket: Ticket, on_event: Callable[[Event], None], reason: str) -> None:
    """Ends a request process 0 cannot announce with an error event (never stopping the loop)."""
    try:
        on_event(Event(ticket.request.id, [], "error", reason, len(ticket.request.prompt_ids)))
    except Exception:  # noqa: BLE001 — a listener that fails must not stop the loop
        pass


class FollowerSync(_ServerSync):
    """Another process's side: queues what process 0 announced, cancels what it cancelled."""

    def __init__(self, batch: EngineCore, make_stop: Callable[[list[str]], Any]) -> None:
        self.make_stop = make_stop
        self.size = message_size(batch.max_model_len)
        self.tickets: dict[int, Ticket] = {}
        batch.sync = self
        batch.on_iteration = None  # metrics live on process 0

    def exchange(self, b: EngineCore, stopping: bool) -> bool:
        msg = cluster.agree(np.zeros(self.size, np.int32)).tolist()
        stop, n_cancel, n_admit, _ = msg[:HEADER]
        at = HEADER
        for seq in msg[at: at + n_cancel]:
            if seq in self.tickets:
                self.tickets[seq].agreed_cancel = True
        at += n_cancel
        admitted = []
        for _ in range(n_admit):
            req, seq, at = _decode(msg, at, self.make_stop)
            ticket = Ticket(req)
            ticket.seq = seq
            self.tickets[seq] = ticket
            admitted.append((ticket, self._forget(seq)))
        b.enqueue(admitted)
        return bool(stop)

    def _forget(self, seq: int) -> Callable[[Event], None]:
        def on_event(event: Event) -> None:
            if event.finish_reason is not None:
                self.tickets.pop(seq, None)
        return on_event


def serve_role(batch: EngineCore, make_stop: Callable[[list[str]], Any]) -> bool:
    """Sets a multi-process server's batch up; runs a follower's loop to process 0's stop and returns False there.

    Returns True where this process should go on serving HTTP (process 0, or a single-process run).
    Every process prepares first (``EngineCore.prepare``: compiles, then calibrates alike), so the loop's
    broadcasts never interleave with the calibrations' collectives.
    """
    if cluster.active() is None:
        return True
    if cluster.is_leader():
        LeaderSync(batch)
    else:
        FollowerSync(batch, make_stop)
    batch.prepare(progress=cluster.is_leader())
    if cluster.is_leader():
        return True
    batch.run(threading.Event())
    return False
