"""The coupled sampler (issue 24): Gumbel-max with noise keyed by (seed, position) makes a sampled output a
function of (prompt, parameters, seed) alone, whatever the mode, tree, batch or load, and stays exact."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from conftest import tiny_model
from jaxspec.decoding import sampling
from jaxspec.request import SamplingError, seed_words
from jaxspec.speculators.ngram import NGramSpeculator
from jaxspec.decoding.tree import DynamicTree
from jaxspec.engine import Engine, early_exit
from jaxspec.engine.core import EngineCore, Request
from jaxspec.decoding.step import prefill_model
from models.transformer import KVCache

PROMPTS = [[5, 3, 8, 1, 9, 2], [7, 7, 1], list(range(1, 41)), [4, 4, 4, 4, 2, 3], [9], [2, 8, 2, 8, 2]]
COSTS = {"none": 1.0, "ngram": 1.2, "ssm": 1.5, "ssm+ngram": 1.7}
PARAMS = [sampling.SamplerParams(0.9, seed=3), sampling.SamplerParams(1.0, top_k=6, seed=11),
          sampling.SamplerParams(0.7, top_p=0.8, seed=5), sampling.SamplerParams(),
          sampling.SamplerParams(1.3, top_k=20, top_p=0.95, seed=2**40 + 1), sampling.SamplerParams(0.8, seed=0)]


@pytest.fixture(scope="module")
def llm():
    return tiny_model()


@pytest.fixture(scope="module")
def engines(llm) -> dict[str, Engine]:
    """One engine per mode for the module: each traces its steps once, whichever test runs them first."""
    return coupled_engines(llm)


def coupled_engines(llm) -> dict[str, Engine]:
    near = early_exit(llm, 1)
    return {
        "incremental": Engine(llm, verify="coupled"),
        "sequence": Engine(llm, [near], (1, 1, 1), verify="coupled"),
        "tree": Engine(llm, [near, NGramSpeculator(3)], [(1, 2, 1), (1, 1, 1, 1)], verify="coupled"),
        "dynamic": Engine(llm, [near], DynamicTree(8, 3, 3), verify="coupled"),
        "auto": Engine(llm, [near, NGramSpeculator(3)], [DynamicTree(8, 3, 3), (1, 1, 1)], verify="coupled",
                       auto=True, costs=COSTS),
    }


@pytest.fixture(scope="module")
def wanted(engines) -> list[list[int]]:
    """Each request's incremental output: what every mode, alone or in a batch, must reproduce."""
    want = [engines["incremental"].generate(p, 16, params).token_ids for p, params in zip(PROMPTS, PARAMS)]
    assert len({tuple(w) for w in want}) == len(want)
    return want


# Each mode compiles its own steps for one row and a batch of eight (auto: ~5 min cold, every member of its family):
# the default run keeps the tree of an SSM merged with the n-gram chain; the other modes run under -m slow.
@pytest.mark.parametrize("name", ["tree", pytest.param("sequence", marks=pytest.mark.slow),
                                  pytest.param("dynamic", marks=pytest.mark.slow),
                                  pytest.param("auto", marks=pytest.mark.slow)])
def test_same_seed_same_tokens_in_every_mode_alone_and_in_a_batch(engines, wanted, name):
    engine = engines[name]
    alone = [engine.generate(p, 16, params) for p, params in zip(PROMPTS, PARAMS)]
    assert [g.token_ids for g in alone] == wanted, name
    # eight slots, every request beside the others, then again in another order: other neighbours, other slots
    batch = EngineCore(engine, max_batch=8, max_model_len=64, prefill_chunk=16)
    together = batch.generate([Request(p, 16, params) for p, params in zip(PROMPTS, PARAMS)])
    assert [g.token_ids for g in together] == wanted, name
    shuffled = batch.generate([Request(PROMPTS[i], 16, PARAMS[i]) for i in (3, 1, 5, 0, 4, 2)])
    assert [g.token_ids for g in shuffled] == [wanted[i] for i in (3, 1, 5, 0, 4, 2)], name
    assert sum(sum(g.step_tokens) - g.llm_steps for g in alone) > 0, name  # speculation accepted sampled tokens
    # the seed matters, and so do the other parameters
    other = engine.generate(PROMPTS[0], 16, sampling.SamplerParams(0.9, seed=4)).token_ids
    assert other != wanted[0]


def test_the_coupled_draw_is_exact_for_the_first_and_second_tokens(llm, engines):
    """Chi-square of (first, second) sampled token pairs over many seeds against the LLM's warped joint
    distribution, incremental and through a tree, with top-k and top-p."""
    params = dict(temperature=1.0, top_k=5, top_p=0.9)
    prompt = [3, 1, 4]
    spec = sampling.WarpSpec.of(sampling.SamplerParams(**params))
    values = sampling.warp_arrays(sampling.SamplerParams(**params), 1)

    @jax.jit  # one compile per prompt length (op by op, the reference cost more than the draws)
    def warped_jit(params, ids):
        cache = KVCache.create(llm.cfg, 1, ids.shape[1])
        logits = prefill_model(llm.forward, params, cache, ids, jnp.asarray([ids.shape[1]]))[0]
        return sampling.warped_probs(logits, spec, values)

    def warped(ids):  # the LLM's warped next-token distribution after ids
        return np.asarray(warped_jit(llm.params, jnp.asarray([ids])), np.float64)[0]

    p1 = warped(prompt)
    joint = {}
    for a in np.flatnonzero(p1 > 0):
        p2 = warped(prompt + [int(a)])
        for b in np.flatnonzero(p2 > 0):
            joint[(int(a), int(b))] = p1[a] * p2[b]
    seeds = 600
    for name in ("incremental", "tree"):
        engine = engines[name]
        # the loop shape of the mode test above (its steps already traced where it ran first)
        batch = EngineCore(engine, max_batch=8, max_model_len=64, prefill_chunk=16)
        outs = batch.generate([Request(prompt, 2, sampling.SamplerParams(**params, seed=s), stop_ids=[])
                               for s in range(seeds)])
        counts = {}
        for g in outs:
            pair = tuple(g.token_ids[:2])
            assert pair in joint, (name, pair)  # never a token outside top-k / top-p
            counts[pair] = counts.get(pair, 0) + 1
        keys = sorted(joint)
        expected = np.asarray([joint[k] for k in keys]) * seeds
        observed = np.asarray([counts.get(k, 0) for k in keys])
        big = expected >= 5  # pool the rare cells
        obs = np.append(observed[big], observed[~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        if exp[-1] == 0:
            obs, exp = obs[:-1], exp[:-1]
        assert stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3, name


def test_every_64_bit_seed_draws_its_own_stream(engines, llm):
    """Seeds s and s + 2**32 (and the signed extremes) sample different tokens; a seed past 32 bits is reproducible
    alone, in a tree and in a batch, and a seed below 2**32 keeps the key it always had."""
    for s in (7, 2**32 - 1, 2**62 + 9):
        assert np.array_equal(seed_words(s), np.asarray(jax.random.PRNGKey(s % 2**32))) == (s < 2**32)
    prompt, seeds = PROMPTS[1], [7, 7 + 2**32, 2**63 - 1, -1, -(2**63)]
    runs = {s: engines["incremental"].generate(prompt, 16, sampling.SamplerParams(0.9, seed=s)).token_ids
            for s in seeds}
    assert len({tuple(t) for t in runs.values()}) == len(seeds)
    high = sampling.SamplerParams(0.9, seed=7 + 2**32)
    assert engines["tree"].generate(prompt, 16, high).token_ids == runs[7 + 2**32]
    batch = EngineCore(engines["tree"], max_batch=8, max_model_len=64, prefill_chunk=16)
    together = batch.generate([Request(prompt, 16, sampling.SamplerParams(0.9, seed=s)) for s in seeds])
    assert [g.token_ids for g in together] == [runs[s] for s in seeds]
    with pytest.raises(SamplingError, match="64 bits"):
        sampling.SamplerParams(0.9, seed=2**64)
