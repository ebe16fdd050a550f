"""Token trees: masks and positions vs brute force, Definition 3.2 merging, and tree attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxspec.decoding.kv_cache import tree_mask
from jaxspec.decoding.tree import (
    TokenTree, ancestor_mask, deduplicate, depth_of, expansion_topology, merge, parse_expansion, paths,
)
from models.transformer import KVCache


def brute_paths(parent: list[int]) -> list[list[int]]:
    """Root-to-node index path of every node by walking parents."""
    out = []
    for i in range(len(parent)):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parent[j]
        out.append(path[::-1])
    return out


@st.composite
def random_parents(draw, max_nodes: int = 24):
    n = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # each new shape compiles
@given(random_parents(), st.integers(0, 40))
def test_tree_mask_and_positions_match_brute_force(parent, length):
    n = len(parent)
    paths_ = brute_paths(parent)
    depth_max = max(len(p) for p in paths_) - 1
    par = jnp.asarray([parent], jnp.int32)
    anc = np.asarray(jax.jit(ancestor_mask, static_argnums=1)(par, max(depth_max, 1)))[0]  # jitted: one compile each
    depth = np.asarray(jax.jit(depth_of, static_argnums=1)(par, max(depth_max, 1)))[0]
    cap = length + n + 3
    mask = np.asarray(jax.jit(tree_mask, static_argnums=3)(jnp.asarray([length]), jnp.asarray(anc)[None],
                                                          jnp.arange(n)[None], cap))[0]
    for i, p in enumerate(paths_):
        assert depth[i] == len(p) - 1  # position of node i is length + depth
        expected = np.zeros(cap, bool)
        expected[:length] = True  # the verified prefix
        expected[[length + j for j in p]] = True  # ancestors-or-self
        np.testing.assert_array_equal(mask[i], expected)
        np.testing.assert_array_equal(anc[i], np.isin(np.arange(n), p))


def test_expansion_topology_shape():
    topo = expansion_topology(parse_expansion("1,1,3,1,1,1,1,1"))
    assert topo.num_nodes == 1 + 1 + 1 + 3 * 6
    assert topo.level_offsets == (0, 1, 2, 3, 6, 9, 12, 15, 18, 21)
    assert all(p < i for i, p in enumerate(topo.parent) if p >= 0)
    assert parse_expansion("") == ()


def _tree_from(tokens, parent) -> TokenTree:
    t = jnp.asarray([tokens], jnp.int32)
    p = jnp.asarray([parent], jnp.int32)
    z = jnp.zeros_like(t)
    return TokenTree(t, p, depth_of(p, 8), jnp.ones_like(t, bool), z, p)


@st.composite
def random_token_trees(draw):
    """A random tree in expansion shape with tokens from a tiny alphabet (so paths collide)."""
    exp = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    topo = expansion_topology(exp)
    tokens = [0] + [draw(st.integers(0, 2)) for _ in range(topo.num_nodes - 1)]
    return _tree_from(tokens, list(topo.parent)), len(exp)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # each new shape compiles
@given(st.lists(random_token_trees(), min_size=1, max_size=3))
def test_merge_holds_exactly_the_union_of_sequences(trees):
    depth = max(d for _, d in trees)
    merged = jax.jit(merge, static_argnums=1)([t for t, _ in trees], depth)  # one compile, not one per op
    got = paths(merged, depth)[0]
    union = set()
    for t, _ in trees:
        union |= set(paths(t, depth)[0])
    assert len(got) == len(set(got)), "a token sequence is stored twice"
    assert set(got) == union
    valid = np.asarray(merged.valid)[0]
    parent = np.asarray(merged.parent)[0]
    assert all(valid[parent[i]] for i in range(1, len(parent)) if valid[i]), "a valid node hangs off a duplicate"
    assert all(parent[i] < i for i in range(1, len(parent)))


def test_dedup_reparents_children_of_duplicates():
    # root -> a(1) -> x(3); root -> a(2) -> y(4): merging keeps one 'a' with both children
    tree = deduplicate(_tree_from([0, 5, 5, 7, 8], [-1, 0, 0, 1, 2]), 2)
    assert np.asarray(tree.valid)[0].tolist() == [True, True, False, True, True]
    assert np.asarray(tree.parent)[0].tolist() == [-1, 0, 0, 1, 1]


def test_tree_attention_equals_running_each_path_alone(tiny_llm):
    """Definition 4.1: the logits at every tree node equal the LLM on that node's path alone."""
    _check_tree_attention(tiny_llm, prompt=[3, 9, 4, 1, 7], atol=1e-4)


def test_tree_attention_default_model(default_llm):
    ids = default_llm.tokenizer.encode("The quick brown fox")
    _check_tree_attention(default_llm, prompt=ids, atol=2e-3)


def _check_tree_attention(model, prompt, atol):
    fwd = jax.jit(model.forward)
    topo = expansion_topology((2, 2, 1))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.cfg.vocab_size, size=topo.num_nodes).astype(np.int32)
    cap = 64
    plen = len(prompt)
    cache = KVCache.create(model.cfg, 1, cap)
    pos = jnp.arange(plen)[None]
    causal = jnp.arange(cap)[None, None, :] <= pos[:, :, None]
    _, cache = fwd(model.params, jnp.asarray([prompt]), pos, cache, causal)
    cache = cache.replace(length=jnp.asarray([plen], jnp.int32))
    parent = jnp.asarray([topo.parent], jnp.int32)
    anc = ancestor_mask(parent, topo.max_depth)
    mask = tree_mask(cache.length, anc, jnp.arange(topo.num_nodes)[None], cap)
    depth = jnp.asarray([topo.depth])
    tree_logits, _ = fwd(model.params, jnp.asarray(tokens)[None], plen + depth, cache, mask)
    for i, path in enumerate(brute_paths(list(topo.parent))):
        seq = prompt + tokens[path].tolist()
        c = KVCache.create(model.cfg, 1, cap)
        p = jnp.arange(len(seq))[None]
        full, _ = fwd(model.params, jnp.asarray([seq]), p, c, jnp.arange(cap)[None, None, :] <= p[:, :, None])
        np.testing.assert_allclose(np.asarray(tree_logits[0, i]), np.asarray(full[0, -1]), atol=atol, rtol=0)
