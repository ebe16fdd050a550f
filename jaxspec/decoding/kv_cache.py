"""KV-cache helpers: masks for the three kinds of feed, and the commit gather."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.transformer import KVCache

__all__ = ["KVCache", "causal_mask", "tree_mask", "commit"]


def causal_mask(start: jax.Array, num_tokens: int, capacity: int) -> jax.Array:
    """mask [B, T, S]: token t (written at slot start + t) sees slots <= its own."""
    slot = start[:, None] + jnp.arange(num_tokens)  # [B, T]
    return jnp.arange(capacity)[None, None, :] <= slot[:, :, None]


def tree_mask(length: jax.Array, anc: jax.Array, rows: jax.Array, capacity: int) -> jax.Array:
    """mask [B, T, S] for tree nodes: the committed prefix plus ancestors-or-self.

    length [B] is the committed length (tree node j lives at slot length + j), anc
    [B, N, N] the ancestor-or-self matrix and rows [B, T] the node index of each fed token.
    """
    n = anc.shape[-1]
    rel = jnp.arange(capacity)[None, :] - length[:, None]  # [B, S]
    in_tree = (rel >= 0) & (rel < n)
    anc_rows = jnp.take_along_axis(anc, rows[:, :, None], axis=1)  # [B, T, N]
    seen = jnp.take_along_axis(anc_rows, jnp.clip(rel, 0, n - 1)[:, None, :], axis=2)  # [B, T, S]
    return (rel < 0)[:, None, :] | (in_tree[:, None, :] & seen)


def commit(cache: KVCache, path: jax.Array, num: jax.Array) -> KVCache:
    """Moves the K/V of the accepted tree nodes into contiguous slots and advances length.

    path [B, P] are tree-node indices ordered by depth (node j sits at slot length + j);
    the first num [B] of them are kept: node path[d] moves to slot length + d.
    """
    b, p = path.shape
    dst = cache.length[:, None] + jnp.arange(p)  # [B, P]
    keep = jnp.arange(p)[None, :] < num[:, None]
    src = jnp.where(keep, cache.length[:, None] + jnp.maximum(path, 0), dst)
    rows = jnp.arange(b)[:, None]
    # cache [L, B, K, S, H]; the [B, P] index dims come first: the moved blocks are [B, P, L, K, H]
    k = cache.k.at[:, rows, :, dst].set(cache.k[:, rows, :, src], mode="promise_in_bounds")
    v = cache.v.at[:, rows, :, dst].set(cache.v[:, rows, :, src], mode="promise_in_bounds")
    return KVCache(k, v, cache.length + num.astype(cache.length.dtype))
