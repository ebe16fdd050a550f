"""Sampling parameters and the logit warping shared by the LLM and every SSM.

The same warp (temperature, then top-k, then top-p) is applied to the LLM's and the
SSMs' logits, so speculative sampling compares the distributions a user asked for.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


class SamplingError(ValueError):
    """Sampling parameters out of range."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler; temperature 0 means greedy."""

    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off; must lie in (0, 1]
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top-p must lie in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class WarpSpec:
    """Static switches of the warp: which stages exist in the compiled graph."""

    greedy: bool = True
    use_top_k: bool = False
    use_top_p: bool = False

    @classmethod
    def of(cls, params: SamplingParams) -> "WarpSpec":
        return cls(params.greedy, not params.greedy and params.top_k > 0, not params.greedy and params.top_p < 1.0)


def warp_arrays(params: SamplingParams, batch: int) -> dict[str, jax.Array]:
    """Traced per-row sampling values [B] so changing them never recompiles (one explicit transfer)."""
    return jax.device_put({
        "temperature": np.full((batch,), max(params.temperature, 1e-6), np.float32),
        "top_k": np.full((batch,), params.top_k, np.int32),
        "top_p": np.full((batch,), params.top_p, np.float32),
    })


def warp_logits(logits: jax.Array, spec: WarpSpec, values: dict[str, jax.Array]) -> jax.Array:
    """Warped log-probabilities of logits [B, ..., V]; -inf outside top-k / top-p."""
    b = logits.shape[0]
    extra = (1,) * (logits.ndim - 2)
    t = values["temperature"].reshape((b,) + extra + (1,))
    x = logits.astype(jnp.float32) / t
    neg = jnp.finfo(jnp.float32).min
    if spec.use_top_k or spec.use_top_p:
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
            keep = before < p  # smallest prefix whose mass reaches p
            threshold = jnp.min(jnp.where(keep, order, jnp.inf), axis=-1, keepdims=True)
            x = jnp.where(x >= threshold, x, neg)
    return jax.nn.log_softmax(x, axis=-1)


def warped_probs(logits: jax.Array, spec: WarpSpec, values: dict[str, jax.Array]) -> jax.Array:
    """Warped probabilities of logits [B, ..., V]."""
    return jnp.exp(warp_logits(logits, spec, values))


def sample(key: jax.Array, logits: jax.Array, spec: WarpSpec, values: dict[str, jax.Array]) -> jax.Array:
    """One token per row of logits [B, ..., V]: argmax when greedy, else a warped draw."""
    if spec.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, warp_logits(logits, spec, values), axis=-1).astype(jnp.int32)
