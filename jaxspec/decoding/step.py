"""One decoding iteration: speculate → merge → verify in one LLM pass → accept → commit.

Incremental decoding (no SSM, empty tree), sequence speculation ⟨1,…,1⟩ and tree
speculation ⟨1,1,3,…⟩ are configurations of this one function. The whole iteration is
a single jitted executable: SSM levels run inside ``fori_loop``, nothing returns to the
host but the few emitted tokens.

The iteration's stages (draft groups, merge, the verifiers, commit) are traced into that one
function and share its configuration (``DecodeConfig``) and the tree's layout; each stage's
algorithm already lives in its own module (``speculate``, ``tree``, ``verify``, ``kv_cache``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax
import jax
import jax.numpy as jnp

from jaxspec.decoding import constrain, ngram, sampling
from jaxspec.decoding.kv_cache import KVCache, causal_mask, commit, tree_mask
from jaxspec.decoding.speculate import call, speculate, speculate_dynamic
from jaxspec.decoding.tree import DynamicTree, Topology, TokenTree, ancestor_mask, deduplicate, merge, single_root
from jaxspec.decoding.verify import Verdict, verify_coupled, verify_greedy
from models.transformer import Forward

VERIFIERS = ("greedy", "mss", "naive", "coupled")


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
    features: bool = False  # feature drafters (``models.drafter``): they read the LLM's states

    def param_axes(self, params: dict) -> dict:
        """vmap in_axes for the group's parameter tree: 0 for stacked leaves, None for shared ones."""
        from models.loading import flatten, unflatten  # noqa: PLC0415

        return unflatten({k: (None if k in self.shared else 0) for k in flatten(params)})


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static settings of the compiled step (hashable: one executable per value).

    Every SSM of the engine keeps its cache in the state; ``topologies[j] is None`` means
    SSM j does not draft in this configuration (its cache is passed through and caught
    up when it drafts again). ``ngram_depth`` > 0 merges a host-proposed chain of that
    many tokens (the n-gram speculator) into the tree.
    """

    topologies: tuple[Topology | DynamicTree | None, ...] = ()  # one per SSM; all None (or empty) + no n-gram = incremental
    warp: sampling.WarpSpec = sampling.WarpSpec()
    verify: str = "greedy"  # greedy | mss | naive | coupled (the last three need a stochastic warp)
    tree_budget: int | None = None  # pad the merged tree to this many nodes
    groups: tuple[SSMGroup, ...] = ()  # how SSM forwards/params/caches are batched; () = one per SSM
    ngram_depth: int = 0  # tokens of the n-gram proposal chain; 0 = no n-gram speculation
    vocab: int = 0  # V of the LLM (the n-gram's one-hot draft rows under stochastic decoding)
    grammar: bool = False  # rows may carry a grammar: masks from the host at every draft level and tree node
    forced_depth: int = 0  # tokens of the chain the grammar forces after the root (a proposal source)

    def __post_init__(self) -> None:
        if self.verify not in VERIFIERS:
            raise ValueError(f"--verify must be one of {', '.join(VERIFIERS)}, got {self.verify!r}")
        if self.ngram_depth < 0:
            raise ValueError(f"the n-gram depth must be >= 0, got {self.ngram_depth}")
        if self.forced_depth < 0 or (self.forced_depth and not self.grammar):
            raise ValueError(f"a forced-token chain ({self.forced_depth}) needs a grammar step")
        if (self.grammar or self.forced_depth) and self.vocab < 1:
            raise ValueError("grammar masks need the vocabulary size")
        if (self.ngram_depth or self.forced_depth) and not self.warp.greedy and self.vocab < 1:
            raise ValueError("stochastic n-gram speculation needs the vocabulary size")
        members = sorted(j for g in self.ssm_groups for j in g.members)
        if members != list(range(len(self.topologies))):
            raise ValueError(f"SSM groups {members} must cover SSMs 0..{len(self.topologies) - 1} once each")
        if self.coupled and self.vocab < 1:
            raise ValueError("the coupled sampler needs the vocabulary size (its Gumbel noise covers it)")
        if not self.warp.greedy and not self.coupled and any(isinstance(t, DynamicTree) for t in self.topologies):
            raise ValueError("dynamic trees draft greedily or coupled: under mss/naive a sampled request drafts "
                             "the fixed fallback tree")
        for g in self.ssm_groups:
            if len({self.topologies[j] for j in g.members}) != 1:
                raise ValueError(f"SSM group {g.members} mixes expansion configs: one vmapped draft needs one")
        if self.tree_budget is not None and self.natural_nodes > self.tree_budget:
            raise ValueError(
                f"the token tree needs {self.natural_nodes} nodes (root included) but --tree-budget is "
                f"{self.tree_budget}; shrink --expansion or raise the budget"
            )

    @property
    def host_masks(self) -> bool:
        """The whole tree is known before dispatch (the root and chains: no SSM drafts), so a grammar's masks
        travel in as an input (``RowMasks.chain_masks``; all -1 for rows without one) instead of a host callback
        mid-step: one executable serves every grammar and unconstrained rows alike."""
        return not self.active

    @property
    def ssm_groups(self) -> tuple[SSMGroup, ...]:
        """The groups, or one single-member group per SSM."""
        return self.groups or tuple(SSMGroup((j,)) for j in range(len(self.topologies)))

    @property
    def drawn(self) -> bool:
        """Sampled rows verified by mss/naive: drafts are i.i.d. draws, kept with their distributions."""
        return not self.warp.greedy and not self.coupled

    @property
    def coupled(self) -> bool:
        """Sampled rows draw by Gumbel-max with noise keyed by (seed, position): drafted and verified alike."""
        return not self.warp.greedy and self.verify == "coupled"

    @property
    def features(self) -> bool:
        """Whether a feature drafter is among the SSMs: the LLM then returns its states every iteration."""
        return any(g.features for g in self.ssm_groups)

    @property
    def active(self) -> tuple[int, ...]:
        """SSMs that draft in this configuration, in merge order."""
        return tuple(j for j, t in enumerate(self.topologies) if t is not None)

    @property
    def sources(self) -> tuple[str, ...]:
        """Who proposes, in merge order: ``ssm:J`` for each drafting SSM, then ``ngram``, then ``forced``."""
        return (tuple(f"ssm:{j}" for j in self.active) + (("ngram",) if self.ngram_depth else ())
                + (("forced",) if self.forced_depth else ()))

    @property
    def speculates(self) -> bool:
        return bool(self.sources)

    @property
    def max_depth(self) -> int:
        return max([t.max_depth for t in self.topologies if t is not None] + [self.ngram_depth, self.forced_depth])

    @property
    def natural_nodes(self) -> int:
        return (1 + sum(t.num_nodes - 1 for t in self.topologies if t is not None) + self.ngram_depth
                + self.forced_depth)

    @property
    def num_nodes(self) -> int:
        """N: tree nodes fed to the LLM per iteration (root included)."""
        return self.tree_budget or self.natural_nodes

    @property
    def max_emit(self) -> int:
        """Most tokens one iteration can emit: the deepest path plus the bonus token."""
        return self.max_depth + 1

    @property
    def draft_levels(self) -> int:
        """SSM forwards per iteration (one per level of each drafting SSM; the n-gram costs none)."""
        return sum(t.max_depth for t in self.topologies if t is not None)


@flax.struct.dataclass
class DecodeState:
    """Everything that changes between iterations, for B slots."""

    llm_cache: KVCache  # length [B] = committed tokens (prompt + emitted, minus the root)
    ssm_caches: tuple[KVCache, ...]  # one per SSM group; a group of G stacks its caches on a leading G axis
    history: jax.Array  # [B, S] committed token ids (slot i holds the token whose K/V is at i)
    root: jax.Array  # [B] last emitted token, not yet fed to the LLM
    key: jax.Array  # [B, 2] one PRNG key per row: a row's draws depend on its own seed only
    values: dict  # traced sampling values, each [B]
    active: jax.Array | None = None  # [B] bool: rows being decoded (None: all); an idle row keeps length 0
    features: jax.Array | None = None  # [B, S, D] the LLM's final-norm state at each committed slot (feature drafters)


@flax.struct.dataclass
class StepOutput:
    tokens: jax.Array  # [B, max_emit] emitted ids, -1 padding
    num: jax.Array  # [B] how many of them are real
    source_depth: jax.Array  # [B, P] per proposer (cfg.sources order): deepest node agreeing with the emitted tokens


def pad_tree(tree: TokenTree, n: int) -> TokenTree:
    """Pads a tree with invalid nodes (parent 0) to n nodes."""
    extra = n - tree.num_nodes
    if extra <= 0:
        return tree
    pad = lambda x, v: jnp.pad(x, ((0, 0), (0, extra)), constant_values=v)  # noqa: E731
    return TokenTree(
        pad(tree.tokens, 0), pad(tree.parent, 0), pad(tree.depth, 1), pad(tree.valid, False),
        pad(tree.source, -1), pad(tree.proposer, 0),
    )


def draft(cfg: DecodeConfig, ssm_forwards, ssm_params, state: DecodeState, key, proposal=None, noise=None,
          masker: constrain.Masker | None = None, forced=None):
    """Speculate with every drafting SSM (and the n-gram and forced-token proposals) and merge.

    ``ssm_forwards``, ``ssm_params`` and ``state.ssm_caches`` hold one entry per SSM group
    (``cfg.ssm_groups``); a multi-member group drafts in one vmapped ``speculate``; a
    group that does not draft keeps its cache. ``proposal`` = (tokens [B, D], count [B])
    of the n-gram speculator; ``noise`` [B, D + 1, V] the coupled sampler's Gumbel noise by
    depth; ``masker`` the grammar's masks (every drafting level of a constrained step); ``forced`` =
    (tokens [B, F], count [B]) the chain the grammar forces. Returns (tree, draft_probs or None, ssm caches, valid
    before deduplication [B, N]); each node's ``ssm`` is its proposer's index in
    ``cfg.sources``.
    """
    length = state.llm_cache.length
    position = {j: p for p, j in enumerate(cfg.active)}
    found: dict[int, tuple] = {}  # source position -> (tree, draft probs)
    caches = []
    keys = sampling.split_rows(key, max(len(cfg.topologies), 1))  # [B, J, 2]
    for group, fwd, params, cache in zip(cfg.ssm_groups, ssm_forwards, ssm_params, state.ssm_caches):
        topo = cfg.topologies[group.members[0]]
        if topo is None:
            caches.append(cache)
            continue

        feats = state.features if group.features else None

        def run(p, c, k, pos, fwd=fwd, topo=topo, feats=feats):
            if isinstance(topo, DynamicTree):
                return speculate_dynamic(fwd, p, c, topo, state.history, length, state.root, pos, feats, cfg.warp,
                                         state.values, noise, masker)
            return speculate(fwd, p, c, topo, state.history, length, state.root, k, cfg.warp, state.values, pos,
                             feats, noise, masker)

        if len(group.members) == 1:
            j = group.members[0]
            tree, q, cache = run(params, cache, sampling.pick_key(keys, j), position[j])
            found[position[j]] = (tree, q)
        else:
            ids = jnp.asarray(group.members, jnp.int32)
            pos = jnp.asarray([position[j] for j in group.members], jnp.int32)
            member_keys = keys[ids] if keys.ndim == 2 else keys[:, ids]  # [G, 2] or [B, G, 2]
            tree, q, cache = jax.vmap(run, in_axes=(group.param_axes(params), 0, keys.ndim - 2, 0))(
                params, cache, member_keys, pos)
            for i, j in enumerate(group.members):
                found[position[j]] = jax.tree_util.tree_map(lambda x, i=i: x[i], (tree, q))
        caches.append(cache)
    if cfg.ngram_depth:
        tokens, count = proposal
        found[len(cfg.active)] = ngram.chain_tree(state.root, tokens[:, : cfg.ngram_depth], count,
                                                   len(cfg.active), cfg.vocab, cfg.drawn)
    if cfg.forced_depth:
        tokens, count = forced
        at = len(found)
        found[at] = ngram.chain_tree(state.root, tokens[:, : cfg.forced_depth], count, at, cfg.vocab, cfg.drawn)
    if not found:
        tree = single_root(state.root)
        return tree, None, tuple(caches), tree.valid
    trees = [found[p][0] for p in range(len(found))]
    probs = [found[p][1] for p in range(len(found))]
    tree = merge(trees, cfg.max_depth, dedup=False)
    proposed = tree.valid
    if not cfg.drawn:  # one copy per path: every verifier but mss/naive matches deterministically
        tree = deduplicate(tree, cfg.max_depth)
    draft_probs = None
    if cfg.drawn:
        # merge() keeps one root, so row 0 is source 0's q at the root; source p > 0 drew its
        # depth-1 children from its own q at the root: append those rows and point source
        # p's depth-1 nodes at them (MSS must divide by the q a child was drawn from).
        body = [q if p == 0 else q[:, 1:] for p, q in enumerate(probs)]
        base = sum(q.shape[1] for q in body)
        draft_probs = jnp.concatenate(body + [q[:, :1] for q in probs[1:]], axis=1)
        own_root = (tree.proposer == 0) & (tree.source > 0)
        tree = tree.replace(proposer=jnp.where(own_root, base + tree.source - 1, tree.proposer))
    return tree, draft_probs, tuple(caches), proposed


def source_depths(tree: TokenTree, proposed: jax.Array, emitted: jax.Array, num: jax.Array, num_sources: int,
                  max_depth: int) -> jax.Array:
    """Per source, the deepest proposed node whose path equals the emitted tokens [B, P].

    emitted [B, P'] are this iteration's tokens (accepted then bonus/recovered), num [B]
    their count. A node agrees when its token is emitted token depth - 1 and its parent
    agrees (paths survive deduplication: duplicates hang under their canonical copy).
    """
    safe = jnp.maximum(tree.parent, 0)
    want = jnp.take_along_axis(emitted, jnp.clip(tree.depth - 1, 0, emitted.shape[1] - 1), axis=1)  # [B, N]
    own = (tree.depth >= 1) & (tree.depth <= num[:, None]) & (tree.tokens == want)

    def grow(_, ok):
        return (tree.parent < 0) | (own & jnp.take_along_axis(ok, safe, axis=1))

    agree = jax.lax.fori_loop(0, max_depth, grow, tree.parent < 0) & proposed & (tree.parent >= 0)
    per = (tree.source[:, :, None] == jnp.arange(max(num_sources, 1))[None, None, :]) & agree[:, :, None]  # [B, N, P]
    return jnp.max(jnp.where(per, tree.depth[:, :, None], 0), axis=1).astype(jnp.int32)


def accept(cfg: DecodeConfig, tree: TokenTree, logits, draft_probs, state: DecodeState, key, noise=None) -> Verdict:
    """Runs the configured verifier on the LLM's logits [B, N, V] (``noise``: the coupled sampler's, by depth)."""
    if cfg.warp.greedy:
        return verify_greedy(tree, logits, cfg.max_depth)
    if cfg.coupled:
        return verify_coupled(tree, logits, noise, cfg.warp, state.values, cfg.max_depth)
    from jaxspec.decoding import verify_stochastic  # noqa: PLC0415 (kept apart: stochastic decoding)

    return verify_stochastic.verify(cfg.verify, tree, logits, draft_probs, key, cfg.warp, state.values, cfg.max_depth)


def decode_step(
    cfg: DecodeConfig,
    llm_forward: Forward,
    ssm_forwards: tuple[Forward, ...],
    llm_params,
    ssm_params: tuple,
    state: DecodeState,
    proposal: tuple[jax.Array, jax.Array] | None = None,
    forced: tuple[jax.Array, jax.Array] | None = None,
    masker: constrain.Masker | None = None,
    chain_masks: jax.Array | None = None,
) -> tuple[DecodeState, StepOutput]:
    """One SpecInfer iteration for all B slots (pure; jit it with cfg, forwards and masker static).

    ``proposal`` = (tokens [B, D], count [B]) is the n-gram speculator's chain, needed
    when ``cfg.ngram_depth`` > 0; ``forced`` (tokens [B, F], count [B]) the grammar's forced
    chain when ``cfg.forced_depth`` > 0. A grammar step with SSM drafts (``cfg.grammar``) masks every draft
    level and the LLM's logits at every tree node with ``masker``'s masks; a tree without SSM drafts
    (``cfg.host_masks``) takes ``chain_masks`` [B, 1 + F + D, W] if given, computed on the host before
    dispatch (``RowMasks.chain_masks``: no callback, so the step dispatches asynchronously), applied only
    where some row has a grammar (all -1: the logits as they are).
    The caller guarantees every write fits the cache: length + cfg.num_nodes <= capacity for every
    row (``Engine`` checks it per step).
    """
    keys = sampling.split_rows(state.key, 3)
    key, k_draft, k_verify = (sampling.pick_key(keys, i) for i in range(3))
    act = state.active if state.active is not None else jnp.ones(state.root.shape, bool)  # [B]
    length = jnp.where(act, state.llm_cache.length, 0)  # [B]: idle rows write at slot 0, in bounds
    state = state.replace(llm_cache=state.llm_cache.replace(length=length))
    noise = None
    if cfg.coupled:  # [B, D + 1, V]: the noise of the positions this iteration can emit (depth d -> length + d + 1)
        noise = sampling.gumbel_at(state.key, length[:, None] + 1 + jnp.arange(cfg.max_depth + 1), cfg.vocab)
    if not cfg.grammar or cfg.host_masks:
        masker = None
    if chain_masks is not None and not cfg.host_masks:
        raise ValueError("chain_masks serve trees without SSM drafts only")
    tree, draft_probs, ssm_caches, proposed = draft(cfg, ssm_forwards, ssm_params, state, k_draft, proposal, noise,
                                                    masker, forced)
    tree = pad_tree(tree, cfg.num_nodes)
    proposed = jnp.pad(proposed, ((0, 0), (0, tree.num_nodes - proposed.shape[1])))
    n = tree.num_nodes
    cap = state.llm_cache.capacity
    anc = ancestor_mask(tree.parent, cfg.max_depth)  # [B, N, N]
    rows = jnp.broadcast_to(jnp.arange(n), tree.tokens.shape)
    mask = tree_mask(length, anc, rows, cap)
    # states [B, N, D]: the tree's final-norm states when a feature drafter needs them, else None
    logits, llm_cache, states = call(llm_forward, llm_params, tree.tokens, None, length[:, None] + tree.depth,
                                     state.llm_cache, mask)
    if masker is not None:  # the LLM's distribution at each node, restricted to what the grammar allows there
        nodes = jnp.where(tree.valid, jnp.arange(n)[None, :], -1)  # [B, N]: -1 = no mask (padding, pruned)
        logits = constrain.masked(masker, logits, tree.tokens, tree.parent, nodes)
    elif chain_masks is not None:  # skipped at run time where no row has a grammar
        bits = constrain.chain_node_masks(chain_masks, tree, cfg.sources, cfg.forced_depth)
        logits = jax.lax.cond(jnp.any(chain_masks != -1), constrain.apply, lambda x, _: x, logits, bits)
    verdict = accept(cfg, tree, logits, draft_probs, state, k_verify, noise)
    verdict = Verdict(verdict.path, jnp.where(act, verdict.num, 0), verdict.next_token)  # idle rows emit nothing

    if n > 1:  # a root-only tree's path is the root itself, already in place
        llm_cache = commit(llm_cache, verdict.path, verdict.num)
    else:
        llm_cache = llm_cache.replace(length=length + verdict.num)
    b, p = verdict.path.shape
    path_tokens = jnp.take_along_axis(tree.tokens, jnp.maximum(verdict.path, 0), axis=1)  # [B, P]
    real = jnp.arange(p)[None, :] < verdict.num[:, None]
    trash = state.history.shape[1]  # padding entries of the path are written nowhere
    dst = jnp.where(real, length[:, None] + jnp.arange(p), trash)
    history = state.history.at[jnp.arange(b)[:, None], dst].set(path_tokens, mode="drop")
    features = state.features
    if cfg.features:  # the accepted path's states become committed features (f at the slot of its token)
        path_states = jnp.take_along_axis(states, jnp.maximum(verdict.path, 0)[:, :, None], axis=1)  # [B, P, D]
        features = features.at[jnp.arange(b)[:, None], dst].set(path_states.astype(features.dtype), mode="drop")
    # Emitted: accepted tokens (path minus the root), then the bonus/recovered token.
    shifted = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted = jnp.where(jnp.arange(p)[None, :] < verdict.num[:, None] - 1, shifted, -1)
    emitted = jnp.where(jnp.arange(p)[None, :] == verdict.num[:, None] - 1, verdict.next_token[:, None], emitted)
    depths = source_depths(tree, proposed, emitted, verdict.num, len(cfg.sources), cfg.max_depth)
    new_state = state.replace(
        llm_cache=llm_cache, ssm_caches=ssm_caches, history=history, root=jnp.where(act, verdict.next_token, 0),
        key=state.key if cfg.coupled else key, features=features,  # coupled: the row's key never moves
    )
    return new_state, StepOutput(emitted.astype(jnp.int32), verdict.num, depths)


def prefill_model(forward: Forward, params, cache: KVCache, tokens, lengths,
                  feats: jax.Array | None = None) -> tuple[jax.Array, KVCache, jax.Array | None]:
    """Feeds padded prompts tokens [B, Tp] (true lengths [B]); returns last-token logits [B, V].

    A feature drafter reads ``feats`` [B, Tp, D] (f_{p-1} per slot). Also returns the forward's
    states (``speculate.call``): every slot's [B, Tp, D] for an LLM serving a feature drafter.
    """
    b, tp = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(tp), (b, tp))
    start = jnp.zeros((b,), jnp.int32)
    mask = causal_mask(start, tp, cache.capacity)
    logits, cache, states = call(forward, params, tokens, feats, positions, cache.replace(length=start), mask,
                                 (lengths - 1)[:, None])
    return logits[:, 0], cache.replace(length=lengths.astype(jnp.int32)), states


def shift_features(states: jax.Array) -> jax.Array:
    """f_{p-1} at every slot p of states [B, T, D] (zeros at p = 0): what a feature drafter reads."""
    return jnp.pad(states[:, :-1], ((0, 0), (1, 0), (0, 0)))


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
    logits, llm_cache, states = prefill_model(llm_forward, llm_params, state.llm_cache, tokens, lengths)
    ssm_caches = []
    for group, f, p, c in zip(cfg.ssm_groups, ssm_forwards, ssm_params, state.ssm_caches):
        feats = shift_features(states) if group.features else None
        fill = lambda p, c, f=f, feats=feats: prefill_model(f, p, c, tokens, lengths, feats)[1]  # noqa: E731
        ssm_caches.append(fill(p, c) if len(group.members) == 1 else jax.vmap(fill, (group.param_axes(p), 0))(p, c))
    ssm_caches = tuple(ssm_caches)
    keys = sampling.split_rows(state.key, 2)
    key, sub = sampling.pick_key(keys, 0), sampling.pick_key(keys, 1)
    if cfg.coupled:  # the first token is the one at position ``lengths``, drawn with the row's fixed key
        key = state.key
    first = first_token(cfg, logits, sub, key, lengths, state.values)
    s = state.history.shape[1]
    tp = tokens.shape[1]
    history = state.history.at[:, :tp].set(tokens) if tp <= s else state.history
    features = state.features
    if cfg.features:
        features = features.at[:, :tp].set(states[:, :s].astype(features.dtype))
    new_state = state.replace(llm_cache=llm_cache, ssm_caches=ssm_caches, history=history, root=first, key=key,
                              features=features)
    return new_state, first


def first_token(cfg: DecodeConfig, logits: jax.Array, key: jax.Array, row_key: jax.Array, position: jax.Array,
                values: dict) -> jax.Array:
    """The token [B] after a prompt from its last logits [B, V]: argmax, a draw with ``key``, or (coupled)
    the Gumbel-max draw of the row's fixed ``row_key`` at ``position`` [B] (the prompt's length)."""
    if cfg.coupled:
        noise = sampling.gumbel_at(row_key, position[:, None], cfg.vocab)[:, 0]  # [B, V]
        return sampling.coupled_choice(logits, cfg.warp, values, noise)
    return sampling.sample(key, logits, cfg.warp, values)


def _row(x: jax.Array, slot, axis: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, slot, 1, axis)


def _put_row(x: jax.Array, row: jax.Array, slot, axis: int) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, row.astype(x.dtype), slot, axis)


def _cache_row(cache: KVCache, slot, grouped: bool) -> KVCache:
    """Row ``slot`` of a cache [L, B, ...] (or a group's [G, L, B, ...]) as a one-row cache."""
    a = 2 if grouped else 1
    return KVCache(_row(cache.k, slot, a), _row(cache.v, slot, a), _row(cache.length, slot, a - 1))


def _put_cache_row(cache: KVCache, row: KVCache, slot, grouped: bool) -> KVCache:
    a = 2 if grouped else 1
    return KVCache(_put_row(cache.k, row.k, slot, a), _put_row(cache.v, row.v, slot, a),
                   _put_row(cache.length, row.length, slot, a - 1))


def prefill_row(
    cfg: DecodeConfig,
    llm_forward: Forward,
    ssm_forwards: tuple[Forward, ...],
    llm_params,
    ssm_params: tuple,
    state: DecodeState,
    slot: jax.Array,
    tokens: jax.Array,
    start: jax.Array,
    count: jax.Array,
    last: jax.Array,
    seed: jax.Array,
    values: dict,
    first_mask: jax.Array | None = None,
) -> DecodeState:
    """Feeds one prompt chunk tokens [1, C] (``count`` real) at positions ``start`` … into row ``slot``.

    The batched engine's admission runs it on a one-row staging state (a long prompt is
    fed chunk by chunk between decoding iterations of the others), then ``insert_row``s
    the row. On the ``last`` chunk the row gets its PRNG key ``seed`` [2] (``jaxspec.request.seed_words``) and
    sampling ``values`` (each [1]), samples its first token (the pending root; from the tokens
    ``first_mask`` [1, W] allows, for a request with a grammar) and becomes active.
    The caller guarantees start + C <= capacity.
    """
    c = tokens.shape[1]
    cap = state.llm_cache.capacity
    positions = start + jnp.arange(c, dtype=jnp.int32)[None, :]  # [1, C]
    begin = jnp.reshape(start, (1,)).astype(jnp.int32)
    mask = causal_mask(begin, c, cap)  # [1, C, S]
    select = jnp.reshape(count - 1, (1, 1)).astype(jnp.int32)

    def feed(forward, params, cache, feats=None):
        logits, cache, states = call(forward, params, tokens, feats, positions, cache.replace(length=begin), mask,
                                     select)
        return logits[:, 0], cache.replace(length=begin + count), states

    logits, llm_row, states = feed(llm_forward, llm_params, _cache_row(state.llm_cache, slot, False))
    llm_cache = _put_cache_row(state.llm_cache, llm_row, slot, False)
    features = state.features
    feats = None
    if cfg.features:  # [1, C, D]: f_{p-1} per chunk slot, the first from the previous chunk (zeros at p = 0)
        feat_row = _row(features, slot, 0)  # [1, S, D]
        before = jax.lax.dynamic_slice_in_dim(feat_row, jnp.maximum(start - 1, 0), 1, 1)  # [1, 1, D]
        before = jnp.where(start > 0, before, 0)
        feats = jnp.concatenate([before, states[:, :-1].astype(before.dtype)], axis=1)
        feat_row = jax.lax.dynamic_update_slice_in_dim(feat_row, states.astype(feat_row.dtype), start, 1)
        features = _put_row(features, feat_row, slot, 0)
    ssm_caches = []
    for group, f, p, cache in zip(cfg.ssm_groups, ssm_forwards, ssm_params, state.ssm_caches):
        grouped = len(group.members) > 1
        row = _cache_row(cache, slot, grouped)
        fe = feats if group.features else None
        if grouped:
            row = jax.vmap(lambda p, c, f=f, fe=fe: feed(f, p, c, fe)[1], (group.param_axes(p), 0))(p, row)
        else:
            row = feed(f, p, row, fe)[1]
        ssm_caches.append(_put_cache_row(cache, row, slot, grouped))
    hist_row = jax.lax.dynamic_update_slice_in_dim(_row(state.history, slot, 0), tokens, start, 1)
    history = _put_row(state.history, hist_row, slot, 0)

    if first_mask is not None:
        logits = constrain.apply(logits, first_mask)
    keys = jax.random.split(seed, 2)  # [2, 2]: the row's key, the first draw's
    first = first_token(cfg, logits, keys[1:], keys[:1], jnp.reshape(start + count, (1,)), values)  # [1]
    active = state.active if state.active is not None else jnp.ones(state.root.shape, bool)
    new_values = {k: jnp.where(last, _put_row(v, values[k], slot, 0), v) for k, v in state.values.items()}
    return state.replace(
        llm_cache=llm_cache,
        ssm_caches=tuple(ssm_caches),
        history=history,
        root=jnp.where(last, _put_row(state.root, first, slot, 0), state.root),
        key=jnp.where(last, _put_row(state.key, keys[:1], slot, 0), state.key),
        values=new_values,
        active=jnp.where(last, _put_row(active, jnp.ones((1,), bool), slot, 0), active),
        features=features,
    )


def insert_row(cfg: DecodeConfig, state: DecodeState, staged: DecodeState, slot: jax.Array) -> DecodeState:
    """Copies the one-row ``staged`` state (a prefilled request) into row ``slot`` of ``state``."""
    ssm_caches = tuple(_put_cache_row(c, s, slot, len(g.members) > 1)
                       for g, c, s in zip(cfg.ssm_groups, state.ssm_caches, staged.ssm_caches))
    return state.replace(
        llm_cache=_put_cache_row(state.llm_cache, staged.llm_cache, slot, False),
        ssm_caches=ssm_caches,
        history=_put_row(state.history, staged.history, slot, 0),
        root=_put_row(state.root, staged.root, slot, 0),
        key=_put_row(state.key, staged.key, slot, 0),
        values={k: _put_row(v, staged.values[k], slot, 0) for k, v in state.values.items()},
        active=_put_row(state.active, staged.active, slot, 0),
        features=None if state.features is None else _put_row(state.features, staged.features, slot, 0),
    )


def set_inactive(state: DecodeState, slot: jax.Array) -> DecodeState:
    """Retires row ``slot``: it stops growing and emitting (length 0) until the next ``insert_row``."""
    empty = lambda c: c.replace(length=c.length.at[..., slot].set(0))  # noqa: E731 (length [B] or [G, B])
    return state.replace(active=_put_row(state.active, jnp.zeros((1,), bool), slot, 0),
                         llm_cache=empty(state.llm_cache), ssm_caches=tuple(empty(c) for c in state.ssm_caches))


def _fit(x: jax.Array, axis: int, size: int) -> jax.Array:
    """x cut or zero-padded to ``size`` along ``axis``."""
    have = x.shape[axis]
    if have >= size:
        return jax.lax.slice_in_dim(x, 0, size, axis=axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - have)
    return jnp.pad(x, pad)


def _fit_cache(cache: KVCache, rows: int, capacity: int) -> KVCache:
    """A cache [L, B, K, S, H] (or a group's [G, L, B, K, S, H]) cut or padded to ``rows`` x ``capacity``."""
    g = cache.k.ndim - 5  # 1 for a stacked group
    fit = lambda x: _fit(_fit(x, 1 + g, rows), 3 + g, capacity)  # noqa: E731
    return KVCache(fit(cache.k), fit(cache.v), _fit(cache.length, g, rows))


def resize(state: DecodeState, rows: int, capacity: int) -> DecodeState:
    """The state laid out for ``rows`` slots of ``capacity`` cache slots (jit with both static).

    Rows and slots past the old shape are zero (inactive, empty); those cut off must be
    unused (the host keeps its live rows at [0, rows) and every length below ``capacity``).
    This is what lets a step's cost follow the rows and cache length in use.
    """
    return state.replace(
        llm_cache=_fit_cache(state.llm_cache, rows, capacity),
        ssm_caches=tuple(_fit_cache(c, rows, capacity) for c in state.ssm_caches),
        history=_fit(_fit(state.history, 0, rows), 1, capacity),
        root=_fit(state.root, 0, rows),
        key=_fit(state.key, 0, rows),
        values={k: _fit(v, 0, rows) for k, v in state.values.items()},
        active=_fit(state.active, 0, rows),
        features=None if state.features is None else _fit(_fit(state.features, 0, rows), 1, capacity),
    )


def move_row(state: DecodeState, src: jax.Array, dst: jax.Array) -> DecodeState:
    """Row ``src`` copied into row ``dst``, then ``src`` retired: keeps the live rows contiguous."""

    def move(x: jax.Array, axis: int) -> jax.Array:
        return _put_row(x, _row(x, src, axis), dst, axis)

    def move_cache(c: KVCache) -> KVCache:
        g = c.k.ndim - 5
        return KVCache(move(c.k, 1 + g), move(c.v, 1 + g), move(c.length, g))

    moved = state.replace(
        llm_cache=move_cache(state.llm_cache),
        ssm_caches=tuple(move_cache(c) for c in state.ssm_caches),
        history=move(state.history, 0),
        root=move(state.root, 0),
        key=move(state.key, 0),
        values={k: move(v, 0) for k, v in state.values.items()},
        active=move(state.active, 0),
        features=None if state.features is None else move(state.features, 0),
    )
    return set_inactive(moved, src)


def set_lengths(state: DecodeState, length: int) -> DecodeState:
    """Every row active with ``length`` committed slots (of zeros): a state to time steps on."""
    fill = lambda c: c.replace(length=jnp.full_like(c.length, length))  # noqa: E731
    return state.replace(llm_cache=fill(state.llm_cache), ssm_caches=tuple(fill(c) for c in state.ssm_caches),
                         active=jnp.ones_like(state.root, bool))
