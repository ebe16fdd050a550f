"""The decoding layout (unrolled layers, output-major kernels, ``tall_dot``) computes the stored model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from models.layers import tall_dot, transpose_kernel
from models.transformer import KVCache, decoding_layout, init_params, make_forward

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
    params = jax.tree_util.tree_map(lambda x: x * 3.0, init_params(cfg, 3))
    capacity = 16
    length = jnp.array([2, 4, 3][:batch], jnp.int32)  # [B] committed tokens, ragged
    cache = KVCache.create(cfg, batch, capacity)
    cache = cache.replace(k=jax.random.normal(jax.random.PRNGKey(1), cache.k.shape),
                          v=jax.random.normal(jax.random.PRNGKey(2), cache.v.shape), length=length)
    toks = jax.random.randint(jax.random.PRNGKey(4), (batch, tokens), 0, cfg.vocab_size)  # [B, T]
    pos = length[:, None] + jnp.arange(tokens)  # [B, T]
    slot = jnp.arange(capacity)[None, None, :]
    mask = slot < (length[:, None, None] + jnp.arange(tokens)[None, :, None] + 1)  # [B, T, S] causal
    ref, ref_cache = make_forward(cfg)(params, toks, pos, cache, mask)
    out, out_cache = make_forward(cfg, unrolled=True)(decoding_layout(params), toks, pos, cache, mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out_cache.k), np.asarray(ref_cache.k), rtol=1e-5, atol=1e-5)


def test_tall_dot_is_a_contraction_over_the_input_axes():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 4, 5))  # [B, T, N, H]: two input axes
    w = jax.random.normal(jax.random.PRNGKey(1), (4, 5, 6))  # [N, H, D] stored input-major
    want = jnp.einsum("btnh,nhd->btd", x, w)
    for rows in [(1, 1), (2, 3)]:
        got = tall_dot(x[: rows[0], : rows[1]], transpose_kernel(w, 2), 2)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want[: rows[0], : rows[1]]), rtol=1e-5, atol=1e-5)
