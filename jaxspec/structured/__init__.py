"""Structured output on the host: grammars compiled by llguidance, one matcher per constrained request.

llguidance (a Rust library with Python bindings and no install requirements; one of vLLM's
structured-output backends) compiles JSON schemas, regular expressions and Lark grammars
against the LLM's tokenizer and computes the bitmask of the tokens allowed after a prefix.
xgrammar would do too, but it requires torch, which the runtime never imports.

``Grammar`` is what a request asks for; ``Vocabulary.compile`` validates it once per content
(cached); ``RowMasks`` is the callback the constrained decoding step calls from the device
(``jaxspec.decoding.constrain``): the mask after every tree path it asks about, walking each
row's matcher forward and rolling it back, so the matcher itself only ever advances along
the tokens the engine commits.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Sequence

import numpy as np

KINDS = ("json_schema", "json_object", "regex", "lark")
MAX_GRAMMAR_CHARS = 100_000  # a grammar's source text (schemas and grammars from clients are bounded)
CACHE_SIZE = 256  # compiled grammars kept per vocabulary


class GrammarError(ValueError):
    """A grammar that does not compile (the message names the problem) or the library is missing."""


@dataclasses.dataclass(frozen=True)
class Grammar:
    """What a request's output must match: ``kind`` in KINDS, ``source`` its text (a JSON schema as JSON text)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"the {self.kind} is {len(self.source)} characters; at most {MAX_GRAMMAR_CHARS}")
        if self.kind != "json_object" and not self.source.strip():
            raise GrammarError(f"the {self.kind} is empty")

    @classmethod
    def json_schema(cls, schema: dict | str) -> "Grammar":
        """A JSON schema given as a dict or as JSON text (re-serialised compactly, so equal schemas share a
        compilation; key order is kept: it is the order the properties are generated in)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema is an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    def describe(self) -> str:
        return self.kind if self.kind == "json_object" else f"{self.kind} ({len(self.source)} characters)"


def _llguidance():
    try:
        import llguidance  # noqa: PLC0415 (the runtime loads it only for constrained requests)
    except ImportError as e:  # pragma: no cover — a project install always has it
        raise GrammarError("structured output needs llguidance: pip install llguidance") from e
    return llguidance


# JSON is generated compactly ({"a":1,"b":[2]}) unless a schema's "x-guidance" says otherwise: free whitespace
# lets a small model wander into runs of newlines, and a fixed layout makes keys and punctuation forced tokens.
JSON_DEFAULTS = {"whitespace_flexible": False}


@functools.lru_cache(maxsize=4 * CACHE_SIZE)
def grammar_text(g: Grammar) -> str:
    """llguidance's grammar for ``g`` (not yet checked against a tokenizer)."""
    llm = _llguidance().LLMatcher
    if g.kind == "json_object":
        return llm.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=JSON_DEFAULTS)
    if g.kind == "json_schema":
        try:
            return llm.grammar_from_json_schema(g.source, defaults=JSON_DEFAULTS)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
    if g.kind == "regex":
        return llm.grammar_from_regex(g.source)
    return llm.grammar_from_lark(g.source)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A validated grammar: matchers are made from ``text`` (cheap once the grammar was seen)."""

    grammar: Grammar
    text: str


class Vocabulary:
    """The LLM's tokenizer as llguidance sees it: ``vocab`` ids (the LLM's logits width), EOS ids."""

    def __init__(self, tokenizer, vocab: int, eos_ids: Sequence[int]) -> None:
        ll = _llguidance()
        backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        if backend is None:
            raise GrammarError(f"structured output needs a fast (tokenizers) tokenizer, got {type(tokenizer).__name__}")
        self.vocab = vocab
        self.eos_ids = tuple(int(t) for t in eos_ids)
        self.words = (vocab + 31) // 32
        self.tokenizer = ll.LLTokenizer(backend.to_str(), n_vocab=vocab, eos_token=list(self.eos_ids))
        self._compile = functools.lru_cache(maxsize=CACHE_SIZE)(self._check)
        self._executor = None

    def _check(self, g: Grammar) -> Compiled:
        text = grammar_text(g)
        error = _llguidance().LLMatcher.validate_grammar(text, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise GrammarError(f"the {g.kind} does not compile: {_one_line(error)}")
        return Compiled(g, text)

    def compile(self, g: Grammar) -> Compiled:
        """Validates ``g`` against this tokenizer (raises GrammarError naming the problem); cached by content."""
        return self._compile(g)

    def matcher(self, compiled: Compiled):
        """A fresh llguidance matcher at the start of ``compiled``'s language."""
        m = _llguidance().LLMatcher(self.tokenizer, compiled.text, log_level=0)
        if m.is_error():
            raise GrammarError(f"the {compiled.grammar.kind} does not compile: {_one_line(m.get_error())}")
        return m

    def advance(self, matcher, tokens: Sequence[int]) -> tuple[int, int]:
        """Consumes ``tokens`` while the grammar allows them; returns (how many it took, how many of those
        ``rollback`` must undo).

        EOS is allowed once the grammar is complete: a stopped matcher takes it without recording it,
        an accepting one through ``consume_token`` (``try_consume_tokens`` refuses EOS). A refused
        token leaves the matcher as it was (no error state).
        """
        done = recorded = 0
        for t in tokens:
            if t in self.eos_ids and matcher.is_stopped():
                ok, kept = True, 0
            elif t in self.eos_ids:
                ok, kept = matcher.is_accepting() and matcher.consume_token(int(t)), 1
            else:
                ok, kept = matcher.try_consume_tokens([int(t)]) == 1, 1
            if not ok:
                break
            done += 1
            recorded += kept
        return done, recorded

    def executor(self):
        """llguidance's thread pool for computing several matchers' masks at once (made on first use)."""
        if self._executor is None:
            self._executor = _llguidance().LLExecutor(num_threads=min(os.cpu_count() or 1, 16))
        return self._executor

    def mask(self, matcher) -> np.ndarray:
        """The packed mask [W] int32 of the tokens ``matcher`` allows next."""
        out = np.empty((1, self.words), np.int32)
        matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        return out[0]


def _one_line(error: str) -> str:
    """llguidance's multi-line diagnostic as one line: its first line plus the ``error:`` lines."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    picked = lines[:1] + [line for line in lines[1:] if line.startswith("error:")]
    return " ".join(picked)[:400]


def allowed(mask: np.ndarray) -> np.ndarray:
    """Token ids a packed mask [W] allows."""
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))


class RowMasks:
    """The host half of a constrained step: one matcher (or None) per state row, masks by tree path.

    ``begin`` installs the rows' matchers before a step is dispatched (their state is the
    committed text: prompt start plus every emitted token, the pending root included);
    ``__call__`` is the ``Masker`` callback; ``forced`` proposes the chain the grammar forces.
    Masks are memoised per (row, path) until the next ``begin``. A row whose matcher fails (llguidance, a bug)
    fails alone: it is recorded in ``failed`` (``take_failed``), left unconstrained, and the loop ends its request;
    the other rows keep their masks.
    """

    def __init__(self, vocab: Vocabulary) -> None:
        self.vocab = vocab
        self.rows: list = []
        self._memo: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}
        self.masks = 0  # masks computed (not memoised), for the cost report
        self.seconds = 0.0  # host time spent in the callback
        self.callbacks = 0  # calls from inside a step (trees with SSM drafts; others get their masks as input)
        self.failed: dict[int, BaseException] = {}  # row -> its matcher's failure since ``begin``

    def take_failed(self) -> dict[int, BaseException]:
        """The rows whose matcher failed since ``begin`` (row -> exception), forgotten once taken."""
        out, self.failed = self.failed, {}
        return out

    def begin(self, matchers: Sequence) -> None:
        """Installs the rows' matchers and computes every row's root mask at once, in llguidance's thread pool
        (every constrained step needs them; with the device idle until the step is dispatched)."""
        self.rows = list(matchers)
        self._memo.clear()
        self.failed = {}
        live = [(r, m) for r, m in enumerate(self.rows) if m is not None]
        if len(live) < 2:
            return
        began = time.perf_counter()
        out = np.empty((len(live), self.vocab.words), np.int32)  # [rows with a grammar, W]
        try:
            self.vocab.executor().unsafe_compute_mask_ptr([(m, i) for i, (_, m) in enumerate(live)],
                                                          out.ctypes.data, out.shape[1] * 4, out.shape[0])
        except Exception:  # noqa: BLE001 — one bad matcher fails the pool's call: each row's mask comes alone
            return
        for i, (r, _) in enumerate(live):
            self._memo[(r, ())] = out[i]
        self.masks += len(live)
        self.seconds += time.perf_counter() - began

    def _guard(self, row: int, exc: Exception) -> None:
        """Records row ``row``'s failure (its first one since ``begin``); the row is unconstrained from then on."""
        self.failed.setdefault(row, exc)
        self.rows[row] = None

    def path_mask(self, row: int, path: tuple[int, ...]) -> np.ndarray | None:
        """The mask after ``path`` from row ``row``'s committed state; None if the grammar forbids the path."""
        key = (row, path)
        if key in self._memo:
            return self._memo[key]
        m = self.rows[row]
        done, recorded = self.vocab.advance(m, path)
        out = self.vocab.mask(m) if done == len(path) else None
        if recorded:
            m.rollback(recorded)
        self.masks += out is not None
        self._memo[key] = out
        return out

    def __call__(self, tokens: np.ndarray, parent: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        began = time.perf_counter()
        self.callbacks += 1
        b, k = nodes.shape
        out = np.full((b, k, self.vocab.words), -1, np.int32)
        p = parent.shape[1]
        for r in range(min(b, len(self.rows))):
            if self.rows[r] is None:
                continue
            try:
                for j in range(k):
                    node = int(nodes[r, j])
                    if node < 0:
                        continue
                    path = []
                    while node > 0 and len(path) < p:  # node 0 is the root, already consumed
                        path.append(int(tokens[r, node]))
                        node = int(parent[r, node])
                    mask = self.path_mask(r, tuple(reversed(path)))
                    if mask is not None:  # a path the grammar forbids is never accepted: leave it unmasked
                        out[r, j] = mask
            except Exception as exc:  # noqa: BLE001 — this row fails alone (an exception here would fail the step)
                self._guard(r, exc)
                out[r] = -1
        self.seconds += time.perf_counter() - began
        return out

    def chain_masks(self, chains: Sequence[Sequence[int]], proposals: Sequence[Sequence[int]], forced_depth: int,
                    ngram_depth: int) -> np.ndarray:
        """[B, 1 + F + D, W] int32: each row's mask at the root, after each prefix of its forced chain (F
        slots), then after each prefix of its n-gram proposal (D slots); -1 (all allowed) for rows without a
        grammar, slots past a chain's end and paths the grammar forbids. The masks of a tree known before
        dispatch (``DecodeConfig.host_masks``), laid out for ``constrain.chain_node_masks``."""
        began = time.perf_counter()
        out = np.full((len(self.rows), 1 + forced_depth + ngram_depth, self.vocab.words), -1, np.int32)
        for r, m in enumerate(self.rows):
            if m is None:
                continue
            paths = [()] + [tuple(chains[r][:t]) for t in range(1, min(len(chains[r]), forced_depth) + 1)]
            slots = list(range(len(paths)))
            ngram = [tuple(proposals[r][:t]) for t in range(1, min(len(proposals[r]), ngram_depth) + 1)]
            paths += ngram
            slots += [1 + forced_depth + t for t in range(len(ngram))]
            try:
                for slot, path in zip(slots, paths):
                    mask = self.path_mask(r, path)
                    if mask is not None:
                        out[r, slot] = mask
            except Exception as exc:  # noqa: BLE001 — this row fails alone
                self._guard(r, exc)
                out[r] = -1
        self.seconds += time.perf_counter() - began
        return out

    def forced(self, row: int, depth: int) -> list[int]:
        """Up to ``depth`` tokens the grammar forces after row ``row``'s committed text.

        llguidance's fast-forward tokens (the canonical tokens of the bytes the grammar
        forces, or those bytes tokenized greedily), and tokens that are the only one their mask
        allows (EOS once the grammar is complete). Proposed as a draft chain: the LLM verifies
        them like any draft, and where the mask allows one token only, its masked distribution
        accepts it with certainty. A matcher that fails leaves the row unconstrained, with no chain (``failed``).
        """
        m = self.rows[row]
        if m is None or depth < 1:
            return []
        try:
            return self._forced(row, m, depth)
        except Exception as exc:  # noqa: BLE001 — this row fails alone
            self._guard(row, exc)
            return []

    def _forced(self, row: int, m, depth: int) -> list[int]:
        """``forced`` for row ``row``, whose matcher is ``m`` (raises what the matcher raises)."""
        chain: list[int] = []
        ff: list[int] = []
        recorded = 0
        while len(chain) < depth:
            if m.is_stopped():  # the grammar is complete: EOS is all that is left
                chain.append(self.vocab.eos_ids[0])
                break
            # the forced bytes' tokens; llguidance holds back a last token that later bytes could extend, so
            # those bytes are tokenized here as a guess (a draft: the LLM decides)
            ff = ff or list(m.compute_ff_tokens()) or list(self.vocab.tokenizer.tokenize_bytes(m.compute_ff_bytes()))
            mask = self._memo.get((row, tuple(chain)))
            if mask is None:
                mask = self.vocab.mask(m)
                self.masks += 1
                self._memo[(row, tuple(chain))] = mask
            if ff:
                t = int(ff.pop(0))
            else:
                only = allowed(mask)
                if len(only) != 1:
                    break
                t = int(only[0])
            if not (int(mask[t // 32]) >> (t % 32)) & 1:
                break
            done, kept = self.vocab.advance(m, [t])
            if not done:
                break
            chain.append(t)
            recorded += kept
        if recorded:
            m.rollback(recorded)
        return chain
