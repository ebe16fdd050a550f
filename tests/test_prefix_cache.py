"""Prefix caching (issue 37): requests sharing a prompt prefix reuse its cached K/V blocks; no output token changes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model
from jaxspec.decoding import sampling
from jaxspec.speculators.ngram import NGramSpeculator
from jaxspec.engine import Engine, RequestError, early_exit
from jaxspec.engine.core import EngineCore, Request
from jaxspec.engine.device.prefix import BLOCK, PrefixCache
from test_drafter import drafter

SYSTEM = [int(t) for t in np.random.default_rng(0).integers(1, 64, 300)]  # longer than the smallest cache bucket
SYSTEM2 = [int(t) for t in np.random.default_rng(1).integers(1, 64, 64)]
OTHER = [0, 9, 8, 7]  # shares nothing (no system prompt holds 0): it takes the staging row between two hits


@pytest.fixture(scope="module")
def llm():
    return tiny_model()


def scripted() -> list[tuple[list[int], int]]:
    """(prompt, the prompt tokens a cache of every block so far must serve) in admission order."""
    return [
        (SYSTEM[:40] + [5, 5], 0),  # cold: caches blocks 0-1
        (OTHER, 0),
        (SYSTEM[:40] + [3], 32),  # two blocks hit; the prompt goes on mid-block
        (OTHER, 0),
        (SYSTEM[:20] + [1, 2], 16),  # the shared prefix ends mid-block: only the full block hits
        (OTHER, 0),
        (SYSTEM + [4], 32),  # longer than every block cached so far: hits 2, caches the rest
        (OTHER, 0),
        (SYSTEM + [6, 6], 288),  # the whole 300-token prefix but its last partial block, past the first bucket
        (OTHER, 0),
        (SYSTEM + [4], 288),  # an exact duplicate
    ]


# tree: ~2 min cold; the drafter (the default speculator) keeps speculating rows in the default run
@pytest.mark.parametrize("mode", ["incremental", pytest.param("tree", marks=pytest.mark.slow), "drafter"])
def test_a_hit_changes_no_token_and_counts_exactly(llm, mode):
    spec = {"incremental": {}, "tree": dict(speculators=[early_exit(llm, 1), NGramSpeculator(3)],
                                             expansion=[(1, 2, 1), (1, 1, 1)]),
            "drafter": dict(speculators=[drafter(llm)], expansion=[(1, 2, 1)])}[mode]
    engine = Engine(llm, **spec)
    script = scripted()
    sampled = sampling.SamplerParams(0.8, seed=5)
    requests = [Request(p, 8, sampled if k == 8 else sampling.SamplerParams()) for k, (p, _) in enumerate(script)]
    cold = EngineCore(engine, max_batch=1, max_model_len=400, reuse_prefix=False)
    want = [g.token_ids for g in cold.generate(requests)]
    assert cold.prefix.stats.hits == 0 and len(cold.prefix) == 0

    batch = EngineCore(engine, max_batch=1, max_model_len=400, prefill_chunk=64)
    got = batch.generate(requests)
    assert [g.token_ids for g in got] == want
    assert [g.cached_tokens for g in got] == [n for _, n in script]
    assert batch.prefix.stats.queries == sum(len(p) for p, _ in script)
    assert batch.prefix.stats.hits == sum(n for _, n in script)
    # every full block of the prompts, once, and of each finished request's committed prompt + answer: all of
    # them without SSMs; with them, up to where the SSMs' caches had caught up (at least the prompt's blocks)
    prompts = chains([p for p, _ in script])
    answered = chains([p + g.token_ids[:-1] for (p, _), g in zip(script, got)])
    assert prompts < answered
    if mode == "incremental":
        assert len(batch.prefix) == len(answered)
    else:
        assert len(prompts) <= len(batch.prefix) <= len(answered)


def chains(sequences: list[list[int]]) -> set[tuple[int, ...]]:
    """The distinct block chains (each a prefix of whole blocks) of ``sequences``."""
    return {tuple(s[:end]) for s in sequences for end in range(BLOCK, len(s) + 1, BLOCK)}


@pytest.mark.parametrize("mode", ["incremental", "drafter"])
def test_a_second_turn_starts_after_the_first_turns_answer(llm, mode):
    """A chat's next turn sends the previous prompt and answer back: both are cached when the first turn ends."""
    engine = Engine(llm, **({} if mode == "incremental" else dict(speculators=[drafter(llm)], expansion=[(1, 2, 1)])))
    first = SYSTEM[:40] + [5, 5]
    cold = EngineCore(engine, max_batch=2, max_model_len=200, reuse_prefix=False)
    batch = EngineCore(engine, max_batch=2, max_model_len=200)
    (answer,) = batch.generate([Request(first, 30, stop_ids=())])
    assert answer.token_ids == cold.generate([Request(first, 30, stop_ids=())])[0].token_ids
    second = first + answer.token_ids + [7, 8, 9]
    turns = [Request(second, 12, stop_ids=()), Request(OTHER, 12)]  # a neighbour decodes beside it
    want = [g.token_ids for g in cold.generate(turns)]
    got = batch.generate(turns)
    assert [g.token_ids for g in got] == want
    committed = len(first) + len(answer.token_ids) - 1
    if mode == "incremental":  # every committed token's block
        assert got[0].cached_tokens == committed // BLOCK * BLOCK == 64
    else:  # the drafter's cache lags the LLM's by the last iteration's tokens at most
        assert len(first) // BLOCK * BLOCK < got[0].cached_tokens <= committed // BLOCK * BLOCK


def test_a_row_whose_drafter_never_drafted_is_cached_without_a_read(llm, monkeypatch):
    """Under auto running plain steps only (every tree priced far above its worth) the drafter holds exactly the
    prompt: a finishing request's blocks are taken up to it with no read of the row's lengths (a read waits for
    the iteration in flight), and a next request sharing that prompt still starts after its blocks."""
    engine = Engine(llm, speculators=[drafter(llm)], expansion=[(1, 2, 1)], auto=True,
                    costs={"none": 1.0, "ssm": 100.0})
    batch = EngineCore(engine, max_batch=2, max_model_len=200)
    reads = []
    committed = batch.executor.fn("committed")
    monkeypatch.setitem(batch.executor._compiled, "committed", lambda *a: reads.append(a) or committed(*a))
    prompt = SYSTEM[:40] + [5, 5]
    (first,) = batch.generate([Request(prompt, 20, stop_ids=())])
    assert set(first.trees) == {"none"} and not reads  # no tree ran: no read
    batch.generate([Request(OTHER, 4)])  # takes the staging row: the next hit comes from the cached blocks
    (again,) = batch.generate([Request(prompt + [7], 8, stop_ids=())])
    assert again.cached_tokens == len(prompt) // BLOCK * BLOCK and not reads
    assert again.token_ids == Engine(llm).generate(prompt + [7], 8, stop_ids=()).token_ids


@pytest.mark.slow  # ~1 min cold; test_loop_random cancels requests between prefix reuses in the default run
def test_cancelled_requests_between_hits_change_nothing(llm):
    """Requests cancelled while staged, mid-prefill or decoding leave the cache consistent for the next hit."""
    engine = Engine(llm, [early_exit(llm, 1)], [(1, 2, 1)])
    prompts = [SYSTEM[:100] + [k] for k in range(6)]
    cold = EngineCore(engine, max_batch=2, max_model_len=200, reuse_prefix=False)
    want = [g.token_ids for g in cold.generate([Request(p, 10) for p in prompts])]
    batch = EngineCore(engine, max_batch=2, max_model_len=200, prefill_chunk=32)
    events: dict[int, list] = {}
    tickets = [batch.submit(Request(p, 10, id=str(k)), events.setdefault(k, []).append)
               for k, p in enumerate(prompts)]
    for k in range(80):
        if k in (1, 3, 6):  # the first while its prompt is fed, then two others as they wait or decode
            tickets[{1: 0, 3: 2, 6: 3}[k]].cancel()
        batch.step()
        if all(e and e[-1].finish_reason for e in events.values()):
            break
    ended = {k: e[-1].finish_reason for k, e in events.items()}
    assert ended[0] == "cancelled" and sum(r == "cancelled" for r in ended.values()) == 3, ended
    for k, e in events.items():
        if ended[k] != "cancelled":
            assert [t for ev in e for t in ev.token_ids] == want[k]
    hits = batch.prefix.stats.hits
    assert [g.token_ids for g in batch.generate([Request(p, 10) for p in prompts])] == want
    assert batch.prefix.stats.hits - hits >= len(prompts) * (100 // BLOCK * BLOCK)  # each reuses the system prompt


def test_a_tiny_bound_evicts_while_requests_run_and_changes_nothing(llm):
    engine = Engine(llm, [early_exit(llm, 1)], [(1, 2, 1)])
    prompts = [p for k in range(4) for p in (SYSTEM[:64] + [k], SYSTEM2 + [k])]  # two prefixes of 4 blocks
    cold = EngineCore(engine, max_batch=3, max_model_len=200, reuse_prefix=False)
    want = [g.token_ids for g in cold.generate([Request(p, 10) for p in prompts])]
    probe = EngineCore(engine, max_batch=3, max_model_len=200)
    probe.generate([Request(SYSTEM[:BLOCK + 1], 1)])
    block_bytes = probe.prefix.bytes
    bound = 5 * block_bytes  # one prefix and a block: each evicts the other's chain from its end
    batch = EngineCore(engine, max_batch=3, max_model_len=200, prefix_cache_bytes=bound)
    for _ in range(2):  # the second round hits what the first left, while evicting to make room
        assert [g.token_ids for g in batch.generate([Request(p, 10) for p in prompts])] == want
        assert batch.prefix.bytes <= bound
    assert batch.prefix.stats.evictions > 0 and batch.prefix.stats.hits > 0


def test_the_bound_holds_over_a_thousand_distinct_prefixes():
    cache = PrefixCache(max_bytes=50 * 4 * BLOCK)
    block = (jnp.zeros((BLOCK,), jnp.float32),)  # 64 bytes: 50 of them fit
    for k in range(1000):
        tokens = [k] * (3 * BLOCK)
        parent = -1
        for b in range(3):
            entry = cache.add(parent, tokens[b * BLOCK:(b + 1) * BLOCK], block)
            parent = entry.id
        assert cache.bytes == len(cache) * 64 <= cache.max_bytes
    assert len(cache) == 50 and cache.stats.evictions == 3000 - 50
    assert len(cache.match([999] * (3 * BLOCK))) == 3  # the newest chain whole: chains are dropped from their ends
    assert cache.match([0] * (3 * BLOCK)) == []


def test_a_bad_bound_is_refused(llm):
    with pytest.raises(RequestError, match="prefix-cache-gb"):
        EngineCore(Engine(llm), prefix_cache_bytes=-1)
