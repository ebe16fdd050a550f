"""Offloading: the LLM's layers live in pinned host memory, stream in one layer per loop step, change nothing.

Invariants: offloaded layer weights are ``pinned_host`` arrays whose bytes survive the
round trip to the device exactly (float32 and bfloat16, every bit pattern); a step's
device scratch memory holds about one layer's weights whatever the layer count; and
``jaxspec generate --offload`` prints the text of the plain run, incremental and tree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts, tiny_config, tiny_model
from jaxspec import cli
from jaxspec.engine import Engine, RequestError, early_exit
from jaxspec.parallel.offload import HOST, fetch, make_offload_forward, memory_kinds, offload_params, to_host
from jaxspec.decoding.sampling import SamplerParams
from models.pipeline import stacked_layout
from models.transformer import KVCache, init_params
from test_engine import full_recompute_greedy


def test_offloaded_layers_live_in_pinned_host_memory(tiny_llm):
    engine = Engine(tiny_llm, offload=True)
    kinds = memory_kinds(engine._llm_params)
    assert kinds.pop("layers") == {HOST}
    assert all(k == {"device"} for k in kinds.values()), kinds  # embeddings, final norm and head stay
    for leaf in jax.tree_util.tree_leaves(engine._llm_params["layers"]):
        assert leaf.sharding.memory_kind == HOST and leaf.shape[0] == tiny_llm.cfg.num_layers


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bytes_round_trip_exactly(dtype):
    """Every bit pattern (NaN payloads, denormals, -0) comes back from host memory unchanged, eagerly and in jit."""
    rng = np.random.default_rng(0)
    if dtype == jnp.float32:
        raw = rng.integers(0, 2**32, size=(4, 1000), dtype=np.uint32).view(np.float32)
    else:
        raw = rng.integers(0, 2**16, size=(4, 1000), dtype=np.uint16).view(jnp.bfloat16)
    x = jnp.asarray(raw)  # [4, 1000] on the device
    host = to_host(x)
    assert host.sharding.memory_kind == HOST
    back = jax.device_put(host, host.sharding.with_memory_kind("device"))
    streamed = jax.jit(fetch)({"w": host})["w"]
    for y in (host, back, streamed):
        assert y.dtype == x.dtype
        assert np.asarray(y).tobytes() == raw.tobytes()
    assert streamed.sharding.memory_kind == "device"


def test_step_holds_about_one_layer_on_the_device():
    """The compiled forward's device scratch is ~one layer's weights for 2 and for 8 layers (streamed, not all)."""
    temps, layer_bytes = {}, None
    for layers in (2, 8):
        cfg = tiny_config(num_layers=layers, hidden_size=256, intermediate_size=1024, num_heads=8, num_kv_heads=4,
                          head_dim=32)
        params = offload_params(stacked_layout(init_params(cfg, 0)))
        layer_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params["layers"])) // layers
        cache = KVCache.create(cfg, 1, 16)
        tokens = jnp.zeros((1, 4), jnp.int32)  # [B, T]
        mask = jnp.ones((1, 4, 16), bool)  # [B, T, S]
        compiled = jax.jit(make_offload_forward(cfg)).lower(params, tokens, tokens, cache, mask).compile()
        temps[layers] = compiled.memory_analysis().temp_size_in_bytes
    assert temps[8] < 2 * layer_bytes, (temps, layer_bytes)
    assert abs(temps[8] - temps[2]) < 0.1 * layer_bytes, (temps, layer_bytes)


def test_offloaded_engine_is_token_identical(tiny_llm):
    """Incremental and tree decoding with offloaded layers emit the greedy tokens of full recomputation."""
    incremental = Engine(tiny_llm, offload=True)
    tree = Engine(tiny_llm, [early_exit(tiny_llm, 1)], (1, 2, 1), offload=True)
    for prompt in random_prompts(2, tiny_llm.cfg.vocab_size, seed=3, hi=12):
        want = full_recompute_greedy(tiny_llm, prompt, 16)
        assert incremental.generate(prompt, 16).token_ids == want
        assert tree.generate(prompt, 16).token_ids == want


@pytest.mark.slow
def test_offloaded_mss_matches_for_the_same_seed():
    llm = tiny_model(num_layers=2, arch="qwen2", attention_bias=True)
    ssm = early_exit(llm, 1)
    params = SamplerParams(0.8, seed=11)
    plain = Engine(llm, [ssm], (1, 2, 1), verify="mss")
    offloaded = Engine(llm, [ssm], (1, 2, 1), verify="mss", offload=True)
    for prompt in random_prompts(2, llm.cfg.vocab_size, seed=4):
        assert offloaded.generate(prompt, 16, params).token_ids == plain.generate(prompt, 16, params).token_ids


def test_offload_with_pipeline_stages_is_refused(tiny_llm):
    from jax.sharding import AbstractMesh

    with pytest.raises(RequestError, match="--offload runs on one pipeline stage"):
        Engine(tiny_llm, mesh=AbstractMesh((2,), ("pipe",)), offload=True)


@pytest.mark.slow
def test_generate_offload_prints_the_same_text(capsys):
    """End to end on the default model: --offload incremental and tree print the plain incremental text."""
    args = ["generate", "--prompt", "What is 2+2?", "--max-new-tokens", "6"]
    texts = {}
    for name, flags in {"plain": ["--mode", "incremental"], "offload": ["--mode", "incremental", "--offload"],
                        "offload-tree": ["--mode", "tree", "--ssm", "layers:4", "--expansion", "1,2", "--offload"]}.items():
        assert cli.main([*args, *flags]) == 0
        texts[name] = capsys.readouterr().out
    assert texts["plain"].strip()
    assert texts["offload"] == texts["plain"] and texts["offload-tree"] == texts["plain"], texts


def test_offload_loads_the_layers_straight_to_host_memory(tiny_hf_checkpoint):
    """``--offload`` on one device: every layer tensor goes from the file to pinned host memory and is relaid out
    there; the device never holds a layer (live device bytes = embeddings, norm and head), and the engine still
    decodes exactly as the plain load does (issue 22)."""
    import gc

    from jaxspec.speculators.resolve import load_llm

    directory, _ = tiny_hf_checkpoint("llama_gqa")

    def device_bytes() -> int:
        gc.collect()
        return sum(a.nbytes for a in jax.live_arrays() if a.sharding.memory_kind == "device")

    plain = load_llm(str(directory), with_tokenizer=False)
    want = Engine(plain).generate([3, 1, 4, 1, 5], 8).token_ids
    del plain
    base = device_bytes()
    llm = load_llm(str(directory), with_tokenizer=False, offload=True)
    layers = sum(x.nbytes for x in jax.tree_util.tree_leaves(llm.params["layers"]))
    rest = sum(x.nbytes for k, v in llm.params.items() if k != "layers" for x in jax.tree_util.tree_leaves(v))
    assert memory_kinds(llm.params)["layers"] == {HOST}
    assert device_bytes() - base <= rest < layers
    engine = Engine(llm, offload=True)
    del llm
    assert memory_kinds(engine._llm_params)["layers"] == {HOST}
    assert device_bytes() - base <= rest
    assert engine.generate([3, 1, 4, 1, 5], 8).token_ids == want


def test_an_early_exit_ssm_of_an_offloaded_llm_runs_on_device_copies(tiny_hf_checkpoint):
    """``--offload --ssm layers:N``: the LLM loaded straight to host memory keeps its layers there, the SSM's first
    N layers are device copies (it runs no streaming forward), and the tree run emits the plain run's tokens
    (before, its prefill multiplied device activations by host-memory weights and failed)."""
    from jaxspec.speculators.resolve import load_llm

    directory, _ = tiny_hf_checkpoint("llama_gqa")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = Engine(load_llm(str(directory), with_tokenizer=False)).generate(prompt, 12).token_ids
    llm = load_llm(str(directory), with_tokenizer=False, offload=True)
    ssm = early_exit(llm, 1)
    assert memory_kinds(llm.params)["layers"] == {HOST} and memory_kinds(ssm.params)["layers"] == {"device"}
    engine = Engine(llm, [ssm], (1, 2), offload=True)
    gen = engine.generate(prompt, 12)
    assert gen.token_ids == want and gen.llm_steps < len(want)  # the early exit's drafts were accepted
