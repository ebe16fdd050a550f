"""The host-only scheduler: queue, rows' owners and layout, pacing, without JAX or a device (issue 65, item 3)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jaxspec.engine.policy.scheduler import Pacer, QueueFull, Scheduler, Slot, Staging, Ticket, reason_of
from jaxspec.request import Generation, Request

ROOT = Path(__file__).resolve().parents[1]


def make(max_batch: int = 4, max_queue: int = 8, stall: float | None = None) -> Scheduler:
    """Rows 1, 2, 4; capacities 256, 512, 1024 (1024 the largest a row may need); a step reaches 10 slots ahead."""
    return Scheduler(max_batch, max_queue, (1, 2, 4), (256, 512, 1024), 1024, 10, stall)


def ticket(n: int = 4, new: int = 8, rid: str = "") -> Ticket:
    return Ticket(Request(list(range(1, n + 1)), new, id=rid))


def slot(sched: Scheduler, committed: int = 4, new: int = 8, done: int = 0) -> Slot:
    """A decoding request taking the next row, ``done`` of its ``new`` tokens emitted."""
    s = Slot(ticket(committed, new), lambda ev: None, Generation(list(range(done)), 0, 0, 0.0, "length"), 0.0, None,
             committed, set(), len(sched.slots))
    sched.add(s)
    return s


def test_the_scheduler_imports_and_runs_without_jax():
    """What the issue asks of it: host-only. A process that drives it through a request's whole way (queue, staging,
    a row, layout, retirement) never loads JAX."""
    code = ("import sys\n"
            "from jaxspec.engine.policy.scheduler import Scheduler, Slot, Staging, Ticket\n"
            "from jaxspec.request import Generation, Request, SamplerParams\n"
            "s = Scheduler(2, 4, (1, 2), (256,), 256, 8)\n"
            "t = Ticket(Request([1, 2, 3], 4, SamplerParams(temperature=0.5, seed=3)))\n"
            "s.submit(t, print); s.absorb(); t2, listener = s.next_waiting(); s.staging = Staging(t2, listener)\n"
            "s.staging = None\n"
            "s.add(Slot(t2, listener, Generation([], 0, 0, 0.0, 'length'), 0.0, None, 3, set(), 0))\n"
            "assert s.layout() == (1, 256) and s.release(s.slots[0]) == (0, None) and s.idle()\n"
            "print('jax' in sys.modules, 'jaxlib' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_the_queue_is_bounded_and_keeps_submission_order():
    sched = make(max_queue=3)
    tickets = [ticket(rid=str(k)) for k in range(3)]
    for t in tickets:
        sched.submit(t, lambda ev: None)
    with pytest.raises(QueueFull, match="3 requests are already waiting .*--max-queue 3"):
        sched.submit(ticket(), lambda ev: None)
    assert sched.wake.is_set() and sched.queued() == 3 and not sched.waiting
    sched.absorb()
    assert [t for t, _ in sched.waiting] == tickets and not sched.incoming
    assert [sched.next_waiting()[0] for _ in range(3)] == tickets and sched.next_waiting() is None


def test_take_incoming_takes_refuses_and_stops_as_the_verdict_says():
    """A multi-process run's leader takes what it can announce: True takes, None refuses, False stops there."""
    sched = make()
    tickets = [ticket(rid=str(k)) for k in range(4)]
    for t in tickets:
        sched.submit(t, lambda ev: None)
    verdicts = {"0": True, "1": None, "2": False, "3": True}
    taken, refused = sched.take_incoming(lambda t: verdicts[t.request.id])
    assert [t for t, _ in taken] == tickets[:1] and [t for t, _ in refused] == tickets[1:2]
    assert [t for t, _ in sched.incoming] == tickets[2:]  # the False one and the rest wait for a later call
    sched.enqueue(taken)
    assert sched.live_tickets() == tickets[:1] and sched.queue_depth() == 3


def test_no_request_is_staged_while_every_row_is_taken():
    sched = make(max_batch=2)
    sched.submit(ticket(), lambda ev: None)
    sched.absorb()
    slot(sched)
    slot(sched)
    assert sched.next_waiting() is None and len(sched.waiting) == 1  # still queued, not lost
    sched.release(sched.slots[0])
    assert sched.next_waiting() is not None


def test_cancelled_requests_leave_the_queue_in_order():
    sched = make()
    tickets = [ticket(rid=str(k)) for k in range(4)]
    for t in tickets:
        sched.submit(t, lambda ev: None)
    sched.absorb()
    tickets[1].cancel()
    tickets[3].cancel()
    gone = sched.drop_cancelled(lambda t: t.cancelled.is_set())
    assert [t for t, _ in gone] == [tickets[1], tickets[3]]
    assert [t for t, _ in sched.waiting] == [tickets[0], tickets[2]]


def test_release_keeps_the_rows_contiguous():
    """A retired row's place is taken by the last live row (one row copy); the last row just ends."""
    sched = make()
    a, b, c = slot(sched), slot(sched), slot(sched)
    assert sched.vacate(b) == (1, 2) and sched.slots == [a, b, c] and b.row == 1  # the plan changes nothing
    assert sched.release(b) == (1, 2)  # c moves from row 2 into row 1
    assert sched.slots == [a, c] and (a.row, b.row, c.row) == (0, -1, 1)
    assert sched.release(c) == (1, None)
    assert sched.slots == [a] and c.row == -1
    with pytest.raises(ValueError, match="owns no row"):
        sched.release(c)  # twice: refused, not a second move
    with pytest.raises(ValueError, match="takes row 1, not 3"):
        sched.add(Slot(ticket(), lambda ev: None, Generation([], 0, 0, 0.0, "length"), 0.0, None, 4, set(), 3))


def test_the_layout_is_the_smallest_bucket_holding_the_rows_and_their_caches():
    sched = make()
    assert sched.layout() == (1, 256)  # no row: the smallest bucket
    slot(sched, committed=100)
    assert sched.layout() == (1, 256) and sched.layout(extra_rows=1) == (2, 256)
    slot(sched, committed=250)  # 250 + the step's reach of 10 > 256
    assert sched.layout() == (2, 512)
    slot(sched, committed=10)
    assert sched.layout() == (4, 512)  # three rows lie in the 4-row bucket
    assert sched.layout(need=2000) == (4, 1024)  # never past the largest
    sched.release(sched.slots[1])
    assert sched.layout() == (2, 256)  # shrunk at once when the long row leaves


def test_the_staging_row_has_its_own_bucket_but_at_least_the_rows_capacity():
    sched = make()
    assert sched.staging_layout(300, 256) == 512  # a long prompt entering: its own bucket
    assert sched.staging_layout(10, 512) == 512  # at least the rows': its insert needs no re-layout
    assert sched.staging_layout(5000, 256) == 1024


def test_a_short_request_enters_beside_a_long_prompt_only_with_a_row_to_spare():
    sched = make(max_batch=3)
    long_one = ticket(n=900)
    sched.staging = Staging(long_one, lambda ev: None, fed=100)
    sched.submit(ticket(n=20), lambda ev: None)
    sched.absorb()
    assert sched.may_admit_beside(largest=256)
    assert not sched.may_admit_beside(largest=1024)  # the long one's rest is one chunk: nothing in the way
    sched.staging.fed = 700
    assert not sched.may_admit_beside(largest=256)  # 200 left: no longer long
    sched.staging.fed = 100
    slot(sched)
    slot(sched)
    assert not sched.may_admit_beside(largest=256)  # the last row is the long prompt's
    sched.release(sched.slots[0])
    sched.waiting[0][0].request.prompt_ids.extend(range(300))
    assert not sched.may_admit_beside(largest=256)  # the head is no short request


def test_pacing_lets_decoding_rows_make_up_a_chunks_time():
    pacer = Pacer(0.5)
    assert pacer.budget(256, decoding=True, staging=True, to_feed=True) == 256
    pacer.fed(0.2)  # a paced chunk ran 0.2 s: the rows owe it back at half speed
    assert pacer.budget(256, decoding=True, staging=True, to_feed=True) == 0 and pacer.waits == 1
    pacer.decoded(0.3)  # 0.15 s made up
    assert pacer.debt == pytest.approx(0.05)
    assert pacer.budget(256, decoding=True, staging=True, to_feed=False) == 0 and pacer.waits == 1  # nothing to feed
    pacer.decoded(0.2)  # more than the rest: never below zero
    assert pacer.debt == 0.0 and pacer.budget(256, decoding=True, staging=True, to_feed=True) == 256
    pacer.fed(1.0)
    assert pacer.budget(256, decoding=True, staging=False, to_feed=True) == 256  # a new prompt's first chunk
    assert pacer.debt == 0.0
    pacer.fed(1.0)
    assert pacer.budget(256, decoding=False, staging=True, to_feed=True) == 256  # no row decodes: nothing paced
    unpaced = Pacer(None)
    unpaced.fed(5.0)
    assert not unpaced.paced(True) and unpaced.budget(64, decoding=True, staging=True, to_feed=True) == 64


def test_tokens_left_and_idle_follow_the_rows():
    sched = make()
    assert sched.idle() and sched.tokens_left() == 0
    slot(sched, new=10, done=3)
    slot(sched, new=5, done=4)
    assert not sched.idle() and sched.tokens_left() == 7
    sched.drop_all()
    assert sched.idle() and sched.slots == []


def test_a_failure_reads_as_one_line():
    assert reason_of(RuntimeError("device lost\nat step 3")) == "RuntimeError: device lost"
    assert reason_of(KeyError()) == "KeyError"
