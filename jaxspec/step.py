"""One decoding iteration: speculate → merge → verify in one LLM pass → accept → commit.

Incremental decoding (no SSM, empty tree), sequence speculation ⟨1,…,1⟩ and tree
speculation ⟨1,1,3,…⟩ are configurations of this one function. The whole iteration is
a single jitted executable: SSM levels run inside ``fori_loop``, nothing returns to the
host but the few emitted tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import flax
import jax
import jax.numpy as jnp

from jaxspec import sampling
from jaxspec.kv_cache import KVCache, causal_mask, commit, tree_mask
from jaxspec.speculate import speculate
from jaxspec.tree import Topology, TokenTree, ancestor_mask, merge, single_root
from jaxspec.verify import Verdict, verify_greedy
from models.transformer import Forward

VERIFIERS = ("greedy", "mss", "naive")


@dataclasses.dataclass(frozen=True)
class SSMGroup:
    """SSMs that draft in one vmapped forward: same architecture, dtype and expansion.

    The group's parameters are stacked on a leading member axis G, except the ``shared``
    ones (flattened names such as ``embed/embedding`` that every member holds as one
    array, e.g. a pool's common embedding): those are passed once, unbatched. Its KV
    caches are stacked on G. A one-member group is an ordinary, unstacked SSM.
    """

    members: tuple[int, ...]  # SSM indices, i.e. positions in the merged tree's SSM order
    shared: tuple[str, ...] = ()

    def param_axes(self, params: dict) -> dict:
        """vmap in_axes for the group's parameter tree: 0 for stacked leaves, None for shared ones."""
        from models.loading import flatten, unflatten  # noqa: PLC0415

        return unflatten({k: (None if k in self.shared else 0) for k in flatten(params)})


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static settings of the compiled step (hashable: one executable per value)."""

    topologies: tuple[Topology, ...] = ()  # one per SSM; empty = incremental decoding
    warp: sampling.WarpSpec = sampling.WarpSpec()
    verify: str = "greedy"  # greedy | mss | naive (the last two need a stochastic warp)
    tree_budget: int | None = None  # pad the merged tree to this many nodes
    groups: tuple[SSMGroup, ...] = ()  # how SSM forwards/params/caches are batched; () = one per SSM

    def __post_init__(self) -> None:
        if self.verify not in VERIFIERS:
            raise ValueError(f"--verify must be one of {', '.join(VERIFIERS)}, got {self.verify!r}")
        members = sorted(j for g in self.ssm_groups for j in g.members)
        if members != list(range(len(self.topologies))):
            raise ValueError(f"SSM groups {members} must cover SSMs 0..{len(self.topologies) - 1} once each")
        for g in self.ssm_groups:
            if len({self.topologies[j] for j in g.members}) != 1:
                raise ValueError(f"SSM group {g.members} mixes expansion configs: one vmapped draft needs one")
        if self.tree_budget is not None and self.natural_nodes > self.tree_budget:
            raise ValueError(
                f"the token tree needs {self.natural_nodes} nodes (root included) but --tree-budget is "
                f"{self.tree_budget}; shrink --expansion or raise the budget"
            )

    @property
    def ssm_groups(self) -> tuple[SSMGroup, ...]:
        """The groups, or one single-member group per SSM."""
        return self.groups or tuple(SSMGroup((j,)) for j in range(len(self.topologies)))

    @property
    def max_depth(self) -> int:
        return max((t.max_depth for t in self.topologies), default=0)

    @property
    def natural_nodes(self) -> int:
        return 1 + sum(t.num_nodes - 1 for t in self.topologies)

    @property
    def num_nodes(self) -> int:
        """N: tree nodes fed to the LLM per iteration (root included)."""
        return self.tree_budget or self.natural_nodes

    @property
    def max_emit(self) -> int:
        """Most tokens one iteration can emit: the deepest path plus the bonus token."""
        return self.max_depth + 1


@flax.struct.dataclass
class DecodeState:
    """Everything that changes between iterations, for B slots."""

    llm_cache: KVCache  # length [B] = committed tokens (prompt + emitted, minus the root)
    ssm_caches: tuple[KVCache, ...]  # one per SSM group; a group of G stacks its caches on a leading G axis
    history: jax.Array  # [B, S] committed token ids (slot i holds the token whose K/V is at i)
    root: jax.Array  # [B] last emitted token, not yet fed to the LLM
    key: jax.Array  # PRNG key
    values: dict  # traced sampling values, each [B]


@flax.struct.dataclass
class StepOutput:
    tokens: jax.Array  # [B, max_emit] emitted ids, -1 padding
    num: jax.Array  # [B] how many of them are real


def pad_tree(tree: TokenTree, n: int) -> TokenTree:
    """Pads a tree with invalid nodes (parent 0) to n nodes."""
    extra = n - tree.num_nodes
    if extra <= 0:
        return tree
    pad = lambda x, v: jnp.pad(x, ((0, 0), (0, extra)), constant_values=v)  # noqa: E731
    return TokenTree(
        pad(tree.tokens, 0), pad(tree.parent, 0), pad(tree.depth, 1), pad(tree.valid, False),
        pad(tree.ssm, -1), pad(tree.proposer, 0),
    )


def draft(cfg: DecodeConfig, ssm_forwards, ssm_params, state: DecodeState, key):
    """Speculate with every SSM and merge; returns (tree, draft_probs or None, ssm caches).

    ``ssm_forwards``, ``ssm_params`` and ``state.ssm_caches`` hold one entry per SSM group
    (``cfg.ssm_groups``); a multi-member group drafts in one vmapped ``speculate``.
    """
    length = state.llm_cache.length
    found: dict[int, tuple] = {}  # SSM index -> (tree, draft probs)
    caches = []
    keys = jax.random.split(key, max(len(cfg.topologies), 1))
    for group, fwd, params, cache in zip(cfg.ssm_groups, ssm_forwards, ssm_params, state.ssm_caches):
        topo = cfg.topologies[group.members[0]]

        def run(p, c, k, ssm_id, fwd=fwd, topo=topo):
            return speculate(fwd, p, c, topo, state.history, length, state.root, k, cfg.warp, state.values, ssm_id)

        if len(group.members) == 1:
            j = group.members[0]
            tree, q, cache = run(params, cache, keys[j], j)
            found[j] = (tree, q)
        else:
            ids = jnp.asarray(group.members, jnp.int32)
            tree, q, cache = jax.vmap(run, in_axes=(group.param_axes(params), 0, 0, 0))(params, cache, keys[ids], ids)
            for i, j in enumerate(group.members):
                found[j] = jax.tree_util.tree_map(lambda x, i=i: x[i], (tree, q))
        caches.append(cache)
    trees = [found[j][0] for j in range(len(found))]
    probs = [found[j][1] for j in range(len(found))]
    if not trees:
        return single_root(state.root), None, ()
    tree = merge(trees, cfg.max_depth, dedup=cfg.warp.greedy)
    draft_probs = None
    if not cfg.warp.greedy:
        # merge() keeps one root, so row 0 is SSM 0's q at the root; SSM j > 0 drew its
        # depth-1 children from its own q at the root: append those rows and point SSM
        # j's depth-1 nodes at them (MSS must divide by the q a child was drawn from).
        body = [q if j == 0 else q[:, 1:] for j, q in enumerate(probs)]
        base = sum(q.shape[1] for q in body)
        draft_probs = jnp.concatenate(body + [q[:, :1] for q in probs[1:]], axis=1)
        own_root = (tree.proposer == 0) & (tree.ssm > 0)
        tree = tree.replace(proposer=jnp.where(own_root, base + tree.ssm - 1, tree.proposer))
    return tree, draft_probs, tuple(caches)


def accept(cfg: DecodeConfig, tree: TokenTree, logits, draft_probs, state: DecodeState, key) -> Verdict:
    """Runs the configured verifier on the LLM's logits [B, N, V]."""
    if cfg.warp.greedy:
        return verify_greedy(tree, logits, cfg.max_depth)
    from jaxspec import verify_stochastic  # noqa: PLC0415 (kept apart: stochastic decoding)

    return verify_stochastic.verify(cfg.verify, tree, logits, draft_probs, key, cfg.warp, state.values, cfg.max_depth)


def decode_step(
    cfg: DecodeConfig,
    llm_forward: Forward,
    ssm_forwards: tuple[Forward, ...],
    llm_params,
    ssm_params: tuple,
    state: DecodeState,
) -> tuple[DecodeState, StepOutput]:
    """One SpecInfer iteration for all B slots (pure; jit it with cfg and forwards static)."""
    key, k_draft, k_verify = jax.random.split(state.key, 3)
    tree, draft_probs, ssm_caches = draft(cfg, ssm_forwards, ssm_params, state, k_draft)
    tree = pad_tree(tree, cfg.num_nodes)
    n = tree.num_nodes
    length = state.llm_cache.length
    cap = state.llm_cache.capacity
    anc = ancestor_mask(tree.parent, cfg.max_depth)  # [B, N, N]
    rows = jnp.broadcast_to(jnp.arange(n), tree.tokens.shape)
    mask = tree_mask(length, anc, rows, cap)
    logits, llm_cache = llm_forward(llm_params, tree.tokens, length[:, None] + tree.depth, state.llm_cache, mask)
    verdict = accept(cfg, tree, logits, draft_probs, state, k_verify)

    llm_cache = commit(llm_cache, verdict.path, verdict.num)
    b, p = verdict.path.shape
    path_tokens = jnp.take_along_axis(tree.tokens, jnp.maximum(verdict.path, 0), axis=1)  # [B, P]
    real = jnp.arange(p)[None, :] < verdict.num[:, None]
    dst = jnp.where(real, length[:, None] + jnp.arange(p), state.history.shape[1])
    history = state.history.at[jnp.arange(b)[:, None], dst].set(path_tokens, mode="drop")
    # Emitted: accepted tokens (path minus the root), then the bonus/recovered token.
    shifted = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted = jnp.where(jnp.arange(p)[None, :] < verdict.num[:, None] - 1, shifted, -1)
    emitted = jnp.where(jnp.arange(p)[None, :] == verdict.num[:, None] - 1, verdict.next_token[:, None], emitted)
    new_state = state.replace(
        llm_cache=llm_cache, ssm_caches=ssm_caches, history=history, root=verdict.next_token, key=key
    )
    return new_state, StepOutput(emitted.astype(jnp.int32), verdict.num)


def prefill_model(forward: Forward, params, cache: KVCache, tokens, lengths) -> tuple[jax.Array, KVCache]:
    """Feeds padded prompts tokens [B, Tp] (true lengths [B]); returns last-token logits [B, V]."""
    b, tp = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(tp), (b, tp))
    start = jnp.zeros((b,), jnp.int32)
    mask = causal_mask(start, tp, cache.capacity)
    logits, cache = forward(params, tokens, positions, cache.replace(length=start), mask, (lengths - 1)[:, None])
    return logits[:, 0], cache.replace(length=lengths.astype(jnp.int32))


def prefill(
    cfg: DecodeConfig,
    llm_forward: Forward,
    ssm_forwards: tuple[Forward, ...],
    llm_params,
    ssm_params: tuple,
    state: DecodeState,
    tokens: jax.Array,
    lengths: jax.Array,
) -> tuple[DecodeState, jax.Array]:
    """Prefills the LLM and every SSM with the prompts and samples the first token [B]."""
    logits, llm_cache = prefill_model(llm_forward, llm_params, state.llm_cache, tokens, lengths)
    ssm_caches = []
    for group, f, p, c in zip(cfg.ssm_groups, ssm_forwards, ssm_params, state.ssm_caches):
        fill = lambda p, c, f=f: prefill_model(f, p, c, tokens, lengths)[1]  # noqa: E731
        ssm_caches.append(fill(p, c) if len(group.members) == 1 else jax.vmap(fill, (group.param_axes(p), 0))(p, c))
    ssm_caches = tuple(ssm_caches)
    key, sub = jax.random.split(state.key)
    first = sampling.sample(sub, logits, cfg.warp, state.values)
    s = state.history.shape[1]
    tp = tokens.shape[1]
    history = state.history.at[:, :tp].set(tokens) if tp <= s else state.history
    new_state = state.replace(llm_cache=llm_cache, ssm_caches=ssm_caches, history=history, root=first, key=key)
    return new_state, first


StepFn = Callable[..., tuple[DecodeState, StepOutput]]
