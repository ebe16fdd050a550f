"""Which prompt chunk sizes the loop feeds: found on the device that runs them, by timing real prefills.

A prompt enters in chunks of a ladder of sizes (one prefill executable each). The largest size in
use is found by measurement, never fixed: starting from ``START``, the next size up (4x larger) is
tried on the prompts that arrive, and taken when it feeds tokens at least ``GAIN`` faster per
token; the climb stops at the first size that does not pay (a compute-bound CPU stops early:
256 here; a GPU, where a 128-token pass of the default model cost 1.6 one-token passes, should
climb further). A comparison is fair by construction: a *probe* times the first ``W`` tokens of a
prompt (``W`` = the larger size; fed from its start, after at most W/16 reused tokens such as a
cached system prompt) either as one chunk of the larger size or as chunks of the current one, so
both sizes are timed over the same positions and the same attention work. What was found is kept
in the cost cache (``jaxspec.engine.device.costs``) per device, host and engine, so a machine searches
once; ``--prefill-chunk`` fixes the largest size instead (no search), and a multi-process run
(whose processes must feed alike, while their clocks differ) feeds from ``START`` without one.
"""

from __future__ import annotations

import functools
import statistics
from typing import Callable, Sequence

LADDER = (16, 64, 256, 1024, 4096)  # chunk shapes (4x apart: few executables, each a clear step in work)
START = 256  # where the search starts: the size the loop feeds before anything is measured
GAIN = 0.10  # a larger chunk is taken when its tokens cost at least 10% less each
SAMPLES = 2  # probes per size before two sizes are compared
TIMINGS = 3  # single chunks of a size timed alone before covers are priced by them


def ladder(cap: int | None) -> tuple[int, ...]:
    """The chunk sizes below ``cap`` and ``cap`` itself (None: the whole ladder)."""
    if cap is None:
        return LADDER
    return tuple(b for b in LADDER if b < cap) + (cap,)


def holding(tokens: int, sizes: Sequence[int]) -> int:
    """The smallest of ascending ``sizes`` that holds ``tokens`` (the largest where none does)."""
    return next((b for b in sizes if b >= tokens), sizes[-1])


def cheapest_cover(tokens: int, sizes: Sequence[int], pass_cost: Callable[[int], float]) -> int:
    """The first chunk of the cheapest run of chunks (each one of ``sizes``) covering ``tokens``, by ``pass_cost``
    per chunk; at equal cost the larger chunk (fewer calls)."""
    @functools.lru_cache(maxsize=None)
    def best(n: int) -> tuple[float, int]:  # (cost of covering n tokens, -its first chunk)
        return min((pass_cost(b) + (best(n - b)[0] if b < n else 0.0), -b) for b in sizes)

    return -best(tokens)[1]


class ChunkSizer:
    """The chunk sizes one loop feeds, and the search for its largest (see the module's docstring).

    ``cap``: ``--prefill-chunk`` (the largest size, fixed: no search); ``stored``: what an earlier
    process found on this device (``state()``'s dict) or None; ``search``: False keeps the size it
    starts from (a multi-process run); ``save``: called with ``state()`` whenever the search moves.
    """

    def __init__(self, cap: int | None = None, stored: dict | None = None, search: bool = True,
                 save: Callable[[dict], None] | None = None) -> None:
        if cap is not None and cap < 1:
            raise ValueError(f"a prefill chunk must be >= 1 token, got {cap}")
        self.sizes = ladder(cap)
        self.save = save
        self.samples: dict[int, list[float]] = {}  # size -> seconds per token of whole probes (this comparison)
        self.history: list[dict] = []  # the comparisons decided: {"span": tokens, "tokens_per_s": {size: rate}}
        self.settled = cap is not None or not search
        self.timing = search  # whether chunks may be timed alone (not where processes must feed alike)
        self.seconds: dict[int, list[float]] = {}  # size -> seconds of single chunks timed alone (``TIMINGS`` each)
        start = self.sizes[-1] if cap is not None else min(START, self.sizes[-1])
        if cap is None and stored:
            self.seconds = {int(k): list(v) for k, v in stored.get("seconds", {}).items() if int(k) in self.sizes}
            start = stored.get("largest", start)
            self.settled = self.settled or bool(stored.get("settled"))
            self.samples = {int(k): list(v) for k, v in stored.get("samples", {}).items() if int(k) in self.sizes}
            self.history = list(stored.get("history", []))
        self.index = self.sizes.index(start) if start in self.sizes else self.sizes.index(min(START, self.sizes[-1]))

    @property
    def largest(self) -> int:
        """The largest chunk fed now: a long prompt enters in chunks of this size."""
        return self.sizes[self.index]

    @property
    def candidate(self) -> int | None:
        """The size being tried against ``largest`` (None once the search ended)."""
        if self.settled or self.index + 1 >= len(self.sizes):
            return None
        return self.sizes[self.index + 1]

    def probe(self, start: int, length: int) -> int | None:
        """The size a prompt of ``length`` tokens starting at ``start`` should probe with (None: no probe).

        Only a prompt that holds a whole candidate chunk past ``start`` (and a token after it) probes, and only
        from near its beginning (``start`` at most 1/16 of the chunk: a cached system prompt; a later span would
        weigh more attention per token); probes alternate between the two sizes, the one with fewer samples first.
        """
        top = self.candidate
        if top is None or start > top // 16 or length <= start + top:
            return None
        have = {s: len(self.samples.get(s, [])) for s in (self.largest, top)}
        return top if have[top] < have[self.largest] else self.largest

    def size(self, fed: int, left: int, limit: int, probe: int | None = None, start: int = 0) -> int:
        """The next chunk's size for a prompt with ``fed`` tokens in and ``left`` to go, ending within ``limit``
        cache slots: whole chunks of the largest size that fits what is left; the rest in the cheapest run of
        chunks that covers it, once every size that fits was timed on this device (a compute-bound CPU feeds 73
        tokens as 64 + 16 rather than padded to 256; a launch-bound GPU as one chunk), before that in the smallest
        size that holds it. A probing prompt (from ``start``) feeds its first ``candidate`` tokens in chunks of
        ``probe``."""
        top = self.largest
        if probe is not None and fed < start + (self.candidate or 0):
            top = probe
        fits = [b for b in self.sizes if b <= top and fed + b <= limit] or [self.sizes[0]]
        whole = [b for b in fits if b <= left]
        if whole and whole[-1] == fits[-1]:
            return whole[-1]  # a whole chunk of the largest size that fits
        holds = holding(left, fits)  # the smallest chunk that holds the rest
        if whole and all(self.chunk_seconds(b) is not None for b in fits):
            # never a chunk above the one that holds the rest (it pads more for at best the same seconds): a prompt
            # is fed in sizes up to its own bucket, so a job of short prompts prepares no larger one (``reachable``)
            return cheapest_cover(left, [b for b in fits if b <= holds], self.chunk_seconds)
        return holds

    def reachable(self, longest: int | None = None) -> tuple[int, ...]:
        """The chunk sizes a loop may feed (the search's next size included), or, given the ``longest`` prompt a job
        holds, those its prompts can be fed in: every size up to the smallest that holds ``longest`` (``size``
        never pads past it; the search probes only with a prompt longer than its next size)."""
        top = max(self.largest, self.candidate or 0)
        sizes = [b for b in self.sizes if b <= top]
        if longest is not None:
            sizes = [b for b in sizes if b <= holding(longest, sizes)]
        return tuple(sizes)

    def chunk_seconds(self, size: int) -> float | None:
        """What one chunk of ``size`` takes on this device (median of its timings; None until ``TIMINGS``)."""
        seen = self.seconds.get(size, [])
        return statistics.median(seen) if len(seen) >= TIMINGS else None

    def wants_timing(self, size: int) -> bool:
        """Whether the next chunk of ``size`` should run timed alone (until it was ``TIMINGS`` times)."""
        return self.timing and len(self.seconds.get(size, [])) < TIMINGS

    def time_chunk(self, size: int, seconds: float) -> None:
        """One chunk of ``size`` took ``seconds`` timed alone (its executable ready, nothing else on the device)."""
        if self.wants_timing(size) and seconds > 0:
            self.seconds.setdefault(size, []).append(seconds)
            self._save()

    def record(self, size: int, tokens: int, seconds: float) -> None:
        """One whole probe: ``tokens`` fed in chunks of ``size`` took ``seconds`` (its chunks timed alone)."""
        if self.settled or size not in (self.largest, self.candidate) or tokens <= 0 or seconds <= 0:
            return
        self.samples.setdefault(size, []).append(seconds / tokens)
        top = self.candidate
        if min(len(self.samples.get(s, [])) for s in (self.largest, top)) < SAMPLES:
            self._save()
            return
        rates = {s: statistics.median(self.samples[s]) for s in (self.largest, top)}
        self.history.append({"span": top, "tokens_per_s": {str(s): round(1 / r, 1) for s, r in rates.items()}})
        self.samples = {}  # a next comparison times a wider span: both its sizes afresh
        if rates[top] <= (1 - GAIN) * rates[self.largest]:
            self.index += 1
            self.settled = self.candidate is None
        else:
            self.settled = True
        self._save()

    def state(self) -> dict:
        """What the search found so far (JSON-able; ``stored`` of a later ``ChunkSizer``)."""
        return {"largest": self.largest, "settled": self.settled, "history": self.history,
                "samples": {str(k): v for k, v in sorted(self.samples.items())},
                "seconds": {str(k): v for k, v in sorted(self.seconds.items())}}

    def describe(self) -> str:
        """One line for ``-v``: the largest chunk, and prefill tokens/s by chunk size as the comparisons found."""
        found = "; ".join(f"over {h['span']} tokens " + " vs ".join(f"{s}: {r:,.0f} tok/s"
                                                                   for s, r in h["tokens_per_s"].items())
                          for h in self.history)
        where = "settled" if self.settled else f"trying {self.candidate}"
        return f"prefill chunks up to {self.largest} tokens ({where}{'; ' + found if found else ''})"

    def _save(self) -> None:
        if self.save is not None:
            self.save(self.state())
