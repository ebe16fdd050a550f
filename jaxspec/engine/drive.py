"""Running a list of requests through a scheduling loop in the caller's thread (``generate``, ``stream``): what a
job, the Python API and the benches use, where a server runs the loop on its own thread (``EngineCore.run``)."""

from __future__ import annotations

import collections
from typing import Callable, Iterator, Sequence

from jaxspec.engine.loop import Loop
from jaxspec.engine.policy.scheduler import Ticket, reason_of
from jaxspec.request import Event, Generation, Request, finished


def generate(loop: Loop, requests: Sequence[Request],
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
        loop.check(req)

    def hear(k: int) -> Callable[[Event], None]:
        def listener(ev: Event) -> None:
            if ev.finish_reason is not None:  # kept before the caller's hooks run: one that fails loses no result
                out[k] = finished(requests[k], ev)
            if on_event is not None:
                on_event(k, ev)
            if ev.finish_reason is not None and on_finish is not None:
                on_finish(k, out[k])
        return listener

    for _ in run(loop, requests, hear):
        pass
    return [out[k] for k in range(len(requests))]


def stream(loop: Loop, requests: Sequence[Request]) -> Iterator[tuple[int, Event, Generation | None]]:
    """``generate`` as an iterator: (k, event, request k's Generation on its final event, else None) as events
    come, in this thread; closing it early cancels the requests not finished (their rows retired before it
    returns)."""
    for req in requests:
        loop.check(req)
    heard: collections.deque[tuple[int, Event, Generation | None]] = collections.deque()
    tickets: list[Ticket] = []

    def hear(k: int) -> Callable[[Event], None]:
        def listener(ev: Event) -> None:
            heard.append((k, ev, finished(requests[k], ev) if ev.finish_reason is not None else None))
        return listener

    left = len(requests)
    try:
        for _ in run(loop, requests, hear, tickets):
            while heard:
                k, ev, gen = heard.popleft()
                left -= gen is not None
                yield k, ev, gen
    finally:
        if left:  # closed early: the rest are cancelled and their rows retired now
            for ticket in tickets:
                ticket.cancel()
            for _ in run(loop, (), hear):  # the cancelled rows retire; their events go unheard
                pass


def run(loop: Loop, requests: Sequence[Request], hear: Callable[[int], Callable[[Event], None]],
        tickets: list[Ticket] | None = None) -> Iterator[None]:
    """Submits ``requests`` as the queue has room (each with listener ``hear(k)``; their tickets into
    ``tickets``) and steps the loop until it is idle, yielding after every step. Where the loop itself fails,
    every request not finished ends with that error and the drive stops (what finished is kept)."""
    pending = collections.deque(enumerate(requests))
    while pending or not loop.idle():
        while pending and loop.scheduler.queued() < loop.max_queue:
            k, req = pending.popleft()
            ticket = loop.submit(req, hear(k))
            if tickets is not None:
                tickets.append(ticket)
        try:
            loop.step()
        except Exception as exc:  # noqa: BLE001 — what finished is kept; the rest end with the loop's error
            loop.failed("the scheduling loop", exc)
            error = f"the scheduling loop failed ({reason_of(exc)})"
            loop.fail_all(error)
            for k, req in pending:
                hear(k)(Event(req.id, [], "error", error, prompt_tokens=len(req.prompt_ids)))
            yield
            return
        yield
