"""The decoding loop: cache vs recomputation, greedy identity across modes, counts, KV commit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts, tiny_model
from jaxspec.engine import Engine, RequestError, VocabularyMismatch, early_exit
from jaxspec.decoding.sampling import SamplerParams
from jaxspec.decoding.step import DecodeConfig, DecodeState, decode_step, prefill
from jaxspec.decoding.tree import expansion_topology
from models.transformer import KVCache

TREE = (1, 1, 3, 1, 1, 1, 1, 1)


def full_recompute_greedy(model, prompt, n):
    """Greedy decoding with no cache reuse: the whole sequence is re-run for every token."""
    cap = len(prompt) + n + 1
    fwd = jax.jit(model.forward)
    seq = list(prompt)
    p = jnp.arange(cap)[None]
    mask = jnp.arange(cap)[None, None, :] <= p[:, :, None]
    for _ in range(n):
        padded = jnp.asarray([seq + [0] * (cap - len(seq))])
        logits, _ = fwd(model.params, padded, p, KVCache.create(model.cfg, 1, cap), mask,
                        jnp.asarray([[len(seq) - 1]]))
        seq.append(int(jnp.argmax(logits[0, 0])))
    return seq[len(prompt):]


def test_cached_incremental_equals_full_recomputation(tiny_llm):
    engine = Engine(tiny_llm)
    for prompt in random_prompts(3, tiny_llm.cfg.vocab_size, seed=3, lo=8, hi=9):
        gen = engine.generate(prompt, 24)
        assert gen.token_ids == full_recompute_greedy(tiny_llm, prompt, 24)


@pytest.mark.parametrize("expansion", [(1, 1, 1, 1), TREE, (2, 2, 2), (5,), (1, 1, 5, 1)])
def test_greedy_speculation_is_token_identical_to_incremental(tiny_llm, expansion):
    ssm = early_exit(tiny_llm, 1)
    base = Engine(tiny_llm)
    spec = Engine(tiny_llm, [ssm], expansion)
    for prompt in random_prompts(6, tiny_llm.cfg.vocab_size, seed=7):
        want = base.generate(prompt, 40)
        got = spec.generate(prompt, 40)
        assert got.token_ids == want.token_ids
        assert got.llm_steps == len(got.step_tokens)
        assert all(1 <= k <= len(expansion) + 1 for k in got.step_tokens)
        assert sum(got.step_tokens) + 1 >= len(got.token_ids)  # +1: the prefill's token


def test_merged_ssms_identity_and_acceptance(tiny_llm):
    """Two different SSMs merged into one tree: same output, at least the better SSM's acceptance."""
    other = tiny_model(seed=5)  # an unrelated SSM sharing the vocabulary
    ssms = [early_exit(tiny_llm, 2), other]
    base = Engine(tiny_llm)
    merged = Engine(tiny_llm, ssms, (1, 2, 1))
    single = Engine(tiny_llm, ssms[:1], (1, 2, 1))
    steps_merged = steps_single = 0
    for prompt in random_prompts(3, tiny_llm.cfg.vocab_size, seed=11):
        want = base.generate(prompt, 32).token_ids
        g = merged.generate(prompt, 32)
        assert g.token_ids == want
        steps_merged += g.llm_steps
        steps_single += single.generate(prompt, 32).llm_steps
    assert steps_merged <= steps_single  # a superset tree never accepts less


@pytest.mark.slow  # ~2 min cold; the shipped pool drafts as one vmapped group in test_cli's tree mode and test_sharding
def test_same_shape_ssms_draft_in_one_vmapped_forward(tiny_llm):
    """A pool's same-architecture SSMs form one vmapped group (shared embedding not stacked); same output."""
    a, b = tiny_model(seed=5), tiny_model(seed=6)
    b = b.__class__(b.name, b.cfg, {**b.params, "embed": a.params["embed"]})  # one array, as a pool holds it
    ssms = [a, early_exit(tiny_llm, 2), b]
    batched = Engine(tiny_llm, ssms, (1, 2, 1))
    separate = Engine(tiny_llm, ssms, (1, 2, 1), batch_ssms=False)
    assert [(g.members, g.shared) for g in batched.groups] == [((0, 2), ("embed/embedding",)), ((1,), ())]
    stacked = batched._group_params[0]
    assert stacked["layers"]["mlp"]["up"]["kernel"].shape[0] == 2
    assert stacked["embed"]["embedding"] is a.params["embed"]["embedding"]
    assert [g.members for g in separate.groups] == [(0,), (1,), (2,)]
    for params in (SamplerParams(), SamplerParams(temperature=0.8, seed=3)):
        for prompt in random_prompts(3, tiny_llm.cfg.vocab_size, seed=13):
            want, got = separate.generate(prompt, 24, params), batched.generate(prompt, 24, params)
            assert got.token_ids == want.token_ids and got.step_tokens == want.step_tokens
    assert batched.compilations == separate.compilations  # grouping adds no executable


def test_perfect_ssm_accepts_every_level(tiny_llm):
    """The LLM as its own SSM: every speculated level is accepted, so each step emits m + 1 tokens."""
    engine = Engine(tiny_llm, [tiny_llm], (1, 1, 1, 1))
    gen = engine.generate([1, 2, 3], 41)
    assert gen.step_tokens == [5] * 8
    assert gen.token_ids == Engine(tiny_llm).generate([1, 2, 3], 41).token_ids


def test_no_recompilation_after_warmup(tiny_llm):
    engine = Engine(tiny_llm, [early_exit(tiny_llm, 1)], TREE)
    engine.generate([1, 2, 3], 4)
    warm = engine.compilations
    assert warm == 2  # one prefill and one step executable
    gen = engine.generate([4, 5, 6, 7], 64)
    assert gen.llm_steps > 10
    assert engine.compilations == warm
    engine.generate([9, 8, 7], 64, SamplerParams(temperature=0.0, seed=3))
    assert engine.compilations == warm


def test_kv_commit_equals_incremental_cache(tiny_llm):
    """After tree steps accept paths, the LLM cache equals prefilling the committed tokens."""
    ssm = early_exit(tiny_llm, 2)
    cfg = DecodeConfig((expansion_topology((2, 2, 2)),))
    cap = 128
    prompt = [5, 3, 8, 1, 9, 2]
    state = DecodeState(KVCache.create(tiny_llm.cfg, 1, cap), (KVCache.create(ssm.cfg, 1, cap),),
                        jnp.zeros((1, cap), jnp.int32), jnp.zeros((1,), jnp.int32), jax.random.PRNGKey(0),
                        {"temperature": jnp.ones(1), "top_k": jnp.zeros(1, jnp.int32), "top_p": jnp.ones(1)})
    tokens = jnp.zeros((1, 16), jnp.int32).at[0, : len(prompt)].set(jnp.asarray(prompt))
    fwds, params = (ssm.forward,), (ssm.params,)
    state, _ = prefill(cfg, tiny_llm.forward, fwds, tiny_llm.params, params, state, tokens, jnp.asarray([6]))
    step = jax.jit(lambda s: decode_step(cfg, tiny_llm.forward, fwds, tiny_llm.params, params, s))
    accepted = []
    for _ in range(6):
        state, out = step(state)
        accepted.append(int(out.num[0]))
    assert max(accepted) > 1, "the test needs at least one accepted speculated token"
    n = int(state.llm_cache.length[0])
    seq = state.history[0, :n]
    ref = KVCache.create(tiny_llm.cfg, 1, cap)
    p = jnp.arange(n)[None]
    _, ref = tiny_llm.forward(tiny_llm.params, seq[None], p, ref, jnp.arange(cap)[None, None, :] <= p[:, :, None])
    np.testing.assert_allclose(np.asarray(state.llm_cache.k[..., :n, :]), np.asarray(ref.k[..., :n, :]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(state.llm_cache.v[..., :n, :]), np.asarray(ref.v[..., :n, :]), atol=1e-5)


def test_bad_requests_are_refused_clearly(tiny_llm):
    engine = Engine(tiny_llm)
    with pytest.raises(RequestError, match="context"):
        engine.generate(list(range(10)), tiny_llm.cfg.max_position_embeddings)
    with pytest.raises(RequestError, match="empty"):
        engine.generate([], 4)
    with pytest.raises(VocabularyMismatch, match="vocabulary"):
        Engine(tiny_llm, [tiny_model(vocab_size=80)], (1, 1))
    with pytest.raises(ValueError, match="tree-budget"):
        Engine(tiny_llm, [early_exit(tiny_llm, 1)], TREE, tree_budget=8)


def test_tree_budget_pads_without_changing_output(tiny_llm):
    ssm = early_exit(tiny_llm, 1)
    prompt = [3, 1, 4, 1, 5]
    want = Engine(tiny_llm, [ssm], (1, 2, 1)).generate(prompt, 20).token_ids
    assert Engine(tiny_llm, [ssm], (1, 2, 1), tree_budget=16).generate(prompt, 20).token_ids == want


def test_eos_and_stop_callback(tiny_llm):
    engine = Engine(tiny_llm, [early_exit(tiny_llm, 1)], (1, 1, 1))
    free = engine.generate([2, 7, 1], 30).token_ids
    eos = free[5]
    cut = engine.generate([2, 7, 1], 30, stop_ids=[eos])
    assert cut.finish_reason == "eos" and cut.token_ids == free[: free.index(eos) + 1]
    stopped = engine.generate([2, 7, 1], 30, stop=lambda ids: 3 if len(ids) >= 3 else None)
    assert stopped.finish_reason == "stop" and stopped.token_ids == free[:3]


def test_the_engine_keeps_one_copy_of_the_llms_weights():
    """The engine's decoding layout is built from the loaded tree and replaces it: once the caller drops its model
    the weights are held once (live device bytes), not twice (issue 22)."""
    import gc

    def live() -> int:
        gc.collect()
        return sum(a.nbytes for a in jax.live_arrays())

    base = live()
    model = tiny_model(seed=5)
    size = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
    assert live() - base >= size
    want = Engine(model).generate([1, 2, 3], 4).token_ids
    gc.collect()
    engine = Engine(model)
    del model
    held = live() - base
    assert engine.llm.params is None and held <= 1.1 * size, (held, size)
    assert engine.generate([1, 2, 3], 4).token_ids == want  # the engine alone still decodes


def test_opt_trees_reaching_past_the_position_table_stay_exact():
    """OPT's learned position table ends at the context: a request filling it drafts tree nodes past the last row.
    Those nodes are never committed, but their K/V must stay finite or the row's attention turns to NaN and the
    last tokens come out as 0 (issue 22). Tree decoding must equal incremental up to the last position."""
    llm = tiny_model(seed=3, arch="opt", num_kv_heads=4, activation="relu", attention_bias=True,
                     max_position_embeddings=24)
    incremental = Engine(llm)
    tree = Engine(llm, [early_exit(llm, 1)], (2, 2, 1))
    for prompt in random_prompts(3, llm.cfg.vocab_size, seed=1, lo=8, hi=12):
        n = llm.cfg.max_position_embeddings - len(prompt)  # the request fills the table exactly
        assert tree.generate(prompt, n).token_ids == incremental.generate(prompt, n).token_ids


def test_a_prepared_engine_generates_its_requests_without_compiling(tiny_llm):
    """``Engine.prepare`` readies each length bucket's loop its requests reach (what ``bench`` and ``repro`` call
    before their first request); ``generate`` then compiles nothing, greedy or sampled, and emits what an engine that
    readied each bucket at its first use emits."""
    from jaxspec.cache import BACKEND

    prompts = random_prompts(3, tiny_llm.cfg.vocab_size, seed=5, lo=4, hi=12) + [[7] * 300]  # 256 and 512 buckets
    params = [SamplerParams(), SamplerParams(0.9, seed=2**33 + 1)]
    engine = Engine(tiny_llm)
    assert engine.prepare([(len(p), 16) for p in prompts], params, progress=False) > 0
    before = BACKEND.listen()
    out = [engine.generate(p, 16, q).token_ids for p in prompts for q in params]
    assert BACKEND.listen() == before
    assert sorted(engine.solos) == [256, 512]
    lazy = Engine(tiny_llm)
    before = BACKEND.listen()
    assert [lazy.generate(p, 16, q).token_ids for p in prompts for q in params] == out
    assert BACKEND.listen() > before  # the compiles ``prepare`` took out of the requests
