"""Accept: turn the LLM's logits at every tree node into the tokens this iteration commits.

Every verifier returns a ``Verdict``: the accepted path of tree nodes (root first) and
the LLM's own next token after it: the *bonus* token under greedy decoding, a bonus or
*recovered* (residual-sampled) token under stochastic decoding.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from jaxspec.decoding import sampling
from jaxspec.decoding.tree import TokenTree, ancestor_mask


@flax.struct.dataclass
class Verdict:
    """The outcome of verifying one tree per row."""

    path: jax.Array  # [B, P] accepted node indices ordered by depth, root first; -1 padding
    num: jax.Array  # [B] nodes on the path (root included), so num - 1 tokens were accepted
    next_token: jax.Array  # [B] bonus / recovered token emitted after the path


def path_from_leaf(tree: TokenTree, leaf: jax.Array, max_depth: int) -> tuple[jax.Array, jax.Array]:
    """Root-to-leaf node indices [B, max_depth + 1] (padded -1) and their count [B]."""
    anc = ancestor_mask(tree.parent, max_depth)  # [B, N, N]
    on_path = jnp.take_along_axis(anc, leaf[:, None, None], axis=1)[:, 0]  # [B, N]
    d = jnp.arange(max_depth + 1)
    hit = on_path[:, None, :] & (tree.depth[:, None, :] == d[None, :, None])  # [B, P, N]
    path = jnp.where(hit.any(-1), jnp.argmax(hit, axis=-1), -1).astype(jnp.int32)
    return path, on_path.sum(-1).astype(jnp.int32)


def verify_greedy(tree: TokenTree, logits: jax.Array, max_depth: int) -> Verdict:
    """VerifyGreedy (Algorithm 2, lines 16-22): follow children equal to the LLM's argmax.

    logits [B, N, V] are the LLM's at every node. A node is accepted when it is valid,
    its parent is accepted and its token is the parent's argmax; after Definition 3.2
    merging at most one child per node can match, so the accepted nodes form one path.
    """
    return verify_choices(tree, jnp.argmax(logits, axis=-1).astype(jnp.int32), max_depth)


def verify_coupled(tree: TokenTree, logits: jax.Array, noise: jax.Array, spec: sampling.WarpSpec, values: dict,
                   max_depth: int) -> Verdict:
    """Coupled (Gumbel-max) verification: greedy verification of the LLM's perturbed choices.

    At a node of depth d the LLM's choice is argmax(warped logits + noise[d]), the noise of the
    absolute position it predicts (``sampling.gumbel_at``): the exact sampler incremental decoding
    with the same seed runs, so any tree commits the very tokens incremental decoding emits.
    logits [B, N, V]; noise [B, D + 1, V] by depth.
    """
    at_node = jnp.take_along_axis(noise, jnp.clip(tree.depth, 0, noise.shape[1] - 1)[:, :, None], axis=1)  # [B, N, V]
    return verify_choices(tree, sampling.coupled_choice(logits, spec, values, at_node), max_depth)


def verify_choices(tree: TokenTree, target: jax.Array, max_depth: int) -> Verdict:
    """Follow children equal to the LLM's choice target [B, N] at their parent (argmax, or a coupled draw)."""
    safe_parent = jnp.maximum(tree.parent, 0)
    matches = tree.valid & (tree.tokens == jnp.take_along_axis(target, safe_parent, axis=1))
    accepted = tree.parent < 0  # the root

    def step(_, acc):
        return (tree.parent < 0) | (matches & jnp.take_along_axis(acc, safe_parent, axis=1))

    accepted = jax.lax.fori_loop(0, max_depth, step, accepted)
    deepest = jnp.argmax(jnp.where(accepted, tree.depth, -1), axis=-1).astype(jnp.int32)  # [B]
    path, num = path_from_leaf(tree, deepest, max_depth)
    bonus = jnp.take_along_axis(target, deepest[:, None], axis=1)[:, 0]
    return Verdict(path, num, bonus)
