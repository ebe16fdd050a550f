"""Model configuration shared by every family (LLaMA, Qwen2, OPT)."""

from __future__ import annotations

import dataclasses
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "opt")


class ModelConfigError(ValueError):
    """A checkpoint's configuration cannot be served by jaxspec."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static hyper-parameters of one decoder-only transformer."""

    arch: str  # "llama" | "qwen2" | "opt"
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6  # LLaMA/Qwen2 RMSNorm epsilon (OPT LayerNorm uses 1e-5)
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # HF rope_scaling dict as items
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    # OPT only
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int | None = None  # P; None means == hidden_size
    final_layer_norm: bool = True
    activation: str = "silu"  # "silu" (SwiGLU) for LLaMA/Qwen2, "relu" for OPT
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ModelConfigError(
                f"unknown architecture {self.arch!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def proj_dim(self) -> int:
        """Width of the token embedding (OPT's word_embed_proj_dim, else D)."""
        return self.word_embed_proj_dim or self.hidden_size

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Builds a config from a Hugging Face ``config.json`` dictionary."""
        model_type = hf.get("model_type")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        if model_type in ("llama", "qwen2", "mistral"):
            heads = hf["num_attention_heads"]
            # transformers >= 5 writes rope_parameters (theta included) instead of rope_scaling
            scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
            if scaling:
                scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
            if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
                scaling = None
            rope_theta = hf.get("rope_theta")
            if rope_theta is None:
                rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
            return cls(
                arch="qwen2" if model_type == "qwen2" else "llama",
                vocab_size=hf["vocab_size"],
                hidden_size=hf["hidden_size"],
                intermediate_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=hf.get("num_key_value_heads") or heads,
                head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                max_position_embeddings=hf.get("max_position_embeddings", 2048),
                rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope_theta),
                rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
                activation="silu",
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        if model_type == "opt":
            heads = hf["num_attention_heads"]
            return cls(
                arch="opt",
                vocab_size=hf["vocab_size"],
                hidden_size=hf["hidden_size"],
                intermediate_size=hf["ffn_dim"],
                num_layers=hf["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=heads,
                head_dim=hf["hidden_size"] // heads,
                max_position_embeddings=hf.get("max_position_embeddings", 2048),
                tie_word_embeddings=True,
                attention_bias=True,
                do_layer_norm_before=bool(hf.get("do_layer_norm_before", True)),
                word_embed_proj_dim=hf.get("word_embed_proj_dim"),
                final_layer_norm=not hf.get("_remove_final_layer_norm", False)
                and bool(hf.get("do_layer_norm_before", True)),
                activation=hf.get("activation_function", "relu"),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        raise ModelConfigError(
            f"unknown architecture model_type={model_type!r}; supported: llama, qwen2, opt"
        )
