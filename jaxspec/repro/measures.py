"""What the paper's tables measure, as functions of logits: top-k verification success (Table 1).

Shared by ``jaxspec bench coverage`` and ``jaxspec repro table1``.
"""

from __future__ import annotations


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


def teacher_forced(model, ids: list[int], states=None, hidden: bool = False):
    """(logits [T, V], states [1, T, D] or None) of a model over a whole sequence (no reuse), in one forward.

    ``hidden`` also returns the model's (an LLM's) final-norm states; a feature drafter reads
    those ``states``, so its rates are those of its first draft level.
    """
    import jax.numpy as jnp

    from jaxspec.decoding.speculate import call
    from jaxspec.decoding.step import shift_features
    from models.transformer import KVCache, make_forward

    n = len(ids)
    p = jnp.arange(n)[None]
    mask = jnp.arange(n)[None, None, :] <= p[:, :, None]
    forward = make_forward(model.cfg, model.dtype, hidden=True) if hidden else model.forward
    feats = None if states is None else shift_features(states)
    logits, _, out = call(forward, model.params, jnp.asarray([ids]), feats, p,
                          KVCache.create(model.cfg, 1, n, model.dtype), mask)
    return logits[0], out
