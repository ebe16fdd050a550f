"""The errors that mean bad input, below every layer: any layer raises them, the command line prints each as one line.

``CliError`` is a bad flag, file or command; ``RequestError`` a request or engine configuration the
engine cannot serve; ``VocabularyMismatch`` a speculator that does not share the LLM's tokenizer.
They import nothing, so the engine, the speculators, serving and the cluster can all raise them.
"""

from __future__ import annotations


class CliError(ValueError):
    """A user error reported as one line and exit code 2."""


class RequestError(ValueError):
    """A request the engine cannot serve (prompt too long, bad parameters)."""


class VocabularyMismatch(ValueError):
    """The SSM's tokenizer or vocabulary differs from the LLM's."""
