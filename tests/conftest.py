"""Shared fixtures: tiny random model families (in memory, and as checkpoint directories over the real tokenizer),
the embedded default LLM (loaded once), and the suite's own caches (the user's are never read or written)."""

from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
from pathlib import Path

# Tests compile hundreds of executables of tiny models, and a fresh machine (CI) compiles every one: code generation
# costs more than running the code. Level 0 skips LLVM's optimisation of it; the CPU backend's older elemental
# emitters instead of its MLIR fusion emitters compile a tiny model's speculative step 2.7x quicker (16 steps: 23.1 s
# against 8.6 s, 2026-12-01). Both keep XLA's graph passes (the numerical checks hold under them) and are inherited
# by the CLI and server processes the tests start (``device_env`` keeps them where a test sets fake devices);
# benchmarks never run under them.
FAST_XLA = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
FAKE_DEVICES = "--xla_force_host_platform_device_count"
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), *FAST_XLA]))

# The suite's caches live in a directory of its own, made by the run's first process (xdist's workers and every
# process a test starts inherit it), so no test reads a calibration, step cost or executable the user's runs made, and
# none leaves unoptimised timings where a user's `jaxspec generate` would read them (none of those keys holds the XLA
# flags). USER_CACHE is the root the user's runs use; pytest_sessionfinish checks the run left it as it found it.
SUITE_CACHE_ENV = "JAXSPEC_SUITE_CACHE"
USER_CACHE_ENV = "JAXSPEC_SUITE_USER_CACHE"
MADE_SUITE_CACHE = SUITE_CACHE_ENV not in os.environ  # this process made it, and removes it at the run's end
if MADE_SUITE_CACHE:
    os.environ[USER_CACHE_ENV] = os.environ.get("JAXSPEC_CACHE") or str(Path.home() / ".cache" / "jaxspec")
    os.environ[SUITE_CACHE_ENV] = tempfile.mkdtemp(prefix="jaxspec-suite-")
os.environ["JAXSPEC_CACHE"] = os.environ[SUITE_CACHE_ENV]
USER_CACHE = Path(os.environ[USER_CACHE_ENV])
for _own in ("JAXSPEC_COMPILE_CACHE", "JAXSPEC_WEIGHT_CACHE"):  # a user's own locations: the suite uses its root's
    os.environ.pop(_own, None)

# Serialized executables stay off (tests/test_executables.py turns them on): with them a test's compile counts
# would depend on which test wrote an executable of the same shape first. Inherited by the processes tests start.
os.environ["JAXSPEC_EXECUTABLE_CACHE"] = "off"

import jax  # noqa: E402 (after XLA_FLAGS)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jaxspec.cache import cache_root, enable_compile_cache  # noqa: E402
from jaxspec.engine import LoadedModel  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.transformer import init_params  # noqa: E402

DEV_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "prompts" / "dev_prompts.jsonl"

# One persistent compilation cache for the run (under the suite's root): an engine configuration that several tests
# build is compiled once per run, not once per test.
enable_compile_cache(cache_root() / "xla")


def device_env(count: int, **extra: str) -> dict[str, str]:
    """This environment with ``count`` fake CPU devices for a process a test starts: the suite's other XLA flags
    (level 0) kept, the device count replaced, ``extra`` variables added."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(FAKE_DEVICES)]
    return {**os.environ, "XLA_FLAGS": " ".join([*flags, f"{FAKE_DEVICES}={count}"]), **extra}


def user_qwen_pair() -> tuple[str, str]:
    """The Qwen2.5-Coder GGUF pair that scripts/fetch_qwen_pair.py downloads into the user's cache root: model files a
    slow test reads (never writes) where the user fetched them; CheckpointError where they are absent."""
    from models.loading import qwen_pair_paths

    saved, os.environ["JAXSPEC_CACHE"] = os.environ["JAXSPEC_CACHE"], str(USER_CACHE)
    try:
        return qwen_pair_paths()
    finally:
        os.environ["JAXSPEC_CACHE"] = saved


def cache_listing(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` -> (size, mtime in ns); empty where ``root`` does not exist."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            try:
                st = path.stat()
            except OSError:  # removed meanwhile
                continue
            out[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


_USER_LISTING = pytest.StashKey[tuple[bool, dict[str, tuple[int, int]]]]()  # (root existed, its listing) at the start


def _is_controller(config: pytest.Config) -> bool:
    """The run's first process (no xdist worker): it made the suite's cache and owns the check of the user's."""
    return not hasattr(config, "workerinput")


def pytest_sessionstart(session: pytest.Session) -> None:
    if _is_controller(session.config):
        session.config.stash[_USER_LISTING] = (USER_CACHE.exists(), cache_listing(USER_CACHE))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fails the run if it changed the user's cache root (a file added, removed or rewritten; the root made), then
    removes the suite's own."""
    if not _is_controller(session.config) or _USER_LISTING not in session.config.stash:
        return
    existed, before = session.config.stash[_USER_LISTING]
    after = cache_listing(USER_CACHE)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed or existed != USER_CACHE.exists():
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"the test run changed the user's cache {USER_CACHE} ({len(changed)} files):", *changed[:20]]
        if not existed:
            lines.append(f"{USER_CACHE} did not exist before the run")
        if reporter is not None:
            reporter.write_sep("=", "user cache touched", red=True)
            reporter.write_line("\n".join(lines))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if MADE_SUITE_CACHE:
        shutil.rmtree(os.environ[SUITE_CACHE_ENV], ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def _measurements_of_its_own(tmp_path_factory):
    """Each module runs on a machine of its own as far as measurements go: step costs, compile times and prompt-chunk
    sizes under a fresh ``JAXSPEC_CACHE`` whose ``xla`` and ``weights`` are the run's (compiles and converted weights
    shared). What another module measured, or left half-searched, then steers none of its decisions: a chunk-size
    search left open made a ready server compile while serving, and engine tests ran several times slower after
    others had calibrated the machine than alone."""
    root = tmp_path_factory.mktemp("measured")
    suite = Path(os.environ[SUITE_CACHE_ENV])
    for shared in ("xla", "weights"):
        (suite / shared).mkdir(exist_ok=True)
        (root / shared).symlink_to(suite / shared, target_is_directory=True)
    saved, os.environ["JAXSPEC_CACHE"] = os.environ["JAXSPEC_CACHE"], str(root)
    yield
    os.environ["JAXSPEC_CACHE"] = saved


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


# --------------------------------------------------------------------------------------
# The tiny family as checkpoint files: what `--model` and `--ssm` load in the tests whose assertions hold for any
# weights (HTTP, streaming, stops, grammar masks, prefix-cache counts, seeds, shutdown, CLI plumbing). Random weights
# of a small LLaMA shape in GGUF files carrying the default LLM's real tokenizer and chat template (a GGUF's tokenizer
# loads without transformers: each process a test starts is seconds quicker than with an HF directory), written once
# per session.

TINY_MAX_LEN = 2048  # the tiny LLM's context (its SSM's too)
TINY_SEED = 0  # the tiny LLM's weights (its SSM starts from them)
TINY_SSM_NOISE = 0.1  # the tiny SSM's weights: the tiny LLM's plus this much of each matrix's spread in noise


def tiny_checkpoint_config(vocab: int) -> ModelConfig:
    """The tiny LLM: 2 layers, width 64, 8 heads over 4 KV heads (tensor=2 and 4 divide them)."""
    return ModelConfig("llama", vocab, 64, 128, 2, 8, 4, 8, max_position_embeddings=TINY_MAX_LEN, rms_norm_eps=1e-5)


@pytest.fixture(scope="session")
def default_tokenizer():
    """The embedded default LLM's tokenizer (its chat template with it), without its weights."""
    from models.loading import default_model_path
    from models.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path())


def _tiny_gguf(directory: Path, name: str, vocab: int, noise: float = 0.0) -> Path:
    """Writes the tiny LLM's shape to ``directory/name`` (``noise``: ``models.random_checkpoint.random_tensors``'s)."""
    from models.loading import default_model_path
    from models.random_checkpoint import write_random_gguf

    path = directory / name
    write_random_gguf(path, tiny_checkpoint_config(vocab), default_model_path(), TINY_SEED, noise)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, default_tokenizer) -> Path:
    """A random 2-layer LLaMA GGUF file (``tiny_checkpoint_config``) with the default LLM's tokenizer."""
    return _tiny_gguf(tmp_path_factory.mktemp("tiny"), "tiny-llama.gguf", len(default_tokenizer))


@pytest.fixture(scope="session")
def tiny_checkpoint_llm(tiny_checkpoint) -> LoadedModel:
    """``tiny_checkpoint`` loaded as the CLI loads an LLM (float32, its tokenizer: the default LLM's)."""
    from jaxspec.speculators.resolve import load_llm

    return load_llm(str(tiny_checkpoint))


@pytest.fixture(scope="session")
def tiny_ssm_checkpoint(tmp_path_factory, default_tokenizer) -> Path:
    """An SSM file for the tiny LLM: its weights with TINY_SSM_NOISE noise, so it agrees with the LLM on part of its
    drafts (about two tokens a step on a chain of four). Speculation on it accepts and rejects: an unrelated random
    SSM's drafts would all be rejected, and an identity test over them would never commit an accepted path."""
    return _tiny_gguf(tmp_path_factory.mktemp("tiny"), "tiny-ssm.gguf", len(default_tokenizer), TINY_SSM_NOISE)


@pytest.fixture(scope="session")
def tiny_drafter(tmp_path_factory, tiny_checkpoint, tiny_checkpoint_llm) -> Path:
    """A feature-drafter directory for the tiny LLM in the shipped drafter's form (fused, EAGLE-3's taps, a draft
    vocabulary of 4096 by random token counts), as training starts it: ``--ssm drafter:DIR``."""
    from jaxspec.speculators.drafter_io import save_drafter
    from jaxspec.speculators.pool import llm_identity
    from models.drafter import default_feature_layers, drafter_config, init_drafter, own_names

    llm = tiny_checkpoint_llm
    layers = default_feature_layers(llm.cfg.num_layers)
    cfg = drafter_config(llm.cfg)
    params = init_drafter(cfg, llm.params, 0, layers)
    counts = np.random.default_rng(0).integers(0, 1000, llm.cfg.vocab_size)
    return save_drafter(tmp_path_factory.mktemp("tiny") / "tiny-drafter", cfg,
                        {k: params[k] for k in own_names(layers)}, llm_identity(llm, str(tiny_checkpoint)), counts,
                        4096, {}, "float32", layers)


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
