"""Where the loop's time goes: each iteration's span from one read of tokens to the next, split by kind of work.

The chooser prices a member by its spans (everything between two iterations: the device step, drafting on the host,
the loop's other host work, waiting), and ``-v`` and a server's report print them per member. Host-only: no JAX.
"""

from __future__ import annotations

import collections
import itertools
import statistics

import numpy as np

from jaxspec.engine.policy import auto

PARTS = ("device", "drafting", "host", "waiting")  # a span's parts, in ``LoopClock.parts``' order
KEEP = 4096  # iterations each record keeps (the newest)


class LoopClock:
    """The loop's timings: per iteration read, its host seconds (choosing, launching, reading), its wall seconds, the
    member it ran and its span's ``PARTS``; and the span in progress (host seconds spent since the last read, whether
    a prompt was fed in it). Appended on the loop's thread; read (and reset) by a server's thread as well."""

    def __init__(self) -> None:
        self.host: collections.deque[float] = collections.deque(maxlen=KEEP)
        self.wall: collections.deque[float] = collections.deque(maxlen=KEEP)
        self.members: collections.deque[str] = collections.deque(maxlen=KEEP)  # the member each one ran
        self.parts: collections.deque[tuple[float, ...]] = collections.deque(maxlen=KEEP)  # [4] seconds each
        self.last_read = 0.0  # perf_counter of the newest read (0: none since the loop last ran empty)
        self.spent = dict.fromkeys(PARTS[1:3], 0.0)  # host seconds since that read: drafting, and the rest
        self.fed = False  # a prompt was fed since that read: the span in progress is not a member's cost

    def ran_empty(self) -> None:
        """The loop has no rows left: the next iteration's span starts at its own dispatch."""
        self.last_read = 0.0
        self.spent = dict.fromkeys(self.spent, 0.0)

    def host_seconds(self) -> float:
        """The host's seconds per iteration, the median of the newest ``auto.TIMING_WINDOW``: what an iteration adds
        to the cycle when it cannot overlap the one in flight (0 before ``auto.MIN_TIMINGS``)."""
        newest = list(itertools.islice(reversed(self.host), auto.TIMING_WINDOW))
        return statistics.median(newest) if len(newest) >= auto.MIN_TIMINGS else 0.0

    def read(self, member: str, dispatched: float, began: float, now: float, blocked: float,
             prefilled: bool) -> tuple[float, float | None]:
        """An iteration's tokens were read at ``now`` (``dispatched``: its launch; ``began``: when choosing it began;
        ``blocked``: seconds the read waited on the device; ``prefilled``: a chunk ran before it on the device).
        Records its wall seconds, member and span parts, and starts the next span. Returns (its wall seconds, its
        span: everything since the previous read, what the chooser prices; None where it holds more than the
        iteration's own work: a prompt fed meanwhile)."""
        span = now - (self.last_read or began)
        drafting, host = self.spent["drafting"], self.spent["host"]
        self.parts.append((blocked, drafting, host, max(0.0, span - blocked - drafting - host)))
        self.spent = dict.fromkeys(self.spent, 0.0)
        fed, self.fed = self.fed, False
        seconds, self.last_read = now - max(dispatched, self.last_read), now
        self.wall.append(seconds)
        self.members.append(member)
        return seconds, None if fed or prefilled else span

    def report(self, iterations: int, overlapped: int) -> list[str]:
        """Host milliseconds per iteration beside the whole iteration's, as medians (an iteration that compiled or
        resized is an outlier, not the loop's cost) and 90th percentiles over the iterations kept (since ``reset``),
        then per member, so auto's plain iterations compare with incremental's; then ``parts_report``. Empty before
        any iteration."""
        # the newest of each, aligned: another thread (a server's) may read or reset them between two appends
        kept = min(len(self.host), len(self.wall), len(self.members))
        if not kept:
            return []
        host = np.asarray(list(self.host)[-kept:]) * 1e3
        wall = np.asarray(list(self.wall)[-kept:]) * 1e3
        members = np.asarray(list(self.members)[-kept:])
        lines = [f"host {np.median(host):.2f} ms per iteration (p90 {np.percentile(host, 90):.2f}) of "
                 f"{np.median(wall):.2f} ms (p90 {np.percentile(wall, 90):.2f}); {kept} iterations timed of "
                 f"{iterations}, {overlapped} overlapped"]
        if len(set(members)) > 1:
            each = [f"{name} {np.median(wall[members == name]):.2f} ms (host {np.median(host[members == name]):.2f}, "
                    f"{int((members == name).sum())})" for name in dict.fromkeys(members)]
            lines.append(f"per member, median: {'; '.join(each)}")
        return lines + self.parts_report()

    def parts_report(self) -> list[str]:
        """Per member, the mean milliseconds of its iterations' spans by ``PARTS``, so a member's price shows where it
        comes from; empty before any iteration."""
        kept = min(len(self.parts), len(self.members))
        if not kept:
            return []
        parts = np.asarray(list(self.parts)[-kept:]) * 1e3  # [N, 4]
        members = np.asarray(list(self.members)[-kept:])
        out = []
        for name in dict.fromkeys(members):
            mine = parts[members == name]
            split = " + ".join(f"{what} {ms:.2f}" for what, ms in zip(PARTS, mine.mean(axis=0)))
            out.append(f"{name}: {mine.sum(axis=1).mean():.2f} ms per iteration = {split} ({len(mine)} iterations)")
        return out

    def reset(self) -> None:
        """Forgets the iterations timed so far (a server's warm-up is not its serving)."""
        for record in (self.host, self.wall, self.members, self.parts):
            record.clear()
