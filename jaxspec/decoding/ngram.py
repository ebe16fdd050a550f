"""How the n-gram (prompt-lookup) speculator's proposals enter the step: host arrays, then a chain of tree nodes.

The speculator itself (``jaxspec.speculators.ngram``: its index of the request's n-grams and its proposals)
lives on the host with the other speculators. A proposal enters the step as a chain of tree nodes, one
per proposed token, and merges with the learned SSMs' trees like any pool member.
Under stochastic decoding each proposed token is its own one-hot draft distribution
(accepted with probability p(token), removed from the residual when rejected), which
keeps multi-step speculative sampling exact for any proposal that depends only on the
committed tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.tree import TokenTree

def proposal_arrays(proposals: list[list[int]], depth: int) -> tuple[np.ndarray, np.ndarray]:
    """Host arrays for the step: tokens [B, depth] (0 padding) and their counts [B]."""
    tokens = np.zeros((len(proposals), max(depth, 1)), np.int32)
    counts = np.zeros((len(proposals),), np.int32)
    for b, p in enumerate(proposals):
        p = p[:depth]
        tokens[b, : len(p)] = p
        counts[b] = len(p)
    return tokens, counts


def chain_tree(root: jax.Array, tokens: jax.Array, count: jax.Array, position: int, vocab: int,
               stochastic: bool) -> tuple[TokenTree, jax.Array]:
    """The proposal as a chain tree [B, D + 1] under the root, and its draft probabilities.

    root [B], tokens [B, D], count [B] (nodes deeper than count are invalid). Row i of the
    draft probabilities [B, D + 1, V] is one-hot at tokens[:, i]: the distribution node
    i + 1 was "drawn" from (a scalar zero under greedy decoding, as ``speculate`` returns).
    """
    b, d = tokens.shape
    depth = jnp.broadcast_to(jnp.arange(d + 1, dtype=jnp.int32), (b, d + 1))
    parent = depth - 1
    tree = TokenTree(
        jnp.concatenate([root[:, None].astype(jnp.int32), tokens.astype(jnp.int32)], axis=1),
        parent,
        depth,
        depth <= count[:, None],
        jnp.where(parent >= 0, position, -1).astype(jnp.int32),
        parent,
    )
    if not stochastic:
        return tree, jnp.zeros((), jnp.float32)
    probs = jax.nn.one_hot(jnp.concatenate([tokens, jnp.zeros((b, 1), tokens.dtype)], axis=1), vocab)
    return tree, probs.astype(jnp.float32)
