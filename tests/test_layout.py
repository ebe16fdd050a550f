"""The decoding layout (unrolled layers, output-major kernels, ``tall_dot``) computes the stored model."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ragged_forward_case, tiny_config
from models.layers import tall_dot, transpose_kernel
from models.transformer import KVCache, decoding_layout, init_params, make_forward, write_kv

FAMILIES = {
    "llama-tied": dict(tie_word_embeddings=True),
    "qwen2-bias": dict(arch="qwen2", attention_bias=True),
    "opt-projected": dict(arch="opt", num_kv_heads=4, activation="relu", attention_bias=True,
                          word_embed_proj_dim=16, tie_word_embeddings=False),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("batch,tokens", [(1, 1), (2, 5)])
def test_decoding_layout_matches_scanned_forward(family, batch, tokens):
    cfg = tiny_config(num_layers=2, **FAMILIES[family])
    params, toks, pos, cache, mask = ragged_forward_case(cfg, batch, tokens)
    # jitted, as the engine runs them (op by op each forward cost seconds of dispatch and per-op compiles)
    ref, ref_cache = jax.jit(make_forward(cfg))(params, toks, pos, cache, mask)
    out, out_cache = jax.jit(make_forward(cfg, unrolled=True))(decoding_layout(params), toks, pos, cache, mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out_cache.k), np.asarray(ref_cache.k), rtol=1e-5, atol=1e-5)


def test_tall_dot_is_a_contraction_over_the_input_axes():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 4, 5))  # [B, T, N, H]: two input axes
    w = jax.random.normal(jax.random.PRNGKey(1), (4, 5, 6))  # [N, H, D] stored input-major
    want = jnp.einsum("btnh,nhd->btd", x, w)
    for rows in [(1, 1), (2, 3)]:
        got = tall_dot(x[: rows[0], : rows[1]], transpose_kernel(w, 2), 2)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want[: rows[0], : rows[1]]), rtol=1e-5, atol=1e-5)


def test_cache_write_is_one_loop_whatever_the_batch_and_updates_in_place():
    """``write_kv``'s graph does not grow with B (a 20,000-row sampler compiles), each row lands at its
    own length, and the compiled unrolled forward copies no whole cache (the write is in place)."""
    cfg = tiny_config(num_layers=2)

    def eqns(batch: int) -> int:
        cache = KVCache.create(cfg, batch, 16)
        new = jnp.zeros((cfg.num_layers, batch, 3, cfg.num_kv_heads, cfg.head_dim))  # [L, B, T, K, H]
        return len(jax.make_jaxpr(write_kv)(cache, new, new).eqns)

    assert eqns(2) == eqns(64) == eqns(20_000)

    length = jnp.array([0, 5, 13], jnp.int32)  # [B]; 13 + 3 = capacity: the last row fills the cache
    cache = KVCache.create(cfg, 3, 16).replace(length=length)
    new = jax.random.normal(jax.random.PRNGKey(0), (cfg.num_layers, 3, 3, cfg.num_kv_heads, cfg.head_dim))
    out = write_kv(cache, new, -new)
    for b, n in enumerate(np.asarray(length)):
        np.testing.assert_array_equal(np.asarray(out.k[:, b, :, n : n + 3]), np.asarray(new[:, b].transpose(0, 2, 1, 3)))
        np.testing.assert_array_equal(np.asarray(out.v[:, b, :, n : n + 3]), -np.asarray(new[:, b].transpose(0, 2, 1, 3)))
        assert not np.asarray(out.k[:, b, :, :n]).any() and not np.asarray(out.k[:, b, :, n + 3 :]).any()

    params = decoding_layout(init_params(cfg, 0))
    cache = KVCache.create(cfg, 4, 64)
    toks, pos = jnp.zeros((4, 2), jnp.int32), jnp.zeros((4, 2), jnp.int32)  # [B, T]
    mask = jnp.ones((4, 2, 64), bool)  # [B, T, S]
    step = jax.jit(make_forward(cfg, unrolled=True), donate_argnums=(3,))
    hlo = step.lower(params, toks, pos, cache, mask).compile().as_text()
    whole = "f32[{},4,{},64,{}]".format(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    assert re.search(re.escape(whole) + r"\{[^}]*\} copy\(", hlo) is None
