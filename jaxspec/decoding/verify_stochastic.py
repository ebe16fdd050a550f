"""Stochastic verification: multi-step speculative sampling (MSS) and naive sampling (NS).

Both verifiers turn the LLM's logits at every node of a drafted token tree into the
tokens one iteration emits, and both emit exactly the LLM's own sampling distribution
(the *warped* one: the same temperature / top-k / top-p the user asked for).
``docs/mss.md`` has the long form of the argument below, with worked examples of what
breaks it; ``tests/test_mss.py`` checks it by exact enumeration and by chi-square tests.

Notation. At a tree node u, p is the LLM's warped distribution after u's prefix. u's
valid children s_1..s_k carry tokens x_i; child s_i was drawn from q_i =
``draft_probs[proposer[s_i]]``, the proposing SSM's warped distribution at u.

MSS (SpecInfer Algorithm 2, VerifyStochastic, lines 24-44). Try u's children in a
uniformly random order; accept child s with probability min(1, p(x_s)/q_s(x_s)); on a
rejection replace p by the residual norm(max(0, p - q_s)) and drop s. If a child is
accepted, move to it (its p is the LLM's there) and repeat. If all children fail,
sample the *recovered* token from the current residual; at a leaf (no valid children)
sample the *bonus* token from the leaf's p.

Exactness (Theorem 4.2). Requirement: conditional on everything that happened before
child s_i is tried (earlier draws, trial order, accept/reject coins), x_i is
distributed as q_i, the very distribution used in its ratio and its residual update.
The drafter guarantees it: each fed node gets k *i.i.d.* draws (with replacement) from
its SSM's warped q, every draw is its own node (no deduplication under stochastic
decoding), several SSMs draw independently, each with its own q row, and the trial
order is drawn independently of the tokens. Claim: the token emitted at u, given
children (x_1,q_1),...,(x_k,q_k) tried in that order, is distributed as p. Induction on k.
k = 0: it is sampled from p. k >= 1: with Z = sum_y max(0, p(y) - q_1(y)) (= the total
variation distance of p and q_1)

    P(emit y) = q_1(y) min(1, p(y)/q_1(y))            # x_1 = y and accepted
              + P(reject x_1) * P(emit y | rejected)
              = min(p(y), q_1(y)) + Z * p'(y)          # P(reject) = sum_x (q_1 - p)^+ = Z
              = min(p(y), q_1(y)) + max(0, p(y) - q_1(y)) = p(y),

where p' = max(0, p - q_1)/Z does not depend on which x_1 was rejected, so by the
induction hypothesis the remaining k - 1 children (independent of x_1, drawn from their
own q's) emit p' exactly. (Z = 0 means p = q_1: rejection has probability 0, so any
fallback is exact; we keep p.) Averaging over trial orders chosen independently of the
tokens keeps the result. After accepting child s with token y the walk continues at s,
whose own children were drawn from the SSM at s given y and are independent of
everything that decided the acceptance; so, conditioned on the first emitted token
being y, the rest of the iteration is MSS at s and emits the LLM's p(. | prefix, y):
by induction on depth the emitted sequence follows the LLM's joint distribution, and a
new iteration starts afresh after it.

Why the drafter must sample. With top-k (without replacement) children, x_1 is the
SSM's argmax, not a draw from q_1, and the identity above fails: p = (1/2, 1/2),
q = (0.9, 0.1), children {a, b} emit a with probability 5/18, not 1/2. Deduplicating
repeated draws also breaks it: a repeated token can never be accepted after its
first copy was rejected (the residual is 0 there), but its rejection still subtracts
its q from the residual, and skipping it changes the output distribution.

Theorem 4.3 (MSS rejects no more often than NS). For a fixed trial order and
averaged over the draws, the probability that MSS rejects every child of u has the
closed form R_k(p) = Z_1 R_{k-1}(p'), R_0 = 1 (p' as above, independent of x_1).
NS rejects iff its sample y ~ p is none of the children's tokens:
N_k(p) = sum_y p(y) prod_i (1 - q_i(y)). Induction: if R_{k-1}(p') <= N_{k-1}(p')
then R_k(p) <= Z_1 sum_y p'(y) prod_{i>=2}(1 - q_i(y))
= sum_y max(0, p(y) - q_1(y)) prod_{i>=2}(1 - q_i(y)) <= sum_y p(y)(1 - q_1(y))
prod_{i>=2}(1 - q_i(y)) = N_k(p), because max(0, p - q) <= p (1 - q) for p, q in [0, 1].
It holds for every order, hence for the random one; it holds in expectation over
the draws, not draw by draw (docs/mss.md has a counterexample for fixed draws).

Implementation. Everything is vectorised over the B rows with static shapes and runs
under ``jit``. MSS is one ``lax.while_loop``: each iteration either tries one untried
child of the current node or finishes the row, so N iterations bound it (every node
is tried at most once along one walk). The trial order comes from i.i.d. uniform
priorities per node (the children of a node are tried in increasing priority: a
uniformly random permutation), the accept coins from one i.i.d. uniform per node,
and the final token from one categorical draw after the loop. NS is a
``lax.fori_loop`` over the max_depth + 1 levels. All randomness comes from ``key``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.decoding import sampling
from jaxspec.decoding.tree import TokenTree
from jaxspec.decoding.verify import Verdict, path_from_leaf

MODES = ("mss", "naive")
_TINY = 1e-30  # a residual with less mass than this is treated as empty (see above)


def verify(
    mode: str,
    tree: TokenTree,
    logits: jax.Array,
    draft_probs: jax.Array | None,
    key: jax.Array,
    warp: sampling.WarpSpec,
    values: dict,
    max_depth: int,
) -> Verdict:
    """Stochastic verification of tree [B, N] against the LLM's logits [B, N, V].

    ``draft_probs`` [B, M, V] holds the warped draft distributions (row
    ``tree.proposer[b, i]`` is the one node i was drawn from); None when the tree is the
    root alone. ``mode`` is "mss" (multi-step speculative sampling) or "naive".
    """
    if warp.greedy:
        raise ValueError("stochastic verification needs a stochastic warp (temperature > 0)")
    p_all = sampling.warped_probs(logits, warp, values)  # [B, N, V]
    if mode == "mss":
        return verify_mss(tree, p_all, draft_probs, key, max_depth)
    if mode == "naive":
        return verify_naive(tree, p_all, key, max_depth)
    raise ValueError(f"stochastic verifier must be one of {', '.join(MODES)}, got {mode!r}")


def _root(tree: TokenTree) -> jax.Array:
    return jnp.argmax(tree.parent < 0, axis=-1).astype(jnp.int32)  # [B]


def _sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """One draw per row of probs [B, V] (zeros excluded)."""
    logp = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, _TINY)), -jnp.inf)
    return sampling.categorical_rows(key, logp).astype(jnp.int32)


def residual(p: jax.Array, q: jax.Array) -> jax.Array:
    """norm(max(0, p - q)) per row; p itself where that has no mass (then p == q)."""
    r = jnp.maximum(p - q, 0.0)
    z = r.sum(-1, keepdims=True)
    return jnp.where(z > _TINY, r / jnp.maximum(z, _TINY), p)


def verify_mss(tree: TokenTree, p_all: jax.Array, draft_probs, key: jax.Array, max_depth: int) -> Verdict:
    """VerifyStochastic on warped LLM probabilities p_all [B, N, V]; see the module doc."""
    b, n, v = p_all.shape
    if draft_probs is None or jnp.ndim(draft_probs) != 3:
        draft_probs = jnp.zeros((b, 1, v), p_all.dtype)  # only reached when no node has a parent
    m = draft_probs.shape[1]
    keys = sampling.split_rows(key, 3)
    k_order, k_coin, k_final = (sampling.pick_key(keys, i) for i in range(3))
    priority = sampling.uniform_rows(k_order, (b, n))  # trial order among siblings
    coin = sampling.uniform_rows(k_coin, (b, n))  # one accept coin per node (each tried at most once)
    rows = jnp.arange(b)
    child_ok = tree.valid & (tree.parent >= 0)
    proposer = jnp.clip(tree.proposer, 0, m - 1)
    root = _root(tree)

    def cond(carry):
        i, _, _, _, done = carry
        return (i < n) & ~jnp.all(done)

    def body(carry):
        i, cur, p, tried, done = carry
        cand = child_ok & (tree.parent == cur[:, None]) & ~tried  # [B, N]
        has = cand.any(-1) & ~done
        s = jnp.argmin(jnp.where(cand, priority, jnp.inf), axis=-1).astype(jnp.int32)  # [B]
        x = tree.tokens[rows, s]
        q = draft_probs[rows, proposer[rows, s]]  # [B, V]: the distribution s was drawn from
        px, qx = p[rows, x], q[rows, x]
        # P(coin * q(x) < p(x)) = min(1, p(x)/q(x)) for coin ~ U[0, 1); no division needed.
        acc = has & (coin[rows, s] * qx < px)
        rej = has & ~acc
        p = jnp.where(acc[:, None], p_all[rows, s], jnp.where(rej[:, None], residual(p, q), p))
        cur = jnp.where(acc, s, cur)
        tried = tried | (rej[:, None] & (jnp.arange(n)[None, :] == s[:, None]))
        return i + 1, cur, p, tried, done | ~has

    init = (jnp.zeros((), jnp.int32), root, p_all[rows, root], jnp.zeros((b, n), bool), jnp.zeros((b,), bool))
    _, cur, p, _, _ = jax.lax.while_loop(cond, body, init)
    next_token = _sample(k_final, p)  # bonus (leaf) or recovered (residual) token
    path, num = path_from_leaf(tree, cur, max_depth)
    return Verdict(path, num, next_token)


def verify_naive(tree: TokenTree, p_all: jax.Array, key: jax.Array, max_depth: int) -> Verdict:
    """Naive sampling: at node u draw x ~ p_u; follow a child holding x, else emit x."""
    b, n, _ = p_all.shape
    rows = jnp.arange(b)
    child_ok = tree.valid & (tree.parent >= 0)

    def body(i, carry):
        cur, nxt, done = carry
        k = jax.random.fold_in(key, i) if key.ndim == 1 else jax.vmap(lambda r: jax.random.fold_in(r, i))(key)
        x = _sample(k, p_all[rows, cur])
        match = child_ok & (tree.parent == cur[:, None]) & (tree.tokens == x[:, None])
        has = match.any(-1) & ~done
        s = jnp.argmax(match, axis=-1).astype(jnp.int32)  # first copy (any fixed rule is exact)
        nxt = jnp.where(~done & ~has, x, nxt)
        return jnp.where(has, s, cur), nxt, done | ~has

    init = (_root(tree), jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool))
    cur, nxt, _ = jax.lax.fori_loop(0, max_depth + 1, body, init)
    path, num = path_from_leaf(tree, cur, max_depth)
    return Verdict(path, num, nxt)
