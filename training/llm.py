"""The LLM a training run distils from: the default model, a checkpoint, or a tiny random one (tests)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


def random_llm(vocab_size: int, seed: int = 0):
    """A tiny random LLaMA LLM (tests and smoke runs; no tokenizer)."""
    from models.loaded import LoadedModel
    from models.config import ModelConfig
    from training.ssm import jit_init_params

    cfg = ModelConfig("llama", vocab_size, 64, 128, 2, 4, 2, 16, max_position_embeddings=512,
                      eos_token_ids=(vocab_size - 1,))
    return LoadedModel(f"random:{vocab_size}", cfg, jit_init_params(cfg, seed), jnp.float32, None)


def load_llm(spec: str):
    """(LoadedModel, source path) for "default", "random:V" or a checkpoint path (float32): a checkpoint loads through
    the engine's own loader (``jaxspec.speculators.resolve.load_llm``: the weight cache, the tokenizer, its EOS)."""
    if spec.startswith("random:"):
        return random_llm(int(spec.split(":", 1)[1])), ""
    from jaxspec.speculators.resolve import load_llm as load_checkpoint_llm
    from models.loading import default_model_path

    path = default_model_path() if spec == "default" else spec
    llm = load_checkpoint_llm(path, "float32")
    return (dataclasses.replace(llm, name="SmolLM2-135M-Instruct") if spec == "default" else llm), path
