"""Speculate: each SSM extends the root into an expansion tree, one batched forward per level.

Per SSM and iteration the draft costs ``m`` forwards inside one ``fori_loop``:
  * step 0 re-feeds the last ``m + 1`` committed tokens plus the root. That keeps the
    SSM cache exact whatever path the LLM accepted last time (even a leaf the SSM never
    fed), so the SSM needs no commit of its own. The SSM cache's ``length`` says how
    many committed tokens it holds; when more than ``m + 1`` are missing (a deeper SSM
    of the pool got a longer path accepted, or iterations ran without this SSM) they
    are fed first, ``m + 1`` at a time (``catch_up``).
  * step i (1 ≤ i < m) feeds the nodes of level i (padded to the widest level) under the
    tree mask; their children are the SSM's top-k (greedy) or i.i.d. draws from its
    warped distribution (stochastic decoding).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding import sampling
from jaxspec.decoding.constrain import Masker, masked
from jaxspec.decoding.kv_cache import causal_mask, tree_mask
from jaxspec.decoding.tree import DynamicTree, Topology, TokenTree, ancestor_mask
from models.transformer import Forward, KVCache


@dataclasses.dataclass(frozen=True)
class LevelTables:
    """Static index tables that let one loop body handle every level of a topology."""

    fed: np.ndarray  # [m, W] node index fed at level i (padded with the level's first node)
    child: np.ndarray  # [m, C] node index of level-(i+1) children (padded with N = trash)
    child_parent: np.ndarray  # [m, C] position of the child's parent within fed[i]
    child_rank: np.ndarray  # [m, C] which of the parent's k draws the child is

    @classmethod
    def of(cls, topo: Topology) -> "LevelTables":
        m, n = topo.max_depth, topo.num_nodes
        w = topo.max_width
        c = max(topo.level_size(i) for i in range(1, m + 1))
        fed = np.zeros((m, w), np.int32)
        child = np.full((m, c), n, np.int32)
        child_parent = np.zeros((m, c), np.int32)
        child_rank = np.zeros((m, c), np.int32)
        for i in range(m):
            lo, hi = topo.level_offsets[i], topo.level_offsets[i + 1]
            fed[i, : hi - lo] = np.arange(lo, hi)
            fed[i, hi - lo :] = lo
            clo, chi = topo.level_offsets[i + 1], topo.level_offsets[i + 2]
            for j, node in enumerate(range(clo, chi)):
                child[i, j] = node
                child_parent[i, j] = topo.parent[node] - lo
                child_rank[i, j] = j % topo.expansion[i]
        return cls(fed, child, child_parent, child_rank)


def call(forward, params, toks, feats, positions, cache: KVCache, mask, select=None):
    """(logits, cache, states or None) of any forward (one signature): a feature drafter reads feats [B, T, D]
    as ``features=`` (and returns its predicted states); a Transformer reads none (and returns its states only
    when made with ``hidden=True``)."""
    out = forward(params, toks, positions, cache, mask, select, **({} if feats is None else {"features": feats}))
    return out[0], out[1], (out[2] if len(out) > 2 else None)


def previous_features(features: jax.Array | None, idx: jax.Array) -> jax.Array | None:
    """f_{p-1} for slots idx [B, W] from the LLM's states features [B, S, D] (zeros at p = 0)."""
    if features is None:
        return None
    prev = jnp.take_along_axis(features, jnp.clip(idx - 1, 0, features.shape[1] - 1)[:, :, None], axis=1)
    return jnp.where((idx > 0)[:, :, None], prev, 0).astype(features.dtype)  # [B, W, D]


def propose(key: jax.Array, logits: jax.Array, k: int, spec: sampling.WarpSpec, values,
            noise: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """k children per row of logits [B, W, V]: top-k (greedy), the top-k of the Gumbel-perturbed warped
    log-probabilities (coupled: ``noise`` [B, V], the children's position's), or k i.i.d. warped draws.

    Returns (tokens [B, W, k], draft probabilities [B, W, V]; zeros unless drawn).
    """
    if spec.greedy:
        return jax.lax.top_k(logits, k)[1].astype(jnp.int32), jnp.zeros((), jnp.float32)
    if noise is not None:
        scores = sampling.perturbed(logits, spec, values, noise[:, None, :])  # top-k needs no normalising
        return jax.lax.top_k(scores, k)[1].astype(jnp.int32), jnp.zeros((), jnp.float32)
    logp = sampling.warp_logits(logits, spec, values)  # [B, W, V]
    draws = sampling.categorical_rows(key, logp, k)  # [B, W, k]
    return draws.astype(jnp.int32), jnp.exp(logp)


def catch_up(forward: Forward, params, cache: KVCache, history: jax.Array, length: jax.Array,
             window: int, features: jax.Array | None = None) -> KVCache:
    """Feeds the committed tokens the SSM cache lacks until at most ``window`` are missing.

    cache.length [B] is how many committed tokens the SSM cache holds, length [B] how many
    the LLM committed, history [B, S] the committed ids (and features [B, S, D] the LLM's
    states, for a feature drafter). Rows already close enough re-feed their last ``window``
    tokens, which rewrites their K/V unchanged.
    """
    cap = cache.capacity
    last = history.shape[1] - 1

    def behind(c: KVCache) -> jax.Array:
        return length - c.length > window  # [B]

    def feed(c: KVCache) -> KVCache:
        late = behind(c)
        start = jnp.where(late, c.length, jnp.maximum(length - window, 0))  # [B]
        idx = start[:, None] + jnp.arange(window)  # [B, W]
        toks = jnp.take_along_axis(history, jnp.minimum(idx, last), axis=1)
        select = jnp.zeros((start.shape[0], 1), jnp.int32)
        _, c, _ = call(forward, params, toks, previous_features(features, idx), idx, c.replace(length=start),
                       causal_mask(start, window, cap), select)
        return c.replace(length=jnp.where(late, start + window, jnp.maximum(length - window, 0)))

    return jax.lax.while_loop(lambda c: jnp.any(behind(c)), feed, cache)


def feed_root(forward: Forward, params, cache: KVCache, history: jax.Array, length: jax.Array, root: jax.Array,
              window: int, features: jax.Array | None = None) -> tuple[jax.Array, KVCache, jax.Array | None]:
    """Draft step 0: re-feeds the last ``window`` committed tokens and the root (slot ``length``).

    Keeps the SSM cache exact whatever path the LLM accepted last time. Returns the root's
    logits [B, 1, V], the cache (length == length) and, for a feature drafter (``features``
    [B, S, D] given), its predicted state at the root [B, 1, D] (the state its children read).
    """
    cap = cache.capacity
    cache = catch_up(forward, params, cache, history, length, window, features)
    start = jnp.maximum(length - window, 0)
    idx = start[:, None] + jnp.arange(window + 1)  # [B, W0]
    hist = jnp.take_along_axis(history, jnp.minimum(idx, history.shape[1] - 1), axis=1)
    toks0 = jnp.where(idx < length[:, None], hist, jnp.where(idx == length[:, None], root[:, None], 0))
    logits0, cache, state0 = call(forward, params, toks0, previous_features(features, idx), idx,
                                  cache.replace(length=start), causal_mask(start, window + 1, cap),
                                  (length - start)[:, None])
    return logits0, cache.replace(length=length), state0


def speculate_dynamic(forward: Forward, params, cache: KVCache, dyn: DynamicTree, history: jax.Array,
                      length: jax.Array, root: jax.Array, source: int = 0,
                      features: jax.Array | None = None, spec: sampling.WarpSpec = sampling.WarpSpec(),
                      values=None, noise: jax.Array | None = None,
                      masker: Masker | None = None) -> tuple[TokenTree, jax.Array, KVCache]:
    """Drafting of a ``DynamicTree``: grow where the SSM is confident, keep the best nodes.

    Every drafted node scores its cumulative draft log-probability (the sum along its
    path): the plain one (greedy), or under coupled sampling the perturbed one of
    ``sampling.coupled_scores`` with ``noise`` [B, m, V] (level i: its children's position's).
    Level i feeds the ``width`` best-scoring nodes of depth i (written at SSM cache slots
    ``length + 1 + (i-1)·width + w``, each attending to its fed ancestors), each of which
    drafts its ``width`` most likely children. The ``nodes`` - 1 best of all drafted nodes
    form the tree, in depth order (a parent before its children); a node whose parent
    missed the cut (possible only on tied scores) is marked invalid.
    A feature drafter (``features`` [B, S, D]: the LLM's states) feeds each node with the state
    it predicted at the node's parent. ``masker`` (constrained rows) masks each expanded node's
    children by the grammar, so every draft is grammar-valid.
    Returns (tree [B, N], scalar 0 draft probabilities, cache with length == length).
    """
    b = root.shape[0]
    m, w, n = dyn.depth, dyn.width, dyn.nodes
    cap = cache.capacity
    pool = 1 + dyn.drafted  # every drafted node plus the root
    fed = dyn.fed
    logits0, cache, state0 = feed_root(forward, params, cache, history, length, root, m + 1, features)

    def scores(logits, i):  # [B, ..., V] -> the log-probabilities children are ranked by
        if noise is None:
            return jax.nn.log_softmax(logits)
        level = noise[:, i].reshape((b,) + (1,) * (logits.ndim - 2) + (noise.shape[-1],))
        return sampling.coupled_scores(logits, spec, values, level)

    tokens = jnp.zeros((b, pool), jnp.int32).at[:, 0].set(root)
    parent = jnp.full((b, pool), -1, jnp.int32)
    logits0 = masked(masker, logits0, tokens, parent, jnp.zeros((b, 1), jnp.int32))
    logp0 = scores(logits0[:, 0], 0)  # [B, V]
    score0, tok0 = jax.lax.top_k(logp0, w)  # [B, W]
    tokens = tokens.at[:, 1: 1 + w].set(tok0)
    parent = parent.at[:, 1: 1 + w].set(0)
    score = jnp.zeros((b, pool), jnp.float32).at[:, 1: 1 + w].set(score0)
    depth = np.zeros(pool, np.int32)  # static: level i's candidates are one slab
    depth[1: 1 + w] = 1
    fed_slot = jnp.full((b, pool), -1, jnp.int32).at[:, 0].set(0)  # [B, pool] fed slot of a node, -1 if not fed
    anc = jnp.zeros((b, fed, fed), bool).at[:, 0, 0].set(True)  # [B, F, F] fed ancestor-or-self
    lo, hi = 1, 1 + w  # the current level's candidates
    rows_b = jnp.arange(b)[:, None]
    node_state = None  # [B, pool, D] feature drafter: the state a node is fed with (its parent's prediction)
    if state0 is not None:
        node_state = jnp.zeros((b, pool, state0.shape[-1]), state0.dtype).at[:, 1: 1 + w].set(
            jnp.broadcast_to(state0, (b, w, state0.shape[-1])))
    for i in range(1, m):
        best = jax.lax.top_k(score[:, lo:hi], w)[1] + lo  # [B, W] pool index of the nodes to expand
        slots = 1 + (i - 1) * w + jnp.arange(w)  # [W] their fed slots
        fed_slot = fed_slot.at[rows_b, best].set(jnp.broadcast_to(slots, (b, w)))
        up = jnp.take_along_axis(fed_slot, jnp.take_along_axis(parent, best, axis=1), axis=1)  # [B, W] parents' slots
        anc = anc.at[:, slots].set(jnp.take_along_axis(anc, up[:, :, None], axis=1)
                                   | (jnp.arange(fed)[None, None, :] == slots[None, :, None]))
        toks = jnp.take_along_axis(tokens, best, axis=1)
        positions = jnp.broadcast_to(length[:, None] + i, (b, w))
        mask = tree_mask(length, anc, jnp.broadcast_to(slots, (b, w)), cap)
        fed_state = None if node_state is None else jnp.take_along_axis(node_state, best[:, :, None], axis=1)
        logits, cache, out = call(forward, params, toks, fed_state, positions, cache.replace(length=length + slots[0]),
                                  mask)
        logits = masked(masker, logits, tokens, parent, best)
        child_lp, child_tok = jax.lax.top_k(scores(logits, i), w)  # [B, W, W]
        nlo, nhi = hi, hi + w * w
        if node_state is not None:
            node_state = node_state.at[:, nlo:nhi].set(jnp.repeat(out, w, axis=1))
        tokens = tokens.at[:, nlo:nhi].set(child_tok.reshape(b, w * w))
        parent = parent.at[:, nlo:nhi].set(jnp.repeat(best, w, axis=1))
        score = score.at[:, nlo:nhi].set((jnp.take_along_axis(score, best, axis=1)[:, :, None] + child_lp).reshape(b, -1))
        depth[nlo:nhi] = i + 1
        lo, hi = nlo, nhi
    cache = cache.replace(length=length)

    keep = jax.lax.top_k(score[:, 1:], n - 1)[1] + 1  # [B, N-1] best nodes, by score
    depth_j = jnp.asarray(depth)
    order = jnp.argsort(depth_j[keep] * pool + jnp.arange(n - 1)[None, :], axis=1)  # depth first, then score
    keep = jnp.take_along_axis(keep, order, axis=1)
    chosen = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), keep], axis=1)  # [B, N] pool index per tree node
    tree_index = jnp.full((b, pool), -1, jnp.int32).at[rows_b, chosen].set(jnp.arange(n, dtype=jnp.int32))
    par_pool = jnp.take_along_axis(parent, chosen, axis=1)
    par_tree = jnp.where(par_pool >= 0, jnp.take_along_axis(tree_index, jnp.maximum(par_pool, 0), axis=1), -1)
    valid = (par_tree >= 0) | (jnp.arange(n) == 0)[None, :]
    for _ in range(m - 1):  # a node is valid only under a valid parent
        valid = valid & ((par_tree < 0) | jnp.take_along_axis(valid, jnp.maximum(par_tree, 0), axis=1))
    par_tree = jnp.where((jnp.arange(n) > 0)[None, :] & (par_tree < 0), 0, par_tree)
    node_depth = jnp.broadcast_to(depth_j[chosen], (b, n)).astype(jnp.int32)
    sources = jnp.where(jnp.arange(n)[None, :] > 0, source, -1).astype(jnp.int32) + jnp.zeros((b, n), jnp.int32)
    tree = TokenTree(jnp.take_along_axis(tokens, chosen, axis=1), par_tree, node_depth, valid, sources, par_tree)
    return tree, jnp.zeros((), jnp.float32), cache


def speculate(
    forward: Forward,
    params,
    cache: KVCache,
    topo: Topology,
    history: jax.Array,
    length: jax.Array,
    root: jax.Array,
    key: jax.Array,
    spec: sampling.WarpSpec,
    values,
    source: int = 0,
    features: jax.Array | None = None,
    noise: jax.Array | None = None,
    masker: Masker | None = None,
) -> tuple[TokenTree, jax.Array, KVCache]:
    """Drafts one expansion tree per row.

    history [B, S] holds committed tokens, length [B] their count (= the LLM cache
    length), root [B] the pending token; features [B, S, D] the LLM's states when the
    drafter is a feature drafter (each node is then fed its parent's predicted state);
    noise [B, m, V] the coupled sampler's Gumbel noise by level (its children's position's);
    ``masker`` (constrained rows) masks every fed node's children by the grammar (its q too).
    Returns (tree [B, N], draft_probs [B, N, V] or a scalar zero under greedy, new SSM cache
    with length == length).
    """
    b = root.shape[0]
    m, n = topo.max_depth, topo.num_nodes
    cap = cache.capacity
    tables = LevelTables.of(topo)
    kmax = max(topo.expansion)
    parent = jnp.broadcast_to(jnp.asarray(topo.parent, jnp.int32), (b, n))
    anc = ancestor_mask(parent, m)  # [B, N, N]
    keys = sampling.split_rows(key, m)  # [B, m, 2] (or [m, 2] for a shared key)

    logits0, cache, state0 = feed_root(forward, params, cache, history, length, root, m + 1, features)  # [B, 1, V]

    tokens = jnp.zeros((b, n + 1), jnp.int32).at[:, 0].set(root)  # slot N is trash
    # [B, N + 1, D] feature drafter: the state each node is fed with (its parent's prediction)
    states = None if state0 is None else jnp.zeros((b, n + 1, state0.shape[-1]), state0.dtype)
    vocab = logits0.shape[-1]
    stochastic = not spec.greedy and noise is None  # draws, whose distributions MSS divides by
    probs = jnp.zeros((b, n + 1, vocab) if stochastic else (), jnp.float32)

    tree_parent = jnp.broadcast_to(jnp.asarray(np.append(topo.parent, 0), jnp.int32), (b, n + 1))  # trash under root

    def expand(i, logits, out, tokens, probs, states, key):
        fed_nodes = jnp.asarray(tables.fed)[i][: logits.shape[1]]
        logits = masked(masker, logits, tokens, tree_parent, jnp.broadcast_to(fed_nodes, (b, fed_nodes.shape[0])))
        level_noise = None if noise is None else noise[:, i]
        draws, q = propose(key, logits, kmax, spec, values, level_noise)  # [B, W, kmax]
        child = jnp.asarray(tables.child)[i]
        child_parent = jnp.asarray(tables.child_parent)[i]
        picked = draws[:, child_parent, jnp.asarray(tables.child_rank)[i]]  # [B, C]
        tokens = tokens.at[:, child].set(picked)
        if stochastic:
            fed = jnp.asarray(tables.fed)[i]
            probs = probs.at[:, fed[: logits.shape[1]]].set(q)
        if states is not None:
            states = states.at[:, child].set(out[:, child_parent])
        return tokens, probs, states

    tokens, probs, states = expand(0, logits0, state0, tokens, probs, states, sampling.pick_key(keys, 0))

    def level(i, carry):
        tokens, probs, states, cache = carry
        fed = jnp.asarray(tables.fed)[i]  # [W]
        rows = jnp.broadcast_to(fed, (b, fed.shape[0]))
        toks = jnp.take_along_axis(tokens, rows, axis=1)
        fed_states = None if states is None else jnp.take_along_axis(states, rows[:, :, None], axis=1)
        first = jnp.asarray(topo.level_offsets)[i]
        write_at = length + first
        positions = jnp.broadcast_to(length[:, None] + i, rows.shape)
        mask = tree_mask(length, anc, rows, cap)
        logits, cache, out = call(forward, params, toks, fed_states, positions, cache.replace(length=write_at), mask)
        tokens, probs, states = expand(i, logits, out, tokens, probs, states, sampling.pick_key(keys, i))
        return tokens, probs, states, cache.replace(length=length)

    if m > 1:
        tokens, probs, states, cache = jax.lax.fori_loop(1, m, level, (tokens, probs, states, cache))

    depth = jnp.broadcast_to(jnp.asarray(topo.depth, jnp.int32), (b, n))
    sources = jnp.where(parent >= 0, source, -1).astype(jnp.int32)
    tree = TokenTree(tokens[:, :n], parent, depth, jnp.ones((b, n), bool), sources, parent)
    return tree, (probs[:, :n] if stochastic else probs), cache
