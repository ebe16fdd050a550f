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

The fused form (EAGLE-3; ``feature_layers`` = k >= 2 block indices of the LLM) reads the
outputs of those blocks side by side, [k·D], instead of the final-norm state: ``fuse``
[k·D, D] projects them to one state. Deeper levels read the drafter's own block output
(width D), so the width of what a call is fed says which it is. Its own ``norm`` precedes the
head, since its states are no longer trained to match the LLM's final-norm ones.

The EAGLE-3 block (``block`` "eagle3", from checkpoints in the ecosystem's dialects,
``jaxspec.speculators.eagle3``) is EAGLE-3's own layer in place of ``fc`` and the plain block:
``fuse`` projects the raw blocks' outputs (no per-block scaling), q/k/v read
[input_norm(embed(x_p)) ‖ hidden_norm(f_{p-1})] (2D wide) and the residual stream starts from
f_{p-1} itself ("eagle3_norm_before_residual": from its normed form). Its embedding and head
may be its own (``lm_head`` or a draft head over its vocabulary map).
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import axes
from models.config import ModelConfig, ModelConfigError
from models.layers import MLP, Attention, Dense, RMSNorm
from models.lowering import Lowering, default_lowering
from models.transformer import Block, KVCache, output_head, write_kv

OWN = ("fc", "layer_0")  # the drafter's trained parameters; the rest are the LLM's
FUSED_OWN = ("fuse", "fc", "layer_0", "norm")  # the fused form's
EAGLE3_OWN = ("fuse", "layer_0", "norm")  # the EAGLE-3 block's (on the LLM's embedding and head)
# the drafter's layer: the project's (fc, then a block of the LLM's architecture) or EAGLE-3's (normed input halves)
BLOCKS = ("own", "eagle3", "eagle3_norm_before_residual")


def own_names(feature_layers: tuple[int, ...], block: str = "own") -> tuple[str, ...]:
    """The parameters a drafter of this form trains and stores (the rest are the LLM's)."""
    if block != "own":
        return EAGLE3_OWN
    return FUSED_OWN if feature_layers else OWN


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high taps: blocks 1, L/2 - 1 and L - 4 (0-based; their outputs)."""
    return tuple(sorted({min(1, num_layers - 1), max(num_layers // 2 - 1, 0), max(num_layers - 4, 0)}))


def check_feature_layers(layers: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """``layers`` as a sorted tuple, or ModelConfigError: >= 2 distinct blocks of the LLM (or none)."""
    out = tuple(sorted({int(i) for i in layers}))
    if out and (len(out) < 2 or out[0] < 0 or out[-1] >= num_layers):
        raise ModelConfigError(f"fused features need >= 2 distinct LLM blocks in [0, {num_layers}), "
                               f"got {list(layers)}")
    return out


def drafter_config(llm: ModelConfig) -> ModelConfig:
    """The drafter's config: one layer of the LLM's architecture (its KV cache has one layer)."""
    if llm.arch == "opt":
        raise ModelConfigError("a feature drafter needs a LLaMA/Qwen-style LLM (final RMSNorm states), not OPT")
    return llm.replace(num_layers=1)


class Eagle3Block(nn.Module):
    """EAGLE-3's decoder layer: attention over [input_norm(embedding) ‖ hidden_norm(state)], residual from the state.

    Slot 0 (the first token, which no LLM state precedes) is seen by itself only: EAGLE-3 drafts from the pair
    (x_1, h_0) on, so every later slot attends over exactly the keys EAGLE-3's own drafting has.
    """

    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    norm_before_residual: bool = False  # the residual stream starts from hidden_norm(state) (speculators' option)

    @nn.compact
    def __call__(self, emb, h, k_cache, v_cache, positions, mask, write_at):
        # emb, h [B, T, D]; k_cache, v_cache [B, K, S, H]; positions [B, T]; mask [B, T, S]; write_at [B]
        cfg = self.cfg
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, self.dtype, name=name)  # noqa: E731
        mask = mask & ((jnp.arange(mask.shape[-1]) > 0)[None, None, :] | (positions == 0)[:, :, None])  # [B, T, S]
        normed = norm("hidden_norm")(h)
        x = jnp.concatenate([norm("input_norm")(emb), normed], axis=-1)  # [B, T, 2D]
        a, k_new, v_new = Attention(cfg, self.dtype, in_width=2 * cfg.hidden_size, name="attn")(
            x, positions, mask, k_cache, v_cache, write_at)
        x = (normed if self.norm_before_residual else h) + a
        x = x + MLP(cfg, self.dtype, name="mlp")(norm("mlp_norm")(x))
        return x, (k_new, v_new)


class FeatureDrafter(nn.Module):
    """fc(embed(x_p) ‖ f_{p-1}) -> one block -> predicted f_p -> the LM head."""

    cfg: ModelConfig  # ``drafter_config(llm)``
    dtype: jnp.dtype = jnp.float32
    draft_vocab: int = 0
    feature_layers: tuple[int, ...] = ()  # the fused form's LLM blocks (empty: the final-norm form)
    kv_write: str = "rows"  # Lowering.kv_write of its one cache write
    block: str = "own"  # one of BLOCKS

    @nn.compact
    def __call__(self, tokens, features, positions, cache: KVCache, mask, select=None):
        # tokens, positions [B, T]; features [B, T, D] (f_{p-1} per slot; the fused form: [B, T, k·D] from the
        # LLM, or [B, T, D] its own states); mask [B, T, S]; select [B, T'] or None
        cfg = self.cfg
        k = len(self.feature_layers)
        own = self.block == "own"
        if self.block not in BLOCKS:
            raise ModelConfigError(f"unknown drafter block {self.block!r}; known: {', '.join(BLOCKS)}")
        if k:
            fuse = Dense((k * cfg.hidden_size,), (cfg.hidden_size,), (None,), (axes.EMBED,), False, self.dtype,
                         name="fuse")
            if features.shape[-1] == k * cfg.hidden_size and own:  # the LLM's blocks: each scaled to unit RMS
                parts = features.astype(jnp.float32).reshape(*features.shape[:-1], k, cfg.hidden_size)
                parts = parts * jax.lax.rsqrt(jnp.mean(jnp.square(parts), -1, keepdims=True) + cfg.rms_norm_eps)
                features = fuse(parts.reshape(features.shape).astype(self.dtype))  # [B, T, D]
            elif features.shape[-1] == k * cfg.hidden_size:  # EAGLE-3 fuses the blocks' outputs as they are
                features = fuse(features.astype(self.dtype))  # [B, T, D]
        embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, param_dtype=self.dtype,
                         embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02),
                                                                     (axes.VOCAB, axes.EMBED)),
                         name="embed")
        if own:
            x = jnp.concatenate([embed(tokens), features.astype(self.dtype)], axis=-1)  # [B, T, 2D]
            x = Dense((2 * cfg.hidden_size,), (cfg.hidden_size,), (None,), (axes.EMBED,), False, self.dtype,
                      name="fc")(x)
            x, (k_new, v_new) = Block(cfg, self.dtype, name="layer_0")(x, cache.k[0], cache.v[0], positions, mask,
                                                                       cache.length)
        else:
            x, (k_new, v_new) = Eagle3Block(cfg, self.dtype, self.block == "eagle3_norm_before_residual",
                                            name="layer_0")(embed(tokens), features.astype(self.dtype), cache.k[0],
                                                            cache.v[0], positions, mask, cache.length)
        cache = write_kv(cache, k_new[None], v_new[None], scatter=self.kv_write == "scatter")
        if select is not None:
            x = jnp.take_along_axis(x, select[:, :, None], axis=1)  # [B, T', D]
        h = RMSNorm(cfg.rms_norm_eps, self.dtype, name="norm")(x) if k or not own else x
        logits = output_head(self, cfg, h, embed.embedding, self.draft_vocab, False)
        return logits, cache, x


DraftForward = Callable[..., tuple[jax.Array, KVCache, jax.Array]]


def make_drafter_forward(cfg: ModelConfig, dtype=jnp.float32, draft_vocab: int = 0,
                         feature_layers: tuple[int, ...] = (), lowering: Lowering | None = None,
                         block: str = "own") -> DraftForward:
    """``forward(params, tokens, positions, cache, mask, select=None, features=...) -> (logits, cache, states)``:
    the transformer's forward signature (``models.transformer.make_forward``) plus the states it reads, features
    [B, T, D] (required); ``lowering``'s kv_write (default: this platform's); ``block`` one of BLOCKS."""
    lowering = lowering or default_lowering()
    model = FeatureDrafter(cfg, dtype, draft_vocab, tuple(feature_layers), lowering.kv_write, block)

    def forward(params, tokens, positions, cache, mask, select=None, features=None):
        if features is None:
            raise ValueError("a feature drafter reads the LLM's states: pass features=[B, T, D]")
        return model.apply({"params": params}, tokens, features, positions, cache, mask, select)

    return forward


def param_tree(cfg: ModelConfig, seed: int = 0, feature_layers: tuple[int, ...] = (), block: str = "own",
               draft_vocab: int = 0) -> dict:
    """A randomly initialised drafter parameter tree (unboxed): the exact tree a loader must produce."""
    cache = KVCache.create(cfg, 1, 4)
    tok = jnp.zeros((1, 1), jnp.int32)
    feats = jnp.zeros((1, 1, cfg.hidden_size * max(len(feature_layers), 1)))
    return nn.meta.unbox(FeatureDrafter(cfg, feature_layers=tuple(feature_layers), block=block,
                                        draft_vocab=draft_vocab).init(
        jax.random.PRNGKey(seed), tok, feats, tok, cache, jnp.ones((1, 1, 4), bool))["params"])


def init_drafter(cfg: ModelConfig, llm_params: dict, seed: int = 0, feature_layers: tuple[int, ...] = (),
                 block: str = "own") -> dict:
    """A fresh drafter on the LLM's embedding/head that starts as "predict f_p = f_{p-1}".

    ``fc`` passes the feature half through (small noise on the token half) and ``layer_0``'s
    output projections start at zero, so the block is the identity: training begins from a
    drafter whose states are already on the LLM's scale instead of from noise. The fused form's
    ``fuse`` starts as the mean of its k blocks' outputs. The EAGLE-3 block has no ``fc``: its
    residual stream starts from the state, so zeroed output projections make it the identity too.
    """
    d = cfg.hidden_size
    params = param_tree(cfg, seed, feature_layers, block)
    if feature_layers:
        k = len(feature_layers)
        params["fuse"]["kernel"] = jnp.tile(jnp.eye(d, dtype=params["fuse"]["kernel"].dtype), (k, 1)) / k
    if "fc" in params:
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


def head_states(params: dict, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """What the head reads from drafter states h [..., D]: the fused form's own ``norm`` of them, else h."""
    if "norm" not in params:
        return h
    return RMSNorm(cfg.rms_norm_eps, h.dtype).apply({"params": params["norm"]}, h)
