"""The errors that mean bad input, below every layer: any layer raises them, the command line prints each as one line;
``warn_once``, the one line a fallback prints where the run goes on without what failed; and ``FailureLog``, the
failures a long run survives (a request log that cannot be written, one row's failed step): the first of each kind
logged with its stack, later ones counted.

``CliError`` is a bad flag, file or command; ``RequestError`` a request or engine configuration the
engine cannot serve; ``VocabularyMismatch`` a speculator that does not share the LLM's tokenizer.
They import nothing of jaxspec, so the engine, the speculators, serving and the cluster can all raise them.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading


class CliError(ValueError):
    """A user error reported as one line and exit code 2."""


class RequestError(ValueError):
    """A request the engine cannot serve (prompt too long, bad parameters)."""


class VocabularyMismatch(ValueError):
    """The SSM's tokenizer or vocabulary differs from the LLM's."""


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(cause: str, message: str) -> bool:
    """Prints ``[jaxspec] warning: message`` on stderr the first time ``cause`` is seen in this process (a fallback
    the run survives must not be silent, nor repeat at every iteration); returns whether it printed."""
    with _warned_lock:
        if cause in _warned:
            return False
        _warned.add(cause)
    print(f"[jaxspec] warning: {message}", file=sys.stderr, flush=True)
    return True


def reset_warnings() -> None:
    """Forgets which causes were warned about (a test that checks a fallback's line needs it printed afresh)."""
    with _warned_lock:
        _warned.clear()


class FailureLog:
    """Failures a run survives, by kind: the first of each kind is logged with its stack (``logger.error`` with
    ``exc_info``), later ones are only counted (``counts``), so a failure that repeats at every request is one stack
    in the log, not a line per request forever."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.counts: collections.Counter[str] = collections.Counter()  # kind -> failures so far
        self._lock = threading.Lock()

    def report(self, kind: str, what: str, exc: BaseException) -> int:
        """Counts a failure of ``kind`` (``what`` failed with ``exc``); logs it with its stack the first time.
        Returns the kind's count so far."""
        with self._lock:
            self.counts[kind] += 1
            count = self.counts[kind]
        if count == 1:
            first = (str(exc).strip().splitlines() or [""])[0]
            self.logger.error("%s failed (%s%s); later failures of this kind are counted, not logged again", what,
                              type(exc).__name__, f": {first}" if first else "", exc_info=exc)
        return count
