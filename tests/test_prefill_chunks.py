"""Prompt chunks sized by measurement on the device, a staging row laid out for its own prompt, and the default
pacing of a long prompt beside decoding rows (issue 40)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import tiny_model
from jaxspec.cli.serve import serve_stall
from jaxspec.config import SchedulerConfig
from jaxspec.engine import Engine
from jaxspec.engine.policy import prefill
from jaxspec.engine.core import EngineCore, Request
from jaxspec.engine.policy.scheduler import PREFILL_STALL
from jaxspec.engine.build import build_core
from jaxspec.engine.policy.prefill import GAIN, SAMPLES, ChunkSizer


@pytest.fixture(scope="module")
def llm():
    return tiny_model()


def test_chunk_sizes_feed_whole_chunks_then_one_that_holds_the_rest():
    chunks = ChunkSizer(search=False)
    assert chunks.largest == prefill.START and chunks.candidate is None
    assert chunks.size(0, 3000, 10_000) == 256  # whole chunks of the largest
    assert chunks.size(0, 184, 10_000) == 256  # the rest: the smallest chunk that holds it
    assert chunks.size(0, 40, 10_000) == 64 and chunks.size(0, 5, 10_000) == 16
    assert chunks.size(990, 184, 1040) == 16  # nothing larger ends within the cache
    fixed = ChunkSizer(cap=100)
    assert fixed.sizes == (16, 64, 100) and fixed.largest == 100 and fixed.candidate is None
    assert fixed.size(0, 5000, 10_000) == 100
    with pytest.raises(ValueError, match="prefill chunk"):
        ChunkSizer(cap=0)


def test_the_rest_of_a_prompt_is_fed_in_the_chunks_this_device_times_cheapest():
    """Once every size was timed here, the tokens left after the whole chunks go in the cheapest run of chunks:
    73 tokens as 64 + 16 where a padded 256-token chunk costs 3x a 64 (a compute-bound CPU), as one padded chunk
    where every chunk costs about the same (a launch-bound GPU: fewer calls win). The timings persist."""
    saved = []
    cpu = ChunkSizer(search=True, save=saved.append)
    assert cpu.size(24, 73, 280) == 256  # nothing timed yet: the smallest chunk that holds the rest
    for size, seconds in ((16, 0.09), (64, 0.17), (256, 0.55)):
        assert cpu.wants_timing(size)
        for _ in range(prefill.TIMINGS):
            cpu.time_chunk(size, seconds)
        assert not cpu.wants_timing(size) and cpu.chunk_seconds(size) == seconds
    assert cpu.size(24, 73, 280) == 64 and cpu.size(88, 9, 280) == 16  # 0.26 s instead of 0.55
    assert cpu.size(24, 27, 280) == 64  # one 64 (0.17) beats 16 + 16 (0.18)
    assert cpu.size(0, 3000, 10_000) == 256  # whole chunks stay whole
    assert ChunkSizer(stored=saved[-1]).size(24, 73, 280) == 64  # a later process starts from the timings
    gpu = ChunkSizer(search=True)
    for size, seconds in ((16, 0.0034), (64, 0.0035), (256, 0.0040)):
        for _ in range(prefill.TIMINGS):
            gpu.time_chunk(size, seconds)
    assert gpu.size(24, 73, 280) == 256
    assert not ChunkSizer(search=False).wants_timing(16)  # processes that must feed alike time nothing
    assert prefill.cheapest_cover(73, (16, 64, 256), float) == 64  # priced by tokens: 80 padded beats 256


def test_the_search_climbs_while_a_larger_chunk_pays_and_stops_where_it_does_not():
    saved = []
    chunks = ChunkSizer(save=saved.append)
    top = chunks.candidate
    assert top == 4 * chunks.largest
    assert chunks.probe(0, top) is None and chunks.probe(100, 5000) is None  # too short; too far in
    assert chunks.probe(0, 5000) == chunks.probe(16, 5000) == chunks.largest  # (after a cached system prompt too)
    assert chunks.size(16, 5000, 10_000, probe=top, start=16) == top
    assert chunks.size(16 + top, 5000, 10_000, probe=top, start=16) == chunks.largest  # the probe's span is in
    assert chunks.size(0, 5000, 10_000, probe=chunks.largest) == chunks.largest
    assert chunks.size(0, 5000, 10_000, probe=top) == top
    for _ in range(SAMPLES):  # the larger chunk's tokens cost 30% less: taken, and the next size tried
        chunks.record(chunks.largest, top, 1.0 * top)
        assert chunks.probe(0, 5000) == top
        chunks.record(top, top, 0.7 * top)
    assert chunks.largest == top and chunks.candidate == 4 * top and not chunks.settled
    top = chunks.candidate
    for _ in range(SAMPLES):  # only (GAIN / 2) faster: the search ends at the size before
        chunks.record(chunks.largest, top, 1.0 * top)
        chunks.record(top, top, (1 - GAIN / 2) * top)
    assert chunks.largest == top // 4 and chunks.settled and chunks.candidate is None
    assert chunks.probe(0, 10_000) is None
    again = ChunkSizer(stored=saved[-1])  # what a later process starts from
    assert (again.largest, again.settled, again.candidate) == (chunks.largest, True, None)
    assert "prefill chunks up to 1024 tokens (settled" in again.describe()


def test_the_loop_searches_chunk_sizes_on_real_prompts_and_keeps_what_it_found(llm, monkeypatch, tmp_path):
    """End to end on a tiny model (the ladder starting at 16): probes time real prefills, the search moves, the
    result is stored for the next loop, and no output token changes."""
    engine = Engine(llm)
    rng = np.random.default_rng(5)
    prompts = [[int(x) for x in rng.integers(1, llm.cfg.vocab_size, 90)] for _ in range(2 * SAMPLES)]
    want = [engine.generate(p, 4).token_ids for p in prompts]  # chunks of 256: shorter than a probe
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(prefill, "START", 16)
    lines = []
    batch = EngineCore(engine, max_batch=2, max_model_len=200, verbose=lines.append)
    assert batch.chunks.largest == 16 and batch.chunks.candidate == 64
    got = batch.generate([Request(p, 4) for p in prompts])
    assert [g.token_ids for g in got] == want
    (decided,) = engine.prefill_chunks()["history"]  # 16 against 64 over 64-token spans, SAMPLES probes each
    rates = {int(s): r for s, r in decided["tokens_per_s"].items()}
    assert decided["span"] == 64 and set(rates) == {16, 64} and min(rates.values()) > 0
    climbed = rates[64] >= rates[16] / (1 - GAIN)
    assert (batch.chunks.largest, batch.chunks.candidate) == ((64, 256) if climbed else (16, None))
    assert sum(line.startswith("prefill chunks up to") for line in lines) == 2 * SAMPLES
    timed = engine.prefill_chunks()["seconds"]  # the chunks after each probe ran timed alone: kept per size
    assert timed and all(0 < len(v) <= prefill.TIMINGS and min(v) > 0 for v in timed.values())
    later = EngineCore(engine, max_batch=2, max_model_len=200)
    assert later.chunks.state() == batch.chunks.state()
    assert EngineCore(engine, max_model_len=200, prefill_chunk=32).buckets == (16, 32)  # fixed: no search


def test_a_long_prompt_enters_beside_a_decoding_row_without_changing_its_bucket(llm):
    """Where the cache is bucketed (attention over every slot), the staging row is laid out for its own prompt:
    while a prompt needing a larger cache bucket is fed, the decoding row keeps its state (no re-layout, so no new
    step executable); at insert the rows grow."""
    from models.lowering import default_lowering

    engine = Engine(llm, lowering=default_lowering("attention=dense"))
    long_prompt = [int(x) for x in np.random.default_rng(3).integers(1, llm.cfg.vocab_size, 700)]
    requests = [Request([5, 3, 8], 40), Request(long_prompt, 4)]
    want = [engine.generate(r.prompt_ids, r.max_new_tokens).token_ids for r in requests]
    batch = EngineCore(engine, max_batch=2, max_model_len=1024, prefill_chunk=64)
    seen = []
    decode = batch._decode

    def watched():
        seen.append((batch.staging is not None, batch.capacity, batch.executor.staging_capacity))
        decode()

    batch._decode = watched
    assert [g.token_ids for g in batch.generate(requests)] == want
    entering = [s for s in seen if s[0]]
    assert len(entering) >= 700 // 64 - 1
    assert {cap for _, cap, _ in entering} == {batch.capacity_buckets[0]}  # the row decoding beside it: untouched
    # the prompt's own bucket from its first chunk: the top one (1,024 tokens and a step's slack)
    assert {staged for _, _, staged in entering} == {batch.capacity_buckets[-1]} and batch.capacity_buckets[-2] < 700
    grown = [k for k, (_, cap, _) in enumerate(seen) if cap == batch.capacity_buckets[-1]]
    assert grown and not any(seen[k][0] for k in grown)  # once it is inserted, the rows grow to its bucket


def test_the_server_paces_long_prompts_by_default_and_generate_does_not(llm):
    engine = Engine(llm)
    assert serve_stall(None) == PREFILL_STALL and serve_stall(0.2) == 0.2 and serve_stall(0) == 0
    batch = build_core(engine, SchedulerConfig(max_batch=2, max_model_len=320, prefill_stall=serve_stall(None)))
    assert batch.prefill_stall == PREFILL_STALL
    assert build_core(engine, SchedulerConfig(max_model_len=320, prefill_stall=0)).prefill_stall is None
    assert build_core(engine, SchedulerConfig(max_model_len=320)).prefill_stall is None  # generate, bench
    long_prompt = [int(x) for x in np.random.default_rng(2).integers(1, llm.cfg.vocab_size, 300)]
    requests = [Request([5, 3, 8], 30), Request(long_prompt, 6)]
    want = [engine.generate(r.prompt_ids, r.max_new_tokens).token_ids for r in requests]
    assert [g.token_ids for g in batch.generate(requests)] == want


def test_a_short_request_is_admitted_beside_a_long_prompt_still_entering(llm):
    """A short prompt queued behind a long one gets its first token while the long one is still being fed (a second
    staging row), a row stays free for the long one, and every request's tokens are its solo ones."""
    engine = Engine(llm)
    rng = np.random.default_rng(4)
    long_prompt = [int(x) for x in rng.integers(1, llm.cfg.vocab_size, 300)]
    requests = [Request([5, 3, 8], 30, id="a"), Request(long_prompt, 5, id="long"), Request([9, 2, 6, 1], 8, id="b")]
    want = [engine.generate(r.prompt_ids, r.max_new_tokens).token_ids for r in requests]
    firsts = []
    batch = EngineCore(engine, max_batch=3, max_model_len=320, prefill_chunk=64)
    got = batch.generate(requests, on_event=lambda _, ev: ev.request_id in firsts or firsts.append(ev.request_id))
    assert [g.token_ids for g in got] == want
    assert firsts == ["a", "b", "long"]  # b came after long and did not wait for its 300 tokens
    full = EngineCore(engine, max_batch=2, max_model_len=320, prefill_chunk=64)  # no free row beside: b waits
    firsts.clear()
    got = full.generate(requests, on_event=lambda _, ev: ev.request_id in firsts or firsts.append(ev.request_id))
    assert [g.token_ids for g in got] == want and firsts.index("b") > firsts.index("long")


def test_a_prompt_is_never_fed_past_its_own_bucket_so_a_job_of_short_prompts_prepares_only_its_sizes():
    """Even where a larger chunk was timed cheaper than the one that holds the rest (noise), a rest is covered by
    sizes up to that one: a prompt's chunks never exceed its bucket, so ``reachable`` may bound a job's prefills by
    its longest prompt (the search's next size stays reachable for a prompt long enough to probe it)."""
    odd = ChunkSizer(search=True)
    for size, seconds in ((16, 0.09), (64, 0.15), (256, 0.10)):  # 256 timed cheaper than 64
        for _ in range(prefill.TIMINGS):
            odd.time_chunk(size, seconds)
    assert odd.size(24, 27, 280) == 64 and odd.size(24, 9, 280) == 16 and odd.size(24, 73, 280) == 256
    chunks = ChunkSizer(search=True)
    assert chunks.largest == prefill.START and chunks.candidate == 1024
    assert chunks.reachable() == (16, 64, 256, 1024)
    assert chunks.reachable(10) == (16,) and chunks.reachable(40) == (16, 64) and chunks.reachable(64) == (16, 64)
    assert chunks.reachable(300) == (16, 64, 256, 1024) and chunks.reachable(5000) == (16, 64, 256, 1024)
    for length in (3, 16, 17, 64, 65, 200):
        fed, sizes = 0, set()
        while fed < length:
            size = chunks.size(fed, length - fed, 10_000)
            sizes.add(size)
            fed += size
        assert sizes <= set(chunks.reachable(length)), (length, sizes)
