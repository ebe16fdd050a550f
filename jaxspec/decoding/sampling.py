"""The logit warping shared by the LLM and every SSM, over a request's ``SamplerParams`` (``jaxspec.request``).

The same warp (temperature, then top-k, then top-p) is applied to the LLM's and the
SSMs' logits, so speculative sampling compares the distributions a user asked for.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.request import SamplerParams


@dataclasses.dataclass(frozen=True)
class WarpSpec:
    """Static switches of the warp: which stages exist in the compiled graph."""

    greedy: bool = True
    use_top_k: bool = False
    use_top_p: bool = False

    @classmethod
    def of(cls, params: SamplerParams) -> "WarpSpec":
        return cls(params.greedy, not params.greedy and params.top_k > 0, not params.greedy and params.top_p < 1.0)

    @property
    def label(self) -> str:
        """The warp in words: ``greedy``, ``sampled``, ``sampled+top-k+top-p``."""
        if self.greedy:
            return "greedy"
        return "+".join(["sampled"] + ["top-k"] * self.use_top_k + ["top-p"] * self.use_top_p)


SAMPLED = WarpSpec(greedy=False)
"""A single sampled request that uses temperature alone: no top-k / top-p stage compiled."""
MIXED = WarpSpec(greedy=False, use_top_k=True, use_top_p=True)
"""Any batch with a sampled row: every stage compiled, each row's values decide, and the top-k / top-p stage (a
sort of the vocabulary at every tree node) runs only in an iteration where some sampled row asks for it."""
BATCH_WARPS = (WarpSpec(), MIXED)  # what a batch of rows can run (``batch_warp``): one executable set each


def batch_warp(rows: Sequence[SamplerParams]) -> WarpSpec:
    """The warp of ``BATCH_WARPS`` that serves every row: greedy, or every stage (``MIXED``).

    One sampled warp rather than one per stage subset halves what a server prepares; a row that asks for
    neither stage keeps its exact distribution there (its top-k is the vocabulary size and its top-p 1, and an
    iteration where no sampled row truncates skips the sort at run time: ``warp_logits``).
    """
    if all(p.greedy for p in rows):
        return WarpSpec()
    return MIXED


def warp_arrays(params: SamplerParams, batch: int) -> dict[str, jax.Array]:
    """Traced per-row sampling values [B] so changing them never recompiles (one explicit transfer)."""
    return jax.device_put(row_values([params] * batch, 0))


def row_values(rows: list[SamplerParams], vocab: int) -> dict[str, np.ndarray]:
    """Per-row sampling values [B] on the host, for one row per request of a batch.

    ``greedy`` rows are argmax rows inside a stochastic executable (``MIXED``); top-k 0
    (off) becomes the vocabulary size so a compiled top-k stage keeps every token.
    """
    return {
        "temperature": np.asarray([max(p.temperature, 1e-6) for p in rows], np.float32),
        "top_k": np.asarray([min(p.top_k, vocab) or vocab for p in rows] if vocab else [p.top_k for p in rows],
                            np.int32),
        "top_p": np.asarray([p.top_p for p in rows], np.float32),
        "greedy": np.asarray([p.greedy for p in rows], bool),
    }


def split_rows(keys: jax.Array, num: int) -> jax.Array:
    """``num`` fresh keys per row: keys [B, 2] -> [B, num, 2], or a single key [2] -> [num, 2]."""
    if keys.ndim == 1:
        return jax.random.split(keys, num)
    return jax.vmap(lambda k: jax.random.split(k, num))(keys)


def pick_key(keys: jax.Array, i) -> jax.Array:
    """The i-th of ``split_rows``' keys: [B, num, 2] -> [B, 2] (or [num, 2] -> [2])."""
    return keys[i] if keys.ndim == 2 else keys[:, i]


def uniform_rows(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """U[0, 1) of shape [B, *shape]: one stream per row's key [B, 2], or one key [2] for all rows."""
    if keys.ndim == 1:
        return jax.random.uniform(keys, shape)
    return jax.vmap(lambda k: jax.random.uniform(k, shape[1:]))(keys)


def categorical_rows(keys: jax.Array, logp: jax.Array, draws: int | None = None) -> jax.Array:
    """Draws from log-probabilities logp [B, ..., V]: [B, ...] (or [B, ..., draws] i.i.d.).

    ``keys`` is one key per row [B, 2] (a row's draws then depend on its own key only, as
    a batched server needs) or one key [2] shared by all rows.
    """
    shape = logp.shape[:-1] + ((draws,) if draws else ())
    if keys.ndim == 1:
        lp = logp[..., None, :] if draws else logp
        return jax.random.categorical(keys, lp, axis=-1, shape=shape)

    def one(k, lp):
        return jax.random.categorical(k, lp[..., None, :] if draws else lp, axis=-1, shape=shape[1:])

    return jax.vmap(one)(keys, logp)


def warp_logits(logits: jax.Array, spec: WarpSpec, values: dict[str, jax.Array]) -> jax.Array:
    """Warped log-probabilities of logits [B, ..., V]; -inf outside top-k / top-p."""
    b = logits.shape[0]
    extra = (1,) * (logits.ndim - 2)
    t = values["temperature"].reshape((b,) + extra + (1,))
    x = logits.astype(jnp.float32) / t
    if spec.use_top_k or spec.use_top_p:
        x = jax.lax.cond(truncating(spec, values, x.shape[-1]), lambda x: _truncate(x, spec, values), lambda x: x, x)
    logp = jax.nn.log_softmax(x, axis=-1)
    if "greedy" in values:  # argmax rows of a mixed batch: a one-hot distribution at the argmax
        onehot = jnp.arange(x.shape[-1]) == jnp.argmax(logits, axis=-1)[..., None]
        logp = jnp.where(values["greedy"].reshape((b,) + extra + (1,)), jnp.where(onehot, 0.0, -jnp.inf), logp)
    return logp


def truncating(spec: WarpSpec, values: dict[str, jax.Array], vocab: int) -> jax.Array:
    """Whether some sampled row of ``values`` asks for a compiled top-k or top-p stage (a scalar bool): where none
    does, those stages keep every token and ``warp_logits`` skips their sort."""
    asks = jnp.zeros(values["temperature"].shape, bool)
    if spec.use_top_k:
        asks |= (values["top_k"] > 0) & (values["top_k"] < vocab)  # 0 and the vocabulary size: off
    if spec.use_top_p:
        asks |= values["top_p"] < 1.0
    if "greedy" in values:  # a greedy row's values do nothing: its distribution is its argmax
        asks &= ~values["greedy"]
    return jnp.any(asks)


def _truncate(x: jax.Array, spec: WarpSpec, values: dict[str, jax.Array]) -> jax.Array:
    """Scaled logits x [B, ..., V] with every token outside each row's top-k / top-p set to the float minimum."""
    b, extra = x.shape[0], (1,) * (x.ndim - 2)
    neg = jnp.finfo(jnp.float32).min
    order = jnp.sort(x, axis=-1)[..., ::-1]  # descending
    if spec.use_top_k:
        k = values["top_k"].reshape((b,) + extra + (1,))
        kth = jnp.take_along_axis(order, jnp.clip(k - 1, 0, x.shape[-1] - 1), axis=-1)
        x = jnp.where(x >= kth, x, neg)
        order = jnp.where(jnp.arange(x.shape[-1]) < k, order, neg)
    if spec.use_top_p:
        p = values["top_p"].reshape((b,) + extra + (1,))
        probs = jax.nn.softmax(order, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted entry
        keep = (before < p) | (p >= 1.0)  # smallest prefix whose mass reaches p; p = 1 keeps all exactly
        threshold = jnp.min(jnp.where(keep, order, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x >= threshold, x, neg)
    return x


def gumbel_at(keys: jax.Array, positions: jax.Array, vocab: int) -> jax.Array:
    """Standard Gumbel noise [B, L, V] for absolute positions [B, L], keyed by (row key, position) alone.

    ``keys``: one key per row [B, 2] (or one [2] for every row). The noise of position t is
    ``gumbel(fold_in(key, t))``: it does not depend on the batch, the tree or the step that asks.
    """
    def one(key, t):
        return jax.random.gumbel(jax.random.fold_in(key, t), (vocab,), jnp.float32)

    if keys.ndim == 1:
        return jax.vmap(jax.vmap(lambda t: one(keys, t)))(positions)
    return jax.vmap(lambda k, ts: jax.vmap(lambda t: one(k, t))(ts))(keys, positions)


def perturbed(logits: jax.Array, spec: WarpSpec, values: dict[str, jax.Array], noise: jax.Array) -> jax.Array:
    """The coupled sampler's scores [B, ..., V]: warped log-probabilities + Gumbel ``noise`` for sampled rows,
    the raw logits for greedy rows (and a greedy ``spec``).

    Their argmax (``coupled_choice``) is an exact draw from the warped distribution (the Gumbel-max
    trick), a deterministic function of the noise; for a greedy row it is the argmax.
    """
    raw = logits.astype(jnp.float32)
    if spec.greedy:
        return raw
    scores = warp_logits(logits, spec, values) + noise
    if "greedy" in values:
        b = logits.shape[0]
        scores = jnp.where(values["greedy"].reshape((b,) + (1,) * (logits.ndim - 1)), raw, scores)
    return scores


def coupled_choice(logits: jax.Array, spec: WarpSpec, values: dict[str, jax.Array], noise: jax.Array) -> jax.Array:
    """The coupled draw [B, ...] (int32): the argmax of ``perturbed`` scores."""
    return jnp.argmax(perturbed(logits, spec, values, noise), axis=-1).astype(jnp.int32)


def coupled_scores(logits: jax.Array, spec: WarpSpec, values: dict[str, jax.Array], noise: jax.Array) -> jax.Array:
    """Normalised ``perturbed`` scores [B, ..., V]: what a coupled drafter ranks children by (top-k; its first
    child is its own coupled draw) and a dynamic tree sums along paths."""
    return jax.nn.log_softmax(perturbed(logits, spec, values, noise), axis=-1)


def warped_probs(logits: jax.Array, spec: WarpSpec, values: dict[str, jax.Array]) -> jax.Array:
    """Warped probabilities of logits [B, ..., V]."""
    return jnp.exp(warp_logits(logits, spec, values))


def sample(key: jax.Array, logits: jax.Array, spec: WarpSpec, values: dict[str, jax.Array]) -> jax.Array:
    """One token per row of logits [B, ..., V]: argmax when greedy, else a warped draw.

    ``key``: one key per row [B, 2] or one shared key [2] (``categorical_rows``).
    """
    if spec.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return categorical_rows(key, warp_logits(logits, spec, values)).astype(jnp.int32)
