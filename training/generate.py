"""Batched greedy generation with the LLM: the teacher side of distillation.

Prompts are right-padded into fixed-size batches (one prompt-length bucket per
compile), prefilled with ``jaxspec.decoding.step.prefill_model`` and continued for a fixed
number of tokens inside one jitted ``lax.scan``: one executable per bucket, weights
as arguments, no host round trip per token.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.kv_cache import causal_mask
from jaxspec.decoding.step import prefill_model
from models.config import ModelConfig
from models.transformer import Forward, KVCache

PAD_ID = -1  # continuation padding after EOS


@dataclasses.dataclass(frozen=True)
class Continuations:
    """Greedy continuations of one batch of prompts."""

    tokens: np.ndarray  # [B, N] int32, PAD_ID after the first EOS
    topk_ids: np.ndarray | None  # [B, N, k] int32: the LLM's top-k ids at each step
    topk_logprobs: np.ndarray | None  # [B, N, k] float16: their log-probabilities


def make_generator(
    forward: Forward,
    cfg: ModelConfig,
    new_tokens: int,
    top_k: int = 0,
    cache_dtype=jnp.float32,
    temperature: float = 0.0,
) -> Callable:
    """Returns jitted ``gen(params, tokens[B, Tp], lengths[B], key) -> (ids[B, N], topk ids, topk logprobs)``.

    Decodes ``new_tokens`` tokens after right-padded prompts, greedily or (``temperature`` > 0)
    by sampling the tempered distribution with ``key`` folded by step; tokens after the first
    EOS are PAD_ID. With ``top_k`` > 0 it also returns the LLM's top-k ids and
    log-probabilities at every step (else empty [B, N, 0] arrays).
    """
    eos = jnp.asarray(cfg.eos_token_ids or (-2,), jnp.int32)

    def pick(logits, key):  # logits [B, V] -> token [B], topk ids / logprobs [B, k]
        if temperature > 0:
            token = jax.random.categorical(key, logits.astype(jnp.float32) / temperature, axis=-1).astype(jnp.int32)
        else:
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if top_k:
            logp = jax.nn.log_softmax(logits, axis=-1)
            vals, ids = jax.lax.top_k(logp, top_k)
            return token, ids.astype(jnp.int32), vals.astype(jnp.float16)
        b = logits.shape[0]
        return token, jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.float16)

    def gen(params, tokens, lengths, key):
        b, tp = tokens.shape
        capacity = tp + new_tokens
        cache = KVCache.create(cfg, b, capacity, cache_dtype)
        logits, cache, _ = prefill_model(forward, params, cache, tokens, lengths)
        first = pick(logits, jax.random.fold_in(key, 0))
        done = jnp.isin(first[0], eos)

        def body(carry, step):
            cache, prev, done = carry
            mask = causal_mask(cache.length, 1, capacity)
            out, cache = forward(params, prev[:, None], cache.length[:, None], cache, mask)
            cache = cache.replace(length=cache.length + 1)
            token, ids, vals = pick(out[:, 0], jax.random.fold_in(key, step))
            emitted = jnp.where(done, PAD_ID, token)
            return (cache, token, done | jnp.isin(token, eos)), (emitted, ids, vals)

        _, (rest, ids, vals) = jax.lax.scan(body, (cache, first[0], done), jnp.arange(1, new_tokens))
        seq = jnp.concatenate([first[0][None], rest], axis=0).T  # [B, N]
        top_ids = jnp.concatenate([first[1][None], ids], axis=0).transpose(1, 0, 2)  # [B, N, k]
        top_vals = jnp.concatenate([first[2][None], vals], axis=0).transpose(1, 0, 2)
        return seq, top_ids, top_vals

    return jax.jit(gen)


def pad_batch(prompts: Sequence[Sequence[int]], batch: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads up to ``batch`` prompts to ``length`` (missing rows repeat the first prompt)."""
    tokens = np.zeros((batch, length), np.int32)
    lengths = np.zeros((batch,), np.int32)
    for i in range(batch):
        p = prompts[i] if i < len(prompts) else prompts[0]
        tokens[i, : len(p)] = p
        lengths[i] = len(p)
    return tokens, lengths


def generate_batch(gen: Callable, params, prompts: Sequence[Sequence[int]], batch: int, length: int,
                   key: jax.Array | None = None) -> Continuations:
    """Runs ``gen`` on up to ``batch`` prompts padded to ``length`` (``key``: a sampling generator's
    randomness); drops the filler rows."""
    tokens, lengths = pad_batch(prompts, batch, length)
    key = jax.random.key(0) if key is None else key
    seq, ids, vals = jax.device_get(gen(params, jnp.asarray(tokens), jnp.asarray(lengths), key))
    n = len(prompts)
    has_topk = ids.shape[-1] > 0
    return Continuations(
        np.asarray(seq[:n], np.int32),
        np.asarray(ids[:n], np.int32) if has_topk else None,
        np.asarray(vals[:n], np.float16) if has_topk else None,
    )
