"""A feature-conditioned drafter (EAGLE-style): one transformer layer that reads the LLM's own states.

An independent SSM must rediscover what the LLM is about to say from the tokens alone; this
drafter is handed the LLM's final-norm hidden state of the previous position, which already
encodes it. At slot p it reads (token x_p, feature f_{p-1}) — f_{-1} is zeros — and predicts
f_p, whose LM head (the LLM's own, or its reduced draft-vocabulary rows) scores x_{p+1}.
Slots therefore line up with the LLM's positions, and the engine drives it like any SSM: a
KV cache of committed slots, the root at slot ``length``. Deeper tree levels read the
drafter's own predicted state of the parent node in place of the LLM's.

Parameters: ``fc`` [2D, D] (token embedding ‖ feature -> D), ``layer_0`` (one block of the
LLM's architecture) are the drafter's own; ``embed`` (and ``lm_head`` when untied) are the
LLM's, frozen, so a drafter checkpoint stores ``fc`` and ``layer_0`` only.
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import axes
from models.config import ModelConfig, ModelConfigError
from models.layers import Dense
from models.transformer import Block, KVCache, output_head, write_kv

OWN = ("fc", "layer_0")  # the drafter's trained parameters; the rest are the LLM's


def drafter_config(llm: ModelConfig) -> ModelConfig:
    """The drafter's config: one layer of the LLM's architecture (its KV cache has one layer)."""
    if llm.arch == "opt":
        raise ModelConfigError("a feature drafter needs a LLaMA/Qwen-style LLM (final RMSNorm states), not OPT")
    return llm.replace(num_layers=1)


class FeatureDrafter(nn.Module):
    """fc(embed(x_p) ‖ f_{p-1}) -> one block -> predicted f_p -> the LM head."""

    cfg: ModelConfig  # ``drafter_config(llm)``
    dtype: jnp.dtype = jnp.float32
    draft_vocab: int = 0

    @nn.compact
    def __call__(self, tokens, features, positions, cache: KVCache, mask, select=None):
        # tokens, positions [B, T]; features [B, T, D] (f_{p-1} per slot); mask [B, T, S]; select [B, T'] or None
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, param_dtype=self.dtype,
                         embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02),
                                                                     (axes.VOCAB, axes.EMBED)),
                         name="embed")
        x = jnp.concatenate([embed(tokens), features.astype(self.dtype)], axis=-1)  # [B, T, 2D]
        x = Dense((2 * cfg.hidden_size,), (cfg.hidden_size,), (None,), (axes.EMBED,), False, self.dtype,
                  name="fc")(x)
        x, (k_new, v_new) = Block(cfg, self.dtype, name="layer_0")(x, cache.k[0], cache.v[0], positions, mask,
                                                                   cache.length)
        cache = write_kv(cache, k_new[None], v_new[None])
        if select is not None:
            x = jnp.take_along_axis(x, select[:, :, None], axis=1)  # [B, T', D]
        logits = output_head(self, cfg, x, embed.embedding, self.draft_vocab, False)
        return logits, cache, x


DraftForward = Callable[..., tuple[jax.Array, KVCache, jax.Array]]


def make_drafter_forward(cfg: ModelConfig, dtype=jnp.float32, draft_vocab: int = 0) -> DraftForward:
    """``forward(params, tokens, features, positions, cache, mask, select=None) -> (logits, cache, states)``."""
    model = FeatureDrafter(cfg, dtype, draft_vocab)

    def forward(params, tokens, features, positions, cache, mask, select=None):
        return model.apply({"params": params}, tokens, features, positions, cache, mask, select)

    return forward


def param_tree(cfg: ModelConfig, seed: int = 0) -> dict:
    """A randomly initialised drafter parameter tree (unboxed): the exact tree a loader must produce."""
    cache = KVCache.create(cfg, 1, 4)
    tok = jnp.zeros((1, 1), jnp.int32)
    feats = jnp.zeros((1, 1, cfg.hidden_size))
    return nn.meta.unbox(FeatureDrafter(cfg).init(jax.random.PRNGKey(seed), tok, feats, tok, cache,
                                                  jnp.ones((1, 1, 4), bool))["params"])


def init_drafter(cfg: ModelConfig, llm_params: dict, seed: int = 0) -> dict:
    """A fresh drafter on the LLM's embedding/head that starts as "predict f_p = f_{p-1}".

    ``fc`` passes the feature half through (small noise on the token half) and ``layer_0``'s
    output projections start at zero, so the block is the identity: training begins from a
    drafter whose states are already on the LLM's scale instead of from noise.
    """
    d = cfg.hidden_size
    params = param_tree(cfg, seed)
    fc = params["fc"]["kernel"] * 0.1  # [2D, D]
    params["fc"]["kernel"] = fc.at[d:].set(jnp.eye(d, dtype=fc.dtype))

    def zero_out(path, leaf):
        names = [getattr(k, "key", None) for k in path]
        return jnp.zeros_like(leaf) if names[-2:] in (["o", "kernel"], ["down", "kernel"]) else leaf

    params["layer_0"] = jax.tree_util.tree_map_with_path(zero_out, params["layer_0"])
    for name in ("embed", "lm_head"):
        if name in llm_params:
            params[name] = llm_params[name]
    return params
