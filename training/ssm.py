"""The SSM architecture: a small LLaMA-family model on the LLM's vocabulary, its cost and its init.

The SSM runs through the same ``models.transformer`` code as the LLM; only the
ModelConfig differs. Its token embedding is tied to the LM head (49152 x D dominates
a small model). ``init="llm_embedding"`` starts that embedding from the LLM's own
embedding projected onto its top-D principal directions (PCA), so that token
similarity, and with a tied head the output geometry, is there from step 0; the
blocks start from the usual random init.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.transformer import init_params
from training.config import ConfigError, SSMConfig


def ssm_model_config(llm: ModelConfig, ssm: SSMConfig) -> ModelConfig:
    """A LLaMA ModelConfig with the LLM's vocabulary, special ids and RoPE, and the SSM's shape."""
    return ModelConfig(
        arch="llama",
        vocab_size=llm.vocab_size,
        hidden_size=ssm.hidden_size,
        intermediate_size=ssm.intermediate_size,
        num_layers=ssm.num_layers,
        num_heads=ssm.num_heads,
        num_kv_heads=ssm.num_kv_heads,
        head_dim=ssm.head_dim,
        max_position_embeddings=llm.max_position_embeddings,
        rms_norm_eps=llm.rms_norm_eps if llm.arch != "opt" else 1e-5,
        rope_theta=llm.rope_theta,
        rope_scaling=llm.rope_scaling if llm.arch != "opt" else None,
        tie_word_embeddings=True,
        bos_token_id=llm.bos_token_id,
        eos_token_ids=llm.eos_token_ids,
    )


def flops_per_token(cfg: ModelConfig, context: int = 256) -> float:
    """Forward FLOPs for one new token attending to ``context`` cached tokens (2 per MAC)."""
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    n, k = cfg.num_heads, cfg.num_kv_heads
    attn_proj = d * h * (2 * n + 2 * k)  # q, o: N heads; k, v: K heads
    attn_scores = 2 * n * h * context  # q.k and p.v
    mlp = (3 if cfg.activation == "silu" else 2) * d * f
    head = cfg.proj_dim * cfg.vocab_size
    return 2.0 * (cfg.num_layers * (attn_proj + attn_scores + mlp) + head)


def check_cost(llm: ModelConfig, ssm: ModelConfig, max_ratio: float) -> float:
    """The SSM/LLM per-token FLOP ratio; raises ConfigError above ``max_ratio``."""
    ratio = flops_per_token(ssm) / flops_per_token(llm)
    if ratio > max_ratio:
        raise ConfigError(
            f"the SSM costs {ratio:.3f} of the LLM per token ({flops_per_token(ssm) / 1e6:.1f} vs "
            f"{flops_per_token(llm) / 1e6:.1f} MFLOP), above ssm.max_cost_ratio={max_ratio}: shrink it"
        )
    return ratio


def pca_embedding(embedding: np.ndarray, dim: int, row_norm: float = 1.0) -> np.ndarray:
    """Projects an embedding [V, P] onto its top-``dim`` principal directions -> [V, dim].

    Distances between rows are kept up to one global scale, chosen so the mean row norm is
    ``row_norm``: against a freshly initialised SSM's unit-RMS hidden state the tied head's
    logits then start with a standard deviation of about ``row_norm`` (the LLM's own scale,
    ~3.2 for SmolLM2, gives an initial cross-entropy of ~21 nats instead of ~11).
    """
    e = np.asarray(embedding, np.float32)
    centred = e - e.mean(axis=0, keepdims=True)
    cov = centred.T @ centred  # [P, P]
    vals, vecs = np.linalg.eigh(cov)
    top = vecs[:, np.argsort(vals)[::-1][: min(dim, e.shape[1])]]  # [P, dim']
    out = np.zeros((e.shape[0], dim), np.float32)
    out[:, : top.shape[1]] = e @ top
    return out * (row_norm / max(float(np.linalg.norm(out, axis=1).mean()), 1e-8))


_jit_init = jax.jit(init_params, static_argnums=(0, 2))


def jit_init_params(cfg: ModelConfig, seed: int, dtype=jnp.float32):
    """``models.transformer.init_params`` under jit: one compile per config, not hundreds of eager ops."""
    return _jit_init(cfg, seed, dtype)


def init_ssm(cfg: ModelConfig, ssm: SSMConfig, seed: int, llm_params=None):
    """float32 SSM parameters: random blocks, embedding random or PCA of the LLM's."""
    params = jit_init_params(cfg, seed)
    if ssm.init == "llm_embedding":
        if llm_params is None:
            raise ConfigError("ssm.init=llm_embedding needs the LLM's parameters")
        table = jax.device_get(llm_params["embed"]["embedding"])
        params = dict(params)
        params["embed"] = {"embedding": jnp.asarray(pca_embedding(table, cfg.hidden_size))}
    return params
