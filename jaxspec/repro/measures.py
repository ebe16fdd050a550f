"""What the paper's tables measure, as functions of logits: top-k verification success (Table 1).

Shared by ``jaxspec bench coverage`` and ``jaxspec repro table1``.
"""

from __future__ import annotations

import functools


def coverage_rates(llm_logits, ssm_logits, max_k: int, temperature: float):
    """Per-position success of k = 1..max_k (paper Table 1), both [T, max_k].

    greedy[t, k-1]: the LLM's argmax is among the SSM's top-k tokens.
    stochastic[t, k-1]: probability that multi-step speculative sampling accepts one of k
    i.i.d. draws from the SSM (same temperature), computed exactly: trial i accepts with
    sum_x min(p_i, q) and a rejection leaves p_{i+1} = norm(max(0, p_i - q)).
    """
    import numpy as np

    llm_logits = np.asarray(llm_logits, np.float64)
    ssm_logits = np.asarray(ssm_logits, np.float64)
    target = llm_logits.argmax(-1)
    topk = np.argsort(-ssm_logits, axis=-1)[:, :max_k]
    greedy = np.cumsum(topk == target[:, None], axis=1) > 0

    def softmax(x):
        x = x / max(temperature, 1e-6)
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p, q = softmax(llm_logits), softmax(ssm_logits)
    fail = np.ones(len(p))
    stochastic = np.zeros((len(p), max_k))
    for i in range(max_k):
        accept = np.minimum(p, q).sum(-1)
        fail = fail * (1 - accept)
        stochastic[:, i] = 1 - fail
        residual = np.maximum(p - q, 0)
        mass = residual.sum(-1, keepdims=True)
        p = np.where(mass > 1e-12, residual / np.maximum(mass, 1e-12), p)
    return greedy.astype(float), stochastic


def features_of(ssm) -> bool | tuple[int, ...]:
    """What a speculator reads from the LLM: False (nothing), True (final-norm states) or the blocks a fused
    feature drafter reads (``teacher_forced``'s ``hidden``)."""
    if not getattr(ssm, "features", False):
        return False
    return tuple(getattr(ssm, "feature_layers", ())) or True


def teacher_forced(model, ids: list[int], states=None, hidden: bool | tuple[int, ...] = False):
    """(logits [T, V], states [1, T, D'] or None) of a model over a whole sequence (no reuse), in one forward.

    ``hidden`` also returns the model's (an LLM's) states as a feature drafter reads them
    (``features_of``): the final-norm states [1, T, D] (True), or the outputs of the given blocks
    side by side [1, T, k·D] (a fused drafter's); a feature drafter given ``states`` scores its first
    draft level.
    """
    import jax.numpy as jnp

    from jaxspec.decoding.step import shift_features

    feats = None if states is None else shift_features(states)
    forward = model.forward if not hidden else None
    return _teacher_forced_jit(model.cfg, model.dtype, hidden, forward)(model.params, jnp.asarray([ids]), feats)


@functools.lru_cache(maxsize=16)
def _teacher_forced_jit(cfg, dtype, hidden, forward):
    """One jitted whole-sequence forward per model form (compiled once per length, not op by op)."""
    import jax
    import jax.numpy as jnp

    from jaxspec.decoding.speculate import call
    from models.transformer import KVCache, decoding_layout, make_forward

    unrolled = isinstance(hidden, tuple)  # the blocks' outputs are read from the unrolled layout
    if unrolled:
        forward = make_forward(cfg, dtype, unrolled=True, hidden=hidden)
    elif hidden:
        forward = make_forward(cfg, dtype, hidden=True)

    def run(params, ids, feats):  # ids [1, T]
        n = ids.shape[1]
        p = jnp.arange(n)[None]
        mask = jnp.arange(n)[None, None, :] <= p[:, :, None]
        params = decoding_layout(params) if unrolled else params  # inside the jit: no per-call re-layout
        logits, _, out = call(forward, params, ids, feats, p, KVCache.create(cfg, 1, n, dtype), mask)
        return logits[0], out
    return jax.jit(run)
