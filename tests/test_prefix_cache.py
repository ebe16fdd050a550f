"""Prefix caching (issue 37): requests sharing a prompt prefix reuse its cached K/V blocks; no output token changes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model
from jaxspec.decoding import sampling
from jaxspec.decoding.ngram import NGramSpeculator
from jaxspec.engine import Engine, RequestError, early_exit
from jaxspec.engine.batch import BatchEngine, Request
from jaxspec.engine.prefix import BLOCK, PrefixCache
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


@pytest.mark.parametrize("mode", ["incremental", "tree", "drafter"])
def test_a_hit_changes_no_token_and_counts_exactly(llm, mode):
    spec = {"incremental": {}, "tree": dict(ssms=[early_exit(llm, 1), NGramSpeculator(3)],
                                             expansion=[(1, 2, 1), (1, 1, 1)]),
            "drafter": dict(ssms=[drafter(llm)], expansion=[(1, 2, 1)])}[mode]
    engine = Engine(llm, **spec)
    script = scripted()
    sampled = sampling.SamplingParams(0.8, seed=5)
    requests = [Request(p, 8, sampled if k == 8 else sampling.SamplingParams()) for k, (p, _) in enumerate(script)]
    cold = BatchEngine(engine, max_batch=1, max_model_len=400, reuse_prefix=False)
    want = [g.token_ids for g in cold.generate(requests)]
    assert cold.prefix.stats.hits == 0 and len(cold.prefix) == 0

    batch = BatchEngine(engine, max_batch=1, max_model_len=400, prefill_chunk=64)
    got = batch.generate(requests)
    assert [g.token_ids for g in got] == want
    assert [g.cached_tokens for g in got] == [n for _, n in script]
    assert batch.prefix.stats.queries == sum(len(p) for p, _ in script)
    assert batch.prefix.stats.hits == sum(n for _, n in script)
    assert len(batch.prefix) == (len(SYSTEM) + 2) // BLOCK  # every full block of the system prompt, once


def test_a_tiny_bound_evicts_while_requests_run_and_changes_nothing(llm):
    engine = Engine(llm, [early_exit(llm, 1)], [(1, 2, 1)])
    prompts = [p for k in range(4) for p in (SYSTEM[:64] + [k], SYSTEM2 + [k])]  # two prefixes of 4 blocks
    cold = BatchEngine(engine, max_batch=3, max_model_len=200, reuse_prefix=False)
    want = [g.token_ids for g in cold.generate([Request(p, 10) for p in prompts])]
    probe = BatchEngine(engine, max_batch=3, max_model_len=200)
    probe.generate([Request(SYSTEM[:BLOCK + 1], 1)])
    block_bytes = probe.prefix.bytes
    bound = 5 * block_bytes  # one prefix and a block: each evicts the other's chain from its end
    batch = BatchEngine(engine, max_batch=3, max_model_len=200, prefix_cache_bytes=bound)
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
        BatchEngine(Engine(llm), prefix_cache_bytes=-1)
