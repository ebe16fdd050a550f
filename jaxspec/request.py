"""A request as plain data: what it asks (``SamplerParams``, ``Request``), what it hears (``Event``) and what it
got (``Generation``, ``SpecStats``).

Below every layer beside ``jaxspec.errors`` and ``jaxspec.config``: it imports no JAX, so the host-only scheduler
(``jaxspec.engine.policy.scheduler``), the server's request parsing and the Python API share these types with the device
side without loading a device.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

class SamplingError(ValueError):
    """Sampling parameters out of range."""


# Values are made exact in the dtype the device uses (float32, int32) once, here, so every
# process of a multi-process run (and the host's own decisions) sees what the device runs.
MIN_TEMPERATURE = 1e-5  # below it a request is greedy (as vLLM): 1/T would overflow float32 logits
MAX_TEMPERATURE = 1e4
MIN_TOP_P = 1e-6  # any smaller nucleus holds the top token alone, as this one does (p_top >= 1/vocab)
MAX_TOP_K = 2**31 - 1  # int32 on the device; a larger k keeps every token too
SEED_RANGE = (-2**63, 2**64)  # a seed is read as 64 bits: signed (the server's range) or unsigned (seed + i past it)
_REAL = (int, float, np.integer, np.floating)


@dataclasses.dataclass(frozen=True)
class SamplerParams:
    """What a request asks of the sampler; temperature 0 means greedy.

    Canonical on construction: temperature below ``MIN_TEMPERATURE`` becomes 0 (greedy),
    top-p below ``MIN_TOP_P`` becomes it and top-k above ``MAX_TOP_K`` becomes it (each
    the same distribution); float values are rounded to float32, what the device uses.
    """

    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off; must lie in (0, 1]
    seed: int = 0

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, _REAL) or not 0 <= t <= MAX_TEMPERATURE:
            raise SamplingError(f"temperature must lie in [0, {MAX_TEMPERATURE:g}], got {t!r}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise SamplingError(f"top-k must be an integer >= 0 (0 disables it), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, _REAL) or not 0.0 < p <= 1.0:
            raise SamplingError(f"top-p must lie in (0, 1], got {p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise SamplingError(f"seed must be an integer, got {self.seed!r}")
        if not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise SamplingError(f"seed must fit in 64 bits (-2**63 <= seed < 2**64), got {self.seed!r}")
        t = 0.0 if t < MIN_TEMPERATURE else float(np.float32(t))
        object.__setattr__(self, "temperature", t)
        object.__setattr__(self, "top_k", int(min(k, MAX_TOP_K)))
        object.__setattr__(self, "top_p", float(np.float32(max(p, MIN_TOP_P))))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def seed_words(self) -> np.ndarray:
        """The seed's PRNG key: ``seed_words(self.seed)``."""
        return seed_words(self.seed)


def seed_words(seed: int) -> np.ndarray:
    """[2] uint32: the high and low words of ``seed`` mod 2**64, the threefry key ``jax.random.PRNGKey`` makes of a
    64-bit seed, so every 64-bit seed draws its own stream (a seed below 2**32 keeps the key ``[0, seed]``)."""
    bits = int(seed) % 2**64
    return np.asarray([bits >> 32, bits & 0xFFFFFFFF], np.uint32)


@dataclasses.dataclass(frozen=True)
class SpecStats:
    """One request's speculation, as the server's ``/metrics`` counts it over all requests.

    A draft token proposed by two speculators counts as accepted for both; ``accepted_tokens`` counts it once.
    """

    verify_steps: int  # LLM verification passes after the prefill
    draft_steps: int  # of those, passes that verified at least one draft token (/metrics' num_drafts)
    drafted: dict[str, int]  # speculator -> draft tokens it had verified ("grammar": tokens a grammar forced)
    accepted: dict[str, int]  # speculator -> of those, tokens on the accepted path
    accepted_tokens: int  # draft tokens accepted; each verify step emits these plus the LLM's own token

    @property
    def draft_tokens(self) -> int:
        return sum(self.drafted.values())

    @property
    def accept_length(self) -> float:
        """Tokens per verify step (accepted drafts + 1; 0 before the first step), SGLang's accept length."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    def as_dict(self) -> dict:
        """The plain form every output carries (JSONL ``speculation``, the server's extension field, the API)."""
        return {"verify_steps": self.verify_steps, "draft_steps": self.draft_steps, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "accept_length": round(self.accept_length, 4),
                "by_speculator": {name: {"drafted": d, "accepted": self.accepted.get(name, 0)}
                                  for name, d in self.drafted.items()}}


@dataclasses.dataclass
class Generation:
    """One finished generation and its counters."""

    token_ids: list[int]
    llm_steps: int  # LLM verification passes after the prefill
    ssm_steps: int  # SSM draft forwards (all SSMs, all levels)
    seconds: float
    finish_reason: str  # "eos" | "stop" | "length" | "cancelled" | "error"
    step_tokens: list[int] = dataclasses.field(default_factory=list)  # tokens emitted by each LLM step
    trees: list[str] = dataclasses.field(default_factory=list)  # family member run by each LLM step
    prefill_seconds: float = 0.0  # from the request's admission (its first prompt chunk) to its first token
    cached_tokens: int = 0  # prompt tokens whose K/V were reused from an earlier prompt, not computed
    error: str | None = None  # finish_reason "error": the one-line reason the request failed
    drafted: dict[str, int] = dataclasses.field(default_factory=dict)  # speculator -> draft tokens verified
    accepted: dict[str, int] = dataclasses.field(default_factory=dict)  # speculator -> draft tokens accepted
    draft_steps: int = 0  # LLM steps that verified at least one draft token
    # family member -> [LLM steps of it, seconds they took]: each step's seconds run from the request's previous
    # read (its first token, for the first) to this one's, so they add up to its decoding seconds
    step_seconds: dict[str, list] = dataclasses.field(default_factory=dict)

    def count_step(self, emitted: int, tree: str, drafted: dict[str, int], accepted: dict[str, int],
                   seconds: float = 0.0) -> None:
        """One LLM step of this request: ``emitted`` tokens (accepted drafts + 1) from family member ``tree``,
        ``drafted`` / ``accepted`` draft tokens per speculator, ``seconds`` since its previous step was read."""
        self.llm_steps += 1
        self.step_tokens.append(emitted)
        self.trees.append(tree)
        spent = self.step_seconds.setdefault(tree, [0, 0.0])
        spent[0] += 1
        spent[1] += seconds
        self.draft_steps += any(drafted.values())
        for name, count in drafted.items():
            self.drafted[name] = self.drafted.get(name, 0) + count
            self.accepted[name] = self.accepted.get(name, 0) + accepted.get(name, 0)

    @property
    def speculation(self) -> SpecStats:
        """This request's verify steps, drafts and acceptance by speculator."""
        return SpecStats(self.llm_steps, self.draft_steps, dict(self.drafted), dict(self.accepted),
                         sum(self.step_tokens) - len(self.step_tokens))

    @property
    def iteration_seconds(self) -> dict[str, dict]:
        """Where its decoding time went: family member ("none": plain steps) -> {"n": its LLM steps, "s": their
        seconds}; the counts add up to ``llm_steps``, the seconds to its decoding time (first token to last)."""
        return {tree: {"n": n, "s": round(s, 6)} for tree, (n, s) in self.step_seconds.items()}

    @property
    def tree_counts(self) -> dict[str, int]:
        """How many LLM steps ran each tree (``--mode auto`` switches between them)."""
        return {t: self.trees.count(t) for t in dict.fromkeys(self.trees)}

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens verified per LLM decoding step (prefill's first token excluded)."""
        return float(np.mean(self.step_tokens)) if self.step_tokens else 0.0


@dataclasses.dataclass
class Request:
    """One generation request of a batch."""

    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplerParams = SamplerParams()
    stop_ids: Sequence[int] | None = None  # None: the LLM's EOS ids
    stop: Callable[[list[int]], int | None] | None = None  # stop check (``stops.StopText``): ids -> tokens kept
    id: str = ""
    stop_strings: tuple[str, ...] = ()  # what ``stop`` matches (a multi-host server sends them to its peers)
    grammar: object = None  # structured output: a ``jaxspec.structured.Grammar`` the text must match
    learn: bool = True  # False: auto's acceptance statistics ignore it (synthetic warm-up traffic)


@dataclasses.dataclass
class Event:
    """What a request hears from the engine thread: new tokens, then a final event."""

    request_id: str
    token_ids: list[int]  # tokens new since the previous event (may be empty on the final event)
    finish_reason: str | None  # None while running; "eos" | "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total so far
    generation: Generation | None = None  # counters, on the final event
    tree: str | None = None  # the family member whose iteration emitted these tokens (None: the prefill)
    cached_tokens: int = 0  # prompt tokens whose K/V were reused, not computed (the prefix cache's hit)


def finished(req: Request, ev: Event) -> Generation:
    """A request's Generation from its final event (one that failed before any slot held it gets an empty one)."""
    gen = ev.generation
    if gen is None:
        gen = Generation([], 0, 0, 0.0, ev.finish_reason or "error", cached_tokens=ev.cached_tokens)
    if ev.finish_reason == "error":
        gen.finish_reason, gen.error = "error", ev.error or "error"
    return gen


def all_finished(gens: Sequence[Generation]) -> list[Generation]:
    """``gens`` where none failed; else RuntimeError naming the first failure (a benchmark's numbers need all)."""
    for gen in gens:
        if gen.finish_reason == "error":
            raise RuntimeError(f"a request failed: {gen.error}")
    return list(gens)
