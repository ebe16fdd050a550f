"""Shared fixtures: one tiny random model family and the embedded default LLM (loaded once)."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

# Tests compile hundreds of executables of tiny models, and a fresh machine (CI) compiles every one: LLVM's
# optimisation of the generated code costs more than running it. Level 0 keeps XLA's graph passes (the numerical
# checks hold under it) and is inherited by the CLI and server processes the tests start; benchmarks never run under it.
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""),
                                                 "--xla_backend_optimization_level=0"]))

# Serialized executables stay off (tests/test_executables.py turns them on): with them a test's compile counts
# would depend on which test wrote an executable of the same shape first. Inherited by the processes tests start.
os.environ.setdefault("JAXSPEC_EXECUTABLE_CACHE", "off")

import jax  # noqa: E402 (after XLA_FLAGS)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jaxspec.cache import cache_root, enable_compile_cache
from jaxspec.engine import LoadedModel
from models.config import ModelConfig
from models.transformer import init_params

DEV_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "prompts" / "dev_prompts.jsonl"

# One persistent compilation cache (outside the repository, as the CLI's): an engine
# configuration that several tests build is compiled once per machine, not once per test.
enable_compile_cache(cache_root() / "xla")


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_executables():
    """Frees each module's compiled executables after it: a worker runs many modules, and JAX
    keeps every executable it compiled (a worker otherwise grows past 8 GB over the suite)."""
    yield
    jax.clear_caches()
    gc.collect()


def tiny_config(**overrides) -> ModelConfig:
    base = dict(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                num_kv_heads=2, head_dim=8, max_position_embeddings=4096, eos_token_ids=())
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 1, scale: float = 3.0, **overrides) -> LoadedModel:
    """A random LLaMA-family model whose scaled weights give peaked, non-trivial distributions."""
    cfg = tiny_config(**overrides)
    params = jax.tree_util.tree_map(lambda x: x * scale, init_params(cfg, seed))
    return LoadedModel(f"tiny-{seed}", cfg, params)


def ragged_forward_case(cfg: ModelConfig, batch: int, tokens: int, capacity: int = 16):
    """Inputs of one forward over a ragged batch of trees: (params x3, tokens [B, T], positions [B, T], a cache of
    random K/V with committed lengths 2, 4, 3 [B], the causal mask [B, T, S]); shared by the layout tests."""
    import jax.numpy as jnp  # noqa: PLC0415

    from models.transformer import KVCache  # noqa: PLC0415

    params = jax.tree_util.tree_map(lambda x: x * 3.0, init_params(cfg, 3))
    length = jnp.array([2, 4, 3][:batch], jnp.int32)  # [B] committed tokens, ragged
    cache = KVCache.create(cfg, batch, capacity)
    cache = cache.replace(k=jax.random.normal(jax.random.PRNGKey(1), cache.k.shape),
                          v=jax.random.normal(jax.random.PRNGKey(2), cache.v.shape), length=length)
    toks = jax.random.randint(jax.random.PRNGKey(4), (batch, tokens), 0, cfg.vocab_size)  # [B, T]
    pos = length[:, None] + jnp.arange(tokens)  # [B, T]
    slot = jnp.arange(capacity)[None, None, :]
    mask = slot < (length[:, None, None] + jnp.arange(tokens)[None, :, None] + 1)  # [B, T, S] causal
    return params, toks, pos, cache, mask


@pytest.fixture(scope="session")
def tiny_llm() -> LoadedModel:
    return tiny_model()


@pytest.fixture(scope="session")
def default_llm() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct GGUF, float32, with its tokenizer."""
    from jaxspec.speculators.resolve import load_llm

    return load_llm(None, "float32")


def dev_prompts(n: int | None = None) -> list[dict]:
    if not DEV_PROMPTS.exists():
        pytest.fail(f"development prompts not found at {DEV_PROMPTS} (the repository expects ../shared beside it)")
    rows = [json.loads(line) for line in DEV_PROMPTS.read_text().splitlines() if line.strip()]
    return rows[:n] if n else rows


def random_prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 20) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


# --------------------------------------------------------------------------------------
# Tiny random Hugging Face checkpoints, written once per session (models.loading tests;
# usable by any test that needs a real checkpoint directory).

TINY_HF_CASES = {
    # name: (transformers config class, config kwargs)
    "llama_mha": ("LlamaConfig", dict(num_key_value_heads=4)),
    "llama_gqa": ("LlamaConfig", dict(num_key_value_heads=2)),
    "llama_mqa": ("LlamaConfig", dict(num_key_value_heads=1)),
    "llama_tied": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama_rope_llama3": ("LlamaConfig", dict(num_key_value_heads=2, rope_parameters=dict(
        rope_type="llama3", rope_theta=500.0, factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8))),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2)),
    "opt_pre_norm": ("OPTConfig", dict(do_layer_norm_before=True)),
    "opt_post_norm": ("OPTConfig", dict(do_layer_norm_before=False)),
    "opt_proj": ("OPTConfig", dict(word_embed_proj_dim=16)),
}
TINY_HF_FORMATS = ("safetensors", "bin", "sharded_safetensors", "sharded_bin")


def _tiny_hf_model(case: str, seed: int):
    import torch
    import transformers

    config_class, kwargs = TINY_HF_CASES[case]
    common = dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if config_class == "OPTConfig":
        common |= dict(ffn_dim=48)
    else:
        common |= dict(intermediate_size=48, rms_norm_eps=1e-5)
    config = getattr(transformers, config_class)(**common, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    # O(1) weights (HF's 0.02 init gives near-zero logits): a layout mistake must show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 1.0 if "embed" in name else p.shape[1] ** -0.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
            else:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


def _write_bin(model, directory, shards: int) -> None:
    """The pre-safetensors layout (transformers 5 no longer writes it): pytorch_model.bin,
    or shards plus pytorch_model.bin.index.json."""
    import torch

    model.config.save_pretrained(directory)
    state = model.state_dict()  # includes a tied lm_head.weight, as old checkpoints did
    if shards == 1:
        torch.save(state, directory / "pytorch_model.bin")
        return
    names = list(state)
    weight_map = {}
    for s in range(shards):
        file = f"pytorch_model-{s + 1:05d}-of-{shards:05d}.bin"
        part = {n: state[n].clone() for n in names[s::shards]}
        torch.save(part, directory / file)
        weight_map |= {n: file for n in part}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    """Factory ``(case, fmt="safetensors", dtype="float32") -> (directory, torch model)``.

    Writes a tiny randomly initialised checkpoint (TINY_HF_CASES) in one of TINY_HF_FORMATS;
    the returned eval-mode float32 torch model holds exactly the saved weights (rounded to
    bfloat16 when dtype="bfloat16"). Built once per (case, fmt, dtype) and session.
    """
    built = {}

    def make(case: str, fmt: str = "safetensors", dtype: str = "float32"):
        import torch

        key = (case, fmt, dtype)
        if key not in built:
            model = _tiny_hf_model(case, seed=0)
            if dtype == "bfloat16":
                model = model.to(torch.bfloat16)
            directory = tmp_path_factory.mktemp(f"{case}-{fmt}-{dtype}")
            if fmt == "safetensors":
                model.save_pretrained(directory)
            elif fmt == "sharded_safetensors":
                model.save_pretrained(directory, max_shard_size="20KB")
            elif fmt in ("bin", "sharded_bin"):
                _write_bin(model, directory, shards=1 if fmt == "bin" else 3)
            else:
                raise ValueError(f"unknown format {fmt!r}")
            if dtype != "float32":  # a float32 twin holding the rounded weights (buffers such as
                reference = _tiny_hf_model(case, seed=0)  # rope inv_freq stay float32)
                reference.load_state_dict(model.state_dict())
                model = reference
            built[key] = (directory, model)
        return built[key]

    return make


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' own load of the embedded default GGUF (float32), the reference model."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.loading import default_model_path

    path = Path(default_model_path())
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
