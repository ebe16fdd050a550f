"""Random-weight checkpoints of a LLaMA / Qwen2 shape, with a real tokenizer.

What a test or a device check needs where real weights cannot go: a Hugging Face directory
(safetensors, ``config.json``, the tokenizer's files) or a GGUF file (F32 tensors, the tokenizer of
another GGUF) that ``--model`` loads like any other. Weights are scaled so outputs stay O(1), which
gives peaked, prompt-dependent logits. A GGUF's tokenizer loads without transformers (or torch), so a
process that loads one starts seconds sooner than one loading a directory's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from models.config import ModelConfig

ARCH_NAMES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM")}
# HF tensor names (per layer after "model.layers.{i}.") -> llama.cpp's
GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
GGUF_LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def random_tensors(cfg: ModelConfig, seed: int = 0, noise: float = 0.0) -> dict[str, np.ndarray]:
    """HF-named float32 tensors of ``cfg``'s shape, [out, in]; ``noise`` > 0 adds that fraction of each matrix's
    spread in Gaussian noise (a second model that agrees with the first on part of its argmaxes)."""
    if cfg.arch not in ARCH_NAMES:
        raise ValueError(f"random checkpoints are written for {', '.join(ARCH_NAMES)} shapes, not {cfg.arch}")
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
    if noise > 0:
        jitter = np.random.default_rng(seed + 1)
        tensors = {k: v + (noise * v.std() * jitter.standard_normal(v.shape)).astype(np.float32) if v.ndim == 2 else v
                   for k, v in tensors.items()}
    return tensors


def write_random_checkpoint(directory: str | Path, cfg: ModelConfig, tokenizer, seed: int = 0) -> int:
    """Writes a random checkpoint of ``cfg``'s shape with ``tokenizer`` into ``directory``; returns its weight bytes."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    if len(tokenizer) > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, the shape's vocabulary {cfg.vocab_size}")
    tensors = random_tensors(cfg, seed)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    model_type, architecture = ARCH_NAMES[cfg.arch]
    (out / "config.json").write_text(json.dumps({
        "model_type": model_type, "architectures": [architecture], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "attention_bias": cfg.attention_bias,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": "float32"}, indent=1))
    tokenizer.save_pretrained(out)
    return sum(x.nbytes for x in tensors.values())


def write_random_gguf(path: str | Path, cfg: ModelConfig, tokenizer_gguf: str | Path, seed: int = 0,
                      noise: float = 0.0) -> int:
    """Writes a random LLaMA checkpoint of ``cfg``'s shape (``random_tensors``) as a GGUF file of F32 tensors, with
    the tokenizer and chat template of the GGUF at ``tokenizer_gguf``; returns its weight bytes."""
    import gguf  # noqa: PLC0415

    if cfg.arch != "llama":
        raise ValueError(f"random GGUF files are written for the llama shape, not {cfg.arch}")
    source = gguf.GGUFReader(Path(tokenizer_gguf))
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    if vocab > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {vocab} tokens, the shape's vocabulary {cfg.vocab_size}")
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", cfg.num_layers), ("context_length", cfg.max_position_embeddings),
                       ("embedding_length", cfg.hidden_size), ("feed_forward_length", cfg.intermediate_size),
                       ("attention.head_count", cfg.num_heads), ("attention.head_count_kv", cfg.num_kv_heads),
                       ("attention.key_length", cfg.head_dim), ("vocab_size", cfg.vocab_size)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", cfg.rope_theta)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), kind, sub)
    tensors = random_tensors(cfg, seed, noise)
    for name, array in tensors.items():
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            part, kind = rest.rsplit(".", 1)
            name = f"blk.{i}.{GGUF_LAYER_NAMES[part]}.{kind}"
        else:
            name = GGUF_NAMES[name]
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sum(x.nbytes for x in tensors.values())
