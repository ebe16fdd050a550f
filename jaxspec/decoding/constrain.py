"""Grammar masks on the device: packed token bitmasks applied to draft and verify logits.

A constrained row's host matcher (``jaxspec.structured``) says which tokens may follow a
path of the token tree. The step asks for those masks through a host callback (a
``Masker``) at every tree node it needs them: at each drafting level for the nodes whose
children are proposed (so drafts are grammar-valid) and at every node of the merged tree
for the LLM's logits before verification (greedy takes the masked argmax; sampled rows
draw from the masked, renormalised distribution, so MSS and the coupled sampler stay exact).
Masks are bit-packed like llguidance's: word ``t // 32``, bit ``t % 32`` allows token t.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

NEG = -1e30  # a masked logit: finite, so a path score (a sum of log-probabilities) never becomes nan

# (tokens [B, P], parent [B, P], nodes [B, K]) -> packed masks [B, K, W] int32 of the tokens allowed after
# each node's path (the root, index 0, is the pending token the matcher has already consumed)
Masker = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def words(vocab: int) -> int:
    """W: 32-bit words of a packed mask over ``vocab`` tokens."""
    return (vocab + 31) // 32


def unpack(bits: jax.Array, vocab: int) -> jax.Array:
    """Packed masks [..., W] int32 -> allowed [..., V] bool."""
    shifts = jnp.arange(32, dtype=jnp.int32)
    allowed = (jnp.right_shift(bits[..., None], shifts) & 1).astype(bool)  # [..., W, 32]
    return allowed.reshape(bits.shape[:-1] + (bits.shape[-1] * 32,))[..., :vocab]


def apply(logits: jax.Array, bits: jax.Array) -> jax.Array:
    """logits [..., V] with the tokens ``bits`` [..., W] forbid set to NEG."""
    return jnp.where(unpack(bits, logits.shape[-1]), logits, jnp.asarray(NEG, logits.dtype))


def host_masker(fn: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray], vocab: int) -> Masker:
    """A ``Masker`` that calls ``fn`` (numpy in, int32 [B, K, W] out) on the host from inside the jitted step."""
    w = words(vocab)

    def host(*arrays) -> np.ndarray:  # the callback may receive jax arrays: index numpy ones, not device slices
        return fn(*(np.asarray(a) for a in arrays))

    def masker(tokens: jax.Array, parent: jax.Array, nodes: jax.Array) -> jax.Array:
        shape = jax.ShapeDtypeStruct(nodes.shape + (w,), jnp.int32)
        return jax.pure_callback(host, shape, tokens.astype(jnp.int32), parent.astype(jnp.int32),
                                 nodes.astype(jnp.int32), vmap_method="sequential")

    return masker


def chain_node_masks(table: jax.Array, tree, sources: tuple[str, ...], forced_depth: int) -> jax.Array:
    """Packed masks [B, N, W] of a chains-only tree's nodes from the host's table [B, 1 + F + D, W].

    The table holds, per row, the mask at the root, after each prefix of the forced chain (F),
    then after each prefix of the n-gram chain (D) (``jaxspec.structured.RowMasks.chain_masks``).
    A node's path is a prefix of the chain its source proposed, so (source, depth) finds it; a node
    two chains share has one path, hence one mask either way. Padding is unmasked.
    """
    forced = sources.index("forced") if "forced" in sources else -2
    depth = tree.depth
    index = jnp.where(depth == 0, 0, jnp.where(tree.source == forced, depth, forced_depth + depth))  # [B, N]
    index = jnp.clip(index, 0, table.shape[1] - 1)
    bits = jnp.take_along_axis(table, index[..., None], axis=1)  # [B, N, W]
    return jnp.where(tree.valid[..., None], bits, -1)


def masked(masker: Masker | None, logits: jax.Array, tokens: jax.Array, parent: jax.Array,
           nodes: jax.Array) -> jax.Array:
    """logits [B, K, V] of nodes [B, K] (of the tree tokens/parent [B, P]) masked by the grammar, if any."""
    if masker is None:
        return logits
    return apply(logits, masker(tokens, parent, nodes))
