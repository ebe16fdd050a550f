"""Every lowering (``models.lowering``) computes the same model: forced on this CPU, each variant gives the
default's logits (up to the float sums it reorders), the same cache writes bit for bit, and the same greedy
tokens through the engine; the lowering is part of every forward and calibration cache key."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ragged_forward_case, tiny_config, tiny_model
from jaxspec.speculators.ngram import NGramSpeculator
from jaxspec.engine import Engine
from jaxspec.engine.core import EngineCore, Request
from jaxspec.engine.device.costs import calibration_key, random_model
from models.drafter import drafter_config, init_drafter
from models.loaded import LoadedModel, forward_for
from models.lowering import ENV, Lowering, LoweringError, default_lowering, platform_lowering
from models.transformer import KVCache, decoding_layout, make_forward, write_kv

DEFAULT = Lowering()  # the CPU's forms: what every other test of the suite runs
# every distinct graph: ``dense`` only changes the unrolled layout (a scanned stack multiplies input-major kernels)
# and ``proj`` only the unrolled layout's kernels
VARIANTS = [Lowering(d, k, layer, proj=p) for d, k, layer, p in itertools.product(
    ("barrier", "plain"), ("rows", "scatter"), ("unroll", "scan"), ("fused", "split"))
    if layer == "unroll" or (d == "barrier" and p == "fused")]


def name(low: Lowering) -> str:
    """A test id: the values that vary, e.g. plain-scatter-unroll-split."""
    return f"{low.dense}-{low.kv_write}-{low.layers}-{low.proj}"
FAMILIES = {
    "llama-tied": dict(tie_word_embeddings=True),
    "qwen2-untied": dict(arch="qwen2", attention_bias=True, tie_word_embeddings=False),
    "opt-projected": dict(arch="opt", num_kv_heads=4, activation="relu", attention_bias=True,
                          word_embed_proj_dim=16, tie_word_embeddings=False),
}
PROMPTS = [[1, 2, 3], [5, 9, 2, 7, 7, 1], [3] * 11]


def test_the_cpu_keeps_todays_forms_and_a_gpu_gets_one_gemm_and_one_scatter():
    assert default_lowering() == platform_lowering("cpu") == DEFAULT  # this suite runs on the CPU
    assert platform_lowering("cuda") == platform_lowering("gpu") == Lowering("plain", "scatter", "unroll", "dense")
    assert platform_lowering("tpu").dense == "plain"
    assert DEFAULT.attention == "blocks"  # the CPU reads only the filled part of a cache bucket


def test_specs_override_field_by_field_and_refuse_unknown_names(monkeypatch):
    assert DEFAULT.override("dense=plain, layers=scan") == Lowering("plain", "rows", "scan")
    assert DEFAULT.override("gpu") == platform_lowering("gpu")
    assert DEFAULT.override("gpu,layers=scan").label == \
        "dense=plain,kv_write=scatter,layers=scan,attention=dense,proj=fused"
    assert DEFAULT.override("proj=split") == Lowering(proj="split") and not Lowering(proj="split").fused
    assert Lowering().override(Lowering("plain", "scatter", "scan").label) == Lowering("plain", "scatter", "scan")
    monkeypatch.setenv(ENV, "kv_write=scatter")
    assert default_lowering() == Lowering("barrier", "scatter", "unroll")
    assert default_lowering("dense=plain") == Lowering("plain", "scatter", "unroll")  # the flag over the variable
    assert DEFAULT.override("attention=dense") == Lowering(attention="dense")
    for bad in ("dense=fast", "layer=scan", "h100", "attention=flash"):
        with pytest.raises(LoweringError):
            DEFAULT.override(bad)


@pytest.mark.parametrize("layer", [0, 1])
def test_one_scatter_writes_exactly_what_the_row_loop_writes(layer):
    cfg = tiny_config(num_layers=3)
    length = jnp.array([0, 5, 13], jnp.int32)  # [B]; 13 + 3 = capacity: the last row fills the cache
    cache = KVCache.create(cfg, 3, 16).replace(length=length)
    cache = cache.replace(k=jax.random.normal(jax.random.PRNGKey(1), cache.k.shape),
                          v=jax.random.normal(jax.random.PRNGKey(2), cache.v.shape))
    new = jax.random.normal(jax.random.PRNGKey(0), (cfg.num_layers - layer, 3, 3, cfg.num_kv_heads, cfg.head_dim))
    rows = write_kv(cache, new, -new, layer)
    scattered = jax.jit(lambda c, k, v: write_kv(c, k, v, layer, scatter=True))(cache, new, -new)
    np.testing.assert_array_equal(np.asarray(scattered.k), np.asarray(rows.k))
    np.testing.assert_array_equal(np.asarray(scattered.v), np.asarray(rows.v))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("lowering", VARIANTS, ids=name)
def test_every_lowering_computes_the_default_forward(family, lowering):
    """A ragged batch of 5-token trees: logits within float noise of the default, argmax equal, cache equal."""
    cfg = tiny_config(num_layers=2, **FAMILIES[family])
    params, toks, pos, cache, mask = ragged_forward_case(cfg, batch=3, tokens=5)

    def run(low: Lowering):
        layout = decoding_layout(params, low.fused) if low.unrolled else params
        return jax.jit(make_forward(cfg, unrolled=low.unrolled, lowering=low))(layout, toks, pos, cache, mask)

    ref, ref_cache = run(DEFAULT)
    out, out_cache = run(lowering)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out).argmax(-1), np.asarray(ref).argmax(-1))
    np.testing.assert_allclose(np.asarray(out_cache.k), np.asarray(ref_cache.k), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out_cache.v), np.asarray(ref_cache.v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lengths", [(2, 300, 400), (2, 600, 990)], ids=["early", "tail"])
def test_block_attention_reads_only_the_filled_slots_and_computes_the_dense_forward(lengths):
    """Ragged rows in a 1,000-slot cache (256-slot blocks; the last block ends at the cache's end, overlapping its
    predecessor): the blocked forward's logits are the dense one's, and blocks past the longest row are never read
    (NaN there poisons only the dense form)."""
    cfg = tiny_config(num_layers=2)
    params, toks, pos, cache, _ = ragged_forward_case(cfg, batch=3, tokens=5, capacity=1000)
    length = jnp.array(lengths, jnp.int32)  # [B]
    pos = length[:, None] + jnp.arange(5)  # [B, T]
    mask = jnp.arange(1000)[None, None, :] < (length[:, None, None] + jnp.arange(5)[None, :, None] + 1)  # [B, T, S]
    cache = cache.replace(length=length)
    layout = decoding_layout(params)

    def run(attention: str, c: KVCache):
        low = Lowering(attention=attention)
        return jax.jit(make_forward(cfg, unrolled=True, lowering=low))(layout, toks, pos, c, mask)

    ref, ref_cache = run("dense", cache)
    out, out_cache = run("blocks", cache)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out).argmax(-1), np.asarray(ref).argmax(-1))
    np.testing.assert_allclose(np.asarray(out_cache.k), np.asarray(ref_cache.k), rtol=1e-5, atol=1e-5)
    if max(lengths) + 5 <= 512:  # two blocks hold every filled slot
        past = jnp.arange(1000)[None, None, None, :, None] >= 512  # [1, 1, 1, S, 1]
        poisoned = cache.replace(k=jnp.where(past, jnp.nan, cache.k), v=jnp.where(past, jnp.nan, cache.v))
        assert np.isnan(np.asarray(run("dense", poisoned)[0])).all()  # the dense form reads every slot
        np.testing.assert_allclose(np.asarray(run("blocks", poisoned)[0]), np.asarray(out), rtol=1e-6, atol=1e-6)


def test_block_attention_reads_blocks_from_the_whole_cache_without_copying_a_layer():
    """The compiled blocked forward holds no array the size of one layer's cache: each block is sliced from the
    whole cache [L, B, K, S, H] (a layer sliced first is a copy of all its slots per layer and step on a CPU)."""
    cfg = tiny_config(num_layers=2)
    params, toks, pos, cache, mask = ragged_forward_case(cfg, batch=3, tokens=5, capacity=1000)
    layout = decoding_layout(params)
    fwd = make_forward(cfg, unrolled=True, lowering=Lowering(attention="blocks"))
    text = jax.jit(fwd).lower(layout, toks, pos, cache, mask).compile().as_text()
    b, kv, s, h = cache.k.shape[1:]
    layer = [f"[{b},{kv},{s},{h}]", f"[1,{b},{kv},{s},{h}]"]
    copies = [line.strip()[:160] for line in text.splitlines()
              if " = " in line and any(line.split(" = ", 1)[1].lstrip().split("{")[0].endswith(x) for x in layer)]
    assert f"[{cfg.num_layers},{b},{kv},{s},{h}]" in text  # the whole cache is there (the check reads shapes right)
    assert copies == []


def test_a_long_prompt_decodes_the_same_tokens_with_blocked_and_dense_attention():
    """Through the engine: a 600-token prompt (chunked prefill into the top bucket, 956 slots) and a chain."""
    llm = tiny_model()
    prompt = [int(x) for x in np.random.default_rng(5).integers(0, llm.cfg.vocab_size, 600)]
    tokens = []
    for attention in ("dense", "blocks"):
        engine = Engine(llm, [NGramSpeculator(3)], [(1, 1, 1)], lowering=Lowering(attention=attention))
        batch = EngineCore(engine, max_batch=2, max_model_len=700)
        tokens.append([g.token_ids for g in batch.generate([Request(prompt, 24), Request(prompt[:40], 24)])])
    assert tokens[0] == tokens[1]


def drafter(llm: LoadedModel) -> LoadedModel:
    """A random feature drafter (the pass-through init plus noise), so it proposes varied tokens."""
    cfg = drafter_config(llm.cfg)
    params = init_drafter(cfg, llm.params, 3)
    keys = iter(jax.random.split(jax.random.PRNGKey(3), 64))
    params = jax.tree_util.tree_map(lambda x: x + 0.5 * jax.random.normal(next(keys), x.shape) * jnp.std(x), params)
    return LoadedModel("drafter", cfg, params, features=True)


@pytest.fixture(scope="module")
def llm() -> LoadedModel:
    return tiny_model()


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    """Greedy incremental tokens of every prompt under the default lowering."""
    engine = Engine(llm, lowering=DEFAULT)
    return [engine.generate(p, 24).token_ids for p in PROMPTS]


@pytest.mark.parametrize("lowering", [platform_lowering("gpu"), Lowering("barrier", "scatter", "scan"),
                                      Lowering(proj="split")], ids=name)
def test_greedy_tokens_are_the_defaults_under_the_gpu_lowering_and_scanned_layers(llm, reference, lowering):
    """A batch of three rows through the merged tree of a feature drafter and the n-gram, prefill and tree steps
    alike (each field's every value is covered by the forward test above; here the engine runs them together)."""
    engine = Engine(llm, [drafter(llm), NGramSpeculator(3)], [(1, 2), (1, 1, 1)], lowering=lowering)
    assert engine.lowering == lowering
    batch = EngineCore(engine, max_batch=3, max_model_len=64)
    assert [g.token_ids for g in batch.generate([Request(p, 24) for p in PROMPTS])] == reference


def test_a_fused_drafter_refuses_scanned_layers_clearly(llm):
    from models.drafter import default_feature_layers  # noqa: PLC0415

    layers = default_feature_layers(llm.cfg.num_layers)
    dcfg = drafter_config(llm.cfg)
    fused = LoadedModel("fused", dcfg, init_drafter(dcfg, llm.params, 0, layers), features=True,
                        feature_layers=layers)
    with pytest.raises(ValueError, match="layers=unroll"):
        Engine(llm, [fused], (1, 1), lowering=Lowering(layers="scan"))


def test_the_lowering_keys_forwards_and_calibrations():
    cfg = tiny_config()
    other = Lowering("plain", "scatter", "unroll")
    assert forward_for(cfg, jnp.dtype(jnp.float32), True, lowering=other) is not forward_for(
        cfg, jnp.dtype(jnp.float32), True, lowering=DEFAULT)
    assert forward_for(cfg, jnp.dtype(jnp.float32), True) is forward_for(cfg, jnp.dtype(jnp.float32), True,
                                                                          lowering=DEFAULT)
    model = random_model("tiny")
    assert calibration_key(model)["lowering"] == DEFAULT.label
    assert calibration_key(model, other) != calibration_key(model)


def test_verbose_names_the_device_precision_and_lowering(llm):
    from jaxspec.engine.build import device_line  # noqa: PLC0415

    line = device_line(Engine(llm, lowering=Lowering("plain", "scatter", "unroll")))
    assert "(cpu, jax " in line and "precision float32" in line
    assert line.endswith("lowering dense=plain,kv_write=scatter,layers=unroll,attention=blocks,proj=fused")


def test_a_bad_lowering_is_one_error_line(capsys):
    from jaxspec import cli  # noqa: PLC0415

    assert cli.main(["bench", "step-costs", "--shape", "tiny", "--lowering", "dense=fast"]) == 2
    assert "--lowering: lowering dense must be one of barrier, plain" in capsys.readouterr().err


def test_offloaded_layers_follow_the_lowering_and_keep_the_tokens(llm, reference):
    """The stacked paths (offload here; pipeline stages share ``scan_layers``' block and write) take the lowering."""
    engine = Engine(llm, offload=True, lowering=platform_lowering("gpu"))
    assert [engine.generate(p, 24).token_ids for p in PROMPTS] == reference


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_fused_layout_joins_each_layers_projection_kernels_and_nothing_else(family):
    """``decoding_layout(fused=True)`` holds qkv [N + 2K, H, D] (q, k, v joined along the heads, biases alike) and,
    for SwiGLU, gate_up [2, F, D]: exactly the split layout's kernels, every other leaf the same array."""
    cfg = tiny_config(num_layers=2, **FAMILIES[family])
    params, *_ = ragged_forward_case(cfg, batch=1, tokens=1)
    split, fused = decoding_layout(params, False), decoding_layout(params, True)
    n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    for i in range(cfg.num_layers):
        a, b = split[f"layer_{i}"], fused[f"layer_{i}"]
        assert set(b["attn"]) == {"qkv", "o"} and b["attn"]["qkv"]["kernel"].shape == (n + 2 * k, h, d)
        for leaf in b["attn"]["qkv"]:
            np.testing.assert_array_equal(b["attn"]["qkv"][leaf], np.concatenate([a["attn"][p][leaf] for p in "qkv"]))
        if cfg.arch == "opt":
            assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda x, y: bool(jnp.all(x == y)), b["mlp"],
                                                                 a["mlp"]))
        else:
            assert set(b["mlp"]) == {"gate_up", "down"} and b["mlp"]["gate_up"]["kernel"].shape == (
                2, cfg.intermediate_size, d)
            np.testing.assert_array_equal(b["mlp"]["gate_up"]["kernel"][1], a["mlp"]["up"]["kernel"])
    rest = lambda tree: {k: v for k, v in tree.items() if not k.startswith("layer_")}  # noqa: E731
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda x, y: bool(jnp.all(x == y)), rest(split),
                                                         rest(fused)))


def test_one_device_mesh_keeps_the_fused_kernels():
    """Only a tensor axis over several devices splits them (tests/test_sharding.py: tensor=2 runs proj=split)."""
    from jaxspec.parallel import sharding  # noqa: PLC0415

    assert Engine(tiny_model(), mesh=sharding.parse_mesh("tensor=1")).lowering.proj == "fused"


def test_float32_means_float32_products_where_the_platform_default_rounds_them():
    """``--dtype float32`` on a GPU or TPU asks for float32 products (JAX's default there is TF32 or bfloat16 passes,
    whose shape-dependent rounding flipped greedy tokens on an H200): forced here as the GPU, every dot of the GPU
    lowering's forward carries HIGHEST; bfloat16, a CPU and a precision the user set are left as they are."""
    from jaxspec.engine.build import exact_float32

    cfg = tiny_config()
    params, toks, pos, cache, mask = ragged_forward_case(cfg, 3, 4)
    fwd = make_forward(cfg, lowering=platform_lowering("gpu"))

    def dots() -> tuple[int, int]:  # (dot products, those with HIGHEST precision) of the lowered forward
        text = jax.jit(fwd).lower(params, toks, pos, cache, mask).as_text()
        lines = [line for line in text.splitlines() if "dot_general" in line]
        return len(lines), sum("HIGHEST" in line for line in lines)

    before = jax.config.jax_default_matmul_precision
    assert before is None  # nothing in the suite sets it
    try:
        assert not exact_float32("float32", platform="cpu")
        assert not exact_float32("bfloat16", platform="gpu")
        count, exact = dots()
        assert count >= 3 * cfg.num_layers and exact == 0  # attention and MLP products per layer, the default's
        assert exact_float32("float32", platform="gpu")
        assert dots() == (count, count)
        jax.config.update("jax_default_matmul_precision", "tensorfloat32")  # the user's choice stands
        assert not exact_float32("float32", platform="tpu")
        assert jax.config.jax_default_matmul_precision == "tensorfloat32"
    finally:
        jax.config.update("jax_default_matmul_precision", before)
