"""Random-weight Hugging Face checkpoints of a LLaMA / Qwen2 shape, with a real tokenizer.

What a test or a device check needs where real weights cannot go: a directory ``--model``
loads like any other (safetensors in the HF layout, ``config.json``, the tokenizer's files).
Weights are scaled so outputs stay O(1), which gives peaked, prompt-dependent logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from models.config import ModelConfig

ARCH_NAMES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM")}


def write_random_checkpoint(directory: str | Path, cfg: ModelConfig, tokenizer, seed: int = 0) -> int:
    """Writes a random checkpoint of ``cfg``'s shape with ``tokenizer`` into ``directory``; returns its weight bytes."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    if cfg.arch not in ARCH_NAMES:
        raise ValueError(f"random checkpoints are written for {', '.join(ARCH_NAMES)} shapes, not {cfg.arch}")
    if len(tokenizer) > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, the shape's vocabulary {cfg.vocab_size}")
    rng = np.random.default_rng(seed)
    d, f, h, n, kv = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    def w(rows: int, cols: int) -> np.ndarray:  # [out, in], O(1) outputs
        return (rng.standard_normal((rows, cols), np.float32) / np.sqrt(cols)).astype(np.float32)

    ones = lambda k: np.ones(k, np.float32)  # noqa: E731
    tensors = {"model.embed_tokens.weight": rng.standard_normal((cfg.vocab_size, d), np.float32),
               "model.norm.weight": ones(d)}
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = w(cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        tensors |= {pre + "self_attn.q_proj.weight": w(n * h, d), pre + "self_attn.k_proj.weight": w(kv * h, d),
                    pre + "self_attn.v_proj.weight": w(kv * h, d), pre + "self_attn.o_proj.weight": w(d, n * h),
                    pre + "mlp.gate_proj.weight": w(f, d), pre + "mlp.up_proj.weight": w(f, d),
                    pre + "mlp.down_proj.weight": w(d, f), pre + "input_layernorm.weight": ones(d),
                    pre + "post_attention_layernorm.weight": ones(d)}
        if cfg.attention_bias:
            tensors |= {pre + "self_attn.q_proj.bias": np.zeros(n * h, np.float32),
                        pre + "self_attn.k_proj.bias": np.zeros(kv * h, np.float32),
                        pre + "self_attn.v_proj.bias": np.zeros(kv * h, np.float32)}
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    model_type, architecture = ARCH_NAMES[cfg.arch]
    (out / "config.json").write_text(json.dumps({
        "model_type": model_type, "architectures": [architecture], "vocab_size": cfg.vocab_size, "hidden_size": d,
        "intermediate_size": f, "num_hidden_layers": cfg.num_layers, "num_attention_heads": n,
        "num_key_value_heads": kv, "head_dim": h, "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "attention_bias": cfg.attention_bias,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": "float32"}, indent=1))
    tokenizer.save_pretrained(out)
    return sum(x.nbytes for x in tensors.values())
