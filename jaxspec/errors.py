"""The errors that mean bad input, below every layer: any layer raises them, the command line prints each as one line;
and ``warn_once``, the one line a fallback prints where the run goes on without what failed.

``CliError`` is a bad flag, file or command; ``RequestError`` a request or engine configuration the
engine cannot serve; ``VocabularyMismatch`` a speculator that does not share the LLM's tokenizer.
They import nothing of jaxspec, so the engine, the speculators, serving and the cluster can all raise them.
"""

from __future__ import annotations

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
