"""The n-gram (prompt-lookup) speculator: no model, no weights.

The host keeps an index of every n-gram of the request's tokens (prompt and generated
text). Before an iteration it finds the longest suffix of the tokens that occurred
before (``max_n`` down to ``min_n`` tokens; the latest occurrence wins) and proposes the
tokens that followed it; ``jaxspec.decoding.ngram`` turns the proposals into the step's chain.
"""

from __future__ import annotations

import dataclasses

DEFAULT_MAX_N = 3
DEFAULT_MIN_N = 1


@dataclasses.dataclass(frozen=True)
class NGramSpeculator:
    """``--ssm ngram[:N]``: match suffixes of up to N tokens (down to ``min_n``)."""

    max_n: int = DEFAULT_MAX_N
    min_n: int = DEFAULT_MIN_N

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"ngram:N needs N >= {self.min_n}, got {self.max_n}")

    @property
    def name(self) -> str:
        return f"ngram:{self.max_n}"


def speculator_kinds(speculators) -> list[str]:
    """Each speculator's kind, in order: "ngram" (this prompt lookup) or "ssm" (a learned one): what auto derives a
    tree for (``jaxspec.engine.policy.planner.derive_expansions``)."""
    return ["ngram" if isinstance(s, NGramSpeculator) else "ssm" for s in speculators]


def acceptance_priors(speculators) -> list[tuple[float, ...]]:
    """Each learned speculator's recorded agreement by depth (``LoadedModel.acceptance``; () where it has none), in
    order: what auto scores its candidate trees with (``jaxspec.engine.policy.planner.derive_expansions``)."""
    return [tuple(getattr(s, "acceptance", ())) for s, kind in zip(speculators, speculator_kinds(speculators))
            if kind == "ssm"]


class NGramIndex:
    """Latest end position of every n-gram (``min_n`` ≤ n ≤ ``max_n``) of a growing token list."""

    def __init__(self, tokens=(), max_n: int = DEFAULT_MAX_N, min_n: int = DEFAULT_MIN_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self.matched = 0  # length of the suffix the last proposal matched
        self._ends: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        """Appends tokens; n-grams ending before the last token become searchable."""
        for t in tokens:
            self._index_last()
            self.tokens.append(int(t))

    def _index_last(self) -> None:
        end = len(self.tokens) - 1
        for n in range(self.min_n, min(self.max_n, end + 1) + 1):
            self._ends[tuple(self.tokens[end - n + 1 : end + 1])] = end

    def propose(self, depth: int) -> list[int]:
        """Up to ``depth`` tokens that followed the longest earlier match of the current suffix.

        ``self.matched`` is then that match's length (0 when nothing matched).
        """
        toks = self.tokens
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            end = self._ends.get(tuple(toks[len(toks) - n :]))
            if end is not None:
                self.matched = n
                return toks[end + 1 : end + 1 + depth]
        self.matched = 0
        return []
