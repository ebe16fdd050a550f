"""Sampling: the warped distribution (temperature → top-k → top-p) and seeded reproducibility."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.engine import Engine
from jaxspec.decoding.sampling import (MIXED, SAMPLED, SamplerParams, WarpSpec, batch_warp, row_values, sample,
                                     truncating, warp_arrays, warped_probs)
from jaxspec.request import SamplingError


def reference_warp(logits: np.ndarray, t: float, k: int, p: float) -> np.ndarray:
    """Plain numpy statement of the warp (transformers' order and tie rules)."""
    x = logits.astype(np.float64) / t
    if k > 0:
        kth = np.sort(x)[::-1][k - 1]
        x = np.where(x >= kth, x, -np.inf)
    if p < 1.0:
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        mass_before = np.cumsum(probs[order]) - probs[order]
        keep = np.zeros_like(probs, bool)
        keep[order[mass_before < p]] = True
        x = np.where(keep, x, -np.inf)
    out = np.exp(x - x.max())
    return out / out.sum()


@pytest.mark.parametrize("t, k, p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.9), (0.7, 0, 0.9),
                                     (0.8, 8, 0.75), (2.0, 3, 0.5), (1.0, 1, 1.0), (1.0, 0, 0.01)])
def test_warped_probabilities_match_reference(t, k, p):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 40)).astype(np.float32) * 3
    params = SamplerParams(temperature=t, top_k=k, top_p=p)
    got = np.asarray(warped_probs(jnp.asarray(logits), WarpSpec.of(params), warp_arrays(params, 4)))
    for row in range(4):
        want = reference_warp(logits[row], t, k, p)
        np.testing.assert_allclose(got[row], want, atol=1e-6)
        if k:
            assert (got[row] > 0).sum() <= k
        if p < 1:
            pre = reference_warp(logits[row], t, k, 1.0)[want > 0]  # kept tokens' mass before top-p
            assert pre.sum() - pre.min() < p <= pre.sum() + 1e-6  # the smallest set reaching p


def test_sampler_frequencies_follow_the_warp():
    logits = jnp.asarray([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    params = SamplerParams(temperature=0.8, top_k=4, top_p=0.95)
    spec, values = WarpSpec.of(params), warp_arrays(params, 1)
    keys = jax.random.split(jax.random.PRNGKey(0), 40000)
    draws = np.asarray(jax.vmap(lambda k: sample(k, logits, spec, values))(keys))[:, 0]
    freq = np.bincount(draws, minlength=6) / len(draws)
    want = reference_warp(np.asarray(logits[0]), 0.8, 4, 0.95)
    np.testing.assert_allclose(freq, want, atol=0.01)
    assert freq[want == 0].sum() == 0


def test_greedy_is_argmax():
    logits = jnp.asarray([[0.1, 3.0, 2.9], [5.0, 0.0, 0.0]])
    spec = WarpSpec.of(SamplerParams())
    assert sample(jax.random.PRNGKey(0), logits, spec, warp_arrays(SamplerParams(), 2)).tolist() == [1, 0]


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.2), dict(top_k=-1)])
def test_bad_sampling_params(kw):
    with pytest.raises(SamplingError):
        SamplerParams(**kw)


def test_same_seed_same_output(tiny_llm):
    engine = Engine(tiny_llm)
    a = engine.generate([1, 2, 3], 24, SamplerParams(temperature=1.0, seed=7)).token_ids
    b = engine.generate([1, 2, 3], 24, SamplerParams(temperature=1.0, seed=7)).token_ids
    c = engine.generate([1, 2, 3], 24, SamplerParams(temperature=1.0, seed=8)).token_ids
    assert a == b
    assert a != c


def test_batch_warp_is_greedy_or_every_stage():
    """Greedy rows alone run greedy; any sampled row runs MIXED (one sampled executable set to prepare)."""
    greedy, hot = SamplerParams(), SamplerParams(0.7)
    assert batch_warp([greedy, greedy]) == WarpSpec()
    assert batch_warp([greedy, hot]) == MIXED
    assert batch_warp([hot, SamplerParams(0.7, top_p=0.9)]) == MIXED
    assert batch_warp([greedy, SamplerParams(0.7, top_k=5)]) == MIXED


def test_the_sort_runs_only_where_a_sampled_row_truncates():
    """``truncating`` is False for temperature-only rows and greedy rows whatever their top-k (they take the
    argmax), True once one sampled row asks for top-k or top-p."""
    hot, vocab = SamplerParams(0.7), 50
    asks = lambda rows: bool(truncating(MIXED, jax.device_put(row_values(rows, vocab)), vocab))  # noqa: E731
    assert not asks([hot, SamplerParams(), SamplerParams(1.3)])
    assert not asks([hot, SamplerParams(top_k=5), SamplerParams(top_p=0.5)])  # greedy rows' values do nothing
    assert not asks([SamplerParams(0.7, top_k=vocab), hot])  # top-k of the whole vocabulary keeps every token
    assert asks([hot, SamplerParams(0.7, top_k=5)])
    assert asks([SamplerParams(0.9, top_p=0.8), hot])
    top_p_only = jax.device_put(row_values([SamplerParams(0.9, top_p=0.8)], vocab))
    assert not bool(truncating(WarpSpec(False, use_top_k=True), top_p_only, vocab))  # no top-p stage compiled


def test_a_row_without_top_k_or_top_p_has_the_same_distribution_under_mixed():
    """Top-k = vocabulary and top-p = 1 keep every token exactly: the MIXED warp equals the SAMPLED one."""
    logits = jax.random.normal(jax.random.PRNGKey(0), (3, 4, 50)) * 3  # [B, T, V]
    rows = [SamplerParams(0.7), SamplerParams(), SamplerParams(1.3)]
    values = jax.device_put(row_values(rows, 50))
    np.testing.assert_array_equal(np.asarray(warped_probs(logits, SAMPLED, values)),
                                  np.asarray(warped_probs(logits, MIXED, values)))
    # beside a row that truncates (the sort runs), the others keep their exact distribution
    cut = jax.device_put(row_values(rows + [SamplerParams(0.9, top_k=3)], 50))
    both = np.asarray(warped_probs(jnp.concatenate([logits, logits[:1]]), MIXED, cut))
    np.testing.assert_array_equal(both[:3], np.asarray(warped_probs(logits, SAMPLED, values)))
    assert ((both[3] > 0).sum(-1) == 3).all()
