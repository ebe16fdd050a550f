"""Stop strings: the one rule ``jaxspec generate``, ``jaxspec serve`` and a multi-process run's peers apply.

The rule (OpenAI's): generation stops at the first token whose text completes a stop string;
the returned text ends right before the earliest stop string in it (text before the stop inside
the same token is kept); the completion's tokens are those through that token, its finish reason
``stop``. An EOS after it in the same step is dropped with the rest.

Text is detokenised incrementally, one token at a time over a short window of earlier tokens
(vLLM's prefix / read offsets), and waits while its newest bytes are an incomplete UTF-8
character; each token costs a few tokens' decoding and a search of the last stop's length of
text, never the whole text. Token by token, the match does not depend on how many tokens a step
emits, so every mode, the engine thread and the edge that streams the text agree. A stream holds
back only the tail that could still begin a stop string.
"""

from __future__ import annotations

from typing import Sequence

from jaxspec.engine.runner import RequestError

MAX_STOPS = 16  # stop strings per request (every entry point: CLI, server, multi-process message)
MAX_STOP_CHARS = 256  # characters per stop string


def check_stops(stops: Sequence[str]) -> None:
    """Raises RequestError unless ``stops`` holds at most MAX_STOPS non-empty strings of at most MAX_STOP_CHARS:
    the one rule for the CLI, the server and the engine (and what the multi-process message is sized for)."""
    if len(stops) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise RequestError(f"stop takes 1 to {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters")


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

    @classmethod
    def text_of(cls, tokenizer, ids: Sequence[int], stops: Sequence[str] = ()) -> tuple[str, bool]:
        """A whole completion's text (cut before its first stop string) and whether a stop string cut it."""
        stream = cls(tokenizer, stops)
        stream.feed(ids)
        return stream.finish()

    def __call__(self, ids: list[int]) -> int | None:
        """The engine's check: of the generated ``ids``, how many the completion keeps once a stop string completed.

        The engine passes what it generated so far each step; only the ids not yet fed are decoded.
        Ids that do not continue what was fed (never expected) start the text over."""
        if len(ids) < len(self.ids) or ids[: len(self.ids)] != self.ids:
            self._start()
        return self.feed(ids[len(self.ids):])

    def feed(self, ids: Sequence[int]) -> int | None:
        """Appends ids one at a time until a stop string completes; returns ``tokens`` (None while none did)."""
        for t in ids:
            if self.end is not None:
                break
            self.ids.append(int(t))
            if self._catch_up(final=False) and self.stops:
                self._match()
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
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _catch_up(self, final: bool) -> bool:
        """Moves the newly complete text of the window into ``text``; True when some arrived."""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) <= len(before) or (not final and after.endswith("\ufffd")):
            return False
        self.text += after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        return True

    def _match(self) -> None:
        """Searches the text a stop string completed by the newest token could lie in."""
        start = max(0, self._searched - self.longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        self._searched = len(self.text)
        if hits:
            self.end, self.tokens = min(hits), len(self.ids)

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
