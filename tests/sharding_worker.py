"""Multi-device checks behind tests/test_sharding.py, run in a process with 8 fake CPU devices.

``python tests/sharding_worker.py GROUP OUT.json`` runs GROUP's checks and writes
{check: result or {"error": text}}; the tests assert on the results. The device count
must be fixed before JAX starts (``XLA_FLAGS=--xla_force_host_platform_device_count=8``),
so these checks cannot share the pytest process. One launch runs many checks: every
JAX start and compilation costs seconds on the test machine.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from conftest import random_prompts, tiny_model  # noqa: E402
from jaxspec.parallel import sharding  # noqa: E402
from jaxspec.engine import Engine, LoadedModel, early_exit  # noqa: E402
from jaxspec.decoding.kv_cache import tree_mask  # noqa: E402
from jaxspec.decoding.sampling import SamplerParams  # noqa: E402
from jaxspec.decoding.tree import ancestor_mask  # noqa: E402
from models.lowering import Lowering  # noqa: E402
from models.transformer import KVCache, decoding_layout, make_forward  # noqa: E402

FAMILIES = {  # tiny models whose head counts divide the tensor sizes they are tested with
    "llama": dict(num_heads=4, num_kv_heads=2),
    "llama8": dict(num_heads=8, num_kv_heads=8, head_dim=4),
    "qwen2": dict(arch="qwen2", attention_bias=True, num_heads=8, num_kv_heads=4, head_dim=4),
    "opt": dict(arch="opt", num_heads=8, num_kv_heads=8, head_dim=4, activation="relu", attention_bias=True,
                tie_word_embeddings=False),
    "llama3heads": dict(num_heads=3, num_kv_heads=1, head_dim=8),  # 3 / 1 heads: tensor=2 replicates them
}
TREE = (1, 2, 1)
NEW_TOKENS = 12
MSS = SamplerParams(temperature=1.0, seed=7)


def mesh_of(spec: str) -> jax.sharding.Mesh:
    """A mesh over the first devices it needs (the 8 fake devices hold several test meshes)."""
    sizes = dict(part.split("=") for part in spec.split(","))
    need = int(np.prod([int(v) for v in sizes.values()]))
    return sharding.parse_mesh(spec, jax.devices()[:need])


def model(family: str, layers: int = 2) -> LoadedModel:
    return tiny_model(seed=1, num_layers=layers, **FAMILIES[family])


def generations(engine: Engine, prompts, params: SamplerParams = SamplerParams()) -> list[list[int]]:
    return [engine.generate(p, NEW_TOKENS, params).token_ids for p in prompts]


def tree_logits(m: LoadedModel, params, mesh) -> np.ndarray:
    """LLM logits [B, N, V] of one verification pass over a 6-node token tree above a random cache."""
    cfg, b, cap = m.cfg, 2, 24
    parent = jnp.asarray([[-1, 0, 0, 1, 1, 2]] * b, jnp.int32)  # [B, N]
    depth = jnp.asarray([[0, 1, 1, 2, 2, 2]] * b, jnp.int32)
    length = jnp.asarray([5, 9], jnp.int32)  # [B] committed tokens
    tokens = jax.random.randint(jax.random.PRNGKey(3), parent.shape, 0, cfg.vocab_size)  # [B, N]
    mask = tree_mask(length, ancestor_mask(parent, 3), jnp.broadcast_to(jnp.arange(6), parent.shape), cap)
    shape = (cfg.num_layers, b, cfg.num_kv_heads, cap, cfg.head_dim)  # KVCache layout [L, B, K, S, H]
    cache = KVCache(jax.random.normal(jax.random.PRNGKey(1), shape), jax.random.normal(jax.random.PRNGKey(2), shape),
                    length)
    fwd = make_forward(cfg, unrolled=True, lowering=Lowering(proj="split"))  # the split layout a tensor axis runs
    if mesh is not None:
        cache = jax.device_put(cache, sharding.cache_shardings(cache, mesh))

    def run(p, c):
        if mesh is None:
            return fwd(p, tokens, length[:, None] + depth, c, mask)[0]
        with sharding.activations(mesh):
            return fwd(p, tokens, length[:, None] + depth, c, mask)[0]

    return np.asarray(jax.jit(run)(params, cache))


def shard_shapes(tree: dict, names: list[str]) -> dict[str, list]:
    """Per flattened parameter name: its global shape and every device's shard shape."""
    from models.loading import flatten

    flat = flatten(tree)
    return {n: [list(flat[n].shape), [list(s.data.shape) for s in flat[n].addressable_shards]] for n in names}


def tensor_parallel(family: str, mesh_spec: str, modes: tuple[str, ...]) -> dict:
    """Single device vs ``mesh_spec``: outputs per mode, tree logits, shard shapes, compilations."""
    m, mesh = model(family), mesh_of(mesh_spec)
    prompts = random_prompts(2, m.cfg.vocab_size, seed=3, lo=4, hi=12)
    out: dict = {}
    ssm = early_exit(m, 1)
    engines: dict = {}
    for mode in modes:
        speculators = ([], ()) if mode == "incremental" else ([ssm], TREE)
        if mode not in engines:  # tree and mss share a pair of engines (each warp compiles its own step)
            pair = (Engine(m, *speculators), Engine(m, *speculators, mesh=mesh))
            engines.update({mode: pair} if mode == "incremental" else {"tree": pair, "mss": pair})
        one, many = engines[mode]
        params = MSS if mode == "mss" else SamplerParams()
        want = generations(one, prompts, params)
        before = many.compilations
        got = generations(many, prompts[:1], params)
        warm = many.compilations
        got += generations(many, prompts[1:], params)
        out[mode] = {"one": want, "mesh": got, "compilations": [before, warm, many.compilations]}
    out["proj"] = [pair[1].lowering.proj for pair in engines.values()]  # a tensor axis keeps q/k/v kernels apart
    params = decoding_layout(m.params, fused=False)
    placed = sharding.place_params(params, sharding.param_names(m.cfg, unrolled=True, fused=False), mesh,
                                   f"LLM {m.name}")
    out["logits_max_diff"] = float(np.max(np.abs(tree_logits(m, params, None) - tree_logits(m, placed, mesh))))
    names = ["embed/embedding", "layer_0/mlp/up/kernel", "layer_0/attn/q/kernel", "layer_0/attn/k/kernel",
             "layer_0/attn/o/kernel"]
    if m.cfg.arch == "opt":
        names = ["embed/embedding", "lm_head/kernel", "layer_0/mlp/fc1/kernel", "layer_0/attn/q/kernel",
                 "layer_0/attn/o/kernel"]
    out["shards"] = shard_shapes(placed, names)
    cache = KVCache.create(m.cfg, 2, 256)
    k = jax.device_put(cache.k, sharding.cache_shardings(cache, mesh).k)  # [L, B, K, S, H]
    out["cache_shard"] = [list(k.shape), list(k.addressable_shards[0].data.shape)]
    return out


def data_parallel_pool(specs: tuple[str, ...]) -> dict:
    """Two same-shape SSMs in one vmapped group (shared embedding), G=2 split over data=2."""
    llm = model("llama")
    a, b = tiny_model(seed=5, num_layers=2), tiny_model(seed=6, num_layers=2)
    b = LoadedModel(b.name, b.cfg, {**b.params, "embed": a.params["embed"]})
    prompts = random_prompts(2, llm.cfg.vocab_size, seed=11, lo=4, hi=12)
    out: dict = {}
    for spec in specs:
        one, many = Engine(llm, [a, b], TREE), Engine(llm, [a, b], TREE, mesh=mesh_of(spec))
        out[spec] = {"one": generations(one, prompts), "mesh": generations(many, prompts),
                     "groups": [list(g.members) for g in many.groups]}
        stacked = many._group_params[0]
        state = many.init_state(1, 256, SamplerParams())
        out[spec]["shards"] = shard_shapes(stacked, ["layers/mlp/up/kernel", "embed/embedding"])
        cache = state.ssm_caches[0].k
        out[spec]["cache_shard"] = [list(cache.shape), list(cache.addressable_shards[0].data.shape)]
    return out


def batched() -> dict:
    """EngineCore (slots over data, heads over tensor) vs one device: same outputs, no recompilation; then requests
    sharing a 40-token prefix, the later ones served from the prefix cache (its blocks cut from sharded rows)."""
    from jaxspec.engine.core import EngineCore, Request

    m = model("llama")
    prompts = random_prompts(3, m.cfg.vocab_size, seed=5, lo=4, hi=12)
    shared = random_prompts(1, m.cfg.vocab_size, seed=6, lo=40, hi=41)[0]
    # the middle prompt takes the staging row: the last one's prefix comes from the cache's blocks
    prefixed = [shared + [1], prompts[0], shared + [2, 3]]
    out: dict = {}
    for name, mesh in (("one", None), ("mesh", mesh_of("data=2,tensor=2"))):
        engine = Engine(m, [early_exit(m, 1)], TREE, mesh=mesh)
        batch = EngineCore(engine, max_batch=2, max_model_len=64)
        reqs = [Request(p, NEW_TOKENS) for p in prompts]
        gens = batch.generate(reqs)
        warm = engine.compilations
        gens2 = batch.generate([Request(p, NEW_TOKENS) for p in prompts[::-1]])
        compiled = [warm, engine.compilations]
        hits = batch.generate([Request(p, NEW_TOKENS) for p in prefixed])  # a longer prompt: its chunk compiles
        out[name] = {"first": [g.token_ids for g in gens], "second": [g.token_ids for g in gens2],
                     "compilations": compiled, "prefixed": [g.token_ids for g in hits],
                     "cached": [g.cached_tokens for g in hits]}
    return out


def structured() -> dict:
    """Grammar-constrained batches on data=2,tensor=2 vs one device: a random tiny model over SmolLM2's
    tokenizer, a regex, an SSM tree (masks from the host callback) and incremental decoding (masks as input)."""
    import dataclasses

    from jaxspec.engine.core import EngineCore, Request
    from jaxspec.structured import Grammar
    from models.loading import default_model_path
    from models.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    m = dataclasses.replace(tiny_model(seed=1, vocab_size=49152, eos_token_ids=(2,), **FAMILIES["llama"]),
                            tokenizer=tok)
    prompts = random_prompts(3, 49152, seed=5, lo=4, hi=12)
    grammar = Grammar("regex", "(yes|no), because [a-z ]+\\.")
    out: dict = {}
    for mode, speculators in (("incremental", ([], ())), ("tree", ([early_exit(m, 1)], TREE))):
        for name, mesh in (("one", None), ("mesh", mesh_of("data=2,tensor=2"))):
            engine = Engine(m, *speculators, mesh=mesh)
            gens = EngineCore(engine, max_batch=2, max_model_len=64).generate(
                [Request(p, NEW_TOKENS, grammar=grammar) for p in prompts])
            out[f"{mode}_{name}"] = {"tokens": [g.token_ids for g in gens],
                                     "texts": [tok.decode(g.token_ids, skip_special_tokens=True) for g in gens],
                                     "callbacks": engine.row_masks().callbacks}
    return out


def fallback() -> dict:
    """3 query / 1 KV heads under tensor=2: replicated heads (said once), split MLP, same output."""
    m = model("llama3heads")
    prompts = random_prompts(2, m.cfg.vocab_size, seed=3, lo=4, hi=12)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        first = Engine(m, mesh=mesh_of("tensor=2"))
        first_text = err.getvalue()
        Engine(m, mesh=mesh_of("tensor=2"))
    return {"stderr_first": first_text, "stderr_again": err.getvalue()[len(first_text):],
            "one": generations(Engine(m), prompts), "mesh": generations(first, prompts),
            "shards": shard_shapes(first._llm_params, ["layer_0/attn/q/kernel", "layer_0/mlp/up/kernel"])}


def errors() -> dict:
    """A parameter without logical names, an unknown logical axis, and wrong meshes: the messages."""
    m = model("llama")
    out = {}
    extra = LoadedModel(m.name, m.cfg, {**m.params, "extra": {"kernel": jnp.zeros((4, 4))}})
    for name, fn in {
        "unnamed_parameter": lambda: Engine(extra, mesh=mesh_of("tensor=2")),
        "unknown_axis": lambda: sharding.spec_for(("bogus",), (4,), mesh_of("tensor=2"), "parameter 'x'"),
        "device_count": lambda: sharding.parse_mesh("data=2,tensor=3"),
        "unknown_mesh_axis": lambda: sharding.parse_mesh("model=8"),
    }.items():
        try:
            fn()
            out[name] = {"raised": None}
        except Exception as e:  # noqa: BLE001 (the test checks the type name and the message)
            out[name] = {"raised": type(e).__name__, "is_value_error": isinstance(e, ValueError), "message": str(e)}
    return out


def load_into_shards() -> dict:
    """The default GGUF loaded straight onto tensor=2 (``sharding.placer``) vs loaded plainly."""
    from jaxspec.speculators.resolve import load_llm
    from models.loading import flatten

    mesh = mesh_of("tensor=2")
    llm = load_llm(None, "float32", with_tokenizer=False)
    plain = flatten(llm.params)
    placed = flatten(load_llm(None, "float32", with_tokenizer=False, mesh=mesh).params)
    want = sharding.param_names(llm.cfg)
    out = {"equal": sorted(k for k in plain if np.array_equal(np.asarray(plain[k]), np.asarray(placed[k]))),
           "names": sorted(plain), "specs": {}, "shards": {}}
    for k, leaf in placed.items():
        expected = sharding.sharding_for(want[k], leaf.shape, mesh, k, [])
        out["specs"][k] = leaf.sharding.is_equivalent_to(expected, leaf.ndim)
        out["shards"][k] = [list(leaf.shape), [list(x.data.shape) for x in leaf.addressable_shards]]
    return out


def default_model() -> dict:
    """The embedded SmolLM2-135M (9 / 3 heads) under tensor=2: replicate fallback, same greedy output."""
    from conftest import dev_prompts
    from jaxspec.speculators.resolve import load_llm
    from models.tokenizer import encode_prompt

    llm = load_llm(None, "float32")
    prompts = [encode_prompt(llm.tokenizer, r["prompt"], chat=True) for r in dev_prompts(2)]
    out = {}
    for mode, speculators in (("incremental", ([], ())), ("tree", ([early_exit(llm, 4)], TREE))):
        one, many = Engine(llm, *speculators), Engine(llm, *speculators, mesh=mesh_of("tensor=2"))
        out[mode] = {"one": generations(one, prompts), "mesh": generations(many, prompts)}
    return out


def abstract_states() -> dict:
    """``ModelRunner.abstract_state`` (from ``jax.eval_shape``, nothing allocated) against the real state of the same
    bucket, leaf by leaf as the executable store describes them (shape, dtype, weak type, placement): a mismatch
    would make every prepared executable miss its call and compile again."""
    from jaxspec.decoding import sampling
    from jaxspec.engine.device.executables import _described
    from jaxspec.engine.device.prepare import abstract

    m = model("llama")
    out: dict = {}
    for spec in ("data=2,tensor=2", "pipe=2", "data=4"):
        engine = Engine(m, [early_exit(m, 1)], TREE, mesh=mesh_of(spec))
        got = [_described(x) for x in jax.tree_util.tree_leaves(engine.abstract_state(2, 64))]
        real = [_described(x) for x in
                jax.tree_util.tree_leaves(abstract(engine.init_state(2, 64, sampling.MIXED, active=False)))]
        out[spec] = {"same": got == real, "leaves": len(real), "first_difference": next(
            (f"{a} != {b}" for a, b in zip(got, real) if a != b), None)}
    return out


GROUPS = {
    "default": {
        "abstract_states": abstract_states,
        "tp_llama_2": lambda: tensor_parallel("llama", "tensor=2", ("tree",)),
        "tp_qwen2_4": lambda: tensor_parallel("qwen2", "tensor=4", ()),
        "tp_opt_8": lambda: tensor_parallel("opt", "tensor=8", ()),
        "pool": lambda: data_parallel_pool(("data=2",)),
        "fallback": fallback,
        "errors": errors,
        "load": load_into_shards,
    },
    "slow": {
        "tp_llama_2": lambda: tensor_parallel("llama", "tensor=2", ("incremental", "mss")),
        "tp_llama_4": lambda: tensor_parallel("llama8", "tensor=4", ("incremental", "tree", "mss")),
        "tp_llama_8": lambda: tensor_parallel("llama8", "tensor=8", ("incremental", "tree", "mss")),
        "tp_qwen2_2": lambda: tensor_parallel("qwen2", "tensor=2", ("incremental", "tree", "mss")),
        "tp_qwen2_4": lambda: tensor_parallel("qwen2", "tensor=4", ("incremental", "tree", "mss")),
        "tp_opt_2": lambda: tensor_parallel("opt", "tensor=2", ("incremental", "tree", "mss")),
        "tp_opt_4": lambda: tensor_parallel("opt", "tensor=4", ("incremental", "tree", "mss")),
        "tp_opt_8": lambda: tensor_parallel("opt", "tensor=8", ("incremental", "tree", "mss")),
        "pool": lambda: data_parallel_pool(("data=2,tensor=2",)),
        "batched": batched,
        "default_model": default_model,
        "structured": structured,
    },
}


def main(group: str, out_path: str, only: list[str]) -> None:
    if jax.device_count() != 8:
        raise SystemExit(f"expected 8 fake devices (XLA_FLAGS), got {jax.device_count()}")
    from jaxspec.cache import cache_root, enable_compile_cache

    enable_compile_cache(cache_root() / "xla")
    results = {}
    for name, check in GROUPS[group].items():
        if only and name not in only:
            continue
        start = time.perf_counter()
        try:
            results[name] = check()
            results[name]["seconds"] = round(time.perf_counter() - start, 1)
        except Exception:  # noqa: BLE001 (reported to the test, which fails naming it)
            results[name] = {"error": traceback.format_exc()}
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
