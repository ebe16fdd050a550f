"""Stop strings: the one rule ``jaxspec generate``, ``jaxspec serve`` and a multi-process run's peers apply.

The rule (OpenAI's): generation stops at the first token whose text completes a stop string;
the returned text ends right before the earliest stop string in it (text before the stop inside
the same token is kept); the completion's tokens are those through that token, its finish reason
``stop``. An EOS after it in the same step is dropped with the rest.

Text is detokenised incrementally over a short window of earlier tokens (vLLM's prefix / read
offsets) and waits while its newest bytes are an incomplete UTF-8 character; a step costs a few
tokens' decoding and a search of the new text (and the longest stop's length before it), never
the whole text. The match is defined token by token (a step that completes a stop string is fed
again one token at a time), so it does not depend on how many tokens a step emits: every mode,
the engine thread and the edge that streams the text agree. A stream holds back only the tail
that could still begin a stop string.
"""

from __future__ import annotations

from typing import Callable, Sequence

from jaxspec.engine.device.runner import RequestError

MAX_STOPS = 16  # stop strings per request (every entry point: CLI, server, multi-process message)
MAX_STOP_CHARS = 256  # characters per stop string


def check_stops(stops: Sequence[str]) -> None:
    """Raises RequestError unless ``stops`` holds at most MAX_STOPS non-empty strings of at most MAX_STOP_CHARS:
    the one rule for the CLI, the server and the engine (and what the multi-process message is sized for)."""
    if len(stops) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise RequestError(f"stop takes 1 to {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters")


def decoder(tokenizer) -> Callable[[list[int]], str]:
    """ids -> text without special tokens: the Rust tokenizer's own decode where transformers adds nothing to it
    (no clean-up of spaces), which costs a microsecond where transformers' wrapper costs tens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class StopText:
    """One completion's text under its stop strings: fed token ids, it says where the completion stops.

    Three views of the same rule: ``__call__`` is the engine's stop check (``Request.stop``: the
    generated ids so far -> how many to keep, None while no stop string completed); ``add`` /
    ``finish`` stream the text as it becomes safe to send; ``text_of`` is a whole completion's text.
    """

    def __init__(self, tokenizer, stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.longest = max(map(len, self.stops), default=0)
        self._decoder = decoder(tokenizer)
        self._start()

    def _start(self) -> None:
        """Empties the text (no ids fed)."""
        self.ids: list[int] = []  # the ids fed so far
        self.text = ""  # their text, less an incomplete character at the end
        self.end: int | None = None  # where the first stop string starts in ``text``, once one completed
        self.tokens: int | None = None  # the completion's tokens then: through the one that completed it
        self.sent = 0  # characters of ``text`` handed out by ``add`` / ``finish``
        self._prefix = self._read = 0  # the decoding window: ids[_prefix:_read] is text already taken
        self._searched = 0  # characters of ``text`` searched for stop strings
        self._pending = ""  # complete text before an incomplete character at the end (searched, not taken)

    @classmethod
    def text_of(cls, tokenizer, ids: Sequence[int], stops: Sequence[str] = ()) -> tuple[str, bool]:
        """A whole completion's text (cut before its first stop string) and whether a stop string cut it."""
        stream = cls(tokenizer, stops)
        stream.feed(ids)
        return stream.finish()

    def __call__(self, ids: list[int]) -> int | None:
        """The engine's check: of the generated ``ids``, how many the completion keeps once a stop string completed.

        The engine passes what it generated so far each step; only the ids not yet fed are decoded.
        Ids that visibly do not continue what was fed (never expected) start the text over."""
        n = len(self.ids)
        if len(ids) < n or (n and ids[n - 1] != self.ids[-1]):
            self._start()
        return self.feed(ids[len(self.ids):])

    def feed(self, ids: Sequence[int]) -> int | None:
        """Appends ids until a stop string completes; returns ``tokens`` (None while none did).

        A step's ids decode together; only when a stop string completed among them (or their last
        character is incomplete) are they fed again one at a time, to find the token that completed it."""
        if self.end is not None or not len(ids):
            return self.tokens
        if len(ids) > 1:
            mark = len(self.ids), len(self.text), self._prefix, self._read
            self.ids.extend(int(t) for t in ids)
            if self._catch_up(final=False) and self._search() is None:
                self._searched = len(self.text)
                return None
            n, chars, self._prefix, self._read = mark
            del self.ids[n:]
            self.text, self._pending = self.text[:chars], ""
        for t in ids:
            self.ids.append(int(t))
            if self._catch_up(final=False):
                cut = self._search()
                self._searched = len(self.text)
                if cut is not None:
                    self.text += self._pending  # the complete text the stop string may end in
                    self.end, self.tokens = cut, len(self.ids)
                    break
        return self.tokens

    def add(self, ids: Sequence[int]) -> str:
        """Feeds ``ids``; returns the text now safe to send (none past a stop string, none that may begin one)."""
        self.feed(ids)
        if self.end is not None:
            return self._send(self.end)
        return self._send(len(self.text) - self._held())

    def finish(self) -> tuple[str, bool]:
        """The rest of the text (cut before the first stop string) and whether a stop string cut it.

        An incomplete character left at the end comes out as U+FFFD; it is not searched (the engine never saw it)."""
        if self.end is None:
            self._catch_up(final=True)
            return self._send(len(self.text)), False
        return self._send(self.end), True

    def _decode(self, ids: list[int]) -> str:
        return self._decoder(ids)

    def _catch_up(self, final: bool) -> bool:
        """Moves the newly complete text of the window into ``text``; True when some arrived.

        While the newest bytes are an incomplete character, the complete text before them waits in
        ``_pending`` (searched, not yet taken): a token that completes a stop string and begins a
        character stops the completion at that token, not one later (or never, at the end)."""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        self._pending = ""
        if len(after) <= len(before):
            return False
        new = after[len(before):]
        if not final and new.endswith("\ufffd"):
            self._pending = new.rstrip("\ufffd")
            return bool(self._pending)
        self.text += new
        self._prefix, self._read = self._read, len(self.ids)
        return True

    def _search(self) -> int | None:
        """Where the earliest stop string completed by the text since the last search starts, or None."""
        if not self.stops:
            return None
        start = max(0, self._searched - self.longest + 1)
        text = self.text + self._pending
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits, default=None)

    def _held(self) -> int:
        """Characters at the end of the unsent text that could still begin a stop string."""
        tail = self.text[max(self.sent, len(self.text) - self.longest + 1):]
        for i in range(len(tail)):
            if any(s.startswith(tail[i:]) for s in self.stops):
                return len(tail) - i
        return 0

    def _send(self, end: int) -> str:
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out
